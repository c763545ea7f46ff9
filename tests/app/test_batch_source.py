"""``BatchSource`` against a real queue server (in this process, loopback): the next batch
is fetched and prepared while the step runs, at the version it is trained at, and a batch
fetched but never trained on is delivered again to the next trainer. The step is a sleep:
the devices busy, the host free, as while a jitted step runs."""

import collections
import ctypes
import dataclasses
import platform
import threading
import time
import weakref

import numpy as np
import pytest

from satjax.app import batch_source
from satjax.app.batch_source import BatchSource
from satjax.app.multihost import Peers
from satjax.queue.client import QueueClient, QueueLeaseError
from satjax.queue.core import QueueSettings
from satjax.queue.server import QueueServer
from satjax.trajectory import Trajectory

TOKEN = "batch-source-test-token-0123456789"
GROUP = 4
STEP_S = 1.0  # the fake step


def _group(gid: str, version: int = 0) -> list[Trajectory]:
    rng = np.random.default_rng(abs(hash(gid)) % 1000)
    return [Trajectory(
        trajectory_id=f"{gid}-{i}", group_id=gid, prompt_id=f"p-{gid}",
        prompt_tokens=rng.integers(3, 40, 5, dtype=np.int32),
        response_tokens=rng.integers(3, 40, 4, dtype=np.int32),
        behavior_logprobs=-rng.random(4, dtype=np.float32), policy_version=version,
        reward=float(i % 2), group_size=GROUP) for i in range(GROUP)]


def _groups(trajectories: list[Trajectory]) -> list[str]:
    return sorted({t.group_id for t in trajectories})


def _lags(reply, version: int) -> dict[int, int]:
    """Lag -> count of a delivered batch trained at ``version`` (as the trainer logs it)."""
    return dict(collections.Counter(version - t.policy_version for t in reply.trajectories))


def _never() -> bool:
    return False


@pytest.fixture
def queue(tmp_path):
    server = QueueServer(tmp_path / "q", TOKEN)
    port = server.start(0)
    clients: list[QueueClient] = []

    def client() -> QueueClient:  # each its own consumer id, as each trainer start
        clients.append(QueueClient(f"127.0.0.1:{port}", token=TOKEN))
        return clients[-1]

    yield client
    for c in clients:
        c.close()
    server.stop(1.0)


class Prepared:
    """A prepare function that records what it made, when, and on which thread."""

    def __init__(self) -> None:
        self.made: list[tuple[list[str], float, bool]] = []

    def __call__(self, trajectories: list[Trajectory]) -> list[str]:
        groups = _groups(trajectories)
        self.made.append((groups, time.monotonic(),
                          threading.current_thread() is threading.main_thread()))
        return groups


