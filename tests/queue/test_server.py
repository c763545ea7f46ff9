"""In-process queue server: auth, validation, lag, groups, pausing, acks, durability."""

import dataclasses
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from satjax.queue._proto import pb2
from satjax.queue.client import (
    QueueAuthError,
    QueueClient,
    QueueTooLargeError,
    QueueUnavailableError,
    QueueValidationError,
    RetryPolicy,
)
from satjax.queue.core import QueueSettings
from satjax.queue.server import QueueServer
from satjax.queue.validation import Limits


def ids(batch):
    return sorted(t.trajectory_id for t in batch.trajectories)


# -- auth ---------------------------------------------------------------------------------
def test_wrong_or_missing_token_is_refused(harness, make_group):
    h, good = harness()
    bad = h.client(token="not-the-token")
    with pytest.raises(QueueAuthError, match="UNAUTHENTICATED"):
        bad.put(make_group("g", 1))
    for call in (lambda: bad.get_batch(1, 0), lambda: bad.ack(1), bad.stats,
                 lambda: bad.should_pause(0)):
        with pytest.raises(QueueAuthError):
            call()
    # no metadata at all, on every method, streaming and unary
    channel = grpc.insecure_channel(f"127.0.0.1:{h.port}")
    calls = {}
    put = channel.stream_unary("/satjax.queue.v1.TrajectoryQueue/Put",
                               request_serializer=lambda b: b)
    for name, req in [("Put", None), ("PutBatch", pb2.PutBatchRequest()),
                      ("GetBatch", pb2.GetBatchRequest(n=1)), ("Ack", pb2.AckRequest()),
                      ("Stats", pb2.StatsRequest()), ("ShouldPause", pb2.ShouldPauseRequest())]:
        method = channel.unary_unary(f"/satjax.queue.v1.TrajectoryQueue/{name}",
                                     request_serializer=lambda m: m.SerializeToString())
        try:
            put(iter([b""])) if req is None else method(req)
            calls[name] = "answered"
        except grpc.RpcError as e:
            calls[name] = e.code()
    assert set(calls.values()) == {grpc.StatusCode.UNAUTHENTICATED}, calls
    # the health check is deliberately open (it reveals only SERVING)
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service="satjax.queue.v1.TrajectoryQueue"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    channel.close()
    assert good.stats()["accepted_total"] == 0  # the refused put stored nothing


def test_put_without_token_raises_unauthenticated(harness, make_traj, to_proto):
    h, _ = harness()
    channel = grpc.insecure_channel(f"127.0.0.1:{h.port}")
    put = channel.stream_unary("/satjax.queue.v1.TrajectoryQueue/Put",
                               request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=pb2.PutReply.FromString)
    with pytest.raises(grpc.RpcError) as e:
        put(iter([to_proto(make_traj("a", "g"))]))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()


def test_server_requires_a_token(tmp_path):
    with pytest.raises(ValueError, match="token"):
        QueueServer(tmp_path, "")


