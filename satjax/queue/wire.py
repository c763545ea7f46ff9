"""Conversion between :class:`Trajectory` and its protobuf message (schema v1).

Arrays travel as little-endian packed bytes (see ``trajectory.proto``); routed experts are
narrowed to uint8 when E <= 256 and to uint16 when E <= 65536, so a 1k-token response with
48 layers x top-8 routes costs ~400 KB instead of 1.6 MB.
"""

from __future__ import annotations

import numpy as np

from satjax.queue._proto import pb2
from satjax.trajectory import Trajectory

SCHEMA_VERSION = 1
ROUTE_DTYPES = {"uint8": np.dtype("<u1"), "uint16": np.dtype("<u2"), "int32": np.dtype("<i4")}
LOGIT_DTYPES = {"float16": np.dtype("<f2")}
_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


def route_dtype_name(routes: np.ndarray, num_experts: int | None) -> str:
    """Narrowest dtype holding the expert ids: by E when known, else by the largest id.

    Negative or out-of-range ids fall back to int32 so that the data travels unchanged
    and the server can reject it with a precise message.
    """
    if routes.size == 0:
        return "uint8"
    lo, hi = int(routes.min()), int(routes.max())
    bound = num_experts if num_experts else hi + 1
    if lo >= 0 and hi < bound:
        if bound <= 256:
            return "uint8"
        if bound <= 65536:
            return "uint16"
    return "int32"


def to_proto(traj: Trajectory, *, num_experts: int | None = None) -> pb2.Trajectory:
    """Serialises ``traj``; ``num_experts`` (E) picks the route dtype and is sent along.

    E defaults to the last axis of ``router_logits`` when those are present.
    """
    if num_experts is None and traj.router_logits is not None:
        num_experts = int(np.shape(traj.router_logits)[-1])
    msg = pb2.Trajectory(
        schema_version=SCHEMA_VERSION,
        trajectory_id=traj.trajectory_id,
        group_id=traj.group_id,
        prompt_id=traj.prompt_id,
        group_size=int(traj.group_size),
        prompt_tokens=np.ascontiguousarray(traj.prompt_tokens, dtype=_I32).tobytes(),
        response_tokens=np.ascontiguousarray(traj.response_tokens, dtype=_I32).tobytes(),
        behavior_logprobs=np.ascontiguousarray(traj.behavior_logprobs, dtype=_F32).tobytes(),
        policy_version=int(traj.policy_version),
        reward=float(traj.reward),
        finish_reason=traj.finish_reason,
        engine=traj.engine,
        timing=pb2.Timing(created_unix=float(traj.created_unix),
                          generation_seconds=float(traj.generation_seconds)),
    )
    for key, value in traj.reward_details.items():
        msg.reward_details[key] = float(value)
    if traj.routed_experts is not None:
        routes = np.asarray(traj.routed_experts)
        if routes.ndim != 3:
            raise ValueError(f"routed_experts: expected shape [rows, L, k], got {routes.shape}")
        name = route_dtype_name(routes, num_experts)
        msg.routed_experts.data = np.ascontiguousarray(routes, ROUTE_DTYPES[name]).tobytes()
        msg.routed_experts.dtype = name
        msg.routed_experts.shape.extend(int(s) for s in routes.shape)
        msg.routed_experts.num_experts = int(num_experts or 0)
    if traj.router_logits is not None:
        logits = np.asarray(traj.router_logits)
        if logits.ndim != 3:
            raise ValueError(f"router_logits: expected shape [rows, L, E], got {logits.shape}")
        msg.router_logits.data = np.ascontiguousarray(logits, LOGIT_DTYPES["float16"]).tobytes()
        msg.router_logits.dtype = "float16"
        msg.router_logits.shape.extend(int(s) for s in logits.shape)
    return msg


def _array(data: bytes, dtype: np.dtype, shape: tuple[int, ...] | None = None) -> np.ndarray:
    arr = np.frombuffer(data, dtype=dtype)
    if shape is not None:
        arr = arr.reshape(shape)
    return arr.astype(dtype.newbyteorder("="), copy=True)  # native, writable


def from_proto(msg: pb2.Trajectory) -> Trajectory:
    """Inverse of :func:`to_proto`; routes come back as int32, router logits as float16."""
    if msg.schema_version != SCHEMA_VERSION:
        raise ValueError(f"schema_version: unsupported {msg.schema_version}, "
                         f"this reader knows {SCHEMA_VERSION}")
    routes = None
    if msg.HasField("routed_experts"):
        r = msg.routed_experts
        # one copy, straight into the int32 the trainer uses
        routes = np.frombuffer(r.data, ROUTE_DTYPES[r.dtype]).reshape(tuple(r.shape)).astype(
            np.int32)
    logits = None
    if msg.HasField("router_logits"):
        lg = msg.router_logits
        logits = _array(lg.data, LOGIT_DTYPES[lg.dtype], tuple(lg.shape))
    return Trajectory(
        trajectory_id=msg.trajectory_id,
        group_id=msg.group_id,
        prompt_id=msg.prompt_id,
        prompt_tokens=_array(msg.prompt_tokens, _I32),
        response_tokens=_array(msg.response_tokens, _I32),
        behavior_logprobs=_array(msg.behavior_logprobs, _F32),
        policy_version=int(msg.policy_version),
        reward=float(msg.reward),
        group_size=int(msg.group_size),
        reward_details=dict(msg.reward_details),
        finish_reason=msg.finish_reason,
        routed_experts=routes,
        router_logits=logits,
        engine=msg.engine,
        created_unix=float(msg.timing.created_unix),
        generation_seconds=float(msg.timing.generation_seconds),
    )
