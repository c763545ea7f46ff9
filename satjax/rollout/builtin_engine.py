"""The built-in engine: the satjax KV-cache sampler on local JAX devices.

It is the embedded default on CPU. Weights arrive as the trainer's published Hugging
Face checkpoint directories; sampling runs in ``sample_dtype`` (bf16 by default, which is
how the test bed gets a realistic training-inference mismatch) while the canary runs
in fp32 so that it checks the weights, not the numerics.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from satjax.model import from_pretrained
from satjax.model.sampling import Completion, SamplingParams, generate

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class BuiltinEngine:
    name = "satjax-builtin"
    canary_atol = 1e-4

    def __init__(self, sample_dtype: str = "bfloat16", pad_id: int = 0) -> None:
        if sample_dtype not in _DTYPES:
            raise ValueError(f"sample_dtype: one of {sorted(_DTYPES)}, got {sample_dtype!r}")
        self.sample_dtype = _DTYPES[sample_dtype]
        self.pad_id = pad_id
        self.model = None
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
        return generate(
            self.model, prompts, sampling, rng=jax.random.key(seed),
            dtype=self.sample_dtype, pad_id=self.pad_id,
        )

    def canary_logprobs(self, tokens: list[int]) -> list[float]:
        if self.model is None:
            raise RuntimeError("BuiltinEngine.canary_logprobs before load()")
        return canary_logprobs(self.model, tokens)


def canary_logprobs(model, tokens: list[int]) -> list[float]:
    """fp32 teacher-forced log-probs of ``tokens[1:]``: the trainer and every engine
    compute this same quantity for the weight-sync check."""
    ids = jnp.asarray([tokens], jnp.int32)
    logits = model(ids).logits[0, :-1].astype(jnp.float32)
    lp = jax.nn.log_softmax(logits, axis=-1)
    return np.asarray(jnp.take_along_axis(lp, ids[0, 1:, None], axis=-1)[:, 0]).tolist()
