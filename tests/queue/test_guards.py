"""What callers can do to the queue: poisoned input, unauthenticated floods, a second
consumer, out-of-order acks, misused flags."""

import dataclasses
import threading
import time

import grpc
import numpy as np
import pytest
from queue_testlib import one_line, stop

from satjax.queue._proto import SERVICE, pb2
from satjax.queue.client import NO_RETRY, QueueClient, QueueLeaseError
from satjax.queue.codec import PUT_BATCH_TRAJECTORIES, encode, join_messages
from satjax.queue.core import QueueSettings
from satjax.queue.validation import Limits, validate
from satjax.utils import free_port

LIMITS = ("--vocab-size", "1000", "--num-experts", "8", "--moe-layers", "2", "--top-k", "2",
          "--max-seq-len", "30", "--group-size", "2", "--max-version", "1000",
          "--require-record", "routed_experts", "--refuse-record", "router_logits")


def cpu_seconds(pid: int) -> float:
    import os
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- validation that knows the model -----------------------------------------------------
def _poisons(make_traj):
    def traj(tid, **kw):
        return make_traj(tid, tid, group_size=2, **kw)

    def with_token(t, value):
        t.response_tokens = t.response_tokens.copy()
        t.response_tokens[0] = value
        return t

    def with_versions(t, values):
        t.token_versions = np.array(values, np.int32)
        return t

    def with_expert(t, value):
        t.routed_experts = t.routed_experts.copy()
        t.routed_experts[0, 0, 0] = value
        return t

    return {  # name -> (trajectory, field named by the rejection)
        "token id >= vocab": (with_token(traj("tok"), 1000), "response_tokens"),
        "expert id >= experts": (with_expert(traj("exp"), 8), "routed_experts"),
        "wrong layer count": (traj("lay", layers=3), "routed_experts"),
        "wrong top-k": (traj("topk", k=1), "routed_experts"),
        "over max_seq_len": (traj("long", p=20, n=11), "response_tokens"),
        "wrong group size": (make_traj("gs", "gs", group_size=4), "group_size"),
        "reward inf in float32": (dataclasses.replace(traj("rew"), reward=1e308), "reward"),
        "detail inf in float32": (dataclasses.replace(traj("det"),
                                                      reward_details={"x": -1e39}),
                                  "reward_details"),
        "negative version": (dataclasses.replace(traj("neg"), policy_version=-1),
                             "policy_version"),
        "version over --max-version": (traj("new", version=1001), "policy_version"),
        "token version over --max-version": (with_versions(traj("tv"), [0, 0, 4, 1001, 2**30]),
                                             "token_versions"),
        "no routes (--require-record)": (traj("bare", routes=False), "routed_experts"),
        "logits (--refuse-record)": (traj("logits", logits=True), "router_logits"),
    }


def test_every_poison_value_is_refused_by_a_server_with_model_limits(
        tmp_path, token, make_traj, start_server):
    port = free_port()
    server = start_server(tmp_path / "q", port, *LIMITS)
    poisons = _poisons(make_traj)
    try:
        with QueueClient(f"127.0.0.1:{port}", token=token, retry=NO_RETRY) as c:
            good = [make_traj(f"ok-{i}", "ok", group_size=2, seed=i) for i in range(2)]
            result = c.put(good + [t for t, _ in poisons.values()])
            assert sorted(result.accepted) == ["ok-0", "ok-1"]
            got = {r.index - 2: r for r in result.rejected}
            for i, (name, (_, field)) in enumerate(poisons.items()):
                assert got[i].field == field, (name, got[i])
                assert got[i].message.startswith(field), (name, got[i].message)
            assert len(c.get_batch(2, 0).trajectories) == 2  # the good group is unharmed
    finally:
        stop(server)


def test_versions_are_64_bit_end_to_end(tmp_path, token, make_group, start_server):
    port, big = free_port(), 2**31 + 5
    server = start_server(tmp_path / "q", port)
    try:
        with QueueClient(f"127.0.0.1:{port}", token=token, retry=NO_RETRY) as c:
            c.put(make_group("old", 2, version=0))
            c.put(make_group("new", 2, version=big))  # before any trainer: not "future"
            batch = c.get_batch(4, 0, max_lag=0)
            assert sorted(t.policy_version for t in batch.trajectories) == [0, 0, big, big]
            c.ack(batch.cursor)
            assert c.get_batch(2, big, max_lag=10, allow_partial=True).cursor == 0
            assert c.put(make_group("next", 2, version=big)).ok  # not from the future now
            got = c.get_batch(2, big, max_lag=10).trajectories
            assert [t.policy_version for t in got] == [big, big]
            c.put(make_group("last", 2, version=big + 1))
        stop(server)
        server = start_server(tmp_path / "q", port)  # the trainer version survives too
        with QueueClient(f"127.0.0.1:{port}", token=token, retry=NO_RETRY) as c:
            assert c.stats()["trainer_version"] == big
            assert len(c.get_batch(2, big, max_lag=10).trajectories) == 2
    finally:
        stop(server)


