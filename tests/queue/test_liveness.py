"""No client may stall the queue: Put streams that send nothing, GetBatch calls whose
callers gave up, and many of both at once leave a well-behaved worker's calls fast, and a
call whose caller is gone is handed nothing."""

from __future__ import annotations

import concurrent.futures
import socket
import statistics
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from queue_testlib import TOKEN, make_traj

from satjax.queue._proto import SERVICE, pb2
from satjax.queue.client import QueueClient, QueueError, QueueTimeoutError, RetryPolicy
from satjax.queue.codec import encode
from satjax.queue.core import TrajectoryQueue
from satjax.queue.server import IdleStreams, QueueService

METADATA = (("authorization", f"Bearer {TOKEN}"),)


class BadClients:
    """Misbehaving clients, each on its own channel: Put streams opened with the token that
    never send a message, and GetBatch calls that wait an hour for callers that give up
    after ``give_up_s``. ``close`` ends every one of them (and their channels)."""

    def __init__(self, port: int):
        self.address = f"127.0.0.1:{port}"
        self.release = threading.Event()
        self.channels: list[grpc.Channel] = []
        self.calls: list[grpc.Future] = []

    def _channel(self) -> grpc.Channel:
        channel = grpc.insecure_channel(self.address)
        self.channels.append(channel)
        return channel

    def silent_puts(self, count: int) -> None:
        def never() -> Iterator[bytes]:
            self.release.wait()
            return
            yield  # a generator that yields nothing, once released

        for _ in range(count):
            put = self._channel().stream_unary(f"/{SERVICE}/Put")
            self.calls.append(put.future(never(), metadata=METADATA, timeout=600))

    def abandoned_gets(self, count: int, consumer_id: str, give_up_s: float = 1.5,
                       n: int = 2) -> None:
        request = pb2.GetBatchRequest(n=n, trainer_version=0, timeout_s=3600,
                                      consumer_id=consumer_id).SerializeToString()
        for _ in range(count):
            get = self._channel().unary_unary(f"/{SERVICE}/GetBatch")
            self.calls.append(get.future(request, metadata=METADATA, timeout=give_up_s))

    def close(self) -> None:
        self.release.set()
        for call in self.calls:
            call.cancel()
        for channel in self.channels:
            channel.close()


@pytest.fixture
def bad_clients():
    made: list[BadClients] = []

    def make(port: int) -> BadClients:
        made.append(BadClients(port))
        return made[-1]

    yield make
    for b in made:
        b.close()


def test_put_streams_that_send_nothing_do_not_stall_puts_or_stats(harness, bad_clients,
                                                                    make_group):
    """20 Put streams that never send a message: a worker's put and a Stats still answer
    at once (they used to wait for a server thread until their 10 s deadline), and the
    silent streams are cut once idle for the server's stream_idle_s."""
    h, client = harness(stream_idle_s=2.0)
    bad = bad_clients(h.port)
    bad.silent_puts(20)
    time.sleep(0.5)  # the streams are open on the server
    t0 = time.monotonic()
    assert client.put(make_group("g", 2)).accepted == ["g-0", "g-1"]
    assert client.stats()["pending"] == 2
    assert time.monotonic() - t0 < 2.0
    for call in bad.calls:  # cut by the server, not by their own 600 s deadline
        with pytest.raises(grpc.RpcError) as e:
            call.result(timeout=10)
        assert e.value.code() == grpc.StatusCode.CANCELLED


def test_get_batch_calls_whose_callers_gave_up_do_not_keep_server_threads(
        harness, bad_clients, make_group):
    """20 GetBatch calls with timeout_s 3600 whose callers gave up after 1.5 s: the server
    ends them then, and a worker's next put answers at once (it used to time out). With
    16 threads, as the server used to have: the calls must have ended, not merely found
    threads to spare."""
    h, client = harness(max_workers=16)
    bad = bad_clients(h.port)
    bad.abandoned_gets(20, client.consumer_id)
    time.sleep(2.0)  # every caller has given up
    t0 = time.monotonic()
    assert client.put(make_group("g", 2)).accepted == ["g-0", "g-1"]
    assert time.monotonic() - t0 < 2.0


