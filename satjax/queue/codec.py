"""The queue's one wire codec: schema-v1 Trajectory bytes, read zero-copy, written one-copy.

The generic protobuf runtime copies every ``bytes`` field on parse and again on access;
for a 1k-token trajectory with 48x8 routes that is ~0.5 MB per copy. The queue's hot paths
(server validation, the trainer's GetBatch, the producers' Put) use this walker instead:
``TrajectoryView`` exposes the same attribute names as ``pb2.Trajectory`` (so the validator
takes either) with memoryviews into the original buffer. ``encode`` writes bytes that the
protobuf runtime parses into the same message (tests check both directions against a
protobuf reference codec).

Every field number comes from the generated descriptors (``trajectory.proto`` is the only
place they are written), looked up once at import.

Arrays travel as little-endian packed bytes; routed experts are narrowed to uint8 when
E <= 256 and to uint16 when E <= 65536, so a 1k-token response with 48 layers x top-8
routes costs ~400 KB instead of 1.6 MB.

Stricter than protobuf in one way: a singular field that occurs twice is an error (protobuf
would merge), so what the server validates is what every reader sees. Fields this build
does not know are skipped, as protobuf does, and listed (``TrajectoryView.unknown``): the
server refuses them (:func:`satjax.queue.validation.validate`), since it cannot validate
them and a newer trainer would read them.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from satjax.queue._proto import pb2
from satjax.trajectory import ROUTER_FIELDS, Trajectory

# ===================================================================================
# Wire dtypes and field numbers
# ===================================================================================
SCHEMA_VERSION = pb2.SCHEMA_VERSION_1
TOKEN_DTYPE = np.dtype("<i4")      # prompt_tokens, response_tokens
VERSION_DTYPE = np.dtype("<i4")    # token_versions
LOGPROB_DTYPE = np.dtype("<f4")    # behavior_logprobs
ROUTE_DTYPES: dict[str, np.dtype] = {"uint8": np.dtype("<u1"), "uint16": np.dtype("<u2"),
                                    "int32": np.dtype("<i4")}
LOGIT_DTYPES = {"float16": np.dtype("<f2")}
GATE_DTYPES = {"float16": np.dtype("<f2")}
VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5  # protobuf wire types
MAX_MESSAGE_MB = 64.0  # default gRPC message size limit of server and client alike


def _numbers(desc: Descriptor) -> dict[str, int]:
    return {f.name: f.number for f in desc.fields}


def _wire_types(desc: Descriptor) -> dict[int, tuple[int, ...]]:
    """Field number -> the wire types its declared type may arrive in (a repeated scalar
    also packed, as LEN)."""
    out: dict[int, tuple[int, ...]] = {}
    for f in desc.fields:
        if f.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FIXED64):
            wire: tuple[int, ...] = (FIXED64,)
        elif f.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES,
                        FieldDescriptor.TYPE_MESSAGE):
            wire = (LEN,)
        else:  # the schema's integers and enums are varints
            wire = (VARINT,)
        if f.is_repeated and wire != (LEN,):
            wire += (LEN,)
        out[f.number] = wire
    return out


def _check_wire(wire_types: Mapping[int, tuple[int, ...]], desc: Descriptor, field: int,
                wtype: int) -> None:
    """WireError when a known field arrives in a wire type its declared type never has.

    Protobuf would keep such a field as an unknown one and read the declared field as its
    default (a ``policy_version`` sent as fixed64 would read as 0): refused instead, so
    what the server validates is what the sender meant. Unknown fields are read past
    (and listed: ``TrajectoryView.unknown``).
    """
    allowed = wire_types.get(field)
    if allowed is not None and wtype not in allowed:
        name = desc.fields_by_number[field].name
        raise WireError(f"{desc.name}.{name}: must have wire type {allowed[0]}, got {wtype}")


_TRAJ = _numbers(pb2.Trajectory.DESCRIPTOR)
_TRAJ_WIRE = _wire_types(pb2.Trajectory.DESCRIPTOR)
_ROUTES = _numbers(pb2.RoutedExperts.DESCRIPTOR)
_ROUTES_WIRE = _wire_types(pb2.RoutedExperts.DESCRIPTOR)
_LOGITS = _numbers(pb2.RouterLogits.DESCRIPTOR)
_LOGITS_WIRE = _wire_types(pb2.RouterLogits.DESCRIPTOR)
_GATES = _numbers(pb2.RoutedGates.DESCRIPTOR)
_GATES_WIRE = _wire_types(pb2.RoutedGates.DESCRIPTOR)
_TIMING = _numbers(pb2.Timing.DESCRIPTOR)
_MAP_ENTRY = _numbers(pb2.Trajectory.DESCRIPTOR.fields_by_name["reward_details"].message_type)
_REPLY = _numbers(pb2.GetBatchReply.DESCRIPTOR)
PUT_BATCH_TRAJECTORIES = pb2.PutBatchRequest.DESCRIPTOR.fields_by_name["trajectories"].number
REPLY_TRAJECTORIES = _REPLY["trajectories"]

_STRING_FIELDS = {_TRAJ[n]: n for n in ("trajectory_id", "group_id", "prompt_id",
                                         "finish_reason", "engine")}
_ARRAY_FIELDS = {_TRAJ[n]: n for n in ("prompt_tokens", "response_tokens",
                                        "behavior_logprobs", "token_versions")}
_UINT32_FIELDS = {_TRAJ[n]: n for n in ("schema_version", "group_size")}
_TIMING_FIELDS = {num: name for name, num in _TIMING.items()}
_REWARD_DETAILS = _TRAJ["reward_details"]  # the one repeated field of Trajectory


def route_dtype_name(routes: np.ndarray, num_experts: int | None) -> str:
    """Narrowest dtype holding the expert ids: by E when known, else by the largest id.

    Negative or out-of-range ids fall back to int32 so that the data travels unchanged
    and the server can reject it with a precise message. Integer ids take one pass: seen
    as unsigned, a negative id is larger than any valid one.
    """
    if routes.size == 0:
        return "uint8"
    if routes.dtype.kind in "iu":
        unsigned = routes.view(f"u{routes.dtype.itemsize}")
        hi_u = int(unsigned.max())
        negative = routes.dtype.kind == "i" and hi_u >= 1 << (8 * routes.dtype.itemsize - 1)
        lo, hi = (-1, hi_u) if negative else (0, hi_u)
    else:
        lo, hi = int(routes.min()), int(routes.max())
    bound = num_experts if num_experts else hi + 1
    if lo >= 0 and hi < bound:
        if bound <= 256:
            return "uint8"
        if bound <= 65536:
            return "uint16"
    return "int32"


_DOUBLE = struct.Struct("<d")


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


def iter_fields(buf: memoryview) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value): int for varint/fixed, memoryview for LEN.

    The value is typed Any: its type follows the wire type, which callers check and a
    static type cannot tie to it.
    """
    pos, end = 0, len(buf)
    value: int | memoryview
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
    """RoutedExperts / RoutedGates / RouterLogits view: data (memoryview), dtype, shape,
    num_experts.

    The three messages number data/dtype/shape alike; only RoutedExperts has num_experts
    (0 in the others).
    """

    __slots__ = ("data", "dtype", "shape", "num_experts", "unknown")
    data: memoryview
    dtype: str
    shape: list[int]
    num_experts: int
    unknown: list[int]  # numbers of the fields this build does not know

    def __init__(self, buf: memoryview, desc: Descriptor, numbers: Mapping[str, int],
                 wire_types: Mapping[int, tuple[int, ...]]):
        self.data, self.dtype, self.shape, self.num_experts = memoryview(b""), "", [], 0
        self.unknown = []
        seen: set[int] = set()
        for field, wtype, value in iter_fields(buf):
            if field != numbers["shape"] and field in seen:
                raise WireError(f"field {field} repeated")
            seen.add(field)
            _check_wire(wire_types, desc, field, wtype)
            if field not in wire_types:
                self.unknown.append(field)
            elif field == numbers["data"] and wtype == LEN:
                self.data = value
            elif field == numbers["dtype"] and wtype == LEN:
                self.dtype = _text(value)
            elif field == numbers["shape"]:
                _uint32s(wtype, value, self.shape)
            elif field == numbers.get("num_experts") and wtype == VARINT:
                self.num_experts = value & 0xFFFFFFFF


