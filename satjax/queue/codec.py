"""Zero-copy reading and one-copy writing of schema-v1 Trajectory wire bytes.

The generic protobuf runtime copies every ``bytes`` field on parse and again on access;
for a 1k-token trajectory with 48x8 routes that is ~0.5 MB per copy. The queue's hot paths
(server validation, the trainer's GetBatch, the producers' Put) use this walker instead:
``TrajectoryView`` exposes the same attribute names as ``pb2.Trajectory`` (so the validator
takes either) with memoryviews into the original buffer. ``encode`` writes bytes that the
protobuf runtime parses into exactly ``to_proto(traj)`` (tests check both directions).

Stricter than protobuf in one way: a singular field that occurs twice is an error (protobuf
would merge), so what the server validates is what every reader sees.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator

import numpy as np

from satjax.queue.wire import (
    _F32,
    _I32,
    LOGIT_DTYPES,
    ROUTE_DTYPES,
    SCHEMA_VERSION,
    route_dtype_name,
)
from satjax.trajectory import Trajectory

_DOUBLE = struct.Struct("<d")
VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5


class WireError(ValueError):
    """Bytes that are not a well-formed schema-v1 message."""


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError("varint too long")


def iter_fields(buf: memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value): int for varint/fixed, memoryview for LEN."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos)
        field, wtype = key >> 3, key & 7
        if field == 0:
            raise WireError("field number 0")
        if wtype == VARINT:
            value, pos = _read_varint(buf, pos)
        elif wtype == FIXED64:
            if pos + 8 > end:
                raise WireError("truncated fixed64")
            value, pos = int.from_bytes(buf[pos:pos + 8], "little"), pos + 8
        elif wtype == LEN:
            length, pos = _read_varint(buf, pos)
            if pos + length > end:
                raise WireError("truncated length-delimited field")
            value, pos = buf[pos:pos + length], pos + length
        elif wtype == FIXED32:
            if pos + 4 > end:
                raise WireError("truncated fixed32")
            value, pos = int.from_bytes(buf[pos:pos + 4], "little"), pos + 4
        else:
            raise WireError(f"unsupported wire type {wtype}")
        yield field, wtype, value


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _double(v: int) -> float:
    return _DOUBLE.unpack(v.to_bytes(8, "little"))[0]


def _text(v) -> str:
    try:
        return bytes(v).decode("utf-8")
    except UnicodeDecodeError as e:
        raise WireError(f"invalid UTF-8 in a string field: {e}") from None


def _uint32s(wtype: int, value, out: list[int]) -> None:
    if wtype == VARINT:
        out.append(value & 0xFFFFFFFF)
    elif wtype == LEN:
        pos = 0
        while pos < len(value):
            v, pos = _read_varint(value, pos)
            out.append(v & 0xFFFFFFFF)
    else:
        raise WireError("shape: wrong wire type")


class _Timing:
    __slots__ = ("created_unix", "generation_seconds")

    def __init__(self):
        self.created_unix = 0.0
        self.generation_seconds = 0.0


class _Packed:
    """RoutedExperts / RouterLogits view: data (memoryview), dtype, shape, num_experts."""

    __slots__ = ("data", "dtype", "shape", "num_experts")

    def __init__(self, buf: memoryview):
        self.data, self.dtype, self.shape, self.num_experts = memoryview(b""), "", [], 0
        seen: set[int] = set()
        for field, wtype, value in iter_fields(buf):
            if field != 3 and field in seen:
                raise WireError(f"field {field} repeated")
            seen.add(field)
            if field == 1 and wtype == LEN:
                self.data = value
            elif field == 2 and wtype == LEN:
                self.dtype = _text(value)
            elif field == 3:
                _uint32s(wtype, value, self.shape)
            elif field == 4 and wtype == VARINT:
                self.num_experts = value & 0xFFFFFFFF


_TRAJ_LEN_FIELDS = {2: "trajectory_id", 3: "group_id", 4: "prompt_id", 12: "finish_reason",
                    15: "engine"}
_TRAJ_BYTES_FIELDS = {6: "prompt_tokens", 7: "response_tokens", 8: "behavior_logprobs"}


class TrajectoryView:
    """Read-only view of Trajectory wire bytes; attribute names as in ``pb2.Trajectory``."""

    __slots__ = ("schema_version", "trajectory_id", "group_id", "prompt_id", "group_size",
                 "prompt_tokens", "response_tokens", "behavior_logprobs", "policy_version",
                 "reward", "reward_details", "finish_reason", "routed_experts",
                 "router_logits", "engine", "timing")

    def __init__(self, buf: bytes | memoryview):
        buf = memoryview(buf)
        self.schema_version = self.group_size = self.policy_version = 0
        self.trajectory_id = self.group_id = self.prompt_id = self.finish_reason = ""
        self.engine = ""
        empty = memoryview(b"")
        self.prompt_tokens = self.response_tokens = self.behavior_logprobs = empty
        self.reward = 0.0
        self.reward_details: dict[str, float] = {}
        self.routed_experts: _Packed | None = None
        self.router_logits: _Packed | None = None
        self.timing = _Timing()
        seen: set[int] = set()
        for field, wtype, value in iter_fields(buf):
            if field != 11 and field in seen:
                raise WireError(f"trajectory: field {field} repeated")
            seen.add(field)
            if wtype == LEN:
                if field in _TRAJ_LEN_FIELDS:
                    setattr(self, _TRAJ_LEN_FIELDS[field], _text(value))
                elif field in _TRAJ_BYTES_FIELDS:
                    setattr(self, _TRAJ_BYTES_FIELDS[field], value)
                elif field == 11:
                    key, val = "", 0.0
                    for f, w, v in iter_fields(value):
                        if f == 1 and w == LEN:
                            key = _text(v)
                        elif f == 2 and w == FIXED64:
                            val = _double(v)
                    self.reward_details[key] = val
                elif field == 13:
                    self.routed_experts = _Packed(value)
                elif field == 14:
                    self.router_logits = _Packed(value)
                elif field == 16:
                    for f, w, v in iter_fields(value):
                        if f == 1 and w == FIXED64:
                            self.timing.created_unix = _double(v)
                        elif f == 2 and w == FIXED64:
                            self.timing.generation_seconds = _double(v)
            elif wtype == VARINT:
                if field == 1:
                    self.schema_version = value & 0xFFFFFFFF
                elif field == 5:
                    self.group_size = value & 0xFFFFFFFF
                elif field == 9:
                    self.policy_version = _signed64(value)
            elif wtype == FIXED64 and field == 10:
                self.reward = _double(value)

    def HasField(self, name: str) -> bool:  # noqa: N802 - mirrors the protobuf API
        return getattr(self, name) is not None


def decode(buf: bytes | memoryview, *, compact_routes: bool = False) -> Trajectory:
    """Trajectory from wire bytes, equal to ``from_proto(pb2.Trajectory.FromString(buf))``.

    Token and log-prob arrays are fresh copies. Routes are int32 copies, or with
    ``compact_routes`` read-only uint8/uint16 views into ``buf`` (no copy; the trainer
    widens them when it pads its batch). Router logits are float16 copies.
    """
    v = TrajectoryView(buf)
    if v.schema_version != SCHEMA_VERSION:
        raise WireError(f"schema_version: unsupported {v.schema_version}, "
                        f"this reader knows {SCHEMA_VERSION}")
    routes = logits = None
    if v.routed_experts is not None:
        r = v.routed_experts
        view = np.frombuffer(r.data, ROUTE_DTYPES[r.dtype]).reshape(tuple(r.shape))
        routes = view if compact_routes else view.astype(np.int32)
    if v.router_logits is not None:
        lg = v.router_logits
        logits = np.frombuffer(lg.data, LOGIT_DTYPES[lg.dtype]).reshape(tuple(lg.shape)).copy()
    return Trajectory(
        trajectory_id=v.trajectory_id, group_id=v.group_id, prompt_id=v.prompt_id,
        prompt_tokens=np.frombuffer(v.prompt_tokens, _I32).astype(np.int32),
        response_tokens=np.frombuffer(v.response_tokens, _I32).astype(np.int32),
        behavior_logprobs=np.frombuffer(v.behavior_logprobs, _F32).astype(np.float32),
        policy_version=v.policy_version, reward=v.reward, group_size=v.group_size,
        reward_details=dict(v.reward_details), finish_reason=v.finish_reason,
        routed_experts=routes, router_logits=logits, engine=v.engine,
        created_unix=v.timing.created_unix, generation_seconds=v.timing.generation_seconds)


# -- encoding -----------------------------------------------------------------------------
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64: two's complement, 10 bytes
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _len_field(field: int, payload: bytes) -> list[bytes]:
    return [_varint(field << 3 | LEN), _varint(len(payload)), payload]


def _scalar(field: int, value: int) -> list[bytes]:
    return [_varint(field << 3 | VARINT), _varint(value)] if value else []


def _dbl(field: int, value: float) -> list[bytes]:
    # proto3 omits +0.0 only (-0.0 has a non-zero bit pattern and is written)
    if value == 0.0 and math.copysign(1.0, value) > 0:
        return []
    return [_varint(field << 3 | FIXED64), _DOUBLE.pack(value)]


def _str(field: int, value: str) -> list[bytes]:
    return _len_field(field, value.encode()) if value else []


def _packed_msg(data: bytes, dtype: str, shape: tuple[int, ...], num_experts: int = 0) -> bytes:
    shape_bytes = b"".join(_varint(s) for s in shape)
    return b"".join(_len_field(1, data) + _str(2, dtype) + _len_field(3, shape_bytes)
                    + _scalar(4, num_experts))


def encode(traj: Trajectory, *, num_experts: int | None = None) -> bytes:
    """Wire bytes of ``to_proto(traj, num_experts=...)`` with one copy of each array."""
    if num_experts is None and traj.router_logits is not None:
        num_experts = int(np.shape(traj.router_logits)[-1])
    parts: list[bytes] = []
    parts += _scalar(1, SCHEMA_VERSION) + _str(2, traj.trajectory_id) + _str(3, traj.group_id)
    parts += _str(4, traj.prompt_id) + _scalar(5, int(traj.group_size))
    for field, arr, dtype in ((6, traj.prompt_tokens, _I32), (7, traj.response_tokens, _I32),
                              (8, traj.behavior_logprobs, _F32)):
        data = np.ascontiguousarray(arr, dtype=dtype).tobytes()
        parts += _len_field(field, data) if data else []
    parts += _scalar(9, int(traj.policy_version)) + _dbl(10, float(traj.reward))
    for key, value in traj.reward_details.items():
        entry = b"".join(_str(1, key) + _dbl(2, float(value)))
        parts += _len_field(11, entry)
    parts += _str(12, traj.finish_reason)
    if traj.routed_experts is not None:
        routes = np.asarray(traj.routed_experts)
        if routes.ndim != 3:
            raise ValueError(f"routed_experts: expected shape [rows, L, k], got {routes.shape}")
        name = route_dtype_name(routes, num_experts)
        data = np.ascontiguousarray(routes, ROUTE_DTYPES[name]).tobytes()
        parts += _len_field(13, _packed_msg(data, name, routes.shape, int(num_experts or 0)))
    if traj.router_logits is not None:
        logits = np.asarray(traj.router_logits)
        if logits.ndim != 3:
            raise ValueError(f"router_logits: expected shape [rows, L, E], got {logits.shape}")
        data = np.ascontiguousarray(logits, LOGIT_DTYPES["float16"]).tobytes()
        parts += _len_field(14, _packed_msg(data, "float16", logits.shape))
    parts += _str(15, traj.engine)
    timing = b"".join(_dbl(1, float(traj.created_unix)) + _dbl(2, float(traj.generation_seconds)))
    parts += _len_field(16, timing)
    return b"".join(parts)
