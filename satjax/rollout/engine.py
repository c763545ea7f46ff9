"""What a rollout engine must do, whichever it is (built-in JAX sampler or vLLM)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Protocol

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling controls. ``top_k=0`` and ``top_p=1`` disable those filters."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclasses.dataclass
class Completion:
    """One sampled response. routed_experts: int32 [P + N - 1, L, k] (vLLM convention)."""

    prompt_tokens: np.ndarray
    response_tokens: np.ndarray
    logprobs: np.ndarray
    routed_experts: np.ndarray
    finish_reason: Literal["stop", "length"]


class Engine(Protocol):
    """A sampler serving one policy version at a time.

    ``generate`` returns, per prompt, the response tokens, the log-prob of each under
    the processed sampling distribution, and the routed experts ``[P+N-1, L, k]``.
    """

    name: str
    version: int | None
    canary_atol: float  # how far its canary log-probs may sit from the trainer's (fp32)

    def load(self, checkpoint_dir: Path, version: int) -> None:
        """Serves the full version (a Hugging Face checkpoint directory) ``version``."""
        ...

    def apply_deltas(self, delta_dirs: Sequence[Path], version: int) -> None:
        """Moves the weights served to ``version`` through the delta versions in
        ``delta_dirs`` (``satjax.weight_sync``), in order: the first a delta of the
        version served, each next one a delta of the one before."""
        ...

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, seed: int
    ) -> list[Completion]: ...

    def canary_logprobs(self, tokens: list[int]) -> list[float]:
        """Teacher-forced log-probs of ``tokens[1:]`` given their prefixes (raw,
        temperature 1), in fp32 where the engine allows."""
        ...
