"""The built-in engine: the satjax KV-cache sampler on local JAX devices.

It is the embedded default on CPU. Weights arrive as the trainer's published Hugging
Face checkpoint directories, or as deltas of the version served (``satjax.weight_sync``):
a host mirror of the served version's tensors (their published bytes) takes the XOR and
the model's parameters holding a changed tensor are set from it. Sampling runs in
``sample_dtype`` (bf16 by default, which is how the test bed gets a realistic
training-inference mismatch) while the canary runs in fp32 so that it checks the weights,
not the numerics.

Under ``rollout.partial`` a batch is decoded :data:`SEGMENT_TOKENS` tokens at a time; between
two segments the worker may load new weights (in place, from deltas or a full version), and
the batch goes on with them from its KV cache (:class:`satjax.model.sampling.Generation`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from satjax.model import DTYPES, Qwen3MoeForCausalLM, canary_logprobs, from_pretrained
from satjax.model.hf_io import numpy_dtype, set_hf_tensors
from satjax.model.sampling import Generation, Samples
from satjax.rollout.engine import Completion, SamplingParams, Sync
from satjax.weight_sync import WeightMirror, WeightSubscriber, check_canary, verify_files

# Tokens decoded between two checks for new weights under ``rollout.partial``: each check
# is a host round trip, and a version published mid-segment waits at most this long.
SEGMENT_TOKENS = 4


class BuiltinEngine:
    """``record_router_logits``: also return the full router logits (float16 [P+N-1, L, E])."""

    name = "satjax-builtin"
    canary_atol = 1e-4

    def __init__(self, sample_dtype: str = "bfloat16", pad_id: int = 0,
                 record_router_logits: bool = False) -> None:
        if sample_dtype not in DTYPES:
            raise ValueError(f"sample_dtype: one of {sorted(DTYPES)}, got {sample_dtype!r}")
        self.sample_dtype = DTYPES[sample_dtype]
        self.pad_id = pad_id
        self.record_router_logits = record_router_logits
        self.model: Qwen3MoeForCausalLM | None = None
        self.version: int | None = None
        self.mirror = WeightMirror()  # the published bytes of the version served

    def load(self, checkpoint_dir: Path, version: int) -> None:
        self.mirror.load_full(checkpoint_dir)
        self.model = from_pretrained(checkpoint_dir, dtype=jnp.float32)
        self.version = int(version)

    def apply_deltas(self, delta_dirs: Sequence[Path], version: int) -> None:
        if self.model is None:
            raise RuntimeError("BuiltinEngine.apply_deltas before load()")
        self.version = None  # until the model holds a whole version again
        changed: set[str] = set()
        for d in delta_dirs:
            changed.update(self.mirror.apply_delta(d))
        tensors = {name: np.frombuffer(t.data, numpy_dtype(t.dtype)).reshape(t.shape)
                   for name, t in self.mirror.tensors.items()}
        set_hf_tensors(self.model, tensors, changed)
        self.version = int(version)

    def set_model(self, model, version: int) -> None:
        """In-process sync (same host as the trainer): use the given module directly."""
        self.model, self.version = model, int(version)
        self.mirror = WeightMirror()  # holds no published version: the next sync is full

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, seed: int,
        sync: Sync | None = None,
    ) -> list[Completion]:
        """One completion per prompt; with ``sync``, decoded :data:`SEGMENT_TOKENS` at a time
        with ``sync()`` between segments (the batch continues with the weights loaded)."""
        if self.model is None or self.version is None:
            raise RuntimeError("BuiltinEngine.generate before load()")
        gen = Generation(
            self.model, prompts, **dataclasses.asdict(sampling), rng=jax.random.key(seed),
            dtype=self.sample_dtype, pad_id=self.pad_id, version=self.version,
            record_logits=self.record_router_logits)
        while not gen.decode(self.model, self.version,
                             None if sync is None else SEGMENT_TOKENS):
            assert sync is not None  # decode to the end finishes
            sync()
            if self.model is None or self.version is None:
                raise RuntimeError("BuiltinEngine: no whole version loaded after sync")
        return completions(prompts, gen.samples())

    def canary_logprobs(self, tokens: list[int]) -> list[float]:
        if self.model is None:
            raise RuntimeError("BuiltinEngine.canary_logprobs before load()")
        return canary_logprobs(self.model, tokens)


def published_model(subscriber: WeightSubscriber, version: int) -> Qwen3MoeForCausalLM:
    """The float32 model of published ``version``: its full version, or rebuilt from the
    keyframe of its chain and the deltas after it; every file checked against its
    published checksum first, the canary after. Raises :class:`WeightSyncError` (a
    damaged file: naming the version and the file) or ``OSError``."""
    engine = BuiltinEngine("float32")
    steps = subscriber.sync_plan(version, None)
    for step in steps:
        verify_files(step)
    engine.load(steps[0].path, steps[0].version)
    if len(steps) > 1:
        engine.apply_deltas([s.path for s in steps[1:]], version)
    manifest = steps[-1].manifest
    if manifest.get("canary"):
        check_canary(manifest, engine.canary_logprobs(list(manifest["canary"]["tokens"])),
                     atol=engine.canary_atol)
    assert engine.model is not None
    return engine.model


def completions(prompts: list[list[int]], samples: Samples) -> list[Completion]:
    """Cuts the sampler's padded arrays into one ``Completion`` per prompt."""
    padded = samples.routed_experts.shape[1] - samples.tokens.shape[1] + 1  # P
    out = []
    for row, prompt in enumerate(prompts):
        n, p = int(samples.lengths[row]), int(samples.prompt_lengths[row])
        rows = slice(padded - p, padded + n - 1)
        out.append(Completion(
            prompt_tokens=np.asarray(prompt, np.int32).reshape(-1),
            response_tokens=samples.tokens[row, :n].copy(),
            logprobs=samples.logprobs[row, :n].copy(),
            routed_experts=samples.routed_experts[row, rows].copy(),
            routed_gates=samples.routed_gates[row, rows].copy(),
            token_versions=samples.token_versions[row, :n].copy(),
            router_logits=(None if samples.router_logits is None
                           else samples.router_logits[row, rows].copy()),
            finish_reason="stop" if samples.stopped[row] else "length"))
    return out
