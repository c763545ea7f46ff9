"""The lag sweep's statistics on hand-made results: intervals, paired bootstrap, collapses,
the selection verdict and the markdown report."""

import json

import numpy as np
import pytest

from satjax.app import sweep_report as sr
from satjax.app.sweep_spec import RunSpec
from satjax.run_dir import RunDirs


def test_mean_ci_is_the_student_t_interval():
    xs = [0.40, 0.45, 0.50, 0.42, 0.47, 0.44]
    m, h = sr.mean_ci(xs)
    # t_{0.975, 5} = 2.5706 (printed tables)
    assert m == pytest.approx(np.mean(xs))
    assert h == pytest.approx(2.5706 * np.std(xs, ddof=1) / np.sqrt(6), rel=1e-4)
    assert np.isnan(sr.mean_ci([0.3])[1])


def test_paired_bootstrap_cancels_a_shared_seed_effect():
    r = np.random.default_rng(0)
    seed_luck = r.normal(0, 0.2, 8)  # large, shared by both objectives
    a = 0.5 + seed_luck + 0.1 + r.normal(0, 0.005, 8)
    b = 0.5 + seed_luck
    diff, lo, hi = sr.paired_bootstrap_ci(a, b)
    assert diff == pytest.approx(np.mean(a - b))
    assert 0.08 < lo < diff < hi < 0.12  # paired: separates; unpaired noise would not
    a_unpaired = 0.6 + r.normal(0, 0.2, 8)
    _, lo2, hi2 = sr.paired_bootstrap_ci(a_unpaired, b)
    assert lo2 < hi2 and hi2 - lo2 > 5 * (hi - lo)
    with pytest.raises(ValueError, match="paired"):
        sr.paired_bootstrap_ci(np.ones(1), np.ones(1))


def test_collapse_means_below_half_the_peak_at_the_end():
    up_down = [0.2] * 10 + [0.8] * 30 + [0.1] * 20
    dip_recover = [0.8] * 30 + [0.1] * 20 + [0.8] * 20
    c = sr.collapse_stats(up_down)
    assert c["collapsed"] and c["reward_peak"] == pytest.approx(0.8)
    assert c["reward_final"] == pytest.approx(0.1)
    # the 10-step mean is 0.45 at step 45 (5 steps at 0.8), 0.38 from step 46 on
    assert c["collapse_step"] == 46
    assert not sr.collapse_stats(dip_recover)["collapsed"]
    assert sr.collapse_stats(dip_recover)["collapse_step"] is None
    assert not sr.collapse_stats([0.0] * 20)["collapsed"]
    np.testing.assert_allclose(sr.smooth([1, 2, 3, 4], window=2), [1, 1.5, 2.5, 3.5])


def _results(variant, lag, scores, rewards=None):
    return [{"variant": variant, "lag": lag, "seed": s, "steps": 40, "k": 4,
             "final_avg_at_k": x, "seconds": 1.0,
             "rewards": rewards or [0.5] * 40} for s, x in enumerate(scores)]


def test_selection_verdict_uses_the_standard_error_of_the_drop():
    lo = [0.60, 0.62, 0.58, 0.61, 0.59, 0.60]
    hi = [0.50, 0.52, 0.49, 0.51, 0.48, 0.50]
    s = sr.selection_summary(_results("gspo", 1, lo) + _results("gspo", 16, hi), [1, 16])
    se = np.sqrt(np.var(lo, ddof=1) / 6 + np.var(hi, ddof=1) / 6)
    assert s["drop"] == pytest.approx(np.mean(lo) - np.mean(hi))
    assert s["se"] == pytest.approx(se) and s["degrades"]
    flat = sr.selection_summary(_results("gspo", 1, lo) + _results("gspo", 16, lo[::-1]),
                                [1, 16])
    assert not flat["degrades"] and "learns" not in flat  # no warm-up score given
    # lag 1 learns when its gain over the (seedless) warm-up exceeds 2 SE of its mean
    se_lo = np.std(lo, ddof=1) / np.sqrt(6)
    gain = sr.selection_summary(_results("gspo", 1, lo) + _results("gspo", 16, hi), [1, 16],
                                warmup_avg_at_k=0.58)
    assert gain["gain_lo"] == pytest.approx(0.02) and gain["se_lo"] == pytest.approx(se_lo)
    assert gain["learns"]
    assert not sr.selection_summary(_results("gspo", 1, lo) + _results("gspo", 16, hi),
                                    [1, 16], warmup_avg_at_k=0.6)["learns"]