# -- validation ---------------------------------------------------------------------------
def _mutations():
    f32, i32 = np.float32, np.int32

    def logprobs(values):
        return lambda m: setattr(m, "behavior_logprobs", np.asarray(values, f32).tobytes())

    def response(values):
        return lambda m: setattr(m, "response_tokens", np.asarray(values, i32).tobytes())

    def set_routes(arr, dtype="uint8", num_experts=0):
        def f(m):
            m.routed_experts.Clear()
            m.routed_experts.data = np.asarray(arr).astype(dtype).tobytes()
            m.routed_experts.dtype = dtype
            m.routed_experts.shape.extend(np.shape(arr))
            m.routed_experts.num_experts = num_experts
        return f

    def set_logits(shape):
        def f(m):
            m.router_logits.data = np.zeros(shape, np.float16).tobytes()
            m.router_logits.dtype = "float16"
            m.router_logits.shape.extend(shape)
        return f

    rows = 6 + 5 - 1  # make_traj default P=6, N=5, L=2, k=2
    return {
        "logprob count": (logprobs([-1.0] * 4), "behavior_logprobs"),
        "logprob nan": (logprobs([-1.0, np.nan, -1, -1, -1]), "behavior_logprobs"),
        "logprob inf": (logprobs([-np.inf, -1, -1, -1, -1]), "behavior_logprobs"),
        "logprob positive": (logprobs([-1.0, 0.5, -1, -1, -1]), "behavior_logprobs"),
        "negative response token": (response([1, 2, -3, 4, 5]), "response_tokens"),
        "negative prompt token": (lambda m: setattr(m, "prompt_tokens", np.asarray(
            [1, -1, 2, 3, 4, 5], i32).tobytes()), "prompt_tokens"),
        "ragged token bytes": (lambda m: setattr(m, "prompt_tokens", b"\x01\x02\x03"),
                               "prompt_tokens"),
        "token over vocab": (response([1, 2, 3, 4, 5000]), "response_tokens"),
        "empty response": (lambda m: (setattr(m, "response_tokens", b""),
                                      setattr(m, "behavior_logprobs", b"")), "response_tokens"),
        "too many tokens": (lambda m: (setattr(m, "prompt_tokens", np.zeros(40, i32).tobytes()),
                                       m.ClearField("routed_experts")), "response_tokens"),
        "expert id >= E": (set_routes(np.full((rows, 2, 2), 8)), "routed_experts"),
        "negative expert id": (set_routes(np.full((rows, 2, 2), -1), "int32"),
                               "routed_experts"),
        "routes rows != P+N-1": (set_routes(np.zeros((rows + 1, 2, 2))), "routed_experts"),
        "routes data size": (lambda m: setattr(m.routed_experts, "data", b"\x00" * 7),
                             "routed_experts"),
        "routes dtype": (lambda m: setattr(m.routed_experts, "dtype", "float32"),
                         "routed_experts"),
        "routes k > E": (set_routes(np.zeros((rows, 2, 9))), "routed_experts"),
        "logits rows": (set_logits((rows - 1, 2, 8)), "router_logits"),
        "logits layers": (set_logits((rows, 3, 8)), "router_logits"),
        "logits E != server E": (set_logits((rows, 2, 16)), "router_logits"),
        "schema version": (lambda m: setattr(m, "schema_version", 2), "schema_version"),
        "empty trajectory id": (lambda m: setattr(m, "trajectory_id", ""), "trajectory_id"),
        "empty group id": (lambda m: setattr(m, "group_id", ""), "group_id"),
        "group size 0": (lambda m: setattr(m, "group_size", 0), "group_size"),
        "negative version": (lambda m: setattr(m, "policy_version", -1), "policy_version"),
        "finish reason": (lambda m: setattr(m, "finish_reason", "oops"), "finish_reason"),
        "reward nan": (lambda m: setattr(m, "reward", float("nan")), "reward"),
        "reward detail inf": (lambda m: m.reward_details.__setitem__("x", float("inf")),
                              "reward_details"),
        "negative generation time": (lambda m: setattr(m.timing, "generation_seconds", -1.0),
                                     "timing.generation_seconds"),
    }


def test_every_validation_rule_rejects_only_the_bad_item(harness, make_traj, to_proto):
    limits = Limits(max_seq_len=30, num_experts=8, vocab_size=1000)
    h, client = harness(settings=QueueSettings(limits=limits))
    mutations = _mutations()
    stream, expected = [], {}
    for i, (name, (mutate, field)) in enumerate(mutations.items()):
        good = to_proto(make_traj(f"good-{i}", f"good-{i}", seed=i))
        bad = to_proto(make_traj(f"bad-{i}", f"bad-{i}", seed=i))
        mutate(bad)
        if name == "empty trajectory id":
            bad.trajectory_id = ""
        stream += [good, bad]
        expected[2 * i + 1] = (name, field)
    result = client.put(stream)
    got = {r.index: r for r in result.rejected}
    assert set(got) == set(expected), {expected[i][0] for i in set(expected) - set(got)}
    for index, (name, field) in expected.items():
        assert got[index].field == field, (name, got[index])
        assert got[index].message.startswith(field), (name, got[index].message)
    assert sorted(result.accepted) == sorted(f"good-{i}" for i in range(len(mutations)))
    stats = client.stats()
    assert stats["accepted_total"] == len(mutations)
    assert stats["rejected_total"] == len(mutations)
    with pytest.raises(QueueValidationError, match="behavior_logprobs") as e:
        bad = to_proto(make_traj("strict", "strict"))
        mutations["logprob nan"][0](bad)
        client.put([bad], strict=True)
    assert e.value.rejections[0].field == "behavior_logprobs"


