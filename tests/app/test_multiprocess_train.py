"""``satjax train`` as 2 processes x 4 CPU devices (jax.distributed over loopback, gloo).

Real commands as a user would start them on two hosts: process 0 runs the queue server and
the rollout worker and consumes the queue; both train on one 8-device mesh. (A kill -9 of
either process is tested at the Trainer level in tests/train/test_multiprocess.py.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from satjax.utils import free_port

REPO = Path(__file__).resolve().parents[2]


def start(run_dir: Path, pid: int, port: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    env.pop("SATJAX_VLLM_PYTHON", None)
    log = open(run_dir.parent / f"process{pid}.log", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "satjax", "train", "--config", str(REPO / "configs/tiny.yaml"),
         "--no-progress", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
         "--process-id", str(pid), "--set", f"run_dir={run_dir}", "--set", "sft.steps=3",
         "--set", "train.mesh={data: 2, fsdp: 2, expert: 2, tensor: 1}",
         "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4",
         "--set", "checkpoint.every=2", *extra],
        env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)


def logs(run_dir: Path) -> str:
    return "\n".join(f"--- process {i}\n" + (run_dir.parent / f"process{i}.log").read_text()[-2500:]
                     for i in range(2))


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.slow
def test_two_processes_train_one_run_resume_and_a_failure_stops_both(tmp_path):
    run_dir = tmp_path / "run"
    port = free_port()
    procs = [start(run_dir, i, port, "--set", "train.steps=3") for i in range(2)]
    try:
        for p in procs:
            p.wait(timeout=600)
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], logs(run_dir)
    metrics = run_dir / "logs/metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # one writer: one line per step
    assert all(r["sequences"] == 8 for r in rows)
    assert (run_dir / "weights/LATEST").read_text() == "3"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) \
        == ["2", "3"]
    out0, out1 = ((run_dir.parent / f"process{i}.log").read_text() for i in range(2))
    assert "starting the queue server" in out0 and "starting the queue server" not in out1
    assert out0.splitlines()[-1].startswith("finished step 3 of 3")

    # --resume on both continues the run; then process 0's queue server dies: process 0
    # fails (its child died) and leaves without the collective final save; process 1,
    # waiting in a collective, is stopped by the heartbeat instead of hanging
    port = free_port()
    procs = [start(run_dir, i, port, "--resume", "--set", "train.steps=200") for i in range(2)]
    try:
        deadline = time.time() + 400
        while time.time() < deadline and len(metrics.read_text().splitlines()) < 4:
            assert procs[0].poll() is None and procs[1].poll() is None, logs(run_dir)
            time.sleep(0.5)
        assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()][:4] \
            == [1, 2, 3, 4], logs(run_dir)
        queue = children(procs[0].pid)[0]  # the first child process 0 started
        assert "serve-queue" in Path(f"/proc/{queue}/cmdline").read_text()
        os.kill(queue, signal.SIGKILL)
        t0 = time.time()
        rcs = [p.wait(timeout=90) for p in procs]
        stopped_after = time.time() - t0
    finally:
        for p in procs:
            p.kill()
    assert all(rc != 0 for rc in rcs), (rcs, logs(run_dir))
    assert stopped_after < 30, (stopped_after, logs(run_dir))
    assert "satjax train: failed in process 0" in (run_dir.parent / "process0.log").read_text()