def _wait_delivered(client: QueueClient, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while client.stats()["delivered_unacked"] < n:
        assert time.monotonic() < deadline, client.stats()
        time.sleep(0.02)


def test_the_next_batch_is_fetched_and_prepared_while_the_step_runs(queue):
    client = queue()
    client.put(_group("A") + _group("B") + _group("C"), strict=True)
    prepare = Prepared()
    source = BatchSource(Peers(), client, rows=GROUP, max_lag=5, prepare=prepare)
    try:
        first = source.next(0, _never)
        assert first is not None and first.batch == ["A"]
        source.prefetch(1)
        start = time.monotonic()
        time.sleep(STEP_S)  # step 1
        end = time.monotonic()
        second = source.next(1, _never)
        assert second is not None and second.batch == ["B"]
        groups, made_at, on_main = prepare.made[1]
        assert groups == ["B"] and not on_main
        assert start <= made_at < end  # fetched and prepared during step 1
        # the prefetched batch is a delivery like any other: its cursor comes after step 1's
        assert second.reply is not None and first.reply is not None
        assert second.reply.cursor > first.reply.cursor

        # the loop without prefetch: the batch is fetched when asked, after the step
        time.sleep(STEP_S)  # step 2
        end = time.monotonic()
        third = source.next(2, _never)
        assert third is not None and third.batch == ["C"] and prepare.made[2][1] >= end
    finally:
        source.close()


def test_the_prefetched_batch_is_asked_at_the_version_it_is_trained_at(queue):
    """max_lag 0: while step 1 (version 0) runs, the batch of step 2 is fetched for version
    1, so B (sampled by version 0) is dropped as stale for it and C (version 1) delivered,
    with lag 0, as when the batch is fetched after the step."""
    client = queue()
    client.put(_group("A", 0) + _group("B", 0) + _group("C", 1), strict=True)
    source = BatchSource(Peers(), client, rows=GROUP, max_lag=0, prepare=_groups)
    try:
        first = source.next(0, _never)
        assert first is not None and first.batch == ["A"]
        assert first.reply is not None and _lags(first.reply, 0) == {0: GROUP}
        source.prefetch(1)
        second = source.next(1, _never)
        assert second is not None and second.batch == ["C"]
        assert second.reply is not None
        assert _lags(second.reply, 1) == {0: GROUP} and second.reply.dropped_stale == GROUP
        with pytest.raises(RuntimeError, match="version 3"):  # the loop's version is checked
            source.prefetch(2)
            source.next(3, _never)
    finally:
        source.close()


def test_a_batch_fetched_but_not_trained_is_delivered_again_to_the_next_trainer(queue):
    """Stop after step 1 with step 2's batch prefetched: the checkpoint's ack covers step 1
    only, and the resumed trainer (a new consumer taking over) trains B then C, the same
    sequence as a run that never stopped."""
    client = queue()
    client.put(_group("A") + _group("B") + _group("C"), strict=True)
    source = BatchSource(Peers(), client, rows=GROUP, max_lag=5, prepare=_groups)
    first = source.next(0, _never)
    assert first is not None and first.reply is not None
    source.prefetch(1)
    _wait_delivered(client, 2 * GROUP)  # B is fetched while step 1 "runs"
    assert source.next(1, lambda: True) is None  # stop requested: B is not trained on
    client.ack(first.reply.cursor)  # the checkpoint of step 1
    source.close()
    assert client.stats()["delivered_unacked"] == GROUP

    resumed = BatchSource(Peers(), queue(), rows=GROUP, max_lag=5, prepare=_groups,
                          take_over=True)
    try:
        got = [resumed.next(v, _never) for v in (1, 2)]
        assert [d.batch for d in got if d is not None] == [["B"], ["C"]]
    finally:
        resumed.close()
    with pytest.raises(QueueLeaseError):  # the stopped trainer was fenced
        client.get_batch(GROUP, trainer_version=1, max_lag=5)


def test_stop_and_close_do_not_wait_for_the_data(queue, monkeypatch):
    """Nothing in the queue: a stop request ends next() within a wake-up, not a poll, and
    close() ends the fetch in flight within one GetBatch call."""
    monkeypatch.setattr(batch_source, "CALL_S", 0.5)
    client = queue()
    source = BatchSource(Peers(), client, rows=GROUP, max_lag=5, prepare=_groups,
                         poll_s=30.0)
    t0 = time.monotonic()
    assert source.next(0, lambda: time.monotonic() - t0 > 0.5) is None
    assert time.monotonic() - t0 < 3.0
    t0 = time.monotonic()
    source.close()
    assert time.monotonic() - t0 < 3.0
    assert not any(t.name.startswith("batch-fetch") for t in threading.enumerate())


def test_a_queue_error_in_the_fetch_thread_is_raised_by_next(queue):
    holder = queue()
    holder.get_batch(GROUP, trainer_version=0, max_lag=5)  # another trainer holds the queue
    source = BatchSource(Peers(), queue(), rows=GROUP, max_lag=5, prepare=_groups)
    try:
        with pytest.raises(QueueLeaseError):
            source.next(0, _never)
    finally:
        source.close()


def test_a_batch_larger_than_one_call_is_fetched_in_whole_groups(queue):
    client = queue()
    client.put(_group("A", 0) + _group("B", 0) + _group("C", 1), strict=True)
    source = BatchSource(Peers(), client, rows=2 * GROUP, max_lag=5, prepare=_groups,
                         rows_per_call=GROUP)
    try:
        got = source.next(1, _never)
        assert got is not None and got.batch == ["A", "B"] and got.reply is not None
        assert _lags(got.reply, 1) == {1: 2 * GROUP}
        assert client.ack(got.reply.cursor) == 2 * GROUP  # one cursor covers both calls
    finally:
        source.close()


def test_a_batch_over_one_message_is_fetched_in_halves_told_the_whole_batch(tmp_path):
    """The paper's batch (2 GB) is over gRPC's 64 MiB: with no size configured, a GetBatch
    refused as too large is asked again for half as many groups until it fits; each call
    tells the queue the whole batch, so ShouldPause predicts lags in whole batches."""
    server = QueueServer(tmp_path / "q", TOKEN, max_message_mb=0.03)  # two groups fit
    port = server.start(0)
    client = QueueClient(f"127.0.0.1:{port}", token=TOKEN)

    def group(gid: str) -> list[Trajectory]:  # ~3.3 KB per trajectory, ~13 KB per group
        return [dataclasses.replace(t, response_tokens=np.full(400, 7, np.int32),
                                    behavior_logprobs=np.full(400, -0.5, np.float32))
                for t in _group(gid)]

    for gid in "ABCD":
        client.put(group(gid), strict=True)
    source = BatchSource(Peers(), client, rows=4 * GROUP, max_lag=5, prepare=_groups,
                         group_size=GROUP)
    try:
        got = source.next(1, _never)
        assert got is not None and got.batch == ["A", "B", "C", "D"]
        assert source.rows_per_call == 2 * GROUP
        assert got.reply is not None and client.ack(got.reply.cursor) == 4 * GROUP
        for gid in "EFGH":
            client.put(group(gid), strict=True)
        # trainer at 1, not waiting: the next batch is trained at 2, and the 16 fresh
        # trajectories are one whole batch more (they would be two of the 8-row calls)
        assert client.should_pause(0).predicted_lag == 2 + 1
    finally:
        source.close()
        client.close()
        server.stop(1.0)
def _uniform(gid: str, reward: float = 1.0) -> list[Trajectory]:
    """A group whose members all have the same reward (zero advantages)."""
    return [dataclasses.replace(t, reward=reward) for t in _group(gid)]


def test_dynamic_sampling_drops_uniform_groups_and_tops_up(queue):
    client = queue()
    client.put(_uniform("A") + _group("B") + _uniform("C", 0.0) + _uniform("D")
               + _group("E") + _group("F"), strict=True)
    source = BatchSource(Peers(), client, rows=2 * GROUP, max_lag=5, prepare=_groups,
                         drop_uniform_groups=True, max_fetches=8)
    try:
        got = source.next(0, _never)
        # answers (asked for what is missing): (A, B), (C), (D), (E): B and E are kept
        assert got is not None and got.batch == ["B", "E"]
        assert got.dropped_uniform_groups == 3 and got.fetches == 4
        assert got.reply is not None
        # the dropped groups are acknowledged with the batch, F stays on the queue
        assert client.ack(got.reply.cursor) == 5 * GROUP
        assert client.stats()["pending"] == GROUP
    finally:
        source.close()


def test_dynamic_sampling_gives_up_after_max_fetches(queue):
    client = queue()
    client.put(_group("A") + _uniform("B") + _uniform("C") + _uniform("D"), strict=True)
    source = BatchSource(Peers(), client, rows=2 * GROUP, max_lag=5, prepare=_groups,
                         drop_uniform_groups=True, max_fetches=2)
    try:
        got = source.next(0, _never)  # answers: (A, B), (C): gives up with A alone
        assert got is not None and got.batch == ["A"] and got.fetches == 2
        assert got.dropped_uniform_groups == 2
    finally:
        source.close()


def test_dynamic_sampling_with_only_uniform_groups_trains_on_the_last_ones(queue):
    client = queue()
    client.put(_uniform("E") + _uniform("F"), strict=True)
    source = BatchSource(Peers(), client, rows=GROUP, max_lag=5, prepare=_groups,
                         drop_uniform_groups=True, max_fetches=2)
    try:
        got = source.next(0, _never)
        assert got is not None and got.batch == ["F"] and got.dropped_uniform_groups == 1
    finally:
        source.close()


def test_split_uniform_groups_keeps_order():
    trajs = _group("A") + _uniform("B") + _group("C")
    informative, uniform = batch_source.split_uniform_groups(trajs)
    assert [t.trajectory_id for t in informative] == [t.trajectory_id for t in trajs
                                                       if t.group_id != "B"]
    assert _groups(uniform) == ["B"]


def _rss_bytes() -> int:
    """Resident bytes of this process, after glibc returns the free memory of every malloc
    arena to the kernel (``malloc_trim``): what is measured is what is still allocated, not
    how the gRPC threads' arenas happen to be fragmented (without it the growth of a
    leak-free run varied from 0 to 140 MB between runs)."""
    if platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).malloc_trim(0)
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_fetched_batches_are_freed_once_trained(tmp_path):
    """Twelve 32 MB batches (64 trajectories of ~0.5 MB, the paper's shape) through the
    source, each dropped after its "step": the process grows by about a batch or two (the
    one in hand, the one prefetched), not by a batch per step (as when every fetch ran
    on a fresh thread, whose malloc arena the next one did not reuse). A batch is held by
    no one once the loop drops it."""
    server = QueueServer(tmp_path / "q", TOKEN, settings=QueueSettings(cache_bytes=0))
    port = server.start(0)
    client = QueueClient(f"127.0.0.1:{port}", token=TOKEN, compact_routes=True,
                         max_message_mb=128)
    rng = np.random.default_rng(0)
    template = Trajectory(
        trajectory_id="t", group_id="g", prompt_id="p",
        prompt_tokens=rng.integers(3, 1000, 256, dtype=np.int32),
        response_tokens=rng.integers(3, 1000, 1024, dtype=np.int32),
        behavior_logprobs=-rng.random(1024, dtype=np.float32), policy_version=0, reward=1.0,
        group_size=16, routed_experts=rng.integers(0, 128, (1279, 48, 8), dtype=np.uint8))
    rows, steps = 64, 12
    source = BatchSource(Peers(), client, rows=rows, max_lag=steps, prepare=lambda t: None)
    grown = []
    try:
        for v in range(steps):
            client.put([dataclasses.replace(template, trajectory_id=f"t{v}-{i}",
                                            group_id=f"g{v}-{i // 16}")
                        for i in range(rows)], strict=True)
            if v == 2:
                base = _rss_bytes()
            got = source.next(v, _never)
            assert got is not None and got.reply is not None
            if v + 1 < steps:
                source.prefetch(v + 1)
            client.ack(got.reply.cursor)
            held = weakref.ref(got.trajectories[0])
            del got
            assert held() is None
            if v >= 2:
                grown.append(_rss_bytes() - base)
    finally:
        source.close()
        client.close()
        server.stop(1.0)
    batch = rows * 0.5e6
    assert max(grown) < 3 * batch, [f"{g / 1e6:.0f} MB" for g in grown]


