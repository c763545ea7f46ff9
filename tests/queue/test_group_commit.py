"""Group commit under fsync="always": a put is acknowledged, and its items delivered, only
after the fsync covering its records; concurrent puts share fsyncs; a failed fsync or a
crash before it loses only unacknowledged puts."""

import contextlib
import errno
import os
import subprocess
import sys
import threading
import time

import pytest

from satjax.queue.codec import TrajectoryView, encode
from satjax.queue.core import QueueSettings, TrajectoryQueue
from satjax.queue.store import StorageError


class GatedFsync:
    """Replaces os.fsync: the group-commit thread's calls wait for ``release`` (or fail
    with ``fail``); other threads' (state.json, rolls) go straight through."""

    def __init__(self, monkeypatch):
        self.real, self.calls = os.fsync, 0
        self.gate, self.entered, self.fail = threading.Event(), threading.Event(), False
        self.gate.set()
        monkeypatch.setattr(os, "fsync", self)

    def __call__(self, fd):
        if threading.current_thread().name != "queue-fsync":
            return self.real(fd)
        self.calls += 1
        self.entered.set()
        assert self.gate.wait(30)
        if self.fail:
            raise OSError(errno.EIO, "Input/output error")
        return self.real(fd)

    def hold(self):
        self.entered.clear()
        self.gate.clear()


def open_queue(path, fsync="always"):
    return TrajectoryQueue(path, QueueSettings(fsync=fsync))


@contextlib.contextmanager
def gated_queue(path, monkeypatch, fsync="always"):
    """(GatedFsync, queue at ``path``); on the way out the gate opens (so no group commit
    is left hanging) and the queue closes."""
    gate = GatedFsync(monkeypatch)
    q = open_queue(path, fsync)
    try:
        yield gate, q
    finally:
        gate.gate.set()
        q.close()


def wait_written(q, next_seq):
    """Polls (10 s at most) until the queue has written the records before ``next_seq``."""
    deadline = time.monotonic() + 10
    while q.stats()["next_seq"] < next_seq and time.monotonic() < deadline:
        time.sleep(0.01)


def put_in_thread(q, trajs):
    """Starts ``q.put`` of ``trajs`` in a thread; returns (thread, outcome list)."""
    out = []

    def run():
        try:
            out.append(q.put([q.parse(encode(t)) for t in trajs]))
        except StorageError as e:
            out.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def ids(batch):
    return sorted(TrajectoryView(p).trajectory_id for p in batch.payloads)


def test_put_is_neither_acknowledged_nor_delivered_before_its_fsync(
        tmp_path, make_traj, monkeypatch):
    with gated_queue(tmp_path / "q", monkeypatch) as (fsync, q):
        fsync.hold()
        thread, out = put_in_thread(q, [make_traj("a", "a")])
        assert fsync.entered.wait(10)  # written, the fsync covering it is under way
        thread.join(0.3)
        assert thread.is_alive() and not out                 # not acknowledged yet
        assert ids(q.get_batch(1, 0, max_lag=10)) == []      # nor delivered
        assert q.stats()["pending"] == 0
        fsync.gate.set()
        thread.join(10)
        assert out[0].accepted == ["a"]
        assert ids(q.get_batch(1, 0, max_lag=10)) == ["a"]


def test_concurrent_puts_share_one_fsync(tmp_path, make_traj, monkeypatch):
    with gated_queue(tmp_path / "q", monkeypatch) as (fsync, q):
        fsync.hold()
        first, _ = put_in_thread(q, [make_traj("a", "a")])
        assert fsync.entered.wait(10)
        calls = fsync.calls
        # three more puts are written while the first one's fsync hangs on the disk
        others = [put_in_thread(q, [make_traj(t, t)]) for t in "bcd"]
        wait_written(q, 5)
        fsync.gate.set()
        for thread, out in [(first, None), *others]:
            thread.join(10)
            assert out is None or out[0].accepted
        assert fsync.calls - calls == 1  # one more round covered all three
        assert ids(q.get_batch(4, 0, max_lag=10)) == ["a", "b", "c", "d"]


def test_failed_fsync_fails_the_waiting_puts_and_cuts_only_their_records(
        tmp_path, make_traj, monkeypatch):
    with gated_queue(tmp_path / "q", monkeypatch) as (fsync, q):
        assert q.put([q.parse(encode(make_traj("a", "a")))]).accepted == ["a"]
        (seg,) = (tmp_path / "q").glob("seg-*.log")
        size = seg.stat().st_size
        fsync.hold()
        fsync.fail = True
        waiting = [put_in_thread(q, [make_traj(t, t)]) for t in "bc"]
        assert fsync.entered.wait(10)
        wait_written(q, 4)
        fsync.gate.set()
        for thread, out in waiting:
            thread.join(10)
            assert isinstance(out[0], StorageError) and "retry" in out[0].strerror
        assert seg.stat().st_size == size        # cut back to the last durable record
        fsync.fail = False
        assert q.stats()["pending"] == 1
        # the producers' retries are stored, not taken for duplicates
        assert q.put([q.parse(encode(make_traj(t, t))) for t in "bc"]).duplicates == []
    q = open_queue(tmp_path / "q")
    try:
        assert ids(q.get_batch(3, 0, max_lag=10)) == ["a", "b", "c"]
        assert q.stats()["quarantined_total"] == 0
    finally:
        q.close()


