"""``satjax train`` through real processes (queue server + rollout worker + trainer)."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _env():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user's laptop
    return env


def _train(run_dir, *extra, timeout=900):
    cmd = [sys.executable, "-m", "satjax.cli", "train", "--config", str(REPO / "configs/tiny.yaml"),
           "--no-progress", "--set", f"run_dir={run_dir}", "--set", "sft.steps=5",
           "--set", "checkpoint.every=2", "--set", "rollout.prompts_per_step=2",
           "--set", "rollout.group_size=4", *extra]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def _metrics(run_dir):
    lines = (Path(run_dir) / "logs" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


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

    # a second start without --resume refuses to overwrite the run
    r = _train(run_dir, "--set", "train.steps=5")
    assert r.returncode == 2 and "--resume" in r.stderr

    r = _train(run_dir, "--resume", "--set", "train.steps=5")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _metrics(run_dir)
    assert [m["step"] for m in rows] == [1, 2, 3, 4, 5]
    assert (run_dir / "weights" / "LATEST").read_text() == "5"
    summary = json.loads(r.stdout.splitlines()[0])
    assert "reward_mean" in summary


def test_bad_config_key_is_named(tmp_path):
    r = _train(tmp_path / "run", "--set", "train.stepz=3", timeout=120)
    assert r.returncode == 2
    assert "train.stepz" in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  group_size: many\n")
    r = subprocess.run([sys.executable, "-m", "satjax.cli", "train", "--config", str(bad)],
                       env=_env(), capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "rollout.group_size" in r.stderr
