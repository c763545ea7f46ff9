"""fastwire (the queue's hot-path codec) agrees with the protobuf runtime byte for byte."""

import dataclasses

import numpy as np
import pytest
from _queue_util import assert_same, full_traj, make_traj

from satjax.queue._proto import pb2
from satjax.queue.codec import TrajectoryView, WireError, decode, encode
from satjax.queue.core import BatchResult
from satjax.queue.server import encode_batch_reply
from satjax.queue.wire import from_proto, to_proto


def variants():
    yield full_traj(8)
    yield full_traj(300)
    yield make_traj("no-routes", "g", routes=False)
    t = full_traj(70000)
    yield dataclasses.replace(t, policy_version=-3, reward=-0.0, reward_details={},
                              finish_reason="", engine="", created_unix=0.0)
    yield dataclasses.replace(make_traj("neg", "g"), routed_experts=np.full((10, 2, 2), -1))


@pytest.mark.parametrize("traj", list(variants()), ids=lambda t: t.trajectory_id)
def test_encode_parses_to_the_same_message_and_decode_inverts(traj):
    raw = encode(traj)
    assert pb2.Trajectory.FromString(raw) == to_proto(traj)
    proto_raw = to_proto(traj).SerializeToString()
    assert_same(decode(proto_raw), from_proto(pb2.Trajectory.FromString(proto_raw)))
    assert_same(decode(raw), traj)
    view = TrajectoryView(raw)
    assert view.policy_version == traj.policy_version
    assert view.HasField("routed_experts") == (traj.routed_experts is not None)


def test_compact_routes_are_views_in_the_wire_dtype():
    t = full_traj(8)
    back = decode(encode(t), compact_routes=True)
    assert back.routed_experts.dtype == np.uint8 and not back.routed_experts.flags.writeable
    np.testing.assert_array_equal(back.routed_experts, t.routed_experts)


def test_malformed_bytes_raise_wire_error():
    raw = encode(make_traj("a", "g"))
    for bad in (raw[:-1], raw[: len(raw) // 2], b"\xff" * 12, b"\x00\x01", raw + raw[:2]):
        with pytest.raises(WireError):
            TrajectoryView(bad)
    with pytest.raises(WireError, match="repeated"):
        TrajectoryView(raw + raw)  # every singular field twice: protobuf would merge
    with pytest.raises(WireError, match="UTF-8"):
        TrajectoryView(b"\x12\x02\xff\xfe")


def test_batch_reply_splice_parses_with_protobuf_and_client_decoder():
    from satjax.queue.client import QueueClient

    trajs = [full_traj(8), make_traj("b", "g")]
    raw = encode_batch_reply(BatchResult([encode(t) for t in trajs], 7, {-1: 1, 3: 1}, 2))
    reply = pb2.GetBatchReply.FromString(raw)
    assert reply.cursor == 7 and reply.dropped_stale == 2
    assert dict(reply.lag_histogram) == {-1: 1, 3: 1}
    client = QueueClient("127.0.0.1:1", token="x")
    batch = client._decode_batch(raw)
    client.close()
    assert batch.cursor == 7 and batch.dropped_stale == 2 and batch.lag_histogram == {-1: 1, 3: 1}
    for a, b in zip(trajs, batch.trajectories, strict=True):
        assert_same(a, b)
