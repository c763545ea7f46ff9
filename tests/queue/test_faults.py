"""The queue as a real subprocess: kill -9 mid-stream, concurrent producers, SIGTERM."""

import collections
import signal
import subprocess
import sys
import time

import pytest
from queue_testlib import stop

from satjax.queue.client import QueueClient, QueueError, QueueUnavailableError, RetryPolicy
from satjax.utils import free_port


def logged(path):
    return path.read_text().split() if path.exists() else []


def test_kill9_mid_stream_loses_nothing_and_redelivers_no_ack(
        tmp_path, token, start_server, start_producer):
    port, data = free_port(), tmp_path / "queue"
    address = f"127.0.0.1:{port}"
    extra = ("--fsync", "always", "--segment-mb", "0.02")  # ~20 KB segments: rolls and GC
    server = start_server(data, port, *extra)
    log = tmp_path / "acknowledged.txt"
    producer = start_producer(address, "p", 300, log)
    client = QueueClient(address, token=token,
                         retry=RetryPolicy(retries=80, backoff_s=0.05, max_backoff_s=0.5))
    acked: collections.Counter[str] = collections.Counter()
    held: list[str] = []
    deadline = time.monotonic() + 120
    try:
        while True:
            assert time.monotonic() < deadline, "timed out"
            if not held and len(logged(log)) >= 80:
                # Take a batch and never ack it, then kill -9 while the producer streams.
                held = [t.trajectory_id
                        for t in client.get_batch(4, 0, 1000, timeout=10).trajectories]
                assert held
                server.kill()
                server.wait()
                kill_time_logged = set(logged(log))
                server = start_server(data, port, *extra)
            try:
                batch = client.get_batch(8, 0, max_lag=1000, timeout=0.2, allow_partial=True)
            except QueueUnavailableError:
                continue
            got = [t.trajectory_id for t in batch.trajectories]
            assert not set(got) & set(acked), "an acknowledged trajectory came back"
            if batch.cursor:
                assert client.ack(batch.cursor) == len(got)
                acked.update(got)
            if producer.poll() is not None and set(logged(log)) <= set(acked):
                break
        assert producer.returncode == 0
        stats = client.stats()
        assert stats["pending"] == 0 and stats["delivered_unacked"] == 0
        assert stats["segments"] == 1  # rolled segments were garbage-collected once acked
    finally:
        client.close()
        stop(producer)
        stop(server)
    assert held and set(held) <= set(acked)                 # unacked at the kill: redelivered
    assert kill_time_logged <= set(acked)                  # acknowledged puts survived kill -9
    assert set(acked) == {f"p-{i}" for i in range(300)}    # everything, nothing extra
    assert max(acked.values()) == 1                        # and nothing twice


def test_three_producers_one_consumer_exact_totals(tmp_path, token, start_server, start_producer):
    port = free_port()
    address = f"127.0.0.1:{port}"
    server = start_server(tmp_path / "queue", port, "--fsync", "batch")
    logs = [tmp_path / f"p{i}.txt" for i in range(3)]
    producers = [start_producer(address, f"w{i}", 60, logs[i], batch=6, group_size=3)
                 for i in range(3)]
    client = QueueClient(address, token=token, retry=RetryPolicy(retries=20))
    received: collections.Counter[str] = collections.Counter()
    groups_seen: collections.Counter[str] = collections.Counter()
    try:
        client.wait_ready(30)
        deadline = time.monotonic() + 120
        while sum(received.values()) < 180:
            assert time.monotonic() < deadline, f"only {sum(received.values())} of 180"
            batch = client.get_batch(6, 0, timeout=1.0)
            for t in batch.trajectories:
                received[t.trajectory_id] += 1
                groups_seen[t.group_id] += 1
            if batch.cursor:
                client.ack(batch.cursor)
        for p in producers:
            assert p.wait(timeout=60) == 0
        stats = client.stats()
        assert client.get_batch(6, 0, timeout=0.2, allow_partial=True).trajectories == []
        server.send_signal(signal.SIGTERM)  # graceful shutdown
        assert server.wait(timeout=20) == 0
    finally:
        client.close()
        for p in producers:
            stop(p)
        stop(server)
    expected = {f"w{i}-{j}" for i in range(3) for j in range(60)}
    assert set(received) == expected and max(received.values()) == 1
    assert set(groups_seen.values()) == {3}  # whole groups only
    assert stats["accepted_total"] == 180 and stats["duplicates_total"] == 0
    assert stats["acked_total"] == 180 and stats["pending"] == 0
    assert sorted(t for log in logs for t in logged(log)) == sorted(expected)


def test_cli_refuses_to_start_without_a_token(tmp_path, subprocess_env):
    e = dict(subprocess_env)
    e.pop("SATJAX_QUEUE_token", None)
    r = subprocess.run([sys.executable, "-m", "satjax", "serve-queue", "--port", "0",
                        "--data-dir", str(tmp_path)], env=e, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "token" in r.stderr


def test_cli_token_file_and_host(tmp_path, token, subprocess_env):
    (tmp_path / "tok").write_text(token + "\n")
    port = free_port()
    e = dict(subprocess_env)
    e.pop("SATJAX_QUEUE_token", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "satjax", "serve-queue", "--port", str(port), "--data-dir",
         str(tmp_path / "q"), "--token-file", str(tmp_path / "tok"), "--log-level", "WARNING"],
        env=e, stdout=subprocess.PIPE, text=True)
    try:
        assert "listening on 127.0.0.1:" in proc.stdout.readline()
        with QueueClient(f"127.0.0.1:{port}", token=token) as c:
            assert c.stats()["pending"] == 0
        with QueueClient(f"127.0.0.1:{port}", token="wrong") as c, pytest.raises(QueueError):
            c.stats()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    finally:
        stop(proc)
