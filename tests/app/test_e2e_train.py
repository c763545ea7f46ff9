"""``satjax train`` through real processes (queue server + rollout worker + trainer)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _env():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user's laptop
    return env


def _train(run_dir, *extra, timeout=900, background=False):
    cmd = [sys.executable, "-m", "satjax", "train", "--config", str(REPO / "configs/tiny.yaml"),
           "--no-progress", "--set", f"run_dir={run_dir}", "--set", "sft.steps=5",
           "--set", "checkpoint.every=2", "--set", "rollout.prompts_per_step=2",
           "--set", "rollout.group_size=4", *extra]
    if background:
        return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=REPO)
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def _metrics(run_dir):
    lines = (Path(run_dir) / "logs" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


@pytest.mark.slow
def test_train_writes_metrics_checkpoints_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    r = _train(run_dir, "--set", "train.steps=3")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _metrics(run_dir)
    assert [m["step"] for m in rows] == [1, 2, 3]
    for m in rows:
        assert 0.0 <= m["reward_mean"] <= 1.0
        assert m["sequences"] == 8 and m["lag_mean"] >= 0
        assert {"loss", "grad_norm", "sat_tail_frac", "router_mismatch", "kl_k3"} <= set(m)
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert ckpts[-1] == "3"
    assert (run_dir / "weights" / "LATEST").read_text() == "3"
    assert any((run_dir / "logs").glob("events.out.tfevents.*"))

    assert r.stdout.splitlines()[-1].startswith("finished step 3 of 3; run directory: ")
    assert "compiling the train step" in r.stderr  # a status line for the silent phase

    # a second start without --resume refuses to overwrite the run
    r = _train(run_dir, "--set", "train.steps=5")
    assert r.returncode == 2 and "--resume" in r.stderr

    # --resume without --config continues with the run's own config (2 x 4 sequences, not
    # the defaults' 8 x 8), changing only the safe key train.steps
    r = subprocess.run([sys.executable, "-m", "satjax", "train", "--no-progress", "--set",
                        f"run_dir={run_dir}", "--resume", "--set", "train.steps=4"],
                       env=_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _metrics(run_dir)
    assert [m["step"] for m in rows] == [1, 2, 3, 4] and rows[-1]["sequences"] == 8

    # resume, then Ctrl-C mid-run: the trainer checkpoints the step it reached and stops
    # its worker and queue processes
    proc = _train(run_dir, "--resume", "--set", "train.steps=500", background=True)
    deadline = time.monotonic() + 600
    while len(_metrics(run_dir)) < 5 and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]  # interrupted, after the clean checkpoint
    rows = _metrics(run_dir)
    steps = [m["step"] for m in rows]
    assert steps == list(range(1, len(steps) + 1)) and 5 <= steps[-1] < 500
    ckpts = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert ckpts[-1] == steps[-1]
    assert json.loads(out.splitlines()[0])["reward_mean"] == rows[-1]["reward_mean"]
    assert out.splitlines()[-1].startswith(f"stopped at step {steps[-1]} of 500")
    assert out.splitlines()[-1].endswith(f"satjax train --set run_dir={run_dir} --resume")
    leftover = subprocess.run(["pgrep", "-f", "--", f"--weights {run_dir}/weights"],
                              capture_output=True)
    assert leftover.stdout == b"", "a worker process outlived the trainer"

    r = subprocess.run([sys.executable, "-m", "satjax", "eval", "--config",
                        str(REPO / "configs/tiny.yaml"), "--set", f"run_dir={run_dir}",
                        "--k", "2", "--num-prompts", "4"],
                       env=_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.splitlines()[-1])
    assert result["model"].endswith(f"v{steps[-1]:08d}")
    assert 0.0 <= result["avg@2"] <= result["pass@2"] <= 1.0


def test_bad_config_key_is_named(tmp_path):
    r = _train(tmp_path / "run", "--set", "train.stepz=3", timeout=120)
    assert r.returncode == 2
    assert "train.stepz" in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  group_size: many\n")
    r = subprocess.run([sys.executable, "-m", "satjax", "train", "--config", str(bad)],
                       env=_env(), capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "rollout.group_size" in r.stderr
