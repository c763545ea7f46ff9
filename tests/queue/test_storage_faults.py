"""What the disk can do to the queue: a second server, a full disk, damaged log and state."""

import errno
import json
import os
import threading
import time
import zlib

import pytest
from queue_testlib import one_line, stop

from satjax.queue import store
from satjax.queue.client import NO_RETRY, QueueClient, QueueStorageError, RetryPolicy
from satjax.queue.core import TrajectoryQueue
from satjax.queue.server import QueueServer
from satjax.queue.store import DataDirError
from satjax.utils import free_port


def all_ids(client, n=1000):
    batch = client.get_batch(n, 0, max_lag=1000, allow_partial=True)
    return sorted(t.trajectory_id for t in batch.trajectories), batch


# -- one server per data directory -------------------------------------------------------
def test_second_server_on_a_data_dir_is_refused_naming_the_holder(
        tmp_path, start_server, serve_queue_refusal):
    data = tmp_path / "queue"
    first = start_server(data, free_port())
    try:
        r = serve_queue_refusal(data)
        assert r.returncode != 0
        line = one_line(r.stderr)
        assert f"pid {first.pid}" in line and str(data) in line
        with pytest.raises(DataDirError, match=f"pid {first.pid}"):
            TrajectoryQueue(data)  # in-process too
    finally:
        first.kill()  # kill -9: the kernel drops the lock with the process
        first.wait()
    second = start_server(data, free_port())
    stop(second)


