"""scripts/page_grid.py: the SAT page's grid beside a finished sweep, claim by claim."""

import json
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np

from satjax.app.sweep_spec import RunSpec

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "page_grid.py"
MODULE = runpy.run_path(str(SCRIPT), run_name="not_main")
PAGE = REPO / "docs" / "results" / "paper-recipe" / "page_grid.json"
SEEDS = list(range(6))


def _sweep(out: Path, offsets: dict[tuple[str, int], float], collapsing=()) -> None:
    """A broadcast sweep of four rows at intervals 1 and 8: each run's score is a seed's
    luck (shared by the rows, so it cancels in a paired difference) plus the row's offset,
    plus 0.01 of its own, its sign alternating with the seed and opposite for SAT rows (so a
    SAT row's paired difference from a base row swings by 0.02 around the offsets')."""
    out.mkdir(exist_ok=True)
    variants = sorted({v for v, _ in offsets})
    (out / "sweep.json").write_text(json.dumps(
        {"variants": variants, "lags": [1, 8], "seeds": SEEDS, "seeds_of": {}, "lags_of": {},
         "lag_mode": "broadcast"}))
    rng = np.random.default_rng(0)
    luck = rng.normal(0, 0.05, len(SEEDS))
    for (v, lag), offset in offsets.items():
        for s in SEEDS:
            spec = RunSpec(v, lag, s, "broadcast")
            spec.run_dir(out).mkdir(parents=True)
            rewards = [0.8] * 60 + ([0.1] * 60 if (v, lag) in collapsing else [0.8] * 60)
            # d-bar over 8 logged steps: 0.01 early, then the row's level (higher at 8 but
            # for sat_gspo_r3, whose mismatch does not rise)
            level = 0.004 + (0.004 if lag == 8 and v != "sat_gspo_r3" else 0.0) + 0.0002 * s
            (spec.run_dir(out) / "logs").mkdir()
            (spec.run_dir(out) / "logs" / "metrics.jsonl").write_text("".join(
                json.dumps({"step": i + 1, "mismatch_abs_mean": 0.01 if i < 6 else level})
                + "\n" for i in range(8)))
            spec.result_path(out).write_text(json.dumps({
                "variant": v, "lag": lag, "seed": s, "lag_mode": "broadcast",
                "final_avg_at_k": 0.7 + offset + luck[s] + 0.01 * (-1) ** s * (
                    1 if v.startswith("sat") else -1),
                "rewards": rewards}))


def test_the_verdicts_follow_the_sign_and_the_interval(tmp_path):
    offsets = {("gspo", 1): 0.0, ("gspo", 8): -0.05,
               ("sat_gspo_r3", 1): 0.03, ("sat_gspo_r3", 8): -0.01,  # above GSPO: the page's
               ("gspo_r3", 1): 0.0, ("gspo_r3", 8): -0.08,           # 8: below (page: above)
               ("sat_gspo", 1): 0.0, ("sat_gspo", 8): -0.05}         # as GSPO
    _sweep(tmp_path, offsets, collapsing={("gspo", 8)})
    page = json.loads(PAGE.read_text())
    text, points = MODULE["report"](MODULE["load_results"](tmp_path), page, 0.5)
    verdict = {(p["row"], p["against"], p["lag"]): p["verdict"] for p in points}
    assert verdict[("sat_gspo_r3", "gspo", 1)] == "reproduces"
    assert verdict[("sat_gspo_r3", "gspo", 8)] == "reproduces"
    assert verdict[("gspo_r3", "gspo", 8)] == "reversed"     # the page: +1.67 points
    assert verdict[("sat_gspo", "gspo", 8)] == "not separated"
    assert verdict[("sat_gspo_r3", "gspo_r3", 8)] == "reproduces"  # SAT against its base
    assert ("sat_grpo", "grpo", 1) not in verdict  # rows the sweep did not run
    # the drop table: GSPO's drop of 0.05 (the page's +0.79); its collapse at 8 reproduces
    # (the drop table's line; the d-bar table's comes after it)
    gspo = [line for line in text.splitlines() if line.startswith("| GSPO |")][-2].split(" | ")
    assert gspo[1] == "+0.79" and abs(float(gspo[2].split(" ± ")[0]) - 0.05) < 0.005, gspo
    assert gspo[3] == "reproduces"
    assert gspo[4:] == ["yes", "6/6 (66, 66, 66, 66, 66, 66)", "reproduces |"], gspo
    sat_line = [line for line in text.splitlines() if line.startswith("| SAT-GSPO w/ R3 |")][-2]
    assert "| no | 0/6 | consistent |" in sat_line
    # d-bar over the last quarter of steps: GSPO's rises by 0.004 at 8 (the page: it rises),
    # SAT-GSPO+R3's does not (a rise of exactly 0: its interval contains 0)
    dbar = [line for line in text.splitlines() if line.startswith("| GSPO |")][-1]
    assert dbar.startswith("| GSPO | 0.0097 | 0.0109 | 0.0045 ± 0.0004 | 0.0085 ± 0.0004 | "
                           "+0.0040 ± 0.0000 (n=6) | reproduces |"), dbar
    sat = [line for line in text.splitlines() if line.startswith("| SAT-GSPO w/ R3 |")][-1]
    assert sat.endswith("| +0.0000 ± 0.0000 (n=6) | not separated |"), sat
    assert "against this sweep's means: +0.40 over 4 rows" in text


def test_it_reads_no_score_before_every_run_has_finished(tmp_path):
    _sweep(tmp_path, {("gspo", 1): 0.0, ("gspo", 8): 0.0, ("sat_gspo", 1): 0.0,
                      ("sat_gspo", 8): 0.0})
    RunSpec("sat_gspo", 8, 3, "broadcast").result_path(tmp_path).unlink()
    r = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--page", str(PAGE)],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 1 and "1 of the 24 runs" in r.stderr and "sat_gspo-bcast8-seed3" \
        in r.stderr, r.stderr
    assert not (tmp_path / "page_grid.md").exists()
    # once finished: the report and its plot
    _sweep(tmp_path / "done", {("gspo", 1): 0.0, ("gspo", 8): 0.0, ("sat_gspo", 1): 0.0,
                               ("sat_gspo", 8): 0.0})
    r = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "done"), "--page",
                        str(PAGE)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "done" / "page_grid.png").stat().st_size > 10_000
    assert "| SAT-GSPO | GSPO | +1.92 | " in (tmp_path / "done" / "page_grid.md").read_text()
