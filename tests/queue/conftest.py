"""Fixtures of the queue tests: trajectories, the protobuf oracle, server subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import queue_testlib

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
def start_producer(subprocess_env):
    """``start_producer(address, prefix, count, log, batch=4, group_size=2)``: runs
    ``producer.py``, which logs every id the server acknowledged to ``log``."""

    def start(address, prefix, count, log, batch=4, group_size=2) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, str(PRODUCER), "--address", address, "--prefix", prefix,
             "--count", str(count), "--batch", str(batch), "--group-size", str(group_size),
             "--log", str(log)], env=subprocess_env)

    return start
