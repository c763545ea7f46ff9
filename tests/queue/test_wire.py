"""Schema v1: round trip of every Trajectory field, route packing, proto (re)generation."""

import dataclasses
import os

import numpy as np
import pytest
from _queue_util import assert_same, full_traj, make_traj

from satjax.queue import _proto
from satjax.queue._proto import pb2
from satjax.queue.wire import from_proto, route_dtype_name, to_proto


@pytest.mark.parametrize("experts,dtype", [(8, "uint8"), (256, "uint8"), (300, "uint16"),
                                           (70000, "int32")])
def test_round_trip_every_field(experts, dtype):
    t = full_traj(experts)
    t.routed_experts[0, 0, 0] = experts - 1  # the largest id must survive narrowing
    msg = to_proto(t)
    assert msg.schema_version == 1
    assert msg.routed_experts.dtype == dtype
    assert list(msg.routed_experts.shape) == [9 + 13 - 1, 3, 2]
    assert msg.routed_experts.num_experts == experts  # from router_logits' last axis
    back = from_proto(pb2.Trajectory.FromString(msg.SerializeToString()))
    assert_same(t, back)
    assert back.routed_experts.dtype == np.int32
    assert back.router_logits.dtype == np.float16
    back.prompt_tokens[0] = 5  # arrays are writable copies, not views of the message


def test_round_trip_without_optional_arrays():
    t = make_traj("a", "g", routes=False)
    msg = to_proto(t)
    assert not msg.HasField("routed_experts") and not msg.HasField("router_logits")
    assert_same(t, from_proto(pb2.Trajectory.FromString(msg.SerializeToString())))


def test_route_dtype_rules():
    r = np.array([[[0, 255]]])
    assert route_dtype_name(r, None) == "uint8"
    assert route_dtype_name(r, 300) == "uint16"
    assert route_dtype_name(np.array([[[256]]]), None) == "uint16"
    # ids the declared E cannot hold, or negative ones, travel unchanged as int32
    assert route_dtype_name(np.array([[[9]]]), 8) == "int32"
    assert route_dtype_name(np.array([[[-1]]]), 8) == "int32"
    t = make_traj("a", "g")
    t.routed_experts[0, 0, 0] = -1
    back = from_proto(to_proto(t, num_experts=8))
    assert back.routed_experts[0, 0, 0] == -1


def test_uint8_routes_are_compact():
    t = make_traj("a", "g", p=100, n=1000, layers=48, k=8, experts=128)
    msg = to_proto(t)
    assert len(msg.routed_experts.data) == (1099 * 48 * 8)


def test_bad_shapes_name_the_argument():
    t = make_traj("a", "g")
    with pytest.raises(ValueError, match="routed_experts"):
        to_proto(dataclasses.replace(t, routed_experts=np.zeros((3, 2), np.int32)))
    with pytest.raises(ValueError, match="schema_version"):
        from_proto(pb2.Trajectory(schema_version=2))


def test_generated_modules_are_regenerated_when_stale(tmp_path):
    _proto.generate(tmp_path)
    assert not _proto.is_stale(tmp_path)
    old = _proto.PROTO.stat().st_mtime - 10
    os.utime(tmp_path / "trajectory_pb2.py", (old, old))
    assert _proto.is_stale(tmp_path)
    (tmp_path / "trajectory_pb2_grpc.py").unlink()
    assert _proto.is_stale(tmp_path)
    _proto.generate(tmp_path)
    assert not _proto.is_stale(tmp_path)
    text = (tmp_path / "trajectory_pb2_grpc.py").read_text()
    assert "from satjax.queue import trajectory_pb2" in text


def test_generated_files_are_not_committed():
    import subprocess

    out = subprocess.run(["git", "ls-files", "satjax/queue"], capture_output=True, text=True,
                         cwd=_proto.PROTO_ROOT)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    assert "_pb2" not in out.stdout
