"""Qwen3-MoE-layout decoder in Flax NNX, HF safetensors I/O, KV-cache sampler, tokenizers."""

from satjax.model.config import Qwen3MoeConfig
from satjax.model.hf_io import from_pretrained, save_pretrained
from satjax.model.transformer import ModelOutput, Qwen3MoeForCausalLM

__all__ = [
    "ModelOutput",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "from_pretrained",
    "save_pretrained",
]