def test_a_waiting_get_batch_ends_within_a_slice_of_its_caller_giving_up(harness, bad_clients):
    """The one call a consumer may have waiting ends too once its caller is gone: on a
    server of one thread, a Stats gets that thread 0.6 s after the caller gave up."""
    h, client = harness(max_workers=1)
    bad = bad_clients(h.port)
    bad.abandoned_gets(1, client.consumer_id, give_up_s=1.0)
    time.sleep(1.6)
    assert client.stats()["delivered_unacked"] == 0


def test_a_get_batch_whose_caller_is_gone_takes_nothing(harness, bad_clients, make_group):
    """A GetBatch abandoned by its caller must not take the next group: the consumer's
    live call gets it (it used to go to the dead call: delivered_unacked 8, the live call
    empty)."""
    h, client = harness()
    bad = bad_clients(h.port)
    bad.abandoned_gets(1, client.consumer_id, give_up_s=1.0, n=8)
    time.sleep(1.5)  # its caller has given up
    client.put(make_group("g", 8))
    time.sleep(0.3)
    assert client.stats()["delivered_unacked"] == 0
    assert len(client.get_batch(8, 0, timeout=5).trajectories) == 8
    assert client.stats()["delivered_unacked"] == 8


def test_a_batch_read_for_a_caller_that_left_meanwhile_is_pending_again(tmp_path, make_group):
    """The caller may leave after the last check before delivery, while its batch is read:
    the server finds it gone before replying and makes the batch pending again."""
    queue = TrajectoryQueue(tmp_path / "q")
    streams = IdleStreams(30.0)
    try:
        queue.put([queue.parse(encode(t)) for t in make_group("g", 2)])
        answers = iter([True, False])  # alive at delivery, gone when the reply is due

        class Context:
            def is_active(self) -> bool:
                return next(answers)

        request = pb2.GetBatchRequest(n=2, trainer_version=0, consumer_id="c")
        assert QueueService(queue, streams).get_batch(request, Context()).cursor
        assert queue.stats()["delivered_unacked"] == 0 and queue.stats()["pending"] == 2
    finally:
        streams.close()
        queue.close()


def test_a_waiting_get_batch_gives_way_to_a_newer_call_of_its_consumer(harness, make_group):
    """The server cannot always see that a caller is gone (a peer that vanished without
    closing its connection): a consumer's newer GetBatch ends its older waiting one empty,
    so the group goes to the call that is still listening."""
    h, client = harness()
    old: list = []
    t = threading.Thread(target=lambda: old.append(client.get_batch(2, 0, timeout=30)))
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    newer = h.client(consumer_id=client.consumer_id)
    getter = threading.Thread(target=lambda: old.append(newer.get_batch(2, 0, timeout=10)))
    getter.start()
    t.join(timeout=5)
    assert old and old[0].cursor == 0 and time.monotonic() - t0 < 3  # ended empty, early
    client.put(make_group("g", 2))
    getter.join(timeout=15)
    assert len(old[1].trajectories) == 2


def _cycle(client, make_group, i: int) -> float:
    """One well-behaved worker put of a group plus the trainer's GetBatch of it, in s."""
    t0 = time.perf_counter()
    client.put(make_group(f"w{i}", 2))
    got = client.get_batch(2, 0, timeout=10)
    assert len(got.trajectories) == 2
    client.ack(got.cursor)
    return time.perf_counter() - t0


def test_fifty_silent_and_abandoned_clients_leave_a_worker_as_fast_as_an_idle_server(
        harness, bad_clients, make_group):
    """Load test: 30 silent Put streams and 20 abandoned hour-long GetBatch calls (of the
    worker's own consumer) against one server, an idle twin beside it; the well-behaved
    put + GetBatch cycle, sampled alternately on both, is within 2x of the idle one's."""
    h_idle, idle = harness()
    h_busy, busy = harness(stream_idle_s=60.0)  # the silent streams stay for the test
    bad = bad_clients(h_busy.port)
    bad.silent_puts(30)
    bad.abandoned_gets(20, busy.consumer_id, give_up_s=1.0)
    time.sleep(1.5)
    for i in range(3):  # warm both
        _cycle(idle, make_group, -i - 1)
        _cycle(busy, make_group, -i - 1)
    idle_s, busy_s = [], []
    for i in range(30):
        idle_s.append(_cycle(idle, make_group, i))
        busy_s.append(_cycle(busy, make_group, i))
    idle_med, busy_med = statistics.median(idle_s), statistics.median(busy_s)
    assert busy_med <= 2 * idle_med, (busy_med, idle_med)
    assert h_busy.server.queue is not None
    assert h_busy.server.queue.stats()["delivered_unacked"] == 0


