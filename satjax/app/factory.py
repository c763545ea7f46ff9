"""Builds the run's pieces from a :class:`satjax.config.Config`: task, tokenizer, model,
sampling parameters. Shared by ``satjax train | rollout | eval | sft | lag-sweep``."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from flax import nnx

from satjax.config import Config, ConfigError
from satjax.data.prompts import PromptFormat
from satjax.data.rewards import RewardError, check_on, checked_reward
from satjax.data.tasks import (
    ArithmeticTask,
    DigitStringTask,
    Example,
    FileTask,
    RescoredTask,
    load_examples,
)
from satjax.model import DTYPES, Qwen3MoeConfig, Qwen3MoeForCausalLM, from_pretrained
from satjax.model.tokenizer import CharTokenizer, load_hf_tokenizer
from satjax.rollout.engine import SamplingParams
from satjax.rollout.worker import WorkerConfig
from satjax.train.sft import warmup_enabled

log = logging.getLogger(__name__)


def prompt_format(cfg: Config) -> PromptFormat:
    """``task.prompt_template`` and ``task.system_prompt``."""
    return PromptFormat(cfg.task.prompt_template, cfg.task.system_prompt)


def _encoded_length(tokenizer, fmt: PromptFormat, ex: Example, key: str, path: str,
                    answer: bool) -> int:
    """The templated prompt's length in tokens; with ``answer``, the answer is encoded too
    (the warm-up trains on it). Raises ConfigError naming the row when the template names
    a field it lacks or the tokenizer cannot write its text (the character tokenizer's
    alphabet)."""
    try:
        text = fmt.text(tokenizer, ex)
    except ValueError as e:  # "task.prompt_template: row N has no field ..."
        raise ConfigError(f"config key 'task.prompt_template': {path}: "
                          f"{str(e).partition(': ')[2]}") from None
    where = f"config key {key!r}: {path}: row {ex.index}"
    try:
        n = len(fmt.encode_text(tokenizer, text))
    except ValueError as e:  # outside the character tokenizer's alphabet
        raise ConfigError(f"{where}'s prompt: {e}") from None
    if answer:
        try:
            tokenizer.encode(ex.answer)
        except ValueError as e:
            raise ConfigError(f"{where}'s answer (the warm-up trains on it): {e}") from None
    return n


def _short_prompts(examples: list[Example], tokenizer, fmt: PromptFormat, limit: int,
                   key: str, what: str, answers: bool) -> list[Example]:
    """``examples`` without those whose prompt is longer than ``limit`` tokens (logged);
    every prompt (and with ``answers``, every answer) encodable, else ConfigError."""
    lengths = [_encoded_length(tokenizer, fmt, ex, key, what, answers) for ex in examples]
    kept = [ex for ex, n in zip(examples, lengths, strict=True) if n <= limit]
    if not kept:
        raise ConfigError(f"config key 'task.max_prompt_tokens': must fit a prompt of {what} "
                          f"(the shortest, templated, has {min(lengths)} tokens), got {limit}")
    if len(kept) < len(examples):
        log.warning("task.max_prompt_tokens=%d: dropped %d of %d %s rows whose prompt is "
                    "longer", limit, len(examples) - len(kept), len(examples), what)
    return kept


def build_task(cfg: Config, tokenizer):
    """The configured task; a file task's rows read, their prompts longer than
    ``task.max_prompt_tokens`` (with the template, in ``tokenizer``'s tokens) dropped.
    Raises ConfigError (one line naming the row) for unreadable rows, a null question or
    answer, a template field a row lacks, text the tokenizer cannot write (answers too
    when the SFT warm-up trains on them), no prompt short enough, or a user's reward that
    fails on the first training example (:func:`satjax.data.rewards.check_on`)."""
    task = _build_task(cfg, tokenizer)
    if cfg.task.reward:
        try:  # bounded by task.reward_timeout_s, as every call
            check_on(task.reward, cfg.task.reward, task.example(0))
        except RewardError as e:
            raise ConfigError(f"config key 'task.reward': {str(e).removeprefix('task.reward ')}"
                              " (called at start with the example's reference answer)"
                              ) from None
    return task


def _build_task(cfg: Config, tokenizer):
    t = cfg.task
    if t.name in ("arithmetic", "sort", "reverse"):
        builtin = ArithmeticTask(min_digits=t.min_digits, max_digits=t.max_digits, ops=t.ops,
                                 seed=cfg.seed) if t.name == "arithmetic" else \
            DigitStringTask(op=t.name, min_digits=t.min_digits, max_digits=t.max_digits,
                            scoring=t.scoring, separator=t.separator, seed=cfg.seed)
        return RescoredTask(builtin, checked_reward(t.reward, t.reward_timeout_s)) \
            if t.reward else builtin
    fmt = prompt_format(cfg)

    def load(key: str, path: str) -> list[Example]:
        try:
            examples = load_examples(path, question_field=t.question_field,
                                     answer_field=t.answer_field)
        except ValueError as e:  # one line naming the row and what is wrong
            raise ConfigError(f"config key {key!r}: {e}") from None
        return _short_prompts(examples, tokenizer, fmt, t.max_prompt_tokens, key, path,
                              answers=warmup_enabled(cfg))

    return FileTask(load("task.jsonl_path", t.jsonl_path),
                    checked_reward(t.reward or "math_verify", t.reward_timeout_s),
                    eval_examples=load("task.eval_path", t.eval_path) if t.eval_path else None)


# files that make a checkpoint directory a Hugging Face tokenizer directory too
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tokenizer_path(cfg: Config) -> str:
    """``task.tokenizer_path``; else ``model.path`` when the checkpoint ships its tokenizer
    (a downloaded HF model does; satjax's own checkpoints do not); else "" (the built-in
    character tokenizer)."""
    if cfg.task.tokenizer_path:
        return cfg.task.tokenizer_path
    path = cfg.model.path
    if path and any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return path
    return ""


def build_tokenizer(cfg: Config):
    path = tokenizer_path(cfg)
    return load_hf_tokenizer(path) if path else CharTokenizer()


def model_config(cfg: Config, tokenizer=None) -> Qwen3MoeConfig:
    """The policy's architecture: ``model.path``'s config.json; else the tiny preset sized
    to ``tokenizer`` with ``model.overrides`` over it; else (``model.preset: ""``)
    ``model.overrides`` as the whole architecture (how configs/qwen3-30b-a3b.yaml writes
    the paper's model out, so its shape is known without the weights)."""
    m = cfg.model
    if m.path:
        with open(os.path.join(m.path, "config.json")) as fh:
            return Qwen3MoeConfig.from_hf_dict(json.load(fh))
    if m.preset == "tiny":
        if tokenizer is None:
            raise ValueError("model_config: the tiny preset is sized to a tokenizer; pass one")
        base: dict[str, Any] = dict(
            vocab_size=tokenizer.vocab_size,
            bos_token_id=tokenizer.bos_id,
            eos_token_id=tokenizer.eos_id,
            pad_token_id=tokenizer.pad_id,
        )
        base.update(m.overrides)
    else:
        base = dict(m.overrides)
    try:
        return Qwen3MoeConfig.tiny(**base) if m.preset == "tiny" else Qwen3MoeConfig(**base)
    except (TypeError, ValueError) as e:
        raise ValueError(f"model.overrides: {e}") from None


def architecture_mismatch(cfg: Config) -> list[str]:
    """The ``model.overrides`` fields that ``model.path``'s config.json contradicts, as
    ``"field: config.json has X, the config says Y"`` (empty unless ``model.preset`` is
    "" and both are set): a config written for one model never trains another."""
    m = cfg.model
    if not (m.path and m.preset == "" and m.overrides):
        return []
    have = model_config(cfg)
    want = dataclasses.replace(have, **m.overrides)
    return [f"{k}: config.json has {getattr(have, k)!r}, the config says {getattr(want, k)!r}"
            for k in m.overrides if getattr(have, k) != getattr(want, k)]


def model_options(cfg: Config) -> dict[str, Any]:
    """How the configured policy computes: the keyword arguments ``Qwen3MoeForCausalLM``
    and ``from_pretrained`` take besides its shape (dtypes, dispatch, layer scan)."""
    m = cfg.model
    return dict(dtype=DTYPES[m.dtype], param_dtype=DTYPES[m.param_dtype],
                moe_impl=m.moe_impl, attention=m.attention, scan_layers=m.scan_layers)


def build_model(cfg: Config, tokenizer, *, seed: int | None = None) -> Qwen3MoeForCausalLM:
    """The initial policy: ``model.path`` if set (a local HF checkpoint), else a freshly
    initialised tiny MoE sized to the tokenizer; computing as :func:`model_options` says."""
    if cfg.model.path:
        return from_pretrained(cfg.model.path, **model_options(cfg))
    mcfg = model_config(cfg, tokenizer)
    return Qwen3MoeForCausalLM(
        mcfg, rngs=nnx.Rngs(cfg.seed if seed is None else seed), **model_options(cfg))


def stop_token_ids(cfg: Config, tokenizer) -> tuple[int, ...]:
    """The ids that end a response: the tokenizer's EOS, ``model.path``'s
    generation_config.json ``eos_token_id`` (e.g. a chat model's end-of-turn token) and
    the ``rollout.stop`` strings that are one token each."""
    ids = [tokenizer.eos_id]
    gen = os.path.join(cfg.model.path, "generation_config.json") if cfg.model.path else ""
    if gen and os.path.isfile(gen):
        with open(gen) as fh:
            eos = json.load(fh).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
    ids += [i for i in (tokenizer.token_id(s) for s in cfg.rollout.stop) if i is not None]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def sampling_params(cfg: Config, tokenizer, *, temperature: float | None = None) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        temperature=r.temperature if temperature is None else temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop_token_ids=stop_token_ids(cfg, tokenizer),
    )


def worker_config(cfg: Config, tokenizer, *, seed: int, worker_id: str) -> WorkerConfig:
    """A rollout worker's settings from the run's config."""
    r = cfg.rollout
    return WorkerConfig(
        group_size=r.group_size, prompts_per_step=r.prompts_per_step,
        sampling=sampling_params(cfg, tokenizer), seed=seed, worker_id=worker_id,
        record_routes=r.record_routes, partial=r.partial, queue_retry_s=r.queue_retry_s,
        prompt=prompt_format(cfg),
        stop_strings=tuple(s for s in r.stop if tokenizer.token_id(s) is None),
        overlong=r.overlong, overlong_buffer=r.overlong_buffer,
        overlong_penalty=r.overlong_penalty)
