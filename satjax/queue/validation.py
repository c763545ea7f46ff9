"""Stateless per-trajectory validation done by the queue server before storing anything.

Every rule returns a :class:`Problem` naming the offending proto field, so that a producer
learns exactly what to fix. Stateful rules (policy version from the future, group
consistency, duplicates) live in :mod:`satjax.queue.core`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TypeAlias

import numpy as np
from google.protobuf.unknown_fields import UnknownFieldSet

from satjax.queue._proto import pb2
from satjax.queue.codec import (
    GATE_DTYPES,
    LOGIT_DTYPES,
    LOGPROB_DTYPE,
    ROUTE_DTYPES,
    SCHEMA_VERSION,
    TOKEN_DTYPE,
    VERSION_DTYPE,
    TrajectoryView,
)
from satjax.trajectory import ROUTER_FIELDS  # checked in this order

FINISH_REASONS = ("stop", "length", "abort")
# the trainer computes in float32: a float64 value beyond this is inf there
FLOAT32_MAX = float(np.finfo(np.float32).max)
# gate weights are probabilities; float16 rounds a weight of 1 up to at most this
GATE_MAX = 1.0 + 2.0 ** -10
TrajectoryLike: TypeAlias = pb2.Trajectory | TrajectoryView  # same attribute names


@dataclasses.dataclass(frozen=True)
class Limits:
    """Server-side bounds. The model's (``vocab_size`` ... ``group_size``) are None unless
    the run gives them; then only shape-consistency checks apply to that dimension."""

    max_seq_len: int = 131072         # P + N
    max_group_size: int = 4096
    max_id_chars: int = 256
    vocab_size: int | None = None     # token ids must be < vocab_size
    num_experts: int | None = None    # expert ids must be < num_experts (E)
    moe_layers: int | None = None     # routes / router logits have this many layers (L)
    top_k: int | None = None          # routes have this many experts per token (k)
    group_size: int | None = None     # the run's group size: every group has exactly it
    max_version: int = 2**63 - 1      # policy_version is int64 on the wire; a satjax
                                      # trainer's run passes its int32 bound (MAX_VERSION)
    required: tuple[str, ...] = ()    # router fields every trajectory must carry (what the
                                      # run's workers record and its trainer batches)
    refused: tuple[str, ...] = ()     # router fields no trajectory may carry (what the run
                                      # does not record: a batch mixing rows with and
                                      # without one cannot be made)
    logprob_tolerance: float = 1e-4   # log-probs may exceed 0 by this much (fp rounding)

    def __post_init__(self):
        for name in ("max_seq_len", "max_group_size", "max_id_chars", "vocab_size",
                     "num_experts", "moe_layers", "top_k", "group_size", "max_version"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value!r}")
        for name in ("required", "refused"):
            unknown = set(getattr(self, name)) - set(ROUTER_FIELDS)
            if unknown:
                raise ValueError(f"{name}: must name fields of {ROUTER_FIELDS}, "
                                 f"got {sorted(unknown)!r}")
        both = set(self.required) & set(self.refused)
        if both:
            raise ValueError(f"refused: must not name a required field, got {sorted(both)!r}")


@dataclasses.dataclass(frozen=True)
class Problem:
    field: str
    message: str


def _packed(data: bytes | memoryview, dtype: np.dtype, field: str
            ) -> tuple[np.ndarray | None, Problem | None]:
    if len(data) % dtype.itemsize:
        return None, Problem(field, f"{field}: must be a whole number of {dtype.name} values, "
                                    f"got {len(data)!r} bytes")
    return np.frombuffer(data, dtype=dtype), None


def _check_ids(msg: TrajectoryLike, limits: Limits) -> Problem | None:
    if msg.schema_version != SCHEMA_VERSION:
        return Problem("schema_version", f"schema_version: must be {SCHEMA_VERSION}, "
                                         f"got {msg.schema_version!r}")
    for name in ("trajectory_id", "group_id"):
        value = getattr(msg, name)
        if not value:
            return Problem(name, f"{name}: must be non-empty, got {value!r}")
    for name in ("trajectory_id", "group_id", "prompt_id"):
        value = getattr(msg, name)
        if len(value) > limits.max_id_chars:
            return Problem(name, f"{name}: must be at most {limits.max_id_chars} characters, "
                                 f"got {len(value)!r}")
    if not 1 <= msg.group_size <= limits.max_group_size:
        return Problem("group_size", f"group_size: must be in [1, {limits.max_group_size}], "
                                     f"got {msg.group_size!r}")
    if limits.group_size is not None and msg.group_size != limits.group_size:
        return Problem("group_size", f"group_size: must be the run's group size "
                                     f"{limits.group_size}, got {msg.group_size!r}")
    if not 0 <= msg.policy_version <= limits.max_version:
        return Problem("policy_version", f"policy_version: must be in [0, "
                                         f"{limits.max_version}], got {msg.policy_version!r}")
    if msg.finish_reason not in FINISH_REASONS:
        return Problem("finish_reason", f"finish_reason: must be one of {FINISH_REASONS}, "
                                        f"got {msg.finish_reason!r}")
    if not abs(msg.reward) <= FLOAT32_MAX:
        return Problem("reward", f"reward: must be finite in float32, got {msg.reward!r}")
    for key, value in msg.reward_details.items():
        if not abs(value) <= FLOAT32_MAX:
            return Problem("reward_details", f"reward_details[{key!r}]: must be finite in "
                                             f"float32, got {value!r}")
    t = msg.timing
    for name in ("created_unix", "generation_seconds"):
        value = getattr(t, name)
        if not (math.isfinite(value) and value >= 0):
            return Problem(f"timing.{name}", f"timing.{name}: must be finite and >= 0, "
                                             f"got {value!r}")
    return None


def _check_tokens(msg: TrajectoryLike, limits: Limits) -> tuple[int, int, Problem | None]:
    prompt, bad = _packed(msg.prompt_tokens, TOKEN_DTYPE, "prompt_tokens")
    if bad:
        return 0, 0, bad
    response, bad = _packed(msg.response_tokens, TOKEN_DTYPE, "response_tokens")
    if bad:
        return 0, 0, bad
    logprobs, bad = _packed(msg.behavior_logprobs, LOGPROB_DTYPE, "behavior_logprobs")
    if bad:
        return 0, 0, bad
    assert prompt is not None and response is not None and logprobs is not None
    p, n = len(prompt), len(response)
    if p == 0:
        return p, n, Problem("prompt_tokens", "prompt_tokens: must be non-empty, got 0 tokens")
    if n == 0:
        return p, n, Problem("response_tokens",
                             "response_tokens: must be non-empty, got 0 tokens")
    if p + n > limits.max_seq_len:
        return p, n, Problem("response_tokens", f"response_tokens: P+N must be <= max_seq_len "
                                                f"{limits.max_seq_len}, got {p + n!r}")
    for name, arr in (("prompt_tokens", prompt), ("response_tokens", response)):
        if arr.min() < 0:
            return p, n, Problem(name, f"{name}: token ids must be >= 0, got {int(arr.min())!r}")
        if limits.vocab_size is not None and arr.max() >= limits.vocab_size:
            return p, n, Problem(name, f"{name}: token ids must be < vocab_size "
                                       f"{limits.vocab_size}, got {int(arr.max())!r}")
    if len(logprobs) != n:
        return p, n, Problem("behavior_logprobs", f"behavior_logprobs: must have one value per "
                                                  f"response token ({n}), got {len(logprobs)!r}")
    if not np.isfinite(logprobs).all():
        return p, n, Problem("behavior_logprobs",
                             "behavior_logprobs: must be finite, got a non-finite value")
    if logprobs.max() > limits.logprob_tolerance:
        return p, n, Problem("behavior_logprobs", f"behavior_logprobs: must be <= 0 "
                                                  f"(log-probabilities), got "
                                                  f"{float(logprobs.max())!r}")
    return p, n, None


def _shape(field: str, shape, data: bytes | memoryview, dtype: np.dtype, rows: int
           ) -> Problem | None:
    if len(shape) != 3 or min(shape) < 1:
        return Problem(field, f"{field}.shape: must be 3 positive sizes, got {list(shape)!r}")
    if shape[0] != rows:
        return Problem(field, f"{field}.shape: must have P+N-1 = {rows} rows, "
                              f"got {shape[0]!r}")
    if len(data) != math.prod(shape) * dtype.itemsize:
        return Problem(field, f"{field}.data: must be {math.prod(shape) * dtype.itemsize} "
                              f"bytes (shape {list(shape)} of {dtype.name}), "
                              f"got {len(data)!r}")
    return None


def router_fields_of(msg: TrajectoryLike) -> tuple[str, ...]:
    """The fields of :data:`ROUTER_FIELDS` that ``msg`` carries."""
    return tuple(f for f in ROUTER_FIELDS if msg.HasField(f))


def _check_routing(msg: TrajectoryLike, rows: int, limits: Limits) -> Problem | None:
    for field in limits.required:
        if not msg.HasField(field):
            return Problem(field, f"{field}: must be present (this queue requires it of "
                                  f"every trajectory: --require-record), got none")
    for field in limits.refused:
        if msg.HasField(field):
            return Problem(field, f"{field}: must be absent (this queue's run does not "
                                  f"record it: --refuse-record), got one")
    num_experts = limits.num_experts
    logits_e = None
    # None when unset (a pb2 message returns an empty default, a TrajectoryView None)
    lg = msg.router_logits if msg.HasField("router_logits") else None
    if lg is not None:
        if lg.dtype not in LOGIT_DTYPES:
            return Problem("router_logits", f"router_logits.dtype: must be one of "
                                            f"{tuple(LOGIT_DTYPES)}, got {lg.dtype!r}")
        bad = _shape("router_logits", lg.shape, lg.data, LOGIT_DTYPES[lg.dtype], rows)
        if bad:
            return bad
        if limits.moe_layers is not None and lg.shape[1] != limits.moe_layers:
            return Problem("router_logits", f"router_logits.shape: L must be the server's "
                                            f"moe_layers {limits.moe_layers}, "
                                            f"got {lg.shape[1]!r}")
        logits_e = lg.shape[2]
        if num_experts is not None and logits_e != num_experts:
            return Problem("router_logits", f"router_logits.shape: E must be the server's "
                                            f"num_experts {num_experts}, got {logits_e!r}")
        if not np.isfinite(np.frombuffer(lg.data, LOGIT_DTYPES[lg.dtype])).all():
            return Problem("router_logits", "router_logits.data: must be finite, got a "
                                            "non-finite value")
    r = msg.routed_experts if msg.HasField("routed_experts") else None
    g = msg.routed_gates if msg.HasField("routed_gates") else None
    if r is None:
        if g is not None:
            return Problem("routed_gates", "routed_gates: must come with routed_experts (the "
                                           "gate weights of those experts), got none")
        return None
    if r.dtype not in ROUTE_DTYPES:
        return Problem("routed_experts", f"routed_experts.dtype: must be one of "
                                         f"{tuple(ROUTE_DTYPES)}, got {r.dtype!r}")
    bad = _shape("routed_experts", r.shape, r.data, ROUTE_DTYPES[r.dtype], rows)
    if bad:
        return bad
    if limits.moe_layers is not None and r.shape[1] != limits.moe_layers:
        return Problem("routed_experts", f"routed_experts.shape: L must be the server's "
                                         f"moe_layers {limits.moe_layers}, got {r.shape[1]!r}")
    if limits.top_k is not None and r.shape[2] != limits.top_k:
        return Problem("routed_experts", f"routed_experts.shape: k must be the server's top_k "
                                         f"{limits.top_k}, got {r.shape[2]!r}")
    if lg is not None and lg.shape[1] != r.shape[1]:
        return Problem("router_logits", f"router_logits.shape: L must equal routed_experts' "
                                        f"{r.shape[1]}, got {lg.shape[1]!r}")
    # E: the server's setting, else what the producer declares, else the logits' width.
    for source in (r.num_experts or None, logits_e):
        if num_experts is None:
            num_experts = source
        elif source is not None and source != num_experts:
            return Problem("routed_experts", f"routed_experts.num_experts: E must agree across "
                                             f"server, producer and router_logits, got "
                                             f"{num_experts!r} and {source!r}")
    if num_experts is not None and r.shape[2] > num_experts:
        return Problem("routed_experts", f"routed_experts.shape: k must be <= num_experts "
                                         f"{num_experts}, got {r.shape[2]!r}")
    ids = np.frombuffer(r.data, ROUTE_DTYPES[r.dtype])
    if ids.dtype.kind == "i" and ids.min() < 0:  # uint8/uint16 ids cannot be negative
        return Problem("routed_experts", f"routed_experts: expert ids must be >= 0, "
                                         f"got {int(ids.min())!r}")
    if num_experts is not None and ids.max() >= num_experts:
        return Problem("routed_experts", f"routed_experts: expert ids must be in "
                                         f"[0, {num_experts}), got {int(ids.max())!r}")
    return None if g is None else _check_gates(g, list(r.shape), rows)


def _check_gates(g, routes_shape: list[int], rows: int) -> Problem | None:
    """routed_gates: float16 of routed_experts' shape, each weight in [0, 1]."""
    if g.dtype not in GATE_DTYPES:
        return Problem("routed_gates", f"routed_gates.dtype: must be one of "
                                       f"{tuple(GATE_DTYPES)}, got {g.dtype!r}")
    bad = _shape("routed_gates", g.shape, g.data, GATE_DTYPES[g.dtype], rows)
    if bad:
        return bad
    if list(g.shape) != routes_shape:
        return Problem("routed_gates", f"routed_gates.shape: must equal routed_experts' "
                                       f"{routes_shape}, got {list(g.shape)!r}")
    w = np.frombuffer(g.data, GATE_DTYPES[g.dtype])
    if not np.isfinite(w).all():
        return Problem("routed_gates", "routed_gates.data: must be finite, got a non-finite "
                                       "value")
    if w.min() < 0 or w.max() > GATE_MAX:
        return Problem("routed_gates", f"routed_gates.data: gate weights must be in [0, 1], "
                                       f"got {float(w.min())!r}..{float(w.max())!r}")
    return None


