"""Requests a careless or hostile caller sends: an unbounded wait, bodies that are not the
message they claim to be, a field in the wrong wire type, a stray file in the data dir.
Each is refused with a message naming what is wrong, never a server traceback."""

from __future__ import annotations

import logging
import math
import subprocess
import sys

import grpc
import pytest
from queue_testlib import one_line

from satjax.queue._proto import SERVICE, pb2
from satjax.queue.client import QueueValidationError
from satjax.queue.codec import FIXED64, TrajectoryView, WireError, encode
from satjax.queue.core import QueueSettings, TrajectoryQueue
from satjax.queue.protocol import MAX_WAIT_S
from satjax.queue.store import DataDirError, SegmentLog

POLICY_VERSION = pb2.Trajectory.DESCRIPTOR.fields_by_name["policy_version"].number


def _raw_call(port: int, method: str):
    """A unary call sending and receiving raw bytes, as a client of another stack could."""
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return channel, channel.unary_unary(f"/{SERVICE}/{method}")


@pytest.mark.parametrize("timeout", [math.inf, math.nan, 1e300, -1.0, MAX_WAIT_S * 2])
def test_get_batch_refuses_a_wait_that_is_not_a_bounded_number_of_seconds(harness, timeout):
    h, client = harness()
    with pytest.raises(ValueError, match=r"^timeout: must be a finite number of seconds"):
        client.get_batch(2, 0, timeout=timeout)
    # the server checks it too (another client, or this one's check bypassed)
    channel, call = _raw_call(h.port, "GetBatch")
    body = pb2.GetBatchRequest(n=2, trainer_version=0, timeout_s=timeout,
                               consumer_id="raw").SerializeToString()
    with pytest.raises(grpc.RpcError) as e:
        call(body, metadata=(("authorization", f"Bearer {h.token}"),))
    channel.close()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("timeout_s: must be a finite number of seconds")
    assert client.get_batch(2, 0, timeout=MAX_WAIT_S * 0, allow_partial=True).cursor == 0


@pytest.mark.parametrize("method,request_name", [
    ("GetBatch", "GetBatchRequest"), ("Ack", "AckRequest"), ("Stats", "StatsRequest"),
    ("ShouldPause", "ShouldPauseRequest")])
def test_a_malformed_unary_body_is_invalid_argument_without_a_traceback(
        harness, make_group, caplog, method, request_name):
    h, client = harness()
    channel, call = _raw_call(h.port, method)
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(grpc.RpcError) as e:
            call(b"\xff\xff\xff", metadata=(("authorization", f"Bearer {h.token}"),))
    channel.close()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(f"request: must be a valid {request_name} message")
    assert not [r for r in caplog.records if r.exc_info], caplog.text  # no server traceback
    client.put(make_group("g", 2), strict=True)  # the server serves on
    assert len(client.get_batch(2, 0).trajectories) == 2


def _with_policy_version_as_fixed64(make_traj) -> bytes:
    raw = encode(make_traj("t", "g", version=0))  # version 0: the field is left out
    return raw + bytes([POLICY_VERSION << 3 | FIXED64]) + (7).to_bytes(8, "little")


def test_a_known_field_in_the_wrong_wire_type_is_refused(harness, make_traj):
    raw = _with_policy_version_as_fixed64(make_traj)
    # why: protobuf keeps it as an unknown field and reads policy_version as 0
    assert pb2.Trajectory.FromString(raw).policy_version == 0
    with pytest.raises(WireError, match=r"^Trajectory\.policy_version: must have wire type"):
        TrajectoryView(raw)
    unknown = encode(make_traj("u", "g")) + b"\x98\x06\x01"  # field 99, varint 1
    # an unknown field is read past and listed (the server refuses it: test_guards.py)
    assert (TrajectoryView(unknown).trajectory_id, TrajectoryView(unknown).unknown) == ("u", ["99"])
    _, client = harness()
    with pytest.raises(QueueValidationError) as e:
        client.put([raw], strict=True)
    (r,) = e.value.rejections
    assert r.field == "trajectory" and "policy_version" in r.message
    assert client.stats()["accepted_total"] == 0


def test_a_stored_record_that_no_longer_parses_is_never_delivered(tmp_path, make_traj):
    """A record a laxer codec accepted (policy_version read as 0) is set aside on open."""
    good = [encode(make_traj(f"ok-{i}", "ok", group_size=2, seed=i)) for i in range(2)]
    log = SegmentLog(tmp_path, fsync="never")
    list(log.replay())
    log.append(1, [good[0], _with_policy_version_as_fixed64(make_traj), good[1]])
    log.close()
    q = TrajectoryQueue(tmp_path, QueueSettings(fsync="never"), reset_consumer_state=True)
    try:
        stats = q.stats()
        assert stats["pending"] == 2 and stats["quarantined_total"] == 1
        assert len(q.get_batch(2, 0).payloads) == 2
    finally:
        q.close()


@pytest.mark.parametrize("name", ["seg-1 (copy).log", "seg-abc.log", "seg-1.log"])
def test_a_stray_segment_name_stops_the_server_naming_the_file(
        tmp_path, harness, make_group, serve_queue_refusal, name):
    h, client = harness()
    client.put(make_group("g", 2), strict=True)
    h.server.stop(None)
    h.server = None
    (h.data_dir / name).write_bytes(b"not a segment")
    with pytest.raises(DataDirError, match="is not a segment of this queue"):
        TrajectoryQueue(h.data_dir, QueueSettings(fsync="never"))
    r = serve_queue_refusal(h.data_dir)
    assert r.returncode == 1
    line = one_line(r.stderr)
    assert repr(name) in line and "move it out of the directory" in line
    (h.data_dir / name).unlink()
    q = TrajectoryQueue(h.data_dir, QueueSettings(fsync="never"))  # nothing else harmed
    try:
        assert len(q.get_batch(2, 0).payloads) == 2
    finally:
        q.close()


def test_the_client_loads_neither_the_server_nor_its_storage(subprocess_env):
    """A producer (rollout worker) imports the client: it shares only the protocol and the
    codec with the server."""
    code = ("import sys, satjax.queue.client; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('satjax.queue'))))")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env, check=True,
                         capture_output=True, text=True).stdout.split()
    assert "satjax.queue.protocol" in out
    assert not {"satjax.queue.server", "satjax.queue.core", "satjax.queue.store"} & set(out)
