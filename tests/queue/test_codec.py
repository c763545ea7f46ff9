"""The queue's codec agrees with the protobuf runtime (the oracle: ``to_proto``/``from_proto``)."""

import dataclasses

import numpy as np
import pytest

from satjax.queue import codec
from satjax.queue._proto import pb2
from satjax.queue.codec import (
    PUT_BATCH_TRAJECTORIES,
    TrajectoryView,
    WireError,
    decode,
    decode_batch_reply,
    encode,
    encode_batch_reply,
    join_messages,
    split_messages,
)

VARIANTS = {
    "uint8-routes": lambda make, full: full(8),
    "uint16-routes": lambda make, full: full(300),
    "no-routes": lambda make, full: make("no-routes", "g", routes=False),
    "int32-routes-defaults": lambda make, full: dataclasses.replace(
        full(70000), policy_version=-3, reward=-0.0, reward_details={}, finish_reason="",
        engine="", created_unix=0.0),
    "negative-routes": lambda make, full: dataclasses.replace(
        make("neg", "g"), routed_experts=np.full((10, 2, 2), -1)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_encode_parses_to_the_same_message_and_decode_inverts(
        variant, make_traj, full_traj, assert_same, to_proto, from_proto):
    traj = VARIANTS[variant](make_traj, full_traj)
    raw = encode(traj)
    assert pb2.Trajectory.FromString(raw) == to_proto(traj)
    proto_raw = to_proto(traj).SerializeToString()
    assert_same(decode(proto_raw), from_proto(pb2.Trajectory.FromString(proto_raw)))
    assert_same(decode(raw), traj)
    view = TrajectoryView(raw)
    assert view.policy_version == traj.policy_version
    assert view.HasField("routed_experts") == (traj.routed_experts is not None)


def test_compact_routes_are_views_in_the_wire_dtype(full_traj):
    t = full_traj(8)
    back = decode(encode(t), compact_routes=True)
    assert back.routed_experts.dtype == np.uint8 and not back.routed_experts.flags.writeable
    np.testing.assert_array_equal(back.routed_experts, t.routed_experts)


def test_malformed_bytes_raise_wire_error(make_traj):
    raw = encode(make_traj("a", "g"))
    for bad in (raw[:-1], raw[: len(raw) // 2], b"\xff" * 12, b"\x00\x01", raw + raw[:2]):
        with pytest.raises(WireError):
            TrajectoryView(bad)
    with pytest.raises(WireError, match="repeated"):
        TrajectoryView(raw + raw)  # every singular field twice: protobuf would merge
    with pytest.raises(WireError, match="UTF-8"):
        TrajectoryView(b"\x12\x02\xff\xfe")


def test_batch_reply_splice_parses_with_protobuf_and_decodes_back(
        make_traj, full_traj, assert_same):
    trajs = [full_traj(8), make_traj("b", "g")]
    raw = encode_batch_reply([encode(t) for t in trajs], 7, 2)
    reply = pb2.GetBatchReply.FromString(raw)
    assert reply.cursor == 7 and reply.dropped_stale == 2
    assert [t.trajectory_id for t in reply.trajectories] == ["traj-ü", "b"]
    back, cursor, dropped = decode_batch_reply(raw)
    assert cursor == 7 and dropped == 2
    for a, b in zip(trajs, back, strict=True):
        assert_same(a, b)


def test_put_batch_framing_parses_with_protobuf(make_traj, to_proto):
    trajs = [make_traj("a", "g"), make_traj("b", "g", routes=False)]
    raw = join_messages(PUT_BATCH_TRAJECTORIES, [encode(t) for t in trajs])
    request = pb2.PutBatchRequest.FromString(raw)
    assert [to_proto(t) for t in trajs] == list(request.trajectories)
    assert [bytes(v) for v in split_messages(raw, PUT_BATCH_TRAJECTORIES)] == [
        encode(t) for t in trajs]


def test_field_numbers_come_from_the_descriptor(make_traj):
    # the codec hard-codes none: every number it uses is the .proto's
    assert codec.PUT_BATCH_TRAJECTORIES == pb2.PutBatchRequest.DESCRIPTOR.fields_by_name[
        "trajectories"].number
    traj = make_traj("a", "g", version=3)
    by_name = {f.name: f.number for f in pb2.Trajectory.DESCRIPTOR.fields}
    seen = {field for field, _, _ in codec.iter_fields(memoryview(encode(traj)))}
    assert seen <= set(by_name.values())
    assert by_name["policy_version"] in seen and by_name["routed_experts"] in seen


def test_framing_encode_parts_parses_with_protobuf(make_traj, full_traj, to_proto):
    # the client frames encode_parts (array views) without joining each item first
    trajs = [full_traj(8), make_traj("b", "g", routes=False)]
    raw = join_messages(PUT_BATCH_TRAJECTORIES, [codec.encode_parts(t) for t in trajs])
    assert list(pb2.PutBatchRequest.FromString(raw).trajectories) == [to_proto(t) for t in trajs]


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64, np.uint8, np.uint32,
                                   np.float32])
def test_route_dtype_name_matches_the_min_max_definition(dtype):
    # one pass over the ids (as unsigned) must pick what min/max of the ids would
    def by_min_max(routes, num_experts):
        lo, hi = int(routes.min()), int(routes.max())
        bound = num_experts or hi + 1
        if lo >= 0 and hi < bound and bound <= 65536:
            return "uint8" if bound <= 256 else "uint16"
        return "int32"

    rng = np.random.default_rng(0)
    for lo, hi in ((0, 5), (0, 255), (0, 256), (-3, 100), (0, 30000), (-2**14, 5)):
        if np.issubdtype(dtype, np.unsignedinteger) and lo < 0:
            continue
        routes = rng.integers(lo, hi + 1, (6, 4, 2)).astype(dtype)
        for view in (routes, routes[:, ::2]):  # contiguous and strided
            for num_experts in (None, 128, 256, 300, 70000):
                assert codec.route_dtype_name(view, num_experts) == by_min_max(view, num_experts)


def test_a_record_without_gates_or_versions_still_loads(make_traj, to_proto):
    """The wire stays backward-readable: bytes written without the fields added later
    (routed_gates, token_versions) decode as before, with None for both."""
    old = to_proto(make_traj("old", "g", logits=True))
    assert not old.HasField("routed_gates") and not old.token_versions
    back = decode(old.SerializeToString())
    assert back.routed_gates is None and back.token_versions is None
    np.testing.assert_array_equal(back.versions, np.full(5, back.policy_version))
    assert not back.partial


def test_gates_and_token_versions_round_trip(full_traj):
    t = full_traj(8)
    assert t.routed_gates.dtype == np.float16 and t.partial
    back = decode(encode(t))
    assert back.routed_gates.dtype == np.float16 and back.token_versions.dtype == np.int32
    np.testing.assert_array_equal(back.routed_gates, t.routed_gates)
    np.testing.assert_array_equal(back.versions, t.token_versions)
    assert back.policy_version == int(t.token_versions.min())
