"""Training batches: padded, bucketed arrays built from rollout trajectories.

Alignment convention (the one ``satjax.model.token_logprobs`` produces): position ``t`` of every
``[B, T]`` per-token array refers to token ``tokens[:, t]`` as *predicted* from positions
``< t``. So ``loss_mask[b, t] = 1`` exactly where ``tokens[b, t]`` is a response token,
and ``behavior_logprobs[b, t]`` is the engine's log-prob of that token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from satjax.trajectory import MAX_VERSION, ROUTER_FIELDS, Trajectory


class UnbatchableError(ValueError):
    """Trajectories that cannot make one batch (the data is at fault, not the arguments):
    a trainer skips such a batch and goes on, where stopping would stop again on every
    ``--resume`` (the queue delivers the batch again until it is acknowledged)."""


@struct.dataclass
class Batch:
    """One training batch (a JAX pytree; ``group_size`` is static).

    Shapes (B rows, T bucketed length, L MoE layers, k experts per token):
      tokens            int32   [B, T]  prompt + response, right-padded with pad_id
      attention_mask    int32   [B, T]  1 on real tokens
      loss_mask         float32 [B, T]  1 on response tokens
      behavior_logprobs float32 [B, T]  engine log-probs of the response tokens, 0 elsewhere
      rewards           float32 [B]
      group_ids         int32   [B]     rows of one group are contiguous, group_size each
      policy_versions   int32   [B]     version that sampled the row (-1 on padding rows)
      routed_experts    int32   [B, T, L, k] or None  the engine's experts; row t = the
                                         experts token t was routed to (last real position
                                         zeros)
      routed_gates      float16 [B, T, L, k] or None  their gate weights (same rows)
      router_logits     float16 [B, T, L, E] or None  the engine's full router logits
      advantages        float32 [B] or None  precomputed advantages (else from rewards)
      old_logprobs      float32 [B, T] or None  the proximal policy's log-probs, when the
                                         objective's ratio is taken against them
                                         (several updates per rollout batch: the step
                                         computes them itself)
    """

    tokens: jax.Array
    attention_mask: jax.Array
    loss_mask: jax.Array
    behavior_logprobs: jax.Array
    rewards: jax.Array
    group_ids: jax.Array
    policy_versions: jax.Array
    routed_experts: jax.Array | None = None
    routed_gates: jax.Array | None = None
    router_logits: jax.Array | None = None
    advantages: jax.Array | None = None
    old_logprobs: jax.Array | None = None
    group_size: int = struct.field(pytree_node=False, default=1)

    def route_mask(self) -> jax.Array:
        """[B, T] bool: positions whose routes are recorded (real token with a successor)."""
        m = self.attention_mask.astype(bool)
        return m & jnp.concatenate([m[:, 1:], jnp.zeros_like(m[:, :1])], axis=1)


def pick_bucket(length: int, buckets: Sequence[int]) -> int | None:
    """Smallest bucket >= length, or None."""
    fits = [b for b in sorted(buckets) if b >= length]
    return fits[0] if fits else None


def _grouped(trajectories: Sequence[Trajectory], group_size: int) -> list[Trajectory]:
    """Orders trajectories so each group is contiguous; every group must be complete."""
    groups: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    for gid, members in groups.items():
        if len(members) != group_size:
            raise UnbatchableError(
                f"trajectories: group {gid!r} has {len(members)} members, expected "
                f"group_size={group_size} (incomplete groups bias the group baseline)"
            )
    return [t for members in groups.values() for t in members]


def make_batch(
    trajectories: Sequence[Trajectory],
    *,
    buckets: Sequence[int],
    pad_id: int = 0,
    num_layers_moe: int | None = None,
    top_k: int | None = None,
    batch_multiple: int = 1,
    advantages: Sequence[float] | None = None,
    mask_truncated: bool = False,
    min_rows: int = 0,
) -> Batch:
    """Pads trajectories into a ``Batch`` (host numpy arrays; device_put them yourself).

    Args:
      trajectories: complete groups (``Trajectory.group_size`` members per ``group_id``).
      buckets: allowed padded lengths T; the smallest one >= the longest trajectory is used.
      pad_id: token id of padding.
      num_layers_moe, top_k: expected (L, k) of ``routed_experts`` (checked when given;
        otherwise taken from the first trajectory). Routes are all-or-nothing: either every
        trajectory carries ``routed_experts`` or none does; so are ``routed_gates`` and
        ``router_logits``, each of the shape of the first trajectory's.
      batch_multiple: B is padded up to a multiple of lcm(batch_multiple, group_size)
        with fully masked rows (pass the data-parallel size of the mesh).
      min_rows: B is at least this (padded the same way): a batch that may come short
        (dynamic sampling) keeps the step's shape.
      advantages: optional precomputed advantages, one per trajectory (in input order).
      mask_truncated: give truncated responses (``Trajectory.truncated``) a zero
        ``loss_mask`` (DAPO's overlong filtering, arXiv:2503.14476): they still count in
        their group's reward baseline, but contribute no gradient.

    Raises:
      UnbatchableError naming the offending trajectory; ValueError naming the argument.
    """
    if not trajectories:
        raise ValueError("trajectories: empty list")
    if batch_multiple < 1:
        raise ValueError(f"batch_multiple must be >= 1, got {batch_multiple}")
    group_size = int(trajectories[0].group_size)
    for t in trajectories:
        if int(t.group_size) != group_size:
            raise UnbatchableError(
                f"trajectory {t.trajectory_id!r}: group_size {t.group_size} != {group_size}"
            )
    adv_by_id: dict[int, float] | None = None
    if advantages is not None:
        if len(advantages) != len(trajectories):
            raise ValueError(
                f"advantages: {len(advantages)} values for {len(trajectories)} trajectories"
            )
        adv_by_id = {id(t): float(a) for t, a in zip(trajectories, advantages, strict=True)}
    ordered = _grouped(trajectories, group_size)

    longest = max(t.num_tokens for t in ordered)
    T = pick_bucket(longest, buckets)
    if T is None:
        worst = max(ordered, key=lambda t: t.num_tokens)
        raise UnbatchableError(
            f"trajectory {worst.trajectory_id!r} has {worst.num_tokens} tokens, more than the "
            f"largest bucket {max(buckets)}; raise buckets or cap max_new_tokens"
        )
    multiple = math.lcm(batch_multiple, group_size)
    n = len(ordered)
    B = -(-max(n, min_rows) // multiple) * multiple

    for name in ROUTER_FIELDS:
        have = [t for t in ordered if getattr(t, name) is not None]
        if have and len(have) != len(ordered):
            missing = next(t for t in ordered if getattr(t, name) is None)
            raise UnbatchableError(
                f"trajectory {missing.trajectory_id!r} has no {name} while others do; "
                f"{name} must be present on all trajectories of a batch or on none")
    with_routes = ordered[0].routed_experts is not None
    if with_routes:
        first = ordered[0].routed_experts
        assert first is not None
        L = num_layers_moe if num_layers_moe is not None else first.shape[1]
        k = top_k if top_k is not None else first.shape[2]
    if ordered[0].routed_gates is not None and not with_routes:
        raise UnbatchableError(f"trajectory {ordered[0].trajectory_id!r}: routed_gates without "
                         "routed_experts")

    tokens = np.full((B, T), pad_id, np.int32)
    attn = np.zeros((B, T), np.int32)
    loss_mask = np.zeros((B, T), np.float32)
    blp = np.zeros((B, T), np.float32)
    rewards = np.zeros((B,), np.float32)
    group_ids = np.zeros((B,), np.int32)
    versions = np.full((B,), -1, np.int32)
    adv = np.zeros((B,), np.float32) if adv_by_id is not None else None
    routes = np.zeros((B, T, L, k), np.int32) if with_routes else None
    gates = (np.zeros((B, T, L, k), np.float16) if ordered[0].routed_gates is not None
             else None)
    first_logits = ordered[0].router_logits
    logits = (None if first_logits is None
              else np.zeros((B, T, *np.shape(first_logits)[1:]), np.float16))

    gid_index: dict[str, int] = {}
    for i, t in enumerate(ordered):
        P, N = len(t.prompt_tokens), len(t.response_tokens)
        if len(t.behavior_logprobs) != N:
            raise UnbatchableError(
                f"trajectory {t.trajectory_id!r}: {len(t.behavior_logprobs)} behavior_logprobs "
                f"for {N} response tokens"
            )
        if P == 0:
            raise UnbatchableError(f"trajectory {t.trajectory_id!r}: empty prompt")
        if not 0 <= t.policy_version <= MAX_VERSION:
            raise UnbatchableError(f"trajectory {t.trajectory_id!r}: policy_version must be in "
                             f"[0, {MAX_VERSION}] (int32), got {t.policy_version!r}")
        tokens[i, :P] = t.prompt_tokens
        tokens[i, P : P + N] = t.response_tokens
        attn[i, : P + N] = 1
        loss_mask[i, P : P + N] = 0.0 if mask_truncated and t.truncated else 1.0
        blp[i, P : P + N] = t.behavior_logprobs
        rewards[i] = t.reward
        group_ids[i] = gid_index.setdefault(t.group_id, len(gid_index))
        versions[i] = t.policy_version
        if adv is not None and adv_by_id is not None:
            adv[i] = adv_by_id[id(t)]
        if routes is not None and t.routed_experts is not None:
            r = np.asarray(t.routed_experts)
            if r.shape != (P + N - 1, L, k):
                raise UnbatchableError(
                    f"trajectory {t.trajectory_id!r}: routed_experts shape {r.shape}, expected "
                    f"{(P + N - 1, L, k)} (P + N - 1 rows, L={L} MoE layers, top_k={k})"
                )
            routes[i, : P + N - 1] = r
        for name, out in (("routed_gates", gates), ("router_logits", logits)):
            value = getattr(t, name)
            if out is not None and value is not None:
                if np.shape(value) != (P + N - 1, *out.shape[2:]):
                    raise UnbatchableError(
                        f"trajectory {t.trajectory_id!r}: {name} shape {np.shape(value)}, "
                        f"expected {(P + N - 1, *out.shape[2:])}")
                out[i, : P + N - 1] = value
    # padding rows form whole fake groups with fresh ids, fully masked
    for i in range(n, B):
        group_ids[i] = len(gid_index) + (i - n) // group_size
    # host numpy arrays, in fields typed for the jax.Arrays the step sees once they are placed
    return Batch(
        tokens=tokens, attention_mask=attn, loss_mask=loss_mask,  # type: ignore[arg-type]
        behavior_logprobs=blp, rewards=rewards, group_ids=group_ids,  # type: ignore[arg-type]
        policy_versions=versions, routed_experts=routes,  # type: ignore[arg-type]
        routed_gates=gates, router_logits=logits, advantages=adv,  # type: ignore[arg-type]
        group_size=group_size,
    )