# -- a full disk ---------------------------------------------------------------------------
def test_failed_write_is_rolled_back_and_puts_resume(tmp_path, token, make_traj, monkeypatch):
    server = QueueServer(tmp_path / "q", token)
    client = QueueClient(f"127.0.0.1:{server.start(0)}", token=token, retry=NO_RETRY)
    real_write = store.writev_all
    full = {"on": False}

    def write_half_then_fail(fd, buffers):
        if full["on"]:
            data = b"".join(buffers)
            real_write(fd, [data[:len(data) // 2]])  # a partial record reaches the file
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(fd, buffers)

    monkeypatch.setattr(store, "writev_all", write_half_then_fail)
    try:
        assert client.put([make_traj("a", "a"), make_traj("b", "b")]).ok
        seg = sorted((tmp_path / "q").glob("seg-*.log"))[-1]
        size = seg.stat().st_size
        full["on"] = True
        with pytest.raises(QueueStorageError, match="q.: write failed"):
            client.put([make_traj("c", "c"), make_traj("d", "d")])
        assert seg.stat().st_size == size  # cut back to the last whole record
        full["on"] = False
        assert client.put([make_traj("c", "c")]).accepted == ["c"]  # no restart needed
        server.stop(None)
        client.close()
        server = QueueServer(tmp_path / "q", token)
        client = QueueClient(f"127.0.0.1:{server.start(0)}", token=token, retry=NO_RETRY)
        assert all_ids(client)[0] == ["a", "b", "c"]
        assert client.stats()["quarantined_total"] == 0  # the log stayed well-formed
    finally:
        client.close()
        server.stop(None)


@pytest.fixture
def small_disk(tmp_path, mount_tmpfs):
    """A 3 MiB tmpfs (needs mount rights: root or a user namespace)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    return mount_tmpfs(disk, "size=3m")


def test_full_disk_refuses_puts_then_resumes_and_loses_nothing(
        small_disk, token, make_traj, start_server):
    data, port = small_disk / "queue", free_port()
    address = f"127.0.0.1:{port}"
    filler = small_disk / "filler"
    server = start_server(data, port, "--fsync", "always")
    client = QueueClient(address, token=token, retry=RetryPolicy(retries=1, backoff_s=0.01))
    acknowledged, refused = [], 0
    try:
        filler.write_bytes(b"\0" * (2 << 20))  # leaves about 1 MiB for the queue
        for i in range(200):
            batch = [make_traj(f"t{i}-{j}", f"g{i}-{j}", p=200, n=400) for j in range(4)]
            try:
                acknowledged += client.put(batch).accepted
            except QueueStorageError as e:
                assert "write failed" in str(e) and str(data) in str(e)
                refused += 1
                if refused == 3:
                    break
        assert refused == 3 and acknowledged, "the disk never filled"
        filler.unlink()  # space returns: the same server takes puts again
        late = [make_traj(f"late-{j}", f"late-{j}") for j in range(4)]
        acknowledged += client.put(late).accepted
        server.kill()
        server.wait()
        server = start_server(data, port, "--fsync", "always")
        got, _ = all_ids(client, n=len(acknowledged) + 100)
        assert got == sorted(acknowledged)  # every acknowledged put, nothing else
    finally:
        client.close()
        stop(server)


# -- a damaged log -----------------------------------------------------------------------
def test_flipped_byte_mid_log_is_quarantined_and_later_records_kept(harness, make_traj):
    h, client = harness()
    for i in range(5):
        client.put([make_traj(f"t{i}", f"g{i}")])
    first = client.get_batch(1, 0)
    client.ack(first.cursor)  # t0 consumed
    h.server.stop(None)
    seg = sorted(h.data_dir.glob("seg-*.log"))[-1]
    data = bytearray(seg.read_bytes())
    record = len(data) // 5
    data[record * 2 + record // 2] ^= 0xFF  # inside the third record (t2)
    seg.write_bytes(bytes(data))
    client = h.start()
    stats = client.stats()
    assert stats["quarantined_total"] == 1 and stats["pending"] == 3
    assert len(list((h.data_dir / "quarantine").iterdir())) == 1
    assert client.put([make_traj("t5", "g5")]).ok  # damage never blocks later puts
    got, batch = all_ids(client)
    assert got == ["t1", "t3", "t4", "t5"]
    client.ack(batch.cursor)
    client = h.restart()  # the damaged record stays aside, the rest stays consumed
    assert all_ids(client)[0] == [] and client.put([make_traj("t6", "g6")]).ok


def test_damage_in_a_consumed_record_does_not_block_puts(harness, make_traj):
    h, client = harness()
    for i in range(4):
        client.put([make_traj(f"t{i}", f"g{i}")])
    client.ack(client.get_batch(3, 0).cursor)  # t0..t2 consumed, t3 pending
    h.server.stop(None)
    seg = sorted(h.data_dir.glob("seg-*.log"))[-1]
    data = bytearray(seg.read_bytes())
    data[len(data) // 4 + len(data) // 8] ^= 0xFF  # inside t1, consumed already
    seg.write_bytes(bytes(data))
    client = h.start()
    assert client.stats()["quarantined_total"] == 1
    assert client.put([make_traj("t4", "g4")]).ok  # seqs go on after the highest intact one
    assert all_ids(client)[0] == ["t3", "t4"]


# -- a damaged consumer state ------------------------------------------------------------
@pytest.fixture
def consumed_queue(tmp_path, token, make_traj):
    """A data dir holding t0..t3, t0 and t1 consumed."""
    data = tmp_path / "queue"
    server = QueueServer(data, token)
    with QueueClient(f"127.0.0.1:{server.start(0)}", token=token, retry=NO_RETRY) as c:
        c.put([make_traj(f"t{i}", f"g{i}") for i in range(4)])
        c.ack(c.get_batch(2, 0).cursor)
    server.stop(None)
    return data


@pytest.mark.parametrize("damage", ["missing", "garbage", "inflated"])
def test_bad_consumer_state_stops_the_server_with_a_recovery(
        consumed_queue, damage, serve_queue_refusal, start_server, token):
    state = consumed_queue / "state.json"
    if damage == "missing":
        state.unlink()
    elif damage == "garbage":
        state.write_text('{"watermark": ')
    else:
        body = json.loads(state.read_text())
        state.write_text(json.dumps({**body, "watermark": 99}))
    r = serve_queue_refusal(consumed_queue)
    assert r.returncode != 0
    line = one_line(r.stderr)
    assert str(state) in line and "--reset-consumer-state" in line
    port = free_port()
    server = start_server(consumed_queue, port, "--reset-consumer-state")
    try:
        with QueueClient(f"127.0.0.1:{port}", token=token, retry=NO_RETRY) as c:
            # reset: everything still in the log is delivered again, nothing dropped
            assert all_ids(c)[0] == ["t0", "t1", "t2", "t3"]
    finally:
        stop(server)


def test_state_file_exists_from_the_first_open(tmp_path):
    q = TrajectoryQueue(tmp_path / "q")
    try:
        assert (tmp_path / "q" / "state.json").exists()
    finally:
        q.close()
    assert os.stat(tmp_path / "q" / "state.json").st_mode & 0o077 == 0
    time.sleep(0)  # the lock is released: a second open works
    TrajectoryQueue(tmp_path / "q").close()


def test_background_fsync_does_not_block_appends_and_retries_a_failure(tmp_path, monkeypatch):
    log = store.SegmentLog(tmp_path / "q", fsync="batch", batch_interval_s=0.01)
    list(log.replay())  # starts the background fsync
    real_fsync, entered, release = os.fsync, threading.Event(), threading.Event()
    background = []

    def fsync(fd):
        if threading.current_thread().name != "queue-fsync":
            return real_fsync(fd)
        background.append(fd)
        if len(background) == 1:  # the first one hangs on the disk, then fails
            entered.set()
            release.wait(60)
            raise OSError(errno.EIO, "Input/output error")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    try:
        log.append(1, [b"a" * 100])
        assert entered.wait(30)
        writer = threading.Thread(target=log.append, args=(2, [b"b" * 100]))
        writer.start()
        writer.join(10)  # while the fsync hangs: an append under the I/O lock would wait
        assert not writer.is_alive()
        release.set()
        deadline = time.monotonic() + 30
        while len(background) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(background) >= 2  # the failed flush was retried
    finally:
        release.set()
        log.close()
    reopened = store.SegmentLog(tmp_path / "q", fsync="never")
    assert [seq for seq, _, _ in reopened.replay()] == [1, 2]
    reopened.close()


def test_record_checksum_is_zlib_crc32_of_seq_then_payload(tmp_path):
    # the on-disk format: logs written with zlib's crc32 stay readable, and vice versa
    log = store.SegmentLog(tmp_path / "q", fsync="never")
    list(log.replay())
    payload = os.urandom(3000)
    (loc,) = log.append(7, [payload])
    log.close()
    raw = (tmp_path / "q" / "seg-00000000000000000007.log").read_bytes()
    length, crc, seq = store.HEADER.unpack_from(raw, 0)
    assert (length, seq, raw[loc.offset:]) == (3000, 7, payload)
    assert crc == zlib.crc32(payload, zlib.crc32(store.SEQ.pack(7)))