def test_markdown_report_has_cells_drops_and_collapses():
    collapse = [0.8] * 20 + [0.1] * 20
    results = (_results("gspo", 1, [0.6, 0.7, 0.65]) + _results("gspo", 8, [0.3, 0.4, 0.35])
               + _results("sat_gspo", 1, [0.6, 0.7, 0.65])
               + _results("sat_gspo", 8, [0.58, 0.68, 0.63], rewards=collapse))
    text = sr.results_markdown(results, [1, 8], 0.5)
    assert "Warm-up policy: 0.500" in text
    assert "| gspo | 0.650 ± 0.124 | 0.350 ± 0.124 |" in text
    assert "| gspo | +0.300 [+0.300, +0.300] | — |" in text
    assert "| sat_gspo | +0.020 [+0.020, +0.020] | -0.280 [-0.280, -0.280] (separates) |" in text
    assert "| sat_gspo | 0/3 | 3/3 (step 26, 26, 26) | 3 |" in text
    # a cell the sweep did not run
    text = sr.results_markdown(results + _results("gspo", 16, [0.2]), [1, 8, 16], 0.5)
    assert "| sat_gspo | 0/3 | 3/3 (step 26, 26, 26) | — | 3 |" in text


def test_a_drop_is_compared_with_gspos_over_the_seeds_both_ran():
    """GSPO ran 4 seeds at lags 1 and 16, SAT-GSPO 3 of them, GRPO lag 1 only: SAT-GSPO's
    drop is paired with GSPO's on seeds 0-2, and GRPO has no row in the 1 -> 16 table."""
    results = (_results("gspo", 1, [0.6, 0.7, 0.65, 0.9])
               + _results("gspo", 16, [0.3, 0.4, 0.35, 0.1])
               + _results("sat_gspo", 1, [0.6, 0.7, 0.65])
               + _results("sat_gspo", 16, [0.5, 0.6, 0.55])
               + _results("grpo", 1, [0.6, 0.7, 0.65]))
    text = sr.results_markdown(results, [1, 16], None).split("Drop lag 1 -> lag 16")[1]
    assert "| sat_gspo | +0.100 [+0.100, +0.100] | -0.200 [-0.200, -0.200] (separates) |" in text
    assert "| grpo |" not in text.split("Collapsed runs")[0] and "nan" not in text


def test_diagnostics_show_every_lag_when_there_are_three():
    assert sr.shown_lags([16, 1, 8]) == [1, 8, 16]
    assert sr.shown_lags([1, 2, 4, 8]) == [1, 8]


def test_diagnostics_table_averages_steps_then_seeds_at_the_edge_lags(tmp_path):
    def write(variant, lag, seed, rows):
        path = RunDirs(RunSpec(variant, lag, seed).run_dir(tmp_path)).metrics
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"step": i + 1, **r}) + "\n"
                                for i, r in enumerate(rows)))

    write("gspo", 1, 0, [{"router_mismatch": 0.1}, {"router_mismatch": 0.3}])  # run mean 0.2
    write("gspo", 1, 1, [{"router_mismatch": 0.4, "kl_k3": "nan-as-text"}])    # run mean 0.4
    write("gspo", 4, 0, [{"router_mismatch": 9.0}])  # a middle lag of four: not shown
    write("gspo", 16, 0, [{"router_mismatch": 0.5, "kl_k3": 0.25}])
    write("grpo", 1, 0, [{"router_mismatch": 0.7}])  # run at lag 1 only: one row
    results = [{"variant": v, "lag": lag, "seed": s}
               for v, lag, s in (("gspo", 1, 0), ("gspo", 1, 1), ("gspo", 4, 0),
                                 ("gspo", 16, 0), ("grpo", 1, 0))]
    text = sr.diagnostics_markdown(results, sr.run_metrics(results, tmp_path), [1, 2, 4, 16])
    assert [line.split("|")[2].strip() for line in text.splitlines()
            if line.startswith("| grpo")] == ["1"]
    rows = [line for line in text.splitlines() if line.startswith("| gspo")]
    assert len(rows) == 2
    lag1, lag16 = ([c.strip() for c in row.strip("|").split("|")] for row in rows)
    names = [name for name, _ in sr.DIAGNOSTICS]
    assert lag1[1] == "1" and lag1[2 + names.index("router_mismatch")] == "0.300"
    assert lag1[2 + names.index("kl_k3")] == "—"  # text values are not numbers
    assert lag16[2 + names.index("kl_k3")] == "0.250"


def _write_metrics(root, variant, lag, seed, rows):
    path = RunDirs(RunSpec(variant, lag, seed).run_dir(root)).metrics
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": i + 1, **r}) + "\n" for i, r in enumerate(rows)))