def newest_version(msg: TrajectoryLike) -> int:
    """The newest policy version that sampled a token of ``msg`` (a valid one): its last
    token version, or ``policy_version`` when it has none."""
    if not len(msg.token_versions):
        return msg.policy_version
    # VERSION_DTYPE is "<i4"; int.from_bytes, not numpy (7x faster): this runs under the
    # queue's lock, for every item of a put
    return int.from_bytes(msg.token_versions[-VERSION_DTYPE.itemsize:], "little", signed=True)


def _check_versions(msg: TrajectoryLike, n: int, limits: Limits) -> Problem | None:
    """token_versions (when present): int32 [N], non-decreasing (a worker only moves
    forward), the oldest equal to policy_version (the queue's lag rule reads that), none
    beyond ``max_version`` (the trainer reads every one: a forged 2^30 used to drive its
    token lag to -2e8)."""
    if not len(msg.token_versions):
        return None
    versions, bad = _packed(msg.token_versions, VERSION_DTYPE, "token_versions")
    if bad:
        return bad
    assert versions is not None
    if len(versions) != n:
        return Problem("token_versions", f"token_versions: must have one value per response "
                                         f"token ({n}), got {len(versions)!r}")
    if (np.diff(versions) < 0).any():
        return Problem("token_versions", "token_versions: must be non-decreasing, got a "
                                         "version older than the one before it")
    if int(versions[0]) != msg.policy_version:
        return Problem("token_versions", f"token_versions: the oldest must be policy_version "
                                         f"{msg.policy_version}, got {int(versions[0])!r}")
    if int(versions[-1]) > limits.max_version:
        return Problem("token_versions", f"token_versions: must be in [0, "
                                         f"{limits.max_version}], got {int(versions[-1])!r}")
    return None


