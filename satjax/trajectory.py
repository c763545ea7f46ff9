"""The trajectory record: what a rollout worker produces and the trainer consumes.

This dataclass is the in-memory form shared by every stage of the data path; the gRPC
queue serialises it with the versioned protobuf schema in ``trajectory.proto``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# The largest policy version: versions are int32 wherever they are arrays (token_versions,
# a batch's policy_versions) and in the trainer's state.
MAX_VERSION = int(np.iinfo(np.int32).max)
# The optional router record's fields: a batch has each on all of its rows or on none.
ROUTER_FIELDS = ("routed_experts", "routed_gates", "router_logits")


@dataclasses.dataclass
class Trajectory:
    """One sampled response to one prompt.

    Shapes (P prompt tokens, N response tokens, L MoE layers, k experts per token,
    E experts):
      prompt_tokens:      int32   [P]
      response_tokens:    int32   [N]
      behavior_logprobs:  float32 [N]   log-prob of each response token under the
                                         sampling distribution the engine used.
      routed_experts:     int32   [P + N - 1, L, k] or None. Expert ids the engine routed
                                         each token to (engine order kept). The last token
                                         is never fed back during sampling, so like vLLM we
                                         store P + N - 1 rows; by causality the trainer may
                                         route that final position freely.
      routed_gates:       float16 [P + N - 1, L, k] or None. The engine's gate weights of
                                         ``routed_experts`` (its normalised top-k router
                                         probabilities), same rows and order.
      router_logits:      float16 [P + N - 1, L, E] or None. The engine's full router logits
                                         (``rollout.record_router_logits``).
      policy_version:     in [0, MAX_VERSION].
      token_versions:     int32   [N] or None. The policy version that sampled each response
                                         token (a partial rollout spans several); None: all
                                         of them ``policy_version``. When set,
                                         ``policy_version`` is its minimum (the oldest
                                         token), so the queue's lag rule and ``max_lag``
                                         apply to the oldest token.
    """

    trajectory_id: str
    group_id: str
    prompt_id: str
    prompt_tokens: np.ndarray
    response_tokens: np.ndarray
    behavior_logprobs: np.ndarray
    policy_version: int
    reward: float
    group_size: int = 1
    reward_details: dict[str, float] = dataclasses.field(default_factory=dict)
    finish_reason: str = "length"
    routed_experts: np.ndarray | None = None
    routed_gates: np.ndarray | None = None
    router_logits: np.ndarray | None = None
    token_versions: np.ndarray | None = None
    engine: str = ""
    created_unix: float = 0.0
    generation_seconds: float = 0.0

    @property
    def truncated(self) -> bool:
        """Cut at ``max_new_tokens`` rather than ended by a stop token."""
        return self.finish_reason == "length"

    @property
    def versions(self) -> np.ndarray:
        """int32 [N]: the version that sampled each response token."""
        if self.token_versions is not None:
            return np.asarray(self.token_versions, np.int32)
        return np.full(len(self.response_tokens), self.policy_version, np.int32)

    @property
    def partial(self) -> bool:
        """Sampled by more than one policy version (a partial rollout)."""
        v = self.versions
        return bool(v.size) and int(v.min()) != int(v.max())

    @property
    def num_tokens(self) -> int:
        """P + N."""
        return int(len(self.prompt_tokens) + len(self.response_tokens))