def test_token_versions_from_the_future_are_refused(harness, make_traj):
    """Once the trainer has asked at version 3, a record whose oldest token is version 3
    but whose later tokens claim 1000 and 2^30 is refused (it used to be stored and
    delivered); token versions up to the trainer's next one are accepted."""
    h, client = harness()
    client.get_batch(1, 3)  # the trainer asks at version 3
    forged = make_traj("forged", "forged", version=3)
    forged.token_versions = np.array([3, 3, 4, 1000, 2**30], np.int32)
    fine = make_traj("fine", "fine", version=3)
    fine.token_versions = np.array([3, 3, 4, 4, 4], np.int32)
    result = client.put([forged, fine])
    assert result.accepted == ["fine"]
    assert [(r.trajectory_id, r.field) for r in result.rejected] == [
        ("forged", "token_versions")]
    assert "must be <= 4" in result.rejected[0].message
    assert client.stats()["pending"] == 1


def test_a_group_carries_one_router_record(harness, make_traj, make_group):
    """A member without the routes (gates, logits) its group's others carry is refused,
    in the put that opened the group or a later one: the trainer could batch only part of
    such a group, and would stop on it at every delivery (also after --resume)."""
    h, client = harness()

    def member(group, i, **kw):
        return make_traj(f"{group}-{i}", group, group_size=3, seed=i, **kw)

    result = client.put([member("a", 0), member("a", 1, routes=False), member("a", 2)])
    assert result.accepted == ["a-0", "a-2"]
    assert result.rejected[0].field == "routed_experts"
    assert "must be present like in the rest of group 'a'" in result.rejected[0].message
    # against members stored by an earlier put, and for each optional field
    client.put([member("b", 0, routes=False), member("c", 0, gates=True),
                member("d", 0, logits=True)])
    later = client.put([member("b", 1), member("c", 1), member("d", 1),
                        member("a", 3, routes=False)])
    assert [(r.trajectory_id, r.field) for r in later.rejected] == [
        ("b-1", "routed_experts"), ("c-1", "routed_gates"), ("d-1", "router_logits"),
        ("a-3", "routed_experts")]
    client.put([member("a", 1)])  # the group completes with a consistent member
    got = client.get_batch(3, 0).trajectories
    assert sorted(t.trajectory_id for t in got) == ["a-0", "a-1", "a-2"]
    assert all(t.routed_experts is not None for t in got)


def test_group_larger_than_a_message_is_refused_at_put(harness, make_traj, make_group):
    h, client = harness(max_message_mb=1)
    big = make_traj("big", "big", p=100, n=1000, layers=48, k=8, experts=128)  # ~422 KB
    members = [dataclasses.replace(big, trajectory_id=f"big-{i}", group_size=3)
               for i in range(3)]
    result = client.put(members)
    assert result.accepted == ["big-0", "big-1"]
    assert result.rejected[0].field == "group_id"
    assert "max message size" in result.rejected[0].message
    client.put(make_group("small", 2))  # later groups are not held up
    assert sorted(t.trajectory_id for t in client.get_batch(2, 0).trajectories) == [
        "small-0", "small-1"]


# -- cheap refusal -----------------------------------------------------------------------
def test_unauthenticated_24mb_put_is_refused_before_parsing(
        tmp_path, token, make_traj, start_server):
    port = free_port()
    server = start_server(tmp_path / "q", port)
    raw = encode(make_traj("x", "x"), num_experts=8)  # small items: the most parsing per byte
    body = join_messages(PUT_BATCH_TRAJECTORIES, [raw] * (24 * (1 << 20) // len(raw)))
    assert len(body) > 23 << 20
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
        ("grpc.max_send_message_length", 64 << 20)])
    put_batch = channel.unary_unary(f"/{SERVICE}/PutBatch")
    outcome = {}

    def flood():
        try:
            put_batch(body, metadata=(("authorization", "Bearer wrong-token-0123456789"),),
                      timeout=60)
        except grpc.RpcError as e:
            outcome["code"] = e.code()

    try:
        with QueueClient(f"127.0.0.1:{port}", token=token, retry=NO_RETRY) as c:
            c.stats()
            before = cpu_seconds(server.pid)
            t = threading.Thread(target=flood)
            t.start()
            worst = 0.0
            while t.is_alive():
                t0 = time.monotonic()
                c.stats()
                worst = max(worst, time.monotonic() - t0)
            t.join()
            spent = cpu_seconds(server.pid) - before
        assert outcome["code"] == grpc.StatusCode.UNAUTHENTICATED
        assert spent < 1.0, f"the refusal cost {spent:.2f} s of server CPU"
        assert worst < 1.0, f"an authenticated Stats waited {worst:.2f} s"
    finally:
        channel.close()
        stop(server)


