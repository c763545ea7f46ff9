"""``satjax lag-sweep`` on a toy budget: runs, reports, plots, and resumes without redoing."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_lag_sweep_writes_table_plots_and_skips_finished_runs(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "satjax", "lag-sweep", "--config",
           str(REPO / "configs/tiny.yaml"), "--out", str(tmp_path), "--variants",
           "gspo,sat_gspo_r3", "--lags", "0,2", "--steps", "3", "--eval-every", "3",
           "--jobs", "1", "--seq-eps", "0.05,0.07",
           "--set", "sft.steps=3", "--set", "eval.num_prompts=4", "--set", "eval.k=2",
           "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4",
           "--set", "checkpoint.every=1000"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert sorted((row["variant"], row["lag"]) for row in rows) == [
        ("gspo", "0"), ("gspo", "2"), ("sat_gspo_r3", "0"), ("sat_gspo_r3", "2")]
    assert all(0.0 <= float(row["final_avg_at_k"]) <= 1.0 for row in rows)
    table = (tmp_path / "results.md").read_text()
    assert "| sat_gspo_r3 |" in table and "drop 0->2" in table
    for png in ("reward_vs_step.png", "score_vs_lag.png", "tail_and_flips_vs_lag.png"):
        assert (tmp_path / png).stat().st_size > 1000
    # lag 2 really trained on data two versions old
    metrics = (tmp_path / "runs" / "gspo-lag2-seed0" / "logs" / "metrics.jsonl").read_text()
    assert '"lag_mean": 2.0' in metrics

    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0 and "4 already done" in r.stdout


def test_run_configs_take_every_override_and_their_key_follows_the_config():
    from satjax.app import lag_sweep

    spec = lag_sweep.RunSpec("gspo", 2, 0)
    sat = lag_sweep.RunSpec("sat_gspo", 2, 0)
    overrides = ["eval.k=2", "objective.hparams.is_correction=tis",
                 "gspo:objective.hparams.eps_high=0.5", "sat_gspo:objective.hparams.lam=0.25"]
    cfg = lag_sweep.run_config(spec, None, overrides, "out", "warm", 7, (0.05, 0.07))
    assert (cfg.objective.name, cfg.train.exact_lag, cfg.train.steps, cfg.eval.k) == (
        "gspo", 2, 7, 2)
    # the variant's own defaults, then --seq-eps, then objective.* for all, then its own
    assert cfg.objective.hparams == {"eps_low": 0.05, "eps_high": 0.5, "is_correction": "tis"}
    sat_cfg = lag_sweep.run_config(sat, None, overrides, "out", "warm", 7, (0.05, 0.07))
    assert (sat_cfg.objective.hparams["lam"], sat_cfg.objective.hparams["eps_high"]) == (0.25, 0.07)

    key = lag_sweep.run_key(cfg, 20, {"sft": 1})
    assert key == lag_sweep.run_key(cfg, 20, {"sft": 1})
    more_steps = lag_sweep.run_config(spec, None, overrides, "out", "warm", 8, (0.05, 0.07))
    changed = {lag_sweep.run_key(more_steps, 20, {"sft": 1}),  # steps, eval cadence, warm-up
               lag_sweep.run_key(cfg, 10, {"sft": 1}), lag_sweep.run_key(cfg, 20, {"sft": 2})}
    assert len(changed) == 3 and key not in changed
    with pytest.raises(ValueError, match="objective.name"):
        lag_sweep.run_config(spec, None, ["objective.name=grpo"], "out", "warm", 7, None)
