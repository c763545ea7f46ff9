"""Qwen3-MoE-layout decoder in Flax NNX, HF safetensors I/O, KV-cache sampler, tokenizers."""

import jax.numpy as jnp

from satjax.model.config import Qwen3MoeConfig
from satjax.model.hf_io import from_pretrained, save_pretrained
from satjax.model.logprobs import canary_logprobs, token_logprobs
from satjax.model.moe import RouteRecord
from satjax.model.transformer import (
    REMAT_POLICIES,
    BackboneOutput,
    ModelOutput,
    Qwen3MoeForCausalLM,
)

# config dtype names (model.dtype, model.param_dtype, rollout.sample_dtype) -> JAX dtypes
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

__all__ = [
    "DTYPES",
    "REMAT_POLICIES",
    "BackboneOutput",
    "ModelOutput",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "RouteRecord",
    "canary_logprobs",
    "from_pretrained",
    "save_pretrained",
    "token_logprobs",
]