def test_logprob_tolerance_and_consistent_shapes_without_server_E(harness, make_traj, to_proto):
    h, client = harness()  # no --num-experts: E from the producer's declaration
    t = make_traj("tiny-positive", "a")
    t.behavior_logprobs[0] = 5e-5
    assert client.put([t]).ok
    t2 = make_traj("declared", "b")
    t2.routed_experts[0, 0, 0] = 9
    r = client.put([to_proto(t2, num_experts=8)])
    assert r.rejected[0].field == "routed_experts" and "[0, 8)" in r.rejected[0].message
    t3 = make_traj("logits-E", "c", logits=True, experts=8)
    m3 = to_proto(t3)
    m3.routed_experts.num_experts = 16
    r = client.put([m3])
    assert r.rejected[0].field == "routed_experts" and "agree" in r.rejected[0].message
    assert "16 and 8" in r.rejected[0].message


def test_undecodable_item_does_not_drop_the_stream(harness, token, make_traj, to_proto):
    h, client = harness()
    channel = grpc.insecure_channel(f"127.0.0.1:{h.port}")
    put = channel.stream_unary("/satjax.queue.v1.TrajectoryQueue/Put",
                               request_serializer=lambda b: b,
                               response_deserializer=pb2.PutReply.FromString)
    raw = [to_proto(make_traj(f"t{i}", f"g{i}")).SerializeToString() for i in range(2)]
    reply = put(iter([raw[0], b"\xff\xff\xff\xff", raw[1]]),
                metadata=(("authorization", f"Bearer {token}"),))
    assert list(reply.accepted_ids) == ["t0", "t1"]
    assert [(r.index, r.field) for r in reply.rejections] == [(1, "trajectory")]
    channel.close()


def test_future_versions_are_rejected(harness, make_traj):
    h, client = harness(settings=QueueSettings(future_slack=1))
    assert client.put([make_traj("early", "e", version=100)]).ok  # no trainer yet: no bound
    client.get_batch(2, trainer_version=3, max_lag=200)
    r = client.put([make_traj("ok", "x", version=5), make_traj("future", "y", version=6)])
    assert r.accepted == ["ok"]
    assert r.rejected[0].field == "policy_version" and "future" in r.rejected[0].message


def test_group_consistency_and_duplicates(harness, make_traj, make_group):
    h, client = harness()
    a = make_group("a", 2)
    r = client.put([a[0], dataclasses.replace(a[1], group_size=3)])
    assert r.rejected[0].field == "group_size"
    r = client.put([dataclasses.replace(a[1], prompt_id="other")])
    assert r.rejected[0].field == "prompt_id"
    assert client.put([a[1]]).ok
    r = client.put([make_traj("a-extra", "a", group_size=2)])
    assert r.rejected[0].field == "group_id"
    r = client.put([a[0], a[0]])
    assert r.duplicates == ["a-0", "a-0"] and r.accepted == ["a-0", "a-0"]
    assert client.stats()["accepted_total"] == 2


def test_message_size_limit(harness, make_traj):
    h, client = harness(max_message_mb=1)
    big = make_traj("big", "big", p=100, n=1000, layers=48, k=8, experts=128)
    # 1099 rows x 48 x 8 uint8 = 422 KB: fits one message, three do not fit one reply
    assert client.put([dataclasses.replace(big, trajectory_id=f"b{i}", group_id=f"b{i}")
                       for i in range(3)]).ok
    with pytest.raises(QueueTooLargeError, match="max message size"):
        client.get_batch(3, 0)
    huge = make_traj("huge", "huge", p=100, n=1000, layers=96, k=8, experts=300)  # 1.7 MB
    with pytest.raises(QueueTooLargeError):
        client.put([huge, huge])  # one stream message over 1 MB


