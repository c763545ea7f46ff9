"""Grain pipelines of prompts.

The pipeline is a ``grain.MapDataset`` over example indices, shuffled with a fixed seed
and repeated. Each rollout worker iterates its own (seeded per worker); the trainer's
data position is the queue cursor it checkpoints, not a prompt iterator.
"""

from __future__ import annotations

from typing import Protocol

import grain

from satjax.data.prompts import RAW, PromptFormat
from satjax.data.tasks import Example, FileTask


class Task(Protocol):
    size: int

    def example(self, index: int, split: str = "train") -> Example: ...

    def reward(self, response: str, example: Example) -> float: ...


def prompt_dataset(
    task: Task, *, split: str = "train", seed: int = 0, num_epochs: int | None = None
) -> grain.IterDataset:
    """An iterable of :class:`Example` in a seeded shuffled order, ``num_epochs`` times
    (``None``: forever). Each epoch is reshuffled deterministically."""
    ds = grain.MapDataset.range(task.size)
    ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)
    return ds.map(lambda i: task.example(int(i), split)).to_iter_dataset()


def eval_examples(task: Task, *, num_examples: int) -> list[Example]:
    """The held-out split's first ``num_examples`` in a fixed order; of a file task, never
    a prompt twice, and all of a separate eval file (``task.eval_path``) whatever
    ``num_examples``."""
    if isinstance(task, FileTask):
        n = task.test_size if task.eval_examples is not None \
            else min(num_examples, task.test_size)
        return [task.example(i, "test") for i in range(n)]
    return [task.example(i, "test") for i in range(num_examples)]


def encode_prompt(tokenizer, example: Example, prompt: PromptFormat = RAW
                  ) -> list[int]:
    """The prompt's token ids as ``prompt`` (``task.prompt_template``) makes them: how
    every engine, the evaluation and the SFT warm-up see a prompt."""
    return prompt.encode(tokenizer, example)


def decode_response(tokenizer, tokens) -> str:
    """The response text a reward function scores (EOS removed)."""
    return tokenizer.decode([int(t) for t in tokens if int(t) != tokenizer.eos_id])
