"""Rollout config -> engine: the one place that picks the built-in sampler or vLLM."""

from __future__ import annotations

from pathlib import Path

from satjax.rollout.engine import Engine


def make_engine(rollout_cfg, tokenizer, log_dir: Path | None = None, *, seed: int = 0
                ) -> Engine:
    """The engine ``rollout_cfg.engine`` names ("builtin" or "vllm").

    ``log_dir`` receives the vLLM server's log; ``seed`` is vLLM's server seed (the
    built-in engine is seeded per ``generate`` call).
    """
    if rollout_cfg.engine == "vllm":
        # imported lazily: the vLLM engine pulls in an HTTP client stack the default skips
        from satjax.rollout.vllm_engine import VllmEngine

        return VllmEngine(python=rollout_cfg.vllm_python, dtype=rollout_cfg.sample_dtype,
                          seed=seed, log_dir=log_dir,
                          record_router_logits=rollout_cfg.record_router_logits)
    from satjax.rollout.builtin_engine import BuiltinEngine

    return BuiltinEngine(rollout_cfg.sample_dtype, pad_id=tokenizer.pad_id,
                         record_router_logits=rollout_cfg.record_router_logits)