@pytest.mark.parametrize("flags, expected", [
    (("--token", "short"), "token: must be at least 16 characters"),
    (("--token", " " * 20), "token: must be at least 16 characters"),
    (("--host", "0.0.0.0"), "host: a non-loopback address needs TLS"),
    (("--tls-cert", "cert.pem"), "tls_cert/tls_key: must give both"),
    (("--tls-cert", "missing.pem", "--tls-key", "missing.pem"), "tls_cert: must be a readable"),
    (("--tls-cert", "junk.pem", "--tls-key", "junk.pem"), "tls_cert: must be a PEM file"),
    (("--group-size", "0"), "group_size: must be >= 1"),
    (("--token-file", "missing.txt"), "token_file: must be a readable file"),
])
def test_misused_flags_end_in_one_line(tmp_path, serve_queue_refusal, flags, expected,
                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "junk.pem").write_text("not a certificate")
    r = serve_queue_refusal(tmp_path / "q", *flags)
    assert r.returncode == 2
    assert expected in one_line(r.stderr)


# -- one consumer at a time ----------------------------------------------------------------
def test_second_consumer_is_refused_until_it_takes_over(harness, make_group):
    h, first = harness()
    for name in "abc":
        first.put(make_group(name, 2))
    held = first.get_batch(2, 0)
    second = h.client()
    with pytest.raises(QueueLeaseError, match=first.consumer_id):
        second.get_batch(2, 0)
    with pytest.raises(QueueLeaseError):
        second.get_batch(2, 0, redeliver_unacked=True)
    assert first.stats()["delivered_unacked"] == 2  # the first one's batch is untouched
    with pytest.raises(QueueLeaseError):
        second.ack(held.cursor)
    took = second.get_batch(4, 0, take_over=True)
    assert sorted(t.trajectory_id for t in took.trajectories) == ["a-0", "a-1", "b-0", "b-1"]
    with pytest.raises(QueueLeaseError, match=second.consumer_id):
        first.ack(held.cursor)  # fenced: it cannot ack what the newcomer now owns
    assert second.ack(took.cursor) == 4


def test_an_idle_lease_expires(harness, make_group):
    h, first = harness(settings=QueueSettings(consumer_lease_s=0.3))
    first.put(make_group("a", 2))
    first.get_batch(2, 0)
    time.sleep(0.5)
    successor = h.client()
    again = successor.get_batch(2, 0)  # no take-over needed: the holder went quiet
    assert len(again.trajectories) == 2 and successor.ack(again.cursor) == 2


# -- exact acknowledgement -----------------------------------------------------------------
def test_ack_of_the_last_cursor_covers_batches_after_out_of_order_groups(
        harness, make_group):
    h, client = harness()
    a, b = make_group("a", 2), make_group("b", 2)
    client.put(a[:1])   # seq 1: group a waits for its second member
    client.put(b)       # seqs 2, 3
    client.put(a[1:])   # seq 4: group a completes late but is oldest
    first = client.get_batch(2, 0)
    second = client.get_batch(2, 0)
    assert [t.group_id for t in first.trajectories + second.trajectories] == list("aabb")
    assert second.cursor > first.cursor
    assert client.ack(second.cursor) == 4  # both batches, though `a` holds seq 4 > 3
    client = h.restart()
    assert client.get_batch(2, 0, allow_partial=True, redeliver_unacked=True).trajectories == []
    np.testing.assert_equal(client.stats()["watermark"], 4)


def test_a_record_with_fields_this_queue_does_not_know_is_refused_naming_them(harness,
                                                                               make_traj):
    """A newer worker's record, otherwise valid for the run's queue (its router record
    complete), with a field this build does not know at the top or inside its gates: refused
    at put naming the fields and the upgrade order, never stored or delivered (protobuf
    would have kept them unseen). The same rule on a protobuf message."""
    limits = Limits(vocab_size=1000, num_experts=8, moe_layers=2, top_k=2, group_size=2,
                    required=("routed_experts", "routed_gates"), refused=("router_logits",))
    h, client = harness(settings=QueueSettings(limits=limits))

    def member(group, i):
        return encode(make_traj(f"{group}-{i}", group, group_size=2, gates=True, seed=i))

    newer_top = member("n", 0) + bytes([0x98, 0x06, 1])  # key 99 << 3 (a varint), then 1
    msg = pb2.Trajectory.FromString(member("n", 1))
    msg.routed_gates.MergeFromString(bytes([9 << 3 | 0, 1]))  # field 9 of RoutedGates
    newer_gates = msg.SerializeToString()
    result = client.put([member("ok", 0), newer_top, newer_gates, member("ok", 1)])
    assert result.accepted == ["ok-0", "ok-1"]
    assert [(r.trajectory_id, r.field) for r in result.rejected] == [
        ("n-0", "unknown fields"), ("n-1", "unknown fields")]
    assert "field(s) 99 unknown to this queue" in result.rejected[0].message
    assert "field(s) routed_gates.9 unknown" in result.rejected[1].message
    assert "upgrade the queue (and the trainer) before the workers" in result.rejected[0].message
    got = client.get_batch(2, 0)
    assert sorted(t.trajectory_id for t in got.trajectories) == ["ok-0", "ok-1"]
    client.ack(got.cursor)
    assert client.stats()["pending"] == 0
    bad = validate(pb2.Trajectory.FromString(newer_top), limits)
    assert bad is not None and bad.field == "unknown fields" and "99" in bad.message
    assert validate(pb2.Trajectory.FromString(member("ok", 2)), limits) is None
