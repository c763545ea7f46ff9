"""``satjax train`` (real queue, worker and trainer processes) with gate replay and with
partial rollouts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _train(run_dir, *extra):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)  # one CPU device
    cmd = [sys.executable, "-m", "satjax", "train", "--no-progress", "--set",
           f"run_dir={run_dir}", "--set", "sft.steps=5", "--set", "rollout.prompts_per_step=2",
           "--set", "rollout.group_size=4", *extra]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(x) for x in (Path(run_dir) / "logs" / "metrics.jsonl").open()]


@pytest.mark.slow
def test_gate_replay_trains_on_the_engines_experts_and_gates(tmp_path):
    """bf16 sampling, fp32 trainer: the trainer's own gates differ from the engine's, the
    gates its forward applies do not (nor the experts)."""
    rows = _train(tmp_path / "run", "--set", "train.steps=3", "--set", "train.replay=gates",
                  "--set", "rollout.record_router_logits=true")
    for m in rows:
        assert m["router_gate_diff_applied"] == 0.0 and m["router_mismatch_applied"] == 0.0, m
        assert m["router_gate_diff"] > 0 and m["router_kl"] > 0, m


@pytest.mark.slow
def test_partial_rollouts_span_versions(tmp_path):
    """At max_lag 1 the worker samples the next batch while the trainer trains on the one
    before; 64-token responses of the un-warmed model (16 segments) outlast some steps, so
    the version published at a step's end reaches the worker mid-batch."""
    rows = _train(tmp_path / "run", "--set", "train.steps=12", "--set", "rollout.partial=true",
                  "--set", "train.max_lag=1", "--set", "rollout.max_new_tokens=64",
                  "--set", "sft.mode=never")
    assert max(m["partial_frac"] for m in rows) > 0, [m["partial_frac"] for m in rows]
    for m in rows:  # a partial trajectory's later tokens are fresher than its oldest
        assert 0 <= m["lag_token_mean"] <= m["lag_max"], m
