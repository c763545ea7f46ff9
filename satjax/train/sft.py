"""Supervised warm-up: teach the tiny policy the answer format so RL starts with reward.

Cross-entropy on the answer tokens (and EOS) of ``prompt answer [eos]`` (the prompt as
``task.prompt_template`` makes it), padded to a fixed length so the step compiles once.
``sft.mode`` says when it runs (:func:`warmup_enabled`): by default for a freshly
initialised tiny policy, not for a ``model.path`` checkpoint (it already answers; its
reference answers, e.g. GSM8K's worked solutions, are not what RL should start from).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from satjax.config import Config
from satjax.data.pipeline import encode_prompt
from satjax.data.prompts import RAW, PromptFormat
from satjax.data.tasks import Example
from satjax.model.logprobs import token_logprobs


def warmup_enabled(cfg: Config) -> bool:
    """Whether the run starts with the SFT warm-up: ``sft.mode`` "always", or "auto" without
    ``model.path``."""
    return cfg.sft.mode == "always" or (cfg.sft.mode == "auto" and not cfg.model.path)


def encode_sft_batch(
    examples: list[Example], tokenizer, seq_len: int, prompt: PromptFormat = RAW
) -> dict[str, np.ndarray]:
    """tokens int32 [B, seq_len], loss_mask float32 [B, seq_len] (1 where position t's
    token is an answer/EOS token, i.e. predicted from positions < t)."""
    tokens = np.full((len(examples), seq_len), tokenizer.pad_id, np.int32)
    attn = np.zeros((len(examples), seq_len), np.int32)
    mask = np.zeros((len(examples), seq_len), np.float32)
    for i, ex in enumerate(examples):
        prompt_ids = encode_prompt(tokenizer, ex, prompt)
        answer = [*tokenizer.encode(ex.answer), tokenizer.eos_id]
        ids = prompt_ids + answer
        if len(ids) > seq_len:
            raise ValueError(f"seq_len: example {ex.prompt_id} needs {len(ids)} > {seq_len}")
        tokens[i, : len(ids)] = ids
        attn[i, : len(ids)] = 1
        mask[i, len(prompt_ids) : len(ids)] = 1.0
    return {"tokens": tokens, "attention_mask": attn, "loss_mask": mask}


def sft_loss(model, batch) -> jax.Array:
    """Mean negative log-likelihood of the ``loss_mask`` tokens."""
    lp, _ = token_logprobs(model, batch["tokens"], batch["attention_mask"])
    mask = batch["loss_mask"]
    return -(lp * mask).sum() / jnp.maximum(mask.sum(), 1.0)


@nnx.jit
def _sft_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(sft_loss)(model, batch)
    optimizer.update(model, grads)
    return loss


def run_sft(
    model,
    examples: Iterator[Example],
    tokenizer,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    seq_len: int,
    on_step: Callable[[int, float], None] | None = None,
    prompt: PromptFormat = RAW,
) -> list[float]:
    """Trains ``model`` in place; returns the loss of every step."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, min(50, max(1, steps // 10)), max(steps, 2)
    )
    optimizer = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=0.0), wrt=nnx.Param)
    losses = []
    for step in range(steps):
        batch = encode_sft_batch([next(examples) for _ in range(batch_size)], tokenizer, seq_len,
                                 prompt)
        loss = float(_sft_step(model, optimizer, {k: jnp.asarray(v) for k, v in batch.items()}))
        losses.append(loss)
        if on_step is not None:
            on_step(step, loss)
    return losses