def test_drop_tables_from_the_smallest_lag_to_each_other_lag():
    results = (_results("gspo", 1, [0.6, 0.7, 0.65]) + _results("gspo", 8, [0.5, 0.6, 0.55])
               + _results("gspo", 16, [0.3, 0.4, 0.35]))
    text = sr.results_markdown(results, [1, 8, 16], None)
    assert "Drop lag 1 -> lag 8" in text and "Drop lag 1 -> lag 16" in text
    assert "| gspo | +0.100 [+0.100, +0.100] | — |" in text
    assert "| gspo | +0.300 [+0.300, +0.300] | — |" in text


def test_scores_are_compared_with_gspos_at_each_lag_paired_by_seed():
    results = (_results("gspo", 1, [0.5, 0.6, 0.55]) + _results("sat_gspo", 1, [0.6, 0.7, 0.65])
               + _results("gspo", 8, [0.5, 0.6, 0.55]) + _results("sat_gspo", 8, [0.4, 0.8, 0.5]))
    text = sr.results_markdown(results, [1, 8], None)
    assert "| sat_gspo | +0.100 [+0.100, +0.100] (separates) | +0.017 [" in text
    assert "| gspo | +" not in text.split("Score minus GSPO's")[1].split("Drop lag")[0]
    # the lag-8 difference straddles zero: -0.1, +0.2, -0.05 per seed
    assert text.count("(separates)") == 1
    assert "Score minus GSPO's" not in sr.results_markdown(
        _results("sat_gspo", 1, [0.6, 0.7]), [1], None)


def test_sat_table_averages_steps_then_seeds_for_the_objectives_that_narrow(tmp_path):
    sat = {"sat_q": 0.05, "sat_tail_frac": 0.1, "sat_c_plus_mean": 0.9,
           "sat_c_minus_mean": 0.5, "sat_newly_clipped_frac": 0.02,
           "sat_mean_lo_radius": 1e-3, "sat_mean_hi_radius": 2e-3}
    _write_metrics(tmp_path, "sat_gspo", 8, 0, [sat, {**sat, "sat_newly_clipped_frac": 0.04}])
    _write_metrics(tmp_path, "sat_gspo", 8, 1, [{**sat, "sat_newly_clipped_frac": 0.06}])
    _write_metrics(tmp_path, "gspo", 8, 0, [{**sat, "sat_tail_frac": 0.0}])  # GSPO: no tail
    results = [{"variant": v, "lag": 8, "seed": s}
               for v, s in (("sat_gspo", 0), ("sat_gspo", 1), ("gspo", 0))]
    text = sr.sat_markdown(results, sr.run_metrics(results, tmp_path), [8])
    # the mean factor on gated units is c+ + c- - 1 (one of them is 1 on each gated unit)
    assert "| sat_gspo | 8 | 5.00e-02 | 10.00% | 0.400 | 4.50% | 1.00e-03 | 2.00e-03 |" in text
    assert "| gspo |" not in text
    # the selection's mechanism check reads the same statistics, at the largest lag only
    check = sr.mechanism_check(results, tmp_path, "sat_gspo")
    assert check["sat_newly_clipped_frac"] == pytest.approx(0.045) and check["acts"]
    assert check["lag"] == 8 and check["n"] == 2


def test_selection_reports_the_mechanism_but_never_its_score(tmp_path):
    lo = [0.60, 0.62, 0.58]
    hi = [0.50, 0.52, 0.49]
    for s in range(3):
        _write_metrics(tmp_path, "sat_gspo", 16, s, [{
            "sat_q": 0.2, "sat_tail_frac": 0.1, "sat_c_plus_mean": 1.0, "sat_c_minus_mean": 0.45,
            "sat_newly_clipped_frac": 0.01, "sat_mean_lo_radius": 1e-3,
            "sat_mean_hi_radius": 1e-3}])
    results = (_results("gspo", 1, lo) + _results("gspo", 16, hi)
               + _results("sat_gspo", 16, [0.987, 0.986, 0.985]))
    line = sr.write_selection(results, tmp_path, [1, 16], mechanism="sat_gspo")
    assert "newly clipped 1.00% of tokens" in line and "newly clipped >= 2%: no" in line
    assert "q 2.00e-01), mean factor on gated units 0.450" in line
    text = (tmp_path / "selection.md").read_text()
    assert "0.98" not in text and "| sat_gspo |" not in text  # its scores are not shown
    saved = json.loads((tmp_path / "selection.json").read_text())
    assert saved["variant"] == "gspo" and saved["mechanism"]["acts"] is False


def test_the_report_does_not_load_the_sweep():
    """RunSpec lives in sweep_spec: the report reads a sweep's files without importing the
    module that runs it (which imports the report: no cycle)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, satjax.app.sweep_report; "
            "sys.exit('satjax.app.lag_sweep' in sys.modules)")
    repo = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(repo), "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-2000:]