def test_stream_idle_deadline_spares_a_stream_that_keeps_sending(harness, make_group):
    """Only silence is cut: a Put stream whose items come slower than nothing at all but
    within stream_idle_s of each other is stored whole."""
    h, client = harness(stream_idle_s=1.0)
    channel = grpc.insecure_channel(f"127.0.0.1:{h.port}")
    put = channel.stream_unary(f"/{SERVICE}/Put", response_deserializer=pb2.PutReply.FromString)

    def slow() -> Iterator[bytes]:
        for t in make_group("s", 4):
            time.sleep(0.5)
            yield encode(t)

    try:
        reply = put(slow(), metadata=METADATA, timeout=30)
    finally:
        channel.close()
    assert len(reply.accepted_ids) == 4


def test_a_call_beyond_the_servers_threads_is_refused_at_once_and_retried(
        harness, bad_clients, make_group):
    """Calls beyond the server's threads are refused at once (not queued behind the held
    ones); the client retries them, and its put lands once the silent streams are cut."""
    h, _ = harness(max_workers=2, stream_idle_s=1.0)
    bad = bad_clients(h.port)
    bad.silent_puts(2)
    time.sleep(0.3)
    with pytest.raises(QueueError, match="RESOURCE_EXHAUSTED"):
        h.client().stats()  # retries=0: refused, at once
    with QueueClient(f"127.0.0.1:{h.port}", token=TOKEN,
                     retry=RetryPolicy(retries=8, deadline_s=5)) as patient:
        assert patient.put(make_group("g", 2)).accepted == ["g-0", "g-1"]


class SilentServer:
    """A TCP server on 127.0.0.1 that accepts every connection and never sends a byte: a
    queue host whose process is stopped (SIGSTOP, a wedged event loop) still looks so."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def test_a_queue_that_accepts_and_never_answers_fails_each_call_within_its_deadlines(caplog):
    """Every call (a worker's put and should_pause, the trainer's ack and stats) ends
    within tries x deadline_s plus the backoff, as QueueTimeoutError, with one log line per
    retry; a GetBatch after its one try (not retried past its deadline). Before, a put to
    such a server never returned."""
    server = SilentServer()
    policy = RetryPolicy(retries=2, backoff_s=0.05, deadline_s=0.5)
    calls = {"put": lambda c: c.put([make_traj("t", "g", group_size=1)]),
             "should_pause": lambda c: c.should_pause(0),
             "ack": lambda c: c.ack(1),
             "stats": lambda c: c.stats(),
             "get_batch": lambda c: c.get_batch(1, 0)}
    try:
        with QueueClient(f"127.0.0.1:{server.port}", token=TOKEN, retry=policy) as client, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            for name, call in calls.items():
                retried = policy.retries if name != "get_batch" else 0
                budget = (retried + 1) * policy.deadline_s + 0.05 * (2 ** retried - 1)
                caplog.clear()
                t0 = time.monotonic()
                future = pool.submit(call, client)
                # bounded: a call without a deadline would hang the test, not fail it
                with pytest.raises(QueueTimeoutError, match=f"{name} on .*DEADLINE_EXCEEDED"):
                    future.result(timeout=budget + 10)
                took = time.monotonic() - t0
                assert budget - 0.1 <= took < budget + 1.5, (name, took)
                retries = [r.getMessage() for r in caplog.records
                           if r.name == "satjax.queue.client"]
                assert len(retries) == retried, (name, retries)
                assert all(f"{name} failed (DEADLINE_EXCEEDED" in m for m in retries), retries
    finally:
        server.close()
