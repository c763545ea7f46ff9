"""``satjax train`` killed with ``kill -9`` (its children must follow), resumed (nothing
lost, one metrics record per step), then preempted with SIGTERM (a checkpoint of the step
it reached). Real processes, loopback only; takes minutes."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOKEN = "e2e-secret-token-do-not-store-0123"


def _train(run_dir, *extra):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "satjax", "train", "--config", str(REPO / "configs/tiny.yaml"),
           "--no-progress", "--set", f"run_dir={run_dir}", "--set", "sft.steps=5",
           "--set", "checkpoint.every=2", "--set", "rollout.prompts_per_step=2",
           "--set", "rollout.group_size=4", "--set", f"queue.token={TOKEN}",
           "--set", "train.steps=500", *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)


def _steps(run_dir):
    path = Path(run_dir) / "logs" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.endswith("}")]


def _wait_steps(proc, run_dir, n, timeout=600):
    deadline = time.monotonic() + timeout
    while len(_steps(run_dir)) < n:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.5)


def _checkpoints(run_dir):
    return sorted(int(p.name) for p in (Path(run_dir) / "checkpoints").iterdir()
                  if p.name.isdigit())


def _children(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid):
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_kill9_then_resume_then_sigterm(tmp_path):
    run_dir = tmp_path / "run"
    proc = _train(run_dir)
    _wait_steps(proc, run_dir, 3)
    children = _children(proc.pid)
    assert len(children) == 2  # queue server and one worker
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    deadline = time.monotonic() + 30
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(c) for c in children), "a child outlived the trainer's kill -9"
    restored = _checkpoints(run_dir)[-1]
    assert restored >= 2

    # --resume: a fresh queue server on the same data directory; the re-run steps replace
    # their old metrics lines
    proc = _train(run_dir, "--resume")
    _wait_steps(proc, run_dir, restored + 3)
    children = _children(proc.pid)
    proc.send_signal(signal.SIGTERM)  # a preemption: checkpoint, then exit
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]  # interrupted, after the clean checkpoint
    assert out.strip().splitlines()[-1].endswith("--resume")  # says how to continue
    steps = _steps(run_dir)
    assert steps == list(range(1, len(steps) + 1)), steps  # one record per step
    assert _checkpoints(run_dir)[-1] == steps[-1]  # the step it reached is checkpointed
    assert not any(_alive(c) for c in children)
    queue_log = (run_dir / "logs" / "queue.log").read_text()
    assert "does not follow" not in queue_log and "Traceback" not in queue_log, queue_log[-3000:]

    # the secret is nowhere in clear in the run directory's text files
    for path in [run_dir / "config.yaml", *(run_dir / "logs").glob("*.log")]:
        assert TOKEN not in path.read_text(errors="replace"), path