# -- lag and groups -----------------------------------------------------------------------
def test_lag_filter_drop_counts_and_histogram(harness, make_group):
    h, client = harness()
    for v in range(6):
        client.put(make_group(f"v{v}", 2, version=v))
    batch = client.get_batch(6, trainer_version=5, max_lag=2)
    assert ids(batch) == sorted(f"v{v}-{i}" for v in (3, 4, 5) for i in range(2))
    assert batch.dropped_stale == 6
    assert sorted(5 - t.policy_version for t in batch.trajectories) == [0, 0, 1, 1, 2, 2]
    assert all(5 - t.policy_version <= 2 for t in batch.trajectories)
    stats = client.stats()
    assert stats["dropped_stale_total"] == 6 and stats["pending"] == 0
    # drops are persisted: a restart does not bring them back
    client.ack(batch.cursor)
    client = h.restart()
    assert client.get_batch(2, 5, max_lag=10, allow_partial=True).trajectories == []


def test_default_max_lag_and_mixed_staleness_group(harness, make_group):
    h, client = harness(settings=QueueSettings(max_lag_default=2))
    g = make_group("mixed", 3)
    g[0].policy_version, g[1].policy_version = 1, 4  # oldest member decides: lag 4 > 2
    client.put(g[:2])
    assert client.get_batch(3, trainer_version=5, timeout=0.1).dropped_stale == 2
    g[2].policy_version = 5
    client.put([g[2]])  # late member of a dropped group is dropped too
    client.put(make_group("fresh", 3, version=5))
    batch = client.get_batch(3, trainer_version=5)
    assert ids(batch) == ["fresh-0", "fresh-1", "fresh-2"] and batch.dropped_stale == 1


def test_complete_groups_only(harness, make_group):
    h, client = harness()
    g = make_group("g", 3)
    client.put(g[:2])
    assert client.get_batch(3, 0, timeout=0.2).trajectories == []
    assert client.get_batch(3, 0, allow_partial=True).trajectories == []
    client.put(make_group("h", 3))  # h completes first but g is older: g goes first once whole
    threading.Timer(0.2, lambda: client.put(g[2:])).start()
    t0 = time.monotonic()
    batch = client.get_batch(6, 0, timeout=10)
    assert time.monotonic() - t0 < 5  # woken by the put, not by the timeout
    assert [t.trajectory_id for t in batch.trajectories] == ["g-0", "g-1", "g-2",
                                                              "h-0", "h-1", "h-2"]
    with pytest.raises(QueueValidationError, match="multiple of group_size"):
        client.put(make_group("k", 3))
        client.get_batch(4, 0)
    partial = client.get_batch(6, 0, timeout=0.1, allow_partial=True)
    assert ids(partial) == ["k-0", "k-1", "k-2"]
    with pytest.raises(QueueValidationError, match="n: must be positive"):
        client.get_batch(0, 0)


# -- pausing ------------------------------------------------------------------------------
def test_should_pause(harness, make_group):
    h, client = harness(settings=QueueSettings(max_pending=100))
    d = client.should_pause(0)
    assert not d.pause and d.trainer_version == -1
    client.get_batch(2, trainer_version=10, max_lag=2)  # empty; trainer now at 10, n = 2
    assert not client.should_pause(10).pause           # consumed at 11: lag 1
    assert not client.should_pause(9).pause            # lag 2
    d = client.should_pause(8)                          # lag 3 > 2: would be wasted
    assert d.pause and d.predicted_lag == 3 and "max_lag 2" in d.reason
    client.put(make_group("a", 2, version=10) + make_group("b", 2, version=10))
    d = client.should_pause(9)  # 4 fresh pending = 2 batches ahead: consumed at 13
    assert d.pause and d.predicted_lag == 4 and d.pending_fresh == 4
    assert not client.should_pause(11).pause
    # while the trainer waits inside GetBatch, its version is the one consuming
    client.get_batch(4, 10)
    waiter = threading.Thread(target=lambda: client.get_batch(2, 12, timeout=3))
    waiter.start()
    deadline = time.monotonic() + 3
    while client.should_pause(10).predicted_lag != 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.should_pause(10).predicted_lag == 2  # 12 - 10, not 13 - 10
    client.put(make_group("c", 2, version=12))
    waiter.join()


