"""Schema v1: the protobuf oracle round-trips every field, route packing, the built stubs."""

import dataclasses
import subprocess
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import descriptor_pb2

from satjax.queue._proto import pb2
from satjax.queue.codec import decode, encode, route_dtype_name

REPO = Path(__file__).resolve().parents[2]
PROTO = "satjax/queue/trajectory.proto"


@pytest.mark.parametrize("experts,dtype", [(8, "uint8"), (256, "uint8"), (300, "uint16"),
                                           (70000, "int32")])
def test_round_trip_every_field(experts, dtype, full_traj, assert_same, to_proto, from_proto):
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


def test_round_trip_without_optional_arrays(make_traj, assert_same, to_proto, from_proto):
    t = make_traj("a", "g", routes=False)
    msg = to_proto(t)
    assert not msg.HasField("routed_experts") and not msg.HasField("router_logits")
    assert_same(t, from_proto(pb2.Trajectory.FromString(msg.SerializeToString())))


def test_route_dtype_rules(make_traj):
    r = np.array([[[0, 255]]])
    assert route_dtype_name(r, None) == "uint8"
    assert route_dtype_name(r, 300) == "uint16"
    assert route_dtype_name(np.array([[[256]]]), None) == "uint16"
    # ids the declared E cannot hold, or negative ones, travel unchanged as int32
    assert route_dtype_name(np.array([[[9]]]), 8) == "int32"
    assert route_dtype_name(np.array([[[-1]]]), 8) == "int32"
    t = make_traj("a", "g")
    t.routed_experts[0, 0, 0] = -1
    back = decode(encode(t, num_experts=8))
    assert back.routed_experts[0, 0, 0] == -1


def test_uint8_routes_are_compact(make_traj, to_proto):
    t = make_traj("a", "g", p=100, n=1000, layers=48, k=8, experts=128)
    msg = to_proto(t)
    assert len(msg.routed_experts.data) == (1099 * 48 * 8)


def test_bad_shapes_name_the_argument(make_traj):
    t = make_traj("a", "g")
    with pytest.raises(ValueError, match="routed_experts"):
        encode(dataclasses.replace(t, routed_experts=np.zeros((3, 2), np.int32)))
    with pytest.raises(ValueError, match="router_logits"):
        encode(dataclasses.replace(t, router_logits=np.zeros((3, 2), np.float16)))
    with pytest.raises(ValueError, match="schema_version"):
        decode(pb2.Trajectory(schema_version=2).SerializeToString())


def _strip_json_names(desc):
    # protoc's descriptor set carries json_name; the Python stub's embedded copy does not
    for msg in desc.message_type if hasattr(desc, "message_type") else desc.nested_type:
        for field in msg.field:
            field.ClearField("json_name")
        _strip_json_names(msg)
    return desc


def test_built_modules_match_the_proto(tmp_path):
    from grpc_tools import protoc

    include = Path(protoc.__file__).resolve().parent / "_proto"
    out = tmp_path / "trajectory.desc"
    rc = protoc.main(["grpc_tools.protoc", f"-I{REPO}", f"-I{include}",
                      f"--descriptor_set_out={out}", str(REPO / PROTO)])
    assert rc == 0
    (now,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    built = descriptor_pb2.FileDescriptorProto.FromString(pb2.DESCRIPTOR.serialized_pb)
    assert built.name == PROTO
    # stale stubs (the .proto edited, `pip install -e .` not rerun) fail here
    assert _strip_json_names(built) == _strip_json_names(now)


def test_generated_files_are_not_committed():
    out = subprocess.run(["git", "ls-files", "satjax/queue"], capture_output=True, text=True,
                         cwd=REPO)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    assert "trajectory.proto" in out.stdout
    assert "_pb2" not in out.stdout