def unknown_fields(msg: TrajectoryLike) -> list[str]:
    """The fields of ``msg`` and of its router record this build does not know, by number
    (``routed_gates.9`` inside one): what a newer worker's schema added."""
    if isinstance(msg, TrajectoryView):
        return msg.unknown
    out = [str(f.field_number) for f in UnknownFieldSet(msg)]
    for name in ROUTER_FIELDS:
        if msg.HasField(name):
            out += [f"{name}.{f.field_number}" for f in UnknownFieldSet(getattr(msg, name))]
    return out


def _check_unknown(msg: TrajectoryLike) -> Problem | None:
    """Refuses fields this queue does not know: it could not validate them, an older
    trainer would drop them unseen and a newer one read them unchecked. A rolling upgrade
    upgrades the queue (and the trainer) before the workers."""
    unknown = unknown_fields(msg)
    if not unknown:
        return None
    return Problem("unknown fields",
                   f"field(s) {', '.join(unknown)} unknown to this queue (schema "
                   f"{SCHEMA_VERSION} as this build has it): the record is from a newer "
                   f"worker; upgrade the queue (and the trainer) before the workers")


def validate(msg: TrajectoryLike, limits: Limits) -> Problem | None:
    """First problem found in ``msg`` (None when valid). Rows of routes/logits = P+N-1."""
    bad = _check_unknown(msg) or _check_ids(msg, limits)
    if bad:
        return bad
    p, n, bad = _check_tokens(msg, limits)
    if bad:
        return bad
    return _check_versions(msg, n, limits) or _check_routing(msg, p + n - 1, limits)