def test_should_pause_back_pressure(harness, make_traj):
    h, client = harness(settings=QueueSettings(max_pending=3))
    client.put([make_traj(f"t{i}", f"g{i}") for i in range(3)])
    d = client.should_pause(0)
    assert d.pause and "max_pending" in d.reason


# -- acks, restart, durability ------------------------------------------------------------
def test_ack_cursor_semantics_and_restart(harness, make_group):
    h, client = harness()
    for name in "abcd":
        client.put(make_group(name, 2))
    b1 = client.get_batch(2, 0)
    b2 = client.get_batch(2, 0)
    b3 = client.get_batch(2, 0)
    assert b1.cursor < b2.cursor < b3.cursor
    assert client.ack(b1.cursor) == 2
    assert client.ack(b1.cursor) == 0  # idempotent
    client = h.restart()  # b2, b3 were delivered but not acked: they come back
    again = client.get_batch(6, 0)
    assert ids(again) == ids(b2) + ids(b3) + ["d-0", "d-1"]
    assert client.ack(again.cursor) == 6  # cumulative over batches
    assert client.stats()["watermark"] == 8
    client = h.restart()
    assert client.get_batch(2, 0, allow_partial=True).trajectories == []


def test_redeliver_unacked_without_restart_and_out_of_order_acks(harness, make_group):
    h, client = harness()
    a = make_group("a", 2)
    client.put(a[:1])                  # seq 1: incomplete group
    client.put(make_group("b", 2))          # seq 2, 3
    b = client.get_batch(2, 0)
    assert ids(b) == ["b-0", "b-1"]
    again = client.get_batch(2, 0, redeliver_unacked=True)
    assert ids(again) == ids(b) and again.cursor > b.cursor
    assert client.ack(b.cursor) == 0  # the first delivery was taken back
    assert client.ack(again.cursor) == 2
    assert client.stats()["watermark"] == 0  # seq 1 still pending
    client.put(a[1:])
    ba = client.get_batch(2, 0)
    assert ids(ba) == ["a-0", "a-1"]
    client.ack(ba.cursor)
    assert client.stats()["watermark"] == 4


def _segments(path):
    return sorted(path.glob("seg-*.log"))


def test_torn_tail_is_truncated(harness, make_traj):
    h, client = harness()
    client.put([make_traj(f"t{i}", f"g{i}") for i in range(3)])
    h.server.stop(None)
    seg = _segments(h.data_dir)[-1]
    size = seg.stat().st_size
    with open(seg, "ab") as f:
        f.write(b"\x10\x00\x00\x00\x01\x02")  # half a header: a torn append
    client = h.start()
    assert client.stats()["pending"] == 3
    assert seg.stat().st_size == size
    # a corrupted last record (bad CRC) is cut off too
    h.server.stop(None)
    data = bytearray(seg.read_bytes())
    data[-3] ^= 0xFF
    seg.write_bytes(bytes(data))
    client = h.start()
    assert client.stats()["pending"] == 2
    assert client.put([make_traj("t9", "g9")]).ok  # appends continue after the cut
    assert sorted(ids(client.get_batch(3, 0))) == ["t0", "t1", "t9"]


def test_segments_roll_and_are_garbage_collected(harness, make_traj):
    h, client = harness(settings=QueueSettings(segment_bytes=300))
    for i in range(12):
        client.put([make_traj(f"t{i}", f"g{i}")])
    assert len(_segments(h.data_dir)) >= 4
    batch = client.get_batch(12, 0)
    client.ack(batch.cursor)
    stats = client.stats()
    assert stats["segments"] == 1 and stats["watermark"] == 12
    h.server.stop(None)  # the files go in the background; closing the log waits for it
    assert len(_segments(h.data_dir)) == 1  # only the active segment is left
    client = h.start()
    r = client.put([make_traj("t3", "g3"), make_traj("new", "n")])  # t3 was GC'd: still a dup
    assert r.duplicates == ["t3"]
    batch = client.get_batch(1, 0)
    assert ids(batch) == ["new"] and client.stats()["next_seq"] == 14  # seqs keep growing