class TrajectoryView:
    """Read-only view of Trajectory wire bytes; attribute names as in ``pb2.Trajectory``."""

    __slots__ = ("schema_version", "trajectory_id", "group_id", "prompt_id", "group_size",
                 "prompt_tokens", "response_tokens", "behavior_logprobs", "policy_version",
                 "reward", "reward_details", "finish_reason", "routed_experts",
                 "routed_gates", "router_logits", "token_versions", "engine", "timing",
                 "_unknown")

    def __init__(self, buf: bytes | memoryview):
        buf = memoryview(buf)
        self.schema_version = self.group_size = self.policy_version = 0
        self.trajectory_id = self.group_id = self.prompt_id = self.finish_reason = ""
        self.engine = ""
        empty = memoryview(b"")
        self.prompt_tokens = self.response_tokens = self.behavior_logprobs = empty
        self.token_versions = empty  # absent: every token sampled by policy_version
        self.reward = 0.0
        self.reward_details: dict[str, float] = {}
        self.routed_experts: _Packed | None = None
        self.routed_gates: _Packed | None = None
        self.router_logits: _Packed | None = None
        self.timing = _Timing()
        self._unknown: list[str] = []
        seen: set[int] = set()
        for field, wtype, value in iter_fields(buf):
            if field != _REWARD_DETAILS and field in seen:
                raise WireError(f"trajectory: field {field} repeated")
            seen.add(field)
            _check_wire(_TRAJ_WIRE, pb2.Trajectory.DESCRIPTOR, field, wtype)
            if field not in _TRAJ_WIRE:
                self._unknown.append(str(field))
            elif wtype == LEN:
                if field in _STRING_FIELDS:
                    setattr(self, _STRING_FIELDS[field], _text(value))
                elif field in _ARRAY_FIELDS:
                    setattr(self, _ARRAY_FIELDS[field], value)
                elif field == _REWARD_DETAILS:
                    key, val = "", 0.0
                    for f, w, v in iter_fields(value):
                        if f == _MAP_ENTRY["key"] and w == LEN:
                            key = _text(v)
                        elif f == _MAP_ENTRY["value"] and w == FIXED64:
                            val = _double(v)
                    self.reward_details[key] = val
                elif field == _TRAJ["routed_experts"]:
                    self.routed_experts = _Packed(value, pb2.RoutedExperts.DESCRIPTOR,
                                                  _ROUTES, _ROUTES_WIRE)
                elif field == _TRAJ["routed_gates"]:
                    self.routed_gates = _Packed(value, pb2.RoutedGates.DESCRIPTOR,
                                                _GATES, _GATES_WIRE)
                elif field == _TRAJ["router_logits"]:
                    self.router_logits = _Packed(value, pb2.RouterLogits.DESCRIPTOR,
                                                 _LOGITS, _LOGITS_WIRE)
                elif field == _TRAJ["timing"]:
                    for f, w, v in iter_fields(value):
                        if f in _TIMING_FIELDS and w == FIXED64:
                            setattr(self.timing, _TIMING_FIELDS[f], _double(v))
            elif wtype == VARINT:
                if field in _UINT32_FIELDS:
                    setattr(self, _UINT32_FIELDS[field], value & 0xFFFFFFFF)
                elif field == _TRAJ["policy_version"]:
                    self.policy_version = _signed64(value)
            elif wtype == FIXED64 and field == _TRAJ["reward"]:
                self.reward = _double(value)

    def HasField(self, name: str) -> bool:  # noqa: N802 - mirrors the protobuf API
        return getattr(self, name) is not None

    @property
    def unknown(self) -> list[str]:
        """The fields this build does not know, by number (``routed_gates.9`` for one in a
        sub-message), as a newer writer's schema may add them."""
        return self._unknown + [f"{name}.{n}" for name in ROUTER_FIELDS
                                if (p := getattr(self, name)) is not None for n in p.unknown]


