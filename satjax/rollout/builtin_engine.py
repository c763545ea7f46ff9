"""The built-in engine: the satjax KV-cache sampler on local JAX devices.

It is the embedded default on CPU. Weights arrive as the trainer's published Hugging
Face checkpoint directories; sampling runs in ``sample_dtype`` (bf16 by default, which is
how the test bed gets a realistic training-inference mismatch) while the canary runs
in fp32 so that it checks the weights, not the numerics.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from satjax.model import DTYPES, Qwen3MoeForCausalLM, canary_logprobs, from_pretrained
from satjax.model.sampling import Samples, generate
from satjax.rollout.engine import Completion, SamplingParams


class BuiltinEngine:
    name = "satjax-builtin"
    canary_atol = 1e-4

    def __init__(self, sample_dtype: str = "bfloat16", pad_id: int = 0) -> None:
        if sample_dtype not in DTYPES:
            raise ValueError(f"sample_dtype: one of {sorted(DTYPES)}, got {sample_dtype!r}")
        self.sample_dtype = DTYPES[sample_dtype]
        self.pad_id = pad_id
        self.model: Qwen3MoeForCausalLM | None = None
        self.version: int | None = None

    def load(self, checkpoint_dir: Path, version: int) -> None:
        self.model = from_pretrained(checkpoint_dir, dtype=jnp.float32)
        self.version = int(version)

    def set_model(self, model, version: int) -> None:
        """In-process sync (same host as the trainer): use the given module directly."""
        self.model, self.version = model, int(version)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, seed: int
    ) -> list[Completion]:
        if self.model is None:
            raise RuntimeError("BuiltinEngine.generate before load()")
        samples = generate(
            self.model, prompts, **dataclasses.asdict(sampling), rng=jax.random.key(seed),
            dtype=self.sample_dtype, pad_id=self.pad_id,
        )
        return completions(prompts, samples)

    def canary_logprobs(self, tokens: list[int]) -> list[float]:
        if self.model is None:
            raise RuntimeError("BuiltinEngine.canary_logprobs before load()")
        return canary_logprobs(self.model, tokens)


def completions(prompts: list[list[int]], samples: Samples) -> list[Completion]:
    """Cuts the sampler's padded arrays into one ``Completion`` per prompt."""
    padded = samples.routed_experts.shape[1] - samples.tokens.shape[1] + 1  # P
    out = []
    for row, prompt in enumerate(prompts):
        n, p = int(samples.lengths[row]), int(samples.prompt_lengths[row])
        out.append(Completion(
            prompt_tokens=np.asarray(prompt, np.int32).reshape(-1),
            response_tokens=samples.tokens[row, :n].copy(),
            logprobs=samples.logprobs[row, :n].copy(),
            routed_experts=samples.routed_experts[row, padded - p: padded + n - 1].copy(),
            finish_reason="stop" if samples.stopped[row] else "length"))
    return out
