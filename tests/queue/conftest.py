"""Fixtures of the queue tests: trajectories, the protobuf oracle, server subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import queue_testlib

from satjax.queue.client import NO_RETRY, QueueClient
from satjax.queue.server import QueueServer

REPO = Path(__file__).resolve().parents[2]
PRODUCER = Path(__file__).resolve().parent / "producer.py"


@pytest.fixture
def token() -> str:
    return queue_testlib.TOKEN


@pytest.fixture
def make_traj():
    return queue_testlib.make_traj


@pytest.fixture
def full_traj():
    return queue_testlib.full_traj


@pytest.fixture
def assert_same():
    return queue_testlib.assert_same


@pytest.fixture
def to_proto():
    """The protobuf reference encoder (oracle of ``satjax.queue.codec.encode``)."""
    return queue_testlib.to_proto


@pytest.fixture
def from_proto():
    """The protobuf reference decoder (oracle of ``satjax.queue.codec.decode``)."""
    return queue_testlib.from_proto


@pytest.fixture
def make_group():
    """``make_group(prefix, size, version=0, **make_traj_kw)``: one whole group."""

    def make(prefix, size, version=0, **kw):
        return [queue_testlib.make_traj(f"{prefix}-{i}", prefix, version=version,
                                        group_size=size, seed=i, **kw) for i in range(size)]

    return make


@pytest.fixture
def subprocess_env():
    """Environment of child processes: this checkout's ``satjax`` first, CPU only."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e["JAX_PLATFORMS"] = "cpu"
    return e


@pytest.fixture
def start_server(subprocess_env):
    """``start_server(data_dir, port, *flags)``: ``python -m satjax serve-queue`` as a
    subprocess, returned once it listens. The test stops (or kills) it."""

    def start(data_dir: Path, port: int, *extra: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "satjax", "serve-queue", "--port", str(port),
             "--data-dir", str(data_dir), "--log-level", "WARNING", *extra],
            env={**subprocess_env, "SATJAX_QUEUE_TOKEN": queue_testlib.TOKEN},
            stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "listening on" not in line:
            proc.kill()
            raise RuntimeError(f"server did not start: {line!r}, rc={proc.wait()}")
        return proc

    return start


@pytest.fixture
def serve_queue_refusal(subprocess_env):
    """``serve_queue_refusal(data_dir, *flags)``: runs ``satjax serve-queue`` expecting it to
    refuse to start; returns the CompletedProcess (the test checks its code and stderr)."""

    def run(data_dir: Path, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "satjax", "serve-queue", "--port", "0", "--data-dir",
             str(data_dir), "--log-level", "WARNING", *extra],
            env={**subprocess_env, "SATJAX_QUEUE_TOKEN": queue_testlib.TOKEN},
            capture_output=True, text=True, timeout=60)

    return run


@pytest.fixture
def start_producer(subprocess_env):
    """``start_producer(address, prefix, count, log, batch=4, group_size=2)``: runs
    ``producer.py``, which logs every id the server acknowledged to ``log``."""

    def start(address, prefix, count, log, batch=4, group_size=2) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, str(PRODUCER), "--address", address, "--prefix", prefix,
             "--count", str(count), "--batch", str(batch), "--group-size", str(group_size),
             "--log", str(log)], env=subprocess_env)

    return start


class Harness:
    """Starts/restarts an in-process server on one data dir; hands out clients."""

    def __init__(self, data_dir, token, **kw):
        self.data_dir, self.token, self.kw = data_dir, token, kw
        self.server = None
        self.clients = []

    def start(self):
        self.server = QueueServer(self.data_dir, self.token, **self.kw)
        self.port = self.server.start(0)
        return self.client()

    def client(self, token=None, retry=NO_RETRY, **kw):
        c = QueueClient(f"127.0.0.1:{self.port}", token=token or self.token, retry=retry, **kw)
        self.clients.append(c)
        return c

    def restart(self):
        self.server.stop(None)
        return self.start()

    def close(self):
        for c in self.clients:
            c.close()
        if self.server is not None:
            self.server.stop(None)


@pytest.fixture
def harness(tmp_path, token):
    """``harness(**QueueServer_kw)`` -> (Harness, client): an in-process server on a fresh
    data dir, stopped (with its clients) after the test."""
    made = []

    def make(**kw):
        h = Harness(tmp_path / f"q{len(made)}", token, **kw)
        made.append(h)
        return h, h.start()

    yield make
    for h in made:
        h.close()
