"""What a rollout engine must do, whichever it is (built-in JAX sampler or vLLM)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from satjax.model.sampling import Completion, SamplingParams


class Engine(Protocol):
    """A sampler serving one policy version at a time.

    ``generate`` returns, per prompt, the response tokens, the log-prob of each under
    the processed sampling distribution, and the routed experts ``[P+N-1, L, k]``.
    """

    name: str
    version: int | None
    canary_atol: float  # how far its canary log-probs may sit from the trainer's (fp32)

    def load(self, checkpoint_dir: Path, version: int) -> None: ...

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, seed: int
    ) -> list[Completion]: ...

    def canary_logprobs(self, tokens: list[int]) -> list[float]:
        """Teacher-forced log-probs of ``tokens[1:]`` given their prefixes (raw,
        temperature 1), in fp32 where the engine allows."""
        ...