def _with_logits(gid: str) -> list[Trajectory]:
    """A group carrying router logits, as a worker of another run might put."""
    return [dataclasses.replace(t, router_logits=np.zeros((8, 1, 2), np.float16))
            for t in _group(gid)]


@pytest.mark.parametrize("in_thread", [True, False], ids=["fetch-thread", "main-thread"])
def test_a_batch_that_cannot_be_assembled_is_skipped_and_reported(queue, in_thread, caplog):
    """A batch mixing a group with router logits and one without cannot be made: the
    trainer used to stop on it (and on every --resume, the queue delivering it again).
    It is skipped with one log line, the next batch is delivered in its place, and the
    skipped batch's cursor comes with it, to be acknowledged with it."""
    from satjax.train.batch import make_batch

    client = queue()
    client.put(_with_logits("A") + _group("B"))
    source = BatchSource(Peers(), client, rows=2 * GROUP, max_lag=5,
                         prepare=lambda t: make_batch(t, buckets=(16,)))
    source._prepare_in_thread = in_thread  # a multi-process run prepares on the main thread
    try:
        source.prefetch(0)
        _wait_delivered(client, 2 * GROUP)
        client.put(_group("C") + _group("D"))
        delivered = source.next(0, _never)
    finally:
        source.close()
    assert delivered is not None and _groups(delivered.trajectories) == ["C", "D"]
    assert delivered.batch.tokens.shape[0] == 2 * GROUP
    assert len(delivered.skipped) == 1 and 0 < delivered.skipped[0] < delivered.reply.cursor
    skips = [r.getMessage() for r in caplog.records if "skipping the batch" in r.getMessage()]
    assert len(skips) == 1 and "router_logits" in skips[0]
    client.ack(max(delivered.reply.cursor, *delivered.skipped))
    assert client.stats()["delivered_unacked"] == 0 and client.stats()["pending"] == 0
