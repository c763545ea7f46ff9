"""What a rollout engine must do, whichever it is (built-in JAX sampler or vLLM)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
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
    """One sampled response (P prompt tokens, N response tokens, L MoE layers, top-k of E).

    routed_experts int32   [P + N - 1, L, k]  (vLLM's convention: one row per input
                                              position but the last)
    routed_gates   float16 [P + N - 1, L, k] or None  their gate weights (the normalised
                                              top-k probabilities)
    router_logits  float16 [P + N - 1, L, E] or None  when the engine records them
    token_versions int32   [N] or None  the version that sampled each response token
                                (None: all the version the engine served for the call)
    """

    prompt_tokens: np.ndarray
    response_tokens: np.ndarray
    logprobs: np.ndarray
    routed_experts: np.ndarray
    finish_reason: Literal["stop", "length"]
    routed_gates: np.ndarray | None = None
    router_logits: np.ndarray | None = None
    token_versions: np.ndarray | None = None

    def cut(self, n: int) -> Completion:
        """The first ``n`` response tokens, with their rows of the router record."""
        rows = len(self.prompt_tokens) + n - 1

        def head(a: np.ndarray | None, m: int) -> np.ndarray | None:
            return None if a is None else a[:m]

        return dataclasses.replace(
            self, response_tokens=self.response_tokens[:n], logprobs=self.logprobs[:n],
            routed_experts=self.routed_experts[:rows], routed_gates=head(self.routed_gates, rows),
            router_logits=head(self.router_logits, rows),
            token_versions=head(self.token_versions, n))


# Called by an engine between two segments of a batch under ``rollout.partial``: loads the
# version the trainer now wants, if it changed (the rollout worker's ``maybe_sync``); True
# when the engine then serves new weights.
Sync = Callable[[], bool]


class Engine(Protocol):
    """A sampler serving one policy version at a time.

    ``generate`` returns, per prompt, the response tokens, the log-prob of each under
    the processed sampling distribution, the routed experts ``[P+N-1, L, k]`` with their
    gate weights, and the version of each token. With ``sync`` it calls it between
    segments of the batch and goes on with the weights it then serves (a partial rollout).
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
        self, prompts: list[list[int]], sampling: SamplingParams, seed: int,
        sync: Sync | None = None,
    ) -> list[Completion]: ...

    def canary_logprobs(self, tokens: list[int]) -> list[float]:
        """Teacher-forced log-probs of ``tokens[1:]`` given their prefixes (raw,
        temperature 1), in fp32 where the engine allows."""
        ...