def test_unavailable_is_retried_then_reported(tmp_path, token):
    from satjax.utils import free_port

    port = free_port()
    c = QueueClient(f"127.0.0.1:{port}", token=token, retry=RetryPolicy(retries=2, backoff_s=0.01))
    t0 = time.monotonic()
    with pytest.raises(QueueUnavailableError):
        c.stats()
    assert time.monotonic() - t0 < 10
    with pytest.raises(QueueUnavailableError):
        c.wait_ready(timeout=0.3)
    server = QueueServer(tmp_path, token)
    threading.Timer(0.3, lambda: server.start(port)).start()
    c2 = QueueClient(f"127.0.0.1:{port}", token=token,
                     retry=RetryPolicy(retries=30, backoff_s=0.05))
    try:
        assert c2.stats()["pending"] == 0  # succeeded after retrying while the server came up
    finally:
        time.sleep(0.05)
        server.stop(None)
        c.close()
        c2.close()


def test_delivered_content_matches_put_from_cache_and_from_disk(harness, make_traj, assert_same):
    h, client = harness(settings=QueueSettings(cache_bytes=3000))  # cache holds only a few
    sent = [make_traj(f"t{i}", f"g{i // 2}", group_size=2, seed=i, logits=True)
            for i in range(8)]
    client.put(sent)
    first = client.get_batch(4, 0)
    client = h.restart()  # the rest now come from the segment files
    rest = client.get_batch(8, 0, redeliver_unacked=True)
    got = {t.trajectory_id: t for t in first.trajectories + rest.trajectories}
    assert len(rest.trajectories) == 8  # 4 unacked before the restart + 4 never delivered
    for t in sent:
        assert_same(t, got[t.trajectory_id])


def test_put_batch_unary(harness, token, make_traj, to_proto):
    h, client = harness()
    bad = to_proto(make_traj("bad", "b"))
    bad.behavior_logprobs = b""
    request = pb2.PutBatchRequest(trajectories=[to_proto(make_traj("ok", "a")), bad])
    channel = grpc.insecure_channel(f"127.0.0.1:{h.port}")
    put_batch = channel.unary_unary("/satjax.queue.v1.TrajectoryQueue/PutBatch",
                                    request_serializer=pb2.PutBatchRequest.SerializeToString,
                                    response_deserializer=pb2.PutReply.FromString)
    reply = put_batch(request, metadata=(("authorization", f"Bearer {token}"),))
    channel.close()
    assert list(reply.accepted_ids) == ["ok"]
    assert [(r.index, r.field) for r in reply.rejections] == [(1, "behavior_logprobs")]
    assert ids(client.get_batch(1, 0)) == ["ok"]


def test_stop_wakes_a_waiting_get_batch_with_unavailable(harness):
    h, client = harness()
    errors = []

    def wait():
        try:
            client.get_batch(2, 0, timeout=20)
        except Exception as e:  # noqa: BLE001 - recorded for the assertion
            errors.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    h.server.stop(grace=10)
    waiter.join(10)
    assert not waiter.is_alive() and time.monotonic() - t0 < 5  # not after the grace
    assert len(errors) == 1 and isinstance(errors[0], QueueUnavailableError)
    h.server = None


def test_client_streams_when_a_batch_exceeds_one_message(harness, make_traj, to_proto):
    h, _ = harness()
    client = h.client(max_message_mb=0.01)  # 10 KiB: 60 small trajectories need a stream
    trajs = [make_traj(f"s{i}", f"s{i}", seed=i) for i in range(60)]
    bad = to_proto(trajs[30])
    bad.behavior_logprobs = np.full(5, 1.0, np.float32).tobytes()
    sent = trajs[:30] + [bad] + trajs[31:]
    assert sum(len(to_proto(t).SerializeToString()) for t in trajs) > 10 * 1024
    result = client.put(sent)
    assert [(r.index, r.field) for r in result.rejected] == [(30, "behavior_logprobs")]
    assert len(result.accepted) == 59


def test_cli_defaults_come_from_the_config_schema():
    from satjax import config
    from satjax.queue.server import build_parser

    args = build_parser().parse_args(["--data-dir", "q"])
    assert args.fsync == config.QueueConfig().fsync
    assert args.max_lag_default == config.TrainConfig().max_lag
    assert QueueSettings().fsync == args.fsync  # the library and the CLI agree
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--data-dir", "q", "--fsync", "sometimes"])
