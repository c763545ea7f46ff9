"""Evaluation: avg@k and pass@k of a policy on the task's held-out split."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from satjax.data.pipeline import decode_response, encode_prompt, eval_examples
from satjax.model.sampling import generate
from satjax.rollout.builtin_engine import completions
from satjax.rollout.engine import SamplingParams


@dataclasses.dataclass(frozen=True)
class EvalResult:
    avg_at_k: float  # mean over prompts of the fraction of the k samples that are correct
    pass_at_k: float  # fraction of prompts with at least one correct sample among k
    k: int
    num_prompts: int
    per_prompt: tuple[float, ...]  # fraction correct per prompt

    def as_dict(self) -> dict[str, float]:
        return {f"avg@{self.k}": self.avg_at_k, f"pass@{self.k}": self.pass_at_k,
                "num_prompts": float(self.num_prompts)}


def evaluate(
    model, task, tokenizer, *, num_prompts: int, k: int, sampling: SamplingParams,
    seed: int = 0, batch_prompts: int = 32, dtype=None,
) -> EvalResult:
    """Samples ``k`` responses for each of the first ``num_prompts`` test prompts."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {num_prompts!r}")
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k!r}")
    examples = eval_examples(task, num_examples=num_prompts)
    scores = []
    for start in range(0, len(examples), batch_prompts):
        chunk = examples[start : start + batch_prompts]
        prompts = [encode_prompt(tokenizer, ex) for ex in chunk for _ in range(k)]
        outs = completions(prompts, generate(
            model, prompts, **dataclasses.asdict(sampling), rng=jax.random.key(seed + start),
            dtype=dtype, pad_id=tokenizer.pad_id))
        for i, ex in enumerate(chunk):
            rewards = []
            for c in outs[i * k : (i + 1) * k]:
                rewards.append(task.reward(decode_response(tokenizer, c.response_tokens), ex))
            scores.append(np.asarray(rewards, np.float32))
    per_prompt = np.stack(scores)
    return EvalResult(
        avg_at_k=float(per_prompt.mean()),
        pass_at_k=float((per_prompt.max(axis=1) > 0).mean()),
        k=k,
        num_prompts=len(examples),
        per_prompt=tuple(float(x) for x in per_prompt.mean(axis=1)),
    )