CRASH = """
import os, sys, threading
sys.path.insert(0, {tests!r})
from queue_testlib import make_traj
from satjax.queue.codec import encode
from satjax.queue.core import QueueSettings, TrajectoryQueue
real = os.fsync
def fsync(fd):  # the disk never finishes the group commit: the process dies first
    if threading.current_thread().name == "queue-fsync":
        print("written", flush=True)
        threading.Event().wait()
    return real(fd)
os.fsync = fsync
q = TrajectoryQueue({path!r}, QueueSettings(fsync="always"))
q.put([q.parse(encode(make_traj("b", "b")))])
print("acknowledged", flush=True)
"""


def test_crash_between_write_and_fsync_loses_only_unacknowledged_puts(tmp_path, make_traj):
    q = open_queue(tmp_path / "q")
    assert q.put([q.parse(encode(make_traj("a", "a")))]).accepted == ["a"]
    q.close()
    tests = os.path.dirname(__file__)
    proc = subprocess.Popen([sys.executable, "-c", CRASH.format(tests=tests,
                                                                path=str(tmp_path / "q"))],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "written"
    finally:
        proc.kill()  # kill -9 while the put waits for its fsync: never acknowledged
        proc.wait()
    q = open_queue(tmp_path / "q")
    try:
        # a process crash keeps the page cache (a power cut might not): "b" may be in the
        # log; either way the producer retries it and it is delivered once
        assert q.put([q.parse(encode(make_traj("b", "b")))]).accepted == ["b"]
        batch = q.get_batch(2, 0, max_lag=10, allow_partial=True)
        assert ids(batch) == ["a", "b"]
        q.ack(batch.cursor)
        assert ids(q.get_batch(1, 0, max_lag=10, allow_partial=True)) == []
    finally:
        q.close()


@pytest.mark.parametrize("fsync", ["never", "batch"])
def test_other_policies_acknowledge_without_waiting(tmp_path, make_traj, monkeypatch, fsync):
    with gated_queue(tmp_path / "q", monkeypatch, fsync) as (gate, q):
        gate.hold()  # a background fsync (batch) hanging does not hold the put
        assert q.put([q.parse(encode(make_traj("a", "a")))]).accepted == ["a"]
        assert ids(q.get_batch(1, 0, max_lag=10)) == ["a"]


def test_duplicate_of_a_staged_item_waits_for_it_and_fails_with_it(
        tmp_path, make_traj, monkeypatch):
    with gated_queue(tmp_path / "q", monkeypatch) as (fsync, q):
        assert q.put([q.parse(encode(make_traj("a", "a")))]).accepted == ["a"]
        fsync.hold()
        fsync.fail = True
        first, first_out = put_in_thread(q, [make_traj("b", "b")])
        assert fsync.entered.wait(10)
        retry, retry_out = put_in_thread(q, [make_traj("b", "b")])  # a producer's retry
        retry.join(0.3)
        assert retry.is_alive()  # "b" is not durable: the duplicate is not acknowledged
        fsync.gate.set()
        for thread, out in ((first, first_out), (retry, retry_out)):
            thread.join(10)
            assert isinstance(out[0], StorageError)
        fsync.fail = False
        # a put of durable duplicates only is not held up by the failed seqs
        assert q.put([q.parse(encode(make_traj("a", "a")))]).duplicates == ["a"]
        assert q.put([q.parse(encode(make_traj("b", "b")))]).accepted == ["b"]


def test_waiting_puts_fail_instead_of_hanging_when_the_commit_thread_dies(
        tmp_path, make_traj, monkeypatch):
    q = open_queue(tmp_path / "q")
    real_dup = os.dup

    def dup(fd):
        if threading.current_thread().name == "queue-fsync":
            raise OSError(errno.EMFILE, "Too many open files")
        return real_dup(fd)

    monkeypatch.setattr(os, "dup", dup)
    try:
        thread, out = put_in_thread(q, [make_traj("a", "a")])
        thread.join(10)
        assert not thread.is_alive() and isinstance(out[0], StorageError)
        assert ids(q.get_batch(1, 0, max_lag=10)) == []  # never acknowledged, not delivered
    finally:
        q.close()
