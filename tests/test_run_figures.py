"""scripts/run_figures.py: the README's figures of a run, from its metrics log."""

import json
import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "run_figures.py"


def test_figures_are_the_means_readme_quotes(tmp_path):
    figures = runpy.run_path(str(SCRIPT), run_name="not_main")["figures"]
    logs = tmp_path / "logs"
    logs.mkdir()
    rows = [{"step": 0, "sft_loss": 1.0}]  # a record without a reward is not an RL step
    rows += [{"step": i, "reward_mean": i / 200, "lag_mean": float(i % 3 == 0),
              "time": 100.0 + 2 * i} for i in range(200)]
    (logs / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = figures(tmp_path)
    assert got["steps"] == 200
    assert got["reward_first10"] == pytest.approx(sum(range(10)) / 10 / 200)
    assert got["reward_110_150"] == pytest.approx(sum(range(110, 150)) / 40 / 200)
    assert got["reward_last"] == pytest.approx(199 / 200)
    assert got["reward_last20"] == pytest.approx(sum(range(180, 200)) / 20 / 200)
    assert got["rl_span_s"] == pytest.approx(2 * 199)
    assert got["lags"] == {0.0: 133, 1.0: 67}
    (logs / "metrics.jsonl").write_text(json.dumps(rows[1]) + "\n")
    with pytest.raises(SystemExit, match="holds 1 RL steps"):
        figures(tmp_path)
