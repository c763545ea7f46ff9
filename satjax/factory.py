"""Builds the run's pieces from a :class:`satjax.config.Config`: task, tokenizer, model,
sampling parameters. Shared by ``satjax train | rollout | eval | sft | lag-sweep``."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from satjax.config import Config
from satjax.data.tasks import (
    ArithmeticTask,
    DigitStringTask,
    JsonlMathTask,
    load_jsonl_examples,
)
from satjax.model import DTYPES, Qwen3MoeConfig, Qwen3MoeForCausalLM, from_pretrained
from satjax.model.tokenizer import CharTokenizer, load_hf_tokenizer
from satjax.rollout.engine import SamplingParams


def build_task(cfg: Config):
    t = cfg.task
    if t.name == "arithmetic":
        return ArithmeticTask(
            min_digits=t.min_digits, max_digits=t.max_digits, ops=t.ops, seed=cfg.seed
        )
    if t.name in ("sort", "reverse"):
        return DigitStringTask(op=t.name, min_digits=t.min_digits, max_digits=t.max_digits,
                               scoring=t.scoring, seed=cfg.seed)
    return JsonlMathTask(load_jsonl_examples(t.jsonl_path))


def build_tokenizer(cfg: Config):
    if cfg.task.tokenizer_path:
        return load_hf_tokenizer(cfg.task.tokenizer_path)
    return CharTokenizer()


def model_config(cfg: Config, tokenizer) -> Qwen3MoeConfig:
    if cfg.model.preset != "tiny":
        raise ValueError(
            f"model.preset: must be 'tiny' (the only built-in) unless model.path is set, "
            f"got {cfg.model.preset!r}"
        )
    base = dict(
        vocab_size=tokenizer.vocab_size,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
    )
    base.update(cfg.model.overrides)
    try:
        return Qwen3MoeConfig.tiny(**base)
    except TypeError as e:
        raise ValueError(f"model.overrides: {e}") from None


def build_model(cfg: Config, tokenizer, *, seed: int | None = None) -> Qwen3MoeForCausalLM:
    """The initial policy: ``model.path`` if set (a local HF checkpoint), else a freshly
    initialised tiny MoE sized to the tokenizer."""
    if cfg.model.path:
        return from_pretrained(cfg.model.path, dtype=DTYPES[cfg.model.param_dtype])
    mcfg = model_config(cfg, tokenizer)
    return Qwen3MoeForCausalLM(
        mcfg, rngs=nnx.Rngs(cfg.seed if seed is None else seed),
        dtype=jnp.float32, param_dtype=DTYPES[cfg.model.param_dtype],
    )


def sampling_params(cfg: Config, tokenizer, *, temperature: float | None = None) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        temperature=r.temperature if temperature is None else temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop_token_ids=(tokenizer.eos_id,),
    )
