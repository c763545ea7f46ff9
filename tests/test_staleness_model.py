"""scripts/staleness_model.py: the SAT page's mean-staleness model and the inputs it reads
from a run's config and metrics."""

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "staleness_model.py"
MODULE = runpy.run_path(str(SCRIPT), run_name="not_main")


def test_the_branches_meet_when_the_queue_holds_one_pull():
    """At rho -> 1 the train-bound branch's in-queue lag tends to q_Q and the rollout-bound
    one's to 1: with a queue of one trainer pull (q_Q = 1) both sides are C M/B + 1."""
    predicted_lag = MODULE["predicted_lag"]
    below = predicted_lag(rho=1 - 1e-9, c=96, b=32, m_tail=1.25, q=32)["mean"]
    above = predicted_lag(rho=1 + 1e-9, c=96, b=32, m_tail=1.25, q=32)["mean"]
    assert below == pytest.approx(3 * 1.25 + 1) and above == pytest.approx(below)
    # a deeper queue only adds in-queue lag, and only when the trainer is the bottleneck
    assert predicted_lag(rho=2.0, c=96, b=32, m_tail=1.0, q=320)["in_queue"] == pytest.approx(
        (2 * 10 + 1) / 4)
    assert predicted_lag(rho=0.5, c=96, b=32, m_tail=1.0, q=320)["in_queue"] == 0.5
    with pytest.raises(ValueError, match="rho = 1"):
        predicted_lag(rho=1.0, c=1, b=1, m_tail=1, q=1)


def test_inputs_come_from_the_runs_config_and_metrics(tmp_path):
    cfg = {"rollout": {"num_workers": 3, "prompts_per_step": 4, "group_size": 8},
           "queue": {"max_pending": 64}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "logs").mkdir()
    rows = [{"step": 0, "sft_loss": 1.0}]  # no model metrics: not a step the model reads
    for i in range(12):
        rows.append({"step": i + 1, "rollout_tokens_per_s": 100.0, "sequences": 32,
                     "response_len_mean": 2.5, "response_len_group_max_mean": 3.0,
                     "time/step_s": 0.5, "time/publish_s": 0.3, "time/checkpoint_s": 0.0,
                     "time/wait_data_s": 0.2, "lag_token_mean": 2.0 if i % 2 else 3.0,
                     f"lag_hist/{2 + i % 2}": 32.0})
    (tmp_path / "logs" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n"
                                                             for r in rows))
    with pytest.raises(SystemExit, match="no stop line in"):
        MODULE["inputs"](tmp_path, skip=2)
    # the workers' own stop lines: 960 trajectories in 12 - 4 unpaused seconds each
    for w in range(3):
        (tmp_path / "logs" / f"worker{w}.log").write_text(
            "2026-12-07 04:01:59,512 satjax.rollout.worker worker w0 put group g: 8 of 8\n"
            f"2026-12-07 04:02:03,876 satjax.app.worker_process worker {w} stopped after 960 "
            "trajectories (paused 4.0 s of 12.0 s)\n")
    x = MODULE["inputs"](tmp_path, skip=2)
    assert x["steps"] == 10 and x["generating_rate"] == 300.0
    assert x["v_R"] == pytest.approx(3 * 960 * 2.5 / 8)  # each worker's rate, added up
    assert x["paused_share"] == pytest.approx(1 / 3)
    assert x["v_T"] == pytest.approx(32 * 2.5 / 0.8)
    assert x["rho"] == pytest.approx(9.0)
    assert (x["C"], x["B"], x["Q"]) == (96, 32, 64.0)
    assert x["M_tail"] == pytest.approx(1.2) and x["realised_mean"] == 2.5
    assert x["hist"] == {2: 160.0, 3: 160.0} and x["wait_share"] == pytest.approx(0.2)
    r = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--skip", "2", "--png",
                        str(tmp_path / "lag.png")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    # rho 9 > 1: C M / (rho B) + (2 q_Q + rho - 1) / (2 rho) = 0.4 + (4 + 8) / 18
    assert "predicted mean token lag 1.07 (pre-queue 0.40 + in-queue 0.67)" in r.stdout
    assert "realised mean token lag 2.50" in r.stdout
    assert (tmp_path / "lag.png").stat().st_size > 1000