def _packed_array(p: _Packed | None, dtypes: Mapping[str, np.dtype]) -> np.ndarray | None:
    """A float16 copy of a RoutedGates / RouterLogits view (None when absent)."""
    if p is None:
        return None
    return np.frombuffer(p.data, dtypes[p.dtype]).reshape(tuple(p.shape)).copy()


def decode(buf: bytes | memoryview, *, compact_routes: bool = False) -> Trajectory:
    """Trajectory from wire bytes (the inverse of :func:`encode`).

    Token and log-prob arrays are fresh copies. Routes are int32 copies, or with
    ``compact_routes`` read-only uint8/uint16 views into ``buf`` (no copy; the trainer
    widens them when it pads its batch). Gates and router logits are float16 copies;
    ``token_versions`` an int32 copy, or None when the record has none (every token from
    ``policy_version``).
    """
    v = TrajectoryView(buf)
    if v.schema_version != SCHEMA_VERSION:
        raise WireError(f"schema_version: must be {SCHEMA_VERSION}, got {v.schema_version!r}")
    routes = None
    if v.routed_experts is not None:
        r = v.routed_experts
        view = np.frombuffer(r.data, ROUTE_DTYPES[r.dtype]).reshape(tuple(r.shape))
        routes = view if compact_routes else view.astype(np.int32)
    versions = (np.frombuffer(v.token_versions, VERSION_DTYPE).astype(np.int32)
                if len(v.token_versions) else None)
    return Trajectory(
        trajectory_id=v.trajectory_id, group_id=v.group_id, prompt_id=v.prompt_id,
        prompt_tokens=np.frombuffer(v.prompt_tokens, TOKEN_DTYPE).astype(np.int32),
        response_tokens=np.frombuffer(v.response_tokens, TOKEN_DTYPE).astype(np.int32),
        behavior_logprobs=np.frombuffer(v.behavior_logprobs, LOGPROB_DTYPE).astype(np.float32),
        policy_version=v.policy_version, reward=v.reward, group_size=v.group_size,
        reward_details=dict(v.reward_details), finish_reason=v.finish_reason,
        routed_experts=routes, routed_gates=_packed_array(v.routed_gates, GATE_DTYPES),
        router_logits=_packed_array(v.router_logits, LOGIT_DTYPES), token_versions=versions,
        engine=v.engine,
        created_unix=v.timing.created_unix, generation_seconds=v.timing.generation_seconds)


