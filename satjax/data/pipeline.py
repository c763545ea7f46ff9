"""Grain pipelines of prompts.

The pipeline is a ``grain.MapDataset`` over example indices, shuffled with a fixed seed
and repeated. Each rollout worker iterates its own (seeded per worker); the trainer's
data position is the queue cursor it checkpoints, not a prompt iterator.
"""

from __future__ import annotations

from typing import Protocol

import grain

from satjax.data.tasks import Example


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
    """The first ``num_examples`` of the held-out split, in a fixed order."""
    return [task.example(i, "test") for i in range(num_examples)]


def encode_prompt(tokenizer, example: Example) -> list[int]:
    """``[bos] + prompt tokens`` (no BOS for tokenizers without one, e.g. Qwen's): how every
    engine and the SFT warm-up see a prompt."""
    return tokenizer.encode(example.prompt, add_bos=True)


def decode_response(tokenizer, tokens) -> str:
    """The response text a reward function scores (EOS removed)."""
    return tokenizer.decode([int(t) for t in tokens if int(t) != tokenizer.eos_id])
