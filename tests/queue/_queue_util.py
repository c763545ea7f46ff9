"""Helpers for the queue tests; also a producer process:
``python tests/queue/_queue_util.py ...``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from satjax.trajectory import Trajectory

REPO = Path(__file__).resolve().parents[2]
TOKEN = "test-token-0123456789"


def make_traj(tid: str, group: str, *, version: int = 0, group_size: int = 1, p: int = 6,
              n: int = 5, layers: int = 2, k: int = 2, experts: int = 8, seed: int = 0,
              routes: bool = True, logits: bool = False) -> Trajectory:
    """A valid trajectory with random content (routes rows = p + n - 1)."""
    rng = np.random.default_rng(seed)
    rows = p + n - 1
    return Trajectory(
        trajectory_id=tid, group_id=group, prompt_id="prompt-" + group,
        prompt_tokens=rng.integers(0, 1000, p, dtype=np.int32),
        response_tokens=rng.integers(0, 1000, n, dtype=np.int32),
        behavior_logprobs=-rng.random(n, dtype=np.float32) * 3,
        policy_version=version, reward=float(rng.normal()), group_size=group_size,
        routed_experts=(rng.integers(0, experts, (rows, layers, k), dtype=np.int32)
                        if routes else None),
        router_logits=(rng.normal(size=(rows, layers, experts)).astype(np.float16)
                       if logits else None),
    )


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e["JAX_PLATFORMS"] = "cpu"
    return e


def start_server(data_dir: Path, port: int, *extra: str) -> subprocess.Popen:
    """``python -m satjax serve-queue`` as a subprocess; returns once it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "satjax", "serve-queue", "--port", str(port),
         "--data-dir", str(data_dir), "--log-level", "WARNING", *extra],
        env={**env(), "SATJAX_QUEUE_TOKEN": TOKEN}, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}, rc={proc.wait()}")
    return proc


def produce(address: str, prefix: str, count: int, batch: int, group_size: int,
            log_path: Path, version: int) -> None:
    """Puts ``count`` trajectories; appends each acknowledged id to ``log_path``."""
    from satjax.queue.client import QueueClient

    client = QueueClient(address, token=TOKEN, retries=60, backoff_s=0.05, max_backoff_s=0.5)
    with open(log_path, "a") as log:
        for start in range(0, count, batch):
            trajs = [make_traj(f"{prefix}-{i}", f"{prefix}-g{i // group_size}", version=version,
                               group_size=group_size, seed=i)
                     for i in range(start, min(count, start + batch))]
            result = client.put(trajs, strict=True)
            log.write("".join(t + "\n" for t in result.accepted))
            log.flush()
            time.sleep(0.01)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--log", required=True)
    ap.add_argument("--version", type=int, default=0)
    a = ap.parse_args()
    produce(a.address, a.prefix, a.count, a.batch, a.group_size, Path(a.log), a.version)


def assert_same(a: Trajectory, b: Trajectory) -> None:
    for f in dataclasses.fields(Trajectory):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert x is not None and y is not None, f.name
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f.name)
            assert np.asarray(y).shape == np.asarray(x).shape, f.name
        else:
            assert x == y, f.name


def full_traj(experts: int) -> Trajectory:
    t = make_traj("traj-ü", "group-1", version=17, group_size=4, p=9, n=13, layers=3, k=2,
                  experts=experts, seed=3, logits=True)
    return dataclasses.replace(
        t, reward=-0.625, reward_details={"format": 1.0, "correct": -0.5},
        finish_reason="stop", engine="vllm-0.11", created_unix=1.7e9 + 0.25,
        generation_seconds=3.5)