# ===================================================================================
# Encoding
# ===================================================================================
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64: two's complement, 10 bytes
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


Buffer = bytes | memoryview  # a part of an encoding: joined once, at the end


def _len_field(field: int, payload: Buffer) -> list[Buffer]:
    return [_varint(field << 3 | LEN), _varint(len(payload)), payload]


def _sub_message(field: int, parts: list[Buffer]) -> list[Buffer]:
    """A nested message from its parts, framed without joining them first (no copy)."""
    return [_varint(field << 3 | LEN), _varint(sum(len(p) for p in parts)), *parts]


def _scalar(field: int, value: int) -> list[Buffer]:
    return [_varint(field << 3 | VARINT), _varint(value)] if value else []


def _dbl(field: int, value: float) -> list[Buffer]:
    # proto3 omits +0.0 only (-0.0 has a non-zero bit pattern and is written)
    if value == 0.0 and math.copysign(1.0, value) > 0:
        return []
    return [_varint(field << 3 | FIXED64), _DOUBLE.pack(value)]


def _str(field: int, value: str) -> list[Buffer]:
    return _len_field(field, value.encode()) if value else []


def _array_bytes(array, dtype: np.dtype) -> memoryview:
    """Byte view of ``array`` as contiguous little-endian ``dtype``: no copy when it
    already is one, else the one conversion copy."""
    # numpy's stubs give ndarray __buffer__ only for Python >= 3.12
    return memoryview(np.ascontiguousarray(array, dtype=dtype)).cast("B")  # type: ignore[arg-type]


def _packed_parts(numbers: Mapping[str, int], data: memoryview, dtype: str,
                  shape: tuple[int, ...], num_experts: int = 0) -> list[Buffer]:
    shape_bytes = b"".join(_varint(s) for s in shape)
    parts = (_len_field(numbers["data"], data) + _str(numbers["dtype"], dtype)
             + _len_field(numbers["shape"], shape_bytes))
    if "num_experts" in numbers:
        parts += _scalar(numbers["num_experts"], num_experts)
    return parts


