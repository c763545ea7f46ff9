"""Evaluation: avg@k and pass@k of a policy on the task's held-out split, by
``satjax eval`` and (``eval.every``) during training (:func:`eval_during_training`)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from satjax.data.pipeline import decode_response, encode_prompt, eval_examples
from satjax.data.prompts import RAW, PromptFormat
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
    prompt: PromptFormat = RAW,
) -> EvalResult:
    """Samples ``k`` responses for each held-out prompt (``eval_examples``: the first
    ``num_prompts``, or a whole eval file) and scores them with the task's reward.

    avg@k: the mean reward over prompts and samples (for 0/1 rewards, the fraction
    correct); pass@k: the fraction of prompts with a sample of reward > 0.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {num_prompts!r}")
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k!r}")
    examples = eval_examples(task, num_examples=num_prompts)
    scores = []
    for start in range(0, len(examples), batch_prompts):
        chunk = examples[start : start + batch_prompts]
        prompts = [encode_prompt(tokenizer, ex, prompt) for ex in chunk for _ in range(k)]
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


def eval_during_training(cfg, step: int, model, task, tokenizer) -> dict[str, float]:
    """``eval/avg@k``, ``eval/pass@k`` (k = ``eval.k``) of ``model`` at ``step`` when
    ``eval.every`` divides it (else nothing), for the run's metrics: the trainer's own
    policy, sampled in-process at ``eval.temperature``."""
    every = cfg.eval.every
    if every <= 0 or step % every:
        return {}
    from satjax.app.factory import prompt_format, sampling_params

    result = evaluate(model, task, tokenizer, num_prompts=cfg.eval.num_prompts, k=cfg.eval.k,
                      sampling=sampling_params(cfg, tokenizer,
                                               temperature=cfg.eval.temperature),
                      seed=cfg.seed + step, prompt=prompt_format(cfg))
    return {f"eval/{k}": v for k, v in result.as_dict().items()}