def encode_parts(traj: Trajectory, *, num_experts: int | None = None) -> list[Buffer]:
    """The wire bytes of ``traj`` as parts whose concatenation is :func:`encode`'s result;
    arrays are views (no copy when already in the wire dtype), for callers that frame
    several trajectories into one message with a single copy."""
    if num_experts is None and traj.router_logits is not None:
        num_experts = int(np.shape(traj.router_logits)[-1])
    f = _TRAJ
    parts: list[Buffer] = []
    parts += _scalar(f["schema_version"], SCHEMA_VERSION)
    parts += _str(f["trajectory_id"], traj.trajectory_id) + _str(f["group_id"], traj.group_id)
    parts += _str(f["prompt_id"], traj.prompt_id) + _scalar(f["group_size"], int(traj.group_size))
    for name, dtype in (("prompt_tokens", TOKEN_DTYPE), ("response_tokens", TOKEN_DTYPE),
                        ("behavior_logprobs", LOGPROB_DTYPE)):
        data = _array_bytes(getattr(traj, name), dtype)
        parts += _len_field(f[name], data) if len(data) else []
    parts += _scalar(f["policy_version"], int(traj.policy_version))
    parts += _dbl(f["reward"], float(traj.reward))
    for key, value in traj.reward_details.items():
        entry = b"".join(_str(_MAP_ENTRY["key"], key) + _dbl(_MAP_ENTRY["value"], float(value)))
        parts += _len_field(_REWARD_DETAILS, entry)
    parts += _str(f["finish_reason"], traj.finish_reason)
    if traj.routed_experts is not None:
        routes = np.asarray(traj.routed_experts)
        if routes.ndim != 3:
            raise ValueError(f"routed_experts: must have shape [rows, L, k], got {routes.shape}")
        name = route_dtype_name(routes, num_experts)
        parts += _sub_message(f["routed_experts"], _packed_parts(
            _ROUTES, _array_bytes(routes, ROUTE_DTYPES[name]), name, routes.shape,
            int(num_experts or 0)))
    parts += _float16s("router_logits", _LOGITS, traj.router_logits, "[rows, L, E]")
    parts += _str(f["engine"], traj.engine)
    timing = b"".join(_dbl(_TIMING["created_unix"], float(traj.created_unix))
                      + _dbl(_TIMING["generation_seconds"], float(traj.generation_seconds)))
    parts += _len_field(f["timing"], timing)
    # fields in number order, as protobuf writes them
    parts += _float16s("routed_gates", _GATES, traj.routed_gates, "[rows, L, k]")
    if traj.token_versions is not None:
        parts += _len_field(f["token_versions"],
                            _array_bytes(traj.token_versions, VERSION_DTYPE))
    return parts


def _float16s(name: str, numbers: Mapping[str, int], value, dims: str) -> list[Buffer]:
    """The RoutedGates / RouterLogits field ``name`` of ``value`` [rows, L, *] (none for
    None)."""
    if value is None:
        return []
    arr = np.asarray(value)
    if arr.ndim != 3:
        raise ValueError(f"{name}: must have shape {dims}, got {arr.shape}")
    return _sub_message(_TRAJ[name], _packed_parts(
        numbers, _array_bytes(arr, GATE_DTYPES["float16"]), "float16", arr.shape))


def encode(traj: Trajectory, *, num_experts: int | None = None) -> bytes:
    """Wire bytes of ``traj`` with one copy of each array (none beyond the final join
    when an array is already in its wire dtype).

    ``num_experts`` (E) picks the route dtype and is sent along; it defaults to the last
    axis of ``router_logits`` when those are present.
    """
    return b"".join(encode_parts(traj, num_experts=num_experts))


# ===================================================================================
# Request / reply framing (messages around stored Trajectory bytes)
# ===================================================================================
def frame_messages(field: int, payloads: Iterable[Buffer | list[Buffer]]) -> list[Buffer]:
    """Parts of ``payloads`` as a repeated message ``field`` (each payload bytes, or the
    parts of one as from :func:`encode_parts`): spliced, never re-encoded, not yet joined."""
    tag = _varint(field << 3 | LEN)
    out: list[Buffer] = []
    for p in payloads:
        if isinstance(p, list):
            out += [tag, _varint(sum(len(x) for x in p)), *p]
        else:
            out += [tag, _varint(len(p)), p]
    return out


def join_messages(field: int, payloads: Iterable[Buffer | list[Buffer]]) -> bytes:
    """``payloads`` as a repeated message ``field`` in one copy (see :func:`frame_messages`)."""
    return b"".join(frame_messages(field, payloads))


def split_messages(buf: bytes | memoryview, field: int) -> list[memoryview]:
    """The items of a repeated message ``field`` (other fields are skipped)."""
    return [v for f, w, v in iter_fields(memoryview(buf)) if f == field and w == LEN]


def encode_batch_reply(payloads: Iterable[Buffer], cursor: int, dropped_stale: int) -> bytes:
    """GetBatchReply wire bytes around stored Trajectory ``payloads``."""
    meta = pb2.GetBatchReply(cursor=cursor, dropped_stale=dropped_stale)
    return b"".join([*frame_messages(REPLY_TRAJECTORIES, payloads), meta.SerializeToString()])


def decode_batch_reply(buf: bytes | memoryview, *, compact_routes: bool = False
                       ) -> tuple[list[Trajectory], int, int]:
    """GetBatchReply wire bytes -> (trajectories, cursor, dropped_stale)."""
    trajs, cursor, dropped = [], 0, 0
    for field, _, value in iter_fields(memoryview(buf)):
        if field == REPLY_TRAJECTORIES:
            trajs.append(decode(value, compact_routes=compact_routes))
        elif field == _REPLY["cursor"]:
            cursor = value
        elif field == _REPLY["dropped_stale"]:
            dropped = value
    return trajs, cursor, dropped
