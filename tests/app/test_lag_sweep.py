"""``satjax lag-sweep`` on a toy budget: runs, reports, plots, and resumes without redoing."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from satjax.app.sweep_spec import RunSpec

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_lag_sweep_writes_report_and_resumes_without_rerunning(tmp_path):
    # the test bed's config (sort 6 digits, 32 experts top-4, bf16 sampling), cut to seconds
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "satjax", "lag-sweep", "--config",
           str(REPO / "configs/testbed.yaml"), "--out", str(tmp_path),
           "--lags", "0,2", "--seeds", "0,1", "--steps", "3", "--eval-every", "3",
           "--jobs", "2", "--set", "sft.steps=3", "--set", "eval.num_prompts=4",
           "--set", "eval.k=2", "--set", "rollout.prompts_per_step=2",
           "--set", "rollout.group_size=4"]
    variants = ["--variants", "gspo,sat_grpo_r3"]
    r = subprocess.run(cmd + variants, env=env, capture_output=True, text=True, timeout=600,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("versions: python ")
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert tuple(rows[0]) == ("variant", "lag", "seed", "steps", "k", "final_avg_at_k",
                              "seconds", "reward_peak", "reward_final", "collapsed",
                              "collapse_step")
    assert sorted((row["variant"], row["lag"], row["seed"]) for row in rows) == sorted(
        (v, lag, s) for v in ("gspo", "sat_grpo_r3") for lag in "02" for s in "01")
    assert all(0.0 <= float(row["final_avg_at_k"]) <= 1.0 for row in rows)
    assert len(list((tmp_path / "jax_cache").iterdir())) > 5  # the runs' shared compile cache
    table = (tmp_path / "results.md").read_text()
    assert "| sat_grpo_r3 |" in table and "Drop lag 0 -> lag 2" in table
    assert "Collapsed runs" in table and "Warm-up policy: " in table
    for png in ("reward_vs_step.png", "score_vs_lag.png", "tail_and_flips_vs_lag.png",
                "diagnostics_vs_step.png"):
        assert (tmp_path / png).stat().st_size > 1000
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert sweep["lags"] == [0, 2] and sweep["variants"] == ["gspo", "sat_grpo_r3"]
    # lag 2 really trained on data two versions old, and every step logged the diagnostics
    records = RunSpec("gspo", 2, 0).read_metrics(tmp_path)
    assert [m["lag_mean"] for m in records] == [0.0, 1.0, 2.0]
    for key in ("token_gate_frac", "token_extreme_frac", "kl_k3", "grad_norm"):
        assert all(key in m for m in records), key
    assert records[0]["kl_k3"] < 1e-2  # lag 0 at step 1: only bf16-vs-fp32 mismatch
    # a finished run keeps two small files (what a sweep resumed elsewhere needs)
    run_files = {str(f.relative_to(tmp_path / "runs" / "gspo-lag2-seed0"))
                 for f in (tmp_path / "runs" / "gspo-lag2-seed0").rglob("*") if f.is_file()}
    assert run_files == {"result.json", "logs/metrics.jsonl.gz"}
    # this invocation's share of the compute: one line, all 8 runs
    (session,) = [json.loads(x) for x in (tmp_path / "sessions.jsonl").read_text().splitlines()]
    assert session["runs"] == 8 and session["jobs"] == 2 and session["wall_s"] > 0
    assert session["run_seconds"] == pytest.approx(
        sum(float(row["seconds"]) for row in rows), abs=1.0)
    assert "| total | | 8 |" in table

    results = sorted(tmp_path.glob("runs/*/result.json"))
    stamps = [p.stat().st_mtime_ns for p in results]
    r = subprocess.run(cmd + variants, env=env, capture_output=True, text=True, timeout=300,
                       cwd=REPO)
    assert r.returncode == 0 and "8 runs, 8 already done, 0 to redo" in r.stdout, r.stdout
    assert [p.stat().st_mtime_ns for p in results] == stamps  # nothing re-ran
    # one command for a design with fewer cells in some rows: gspo at lag 0 only,
    # sat_grpo_r3 with seed 0 only; every cell is done already, the report shows the rest
    # as not run
    r = subprocess.run(cmd + variants + ["--lags-of", "gspo:0", "--seeds-of", "sat_grpo_r3:0"],
                       env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0 and "4 runs, 4 already done, 0 to redo" in r.stdout, r.stdout
    table = (tmp_path / "results.md").read_text()
    assert "| gspo | " in table and "| —" in table.split("| gspo |")[1].split("\n")[0]
    # the selection phase (gspo at the smallest and largest lag) reuses the same runs and
    # adds its mechanism check, SAT-GSPO at the largest lag
    r = subprocess.run(cmd + ["--selection"], env=env, capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert r.returncode == 0 and "6 runs, 4 already done" in r.stdout, r.stdout
    selection = (tmp_path / "selection.md").read_text()
    assert "drop > 2 SE: " in selection and "Mechanism (sat_gspo, lag 2, n=2" in selection
    assert "mean factor on gated units" in selection
    # the invocation that re-ran nothing added no line; the selection's added one (2 runs)
    assert [json.loads(x)["runs"] for x in
            (tmp_path / "sessions.jsonl").read_text().splitlines()] == [8, 2]


def test_per_variant_cells_name_variants_of_the_sweep(tmp_path):
    r = subprocess.run([sys.executable, "-m", "satjax", "lag-sweep", "--out", str(tmp_path),
                        "--variants", "gspo", "--seeds-of", "grpo:0,1"],
                       capture_output=True, text=True, timeout=120, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "--seeds-of/--lags-of: ['grpo'] not among --variants" in r.stderr
    assert not any(tmp_path.iterdir())  # refused before anything ran


def test_run_configs_take_every_override_and_their_key_follows_the_config():
    from satjax.app import lag_sweep

    spec = RunSpec("gspo", 2, 0)
    sat = RunSpec("sat_gspo", 2, 0)
    overrides = ["eval.k=2", "objective.hparams.is_correction=tis",
                 "gspo:objective.hparams.eps_high=0.5", "sat_gspo:objective.hparams.quantile=0.8"]
    cfg = lag_sweep.run_config(spec, None, overrides, "out", "warm", 7, (0.05, 0.07))
    assert (cfg.objective.name, cfg.train.exact_lag, cfg.train.steps, cfg.eval.k) == (
        "gspo", 2, 7, 2)
    # the variant's own defaults, then --seq-eps, then objective.* for all, then its own
    assert cfg.objective.hparams == {"eps_low": 0.05, "eps_high": 0.5, "is_correction": "tis"}
    sat_cfg = lag_sweep.run_config(sat, None, overrides, "out", "warm", 7, (0.05, 0.07))
    assert (sat_cfg.objective.hparams["quantile"], sat_cfg.objective.hparams["eps_high"]) == (
        0.8, 0.07)

    key = lag_sweep.run_key(cfg, 20, {"sft": 1})
    assert key == lag_sweep.run_key(cfg, 20, {"sft": 1})
    more_steps = lag_sweep.run_config(spec, None, overrides, "out", "warm", 8, (0.05, 0.07))
    changed = {lag_sweep.run_key(more_steps, 20, {"sft": 1}),  # steps, eval cadence, warm-up
               lag_sweep.run_key(cfg, 10, {"sft": 1}), lag_sweep.run_key(cfg, 20, {"sft": 2})}
    assert len(changed) == 3 and key not in changed
    with pytest.raises(ValueError, match="objective.name"):
        lag_sweep.run_config(spec, None, ["objective.name=grpo"], "out", "warm", 7, None)
    # one --set for several variants; the gate-replay and bounded-lag rows
    several = ["sat_gspo,sat_gspo_gates:objective.hparams.proxy=token",
               "gspo_bounded:train.mismatch_target=0.05"]
    gates = lag_sweep.run_config(RunSpec("sat_gspo_gates", 2, 0), None, several, "out", "warm",
                                 7, (0.05, 0.07))
    assert (gates.train.replay, gates.objective.hparams["proxy"]) == ("gates", "token")
    assert lag_sweep.run_config(sat, None, several, "out", "warm", 7,
                                None).objective.hparams["proxy"] == "token"
    bounded = lag_sweep.run_config(RunSpec("gspo_bounded", 8, 0), None, several, "out",
                                   "warm", 7, None)
    assert (bounded.train.mismatch_target, bounded.train.max_lag) == (0.05, 8)
    with pytest.raises(ValueError, match="gspo_bounded:train.mismatch_target"):
        lag_sweep.run_config(RunSpec("gspo_bounded", 8, 0), None, [], "out", "warm", 7, None)
    with pytest.raises(ValueError, match="'nope' must be one of"):
        lag_sweep.split_overrides(["gspo,nope:train.steps=3"])
    # a row's own hparams (TIS at 2, DPPO's delta 1e-3) under --seq-eps and every --set
    tis = lag_sweep.run_config(RunSpec("gspo_tis_r3", 2, 0), None,
                               ["gspo_tis_r3:objective.hparams.is_threshold=3"], "out", "warm",
                               7, (0.05, 0.07))
    assert (tis.objective.name, tis.train.replay) == ("gspo", "experts")
    assert tis.objective.hparams == {"is_correction": "tis", "is_threshold": 3.0,
                                     "eps_low": 0.05, "eps_high": 0.07}
    dppo = lag_sweep.run_config(RunSpec("dppo_tv", 2, 0), None,
                                ["objective.hparams.delta_high=0.01"], "out", "warm", 7,
                                (0.05, 0.07))
    assert dppo.objective.hparams == {"delta_low": 1e-3, "delta_high": 0.01}
    # the grid's DPPO row: GRPO's token clip (its own radii, not --seq-eps) times the mask
    grid_dppo = lag_sweep.run_config(RunSpec("dppo_tv_clip", 2, 0), None, [], "out", "warm",
                                     7, (0.05, 0.07))
    assert (grid_dppo.objective.name, grid_dppo.objective.hparams) == (
        "dppo_tv_clip", {"delta_low": 1e-3, "delta_high": 1e-3})
    assert "dppo_tv_clip" in lag_sweep.PAPER_VARIANTS
    assert "dppo_tv" not in lag_sweep.PAPER_VARIANTS
    sat_grpo = lag_sweep.run_config(RunSpec("sat_grpo_r3", 2, 0), None, [], "out", "warm", 7,
                                    None)
    assert (sat_grpo.objective.name, sat_grpo.objective.hparams) == ("sat_grpo", {})
    # --variants: 'paper' is the 13 rows in order, each name once
    assert lag_sweep.variant_names("ppo_clip,paper,gspo") == [
        "ppo_clip", *lag_sweep.PAPER_VARIANTS]
    assert lag_sweep.variant_names(None) == list(lag_sweep.VARIANTS)
    assert set(lag_sweep.PAPER_VARIANTS) < set(lag_sweep.VARIANTS)


@pytest.mark.slow
def test_broadcast_interval_run_serves_lags_cycling_one_to_n(tmp_path):
    """``--lag-mode broadcast``: a run with interval 4, driven in-process (``run_one``)
    from a fresh tiny policy; each step's logged served lag follows slime's schedule
    (0, then 1..4 from version 0, then 1.. from version 4)."""
    from satjax.app import lag_sweep
    from satjax.train.lag_schedule import served_version

    spec = RunSpec("gspo", 4, 0, "broadcast")
    assert spec.name == "gspo-bcast4-seed0"
    steps = 7
    cfg = lag_sweep.run_config(
        spec, None,
        ["eval.num_prompts=4", "eval.k=2", "rollout.prompts_per_step=2",
         "rollout.group_size=4", "train.mesh={data: 1}"], str(tmp_path), "", steps, None)
    assert (cfg.train.broadcast_every, cfg.train.exact_lag, cfg.train.max_lag) == (4, -1, 4)
    result = lag_sweep.run_one(spec, cfg, str(tmp_path), steps, "key")
    assert (result["lag"], result["lag_mode"]) == (4, "broadcast")
    records = spec.read_metrics(tmp_path)
    lags = [m["lag_mean"] for m in records]
    assert lags == [0.0, 1.0, 2.0, 3.0, 4.0, 1.0, 2.0]
    assert lags == [k - served_version(k, cfg.train) for k in range(steps)]
    assert all(m["lag_max"] == m["lag_mean"] for m in records)  # one version per batch
    # the exact-lag spelling of the same numbers is another run, next to it
    assert RunSpec.of(result) == spec != RunSpec("gspo", 4, 0)
    exact = lag_sweep.run_config(RunSpec("gspo", 4, 0), None, [], str(tmp_path), "", 3, None)
    assert (exact.train.broadcast_every, exact.train.exact_lag) == (0, 4)


@pytest.mark.slow
def test_partial_rollout_runs_move_to_the_next_version_mid_batch(tmp_path):
    """``--set rollout.partial=true``: after its first decode segment each batch is sampled
    by the next version, so its oldest tokens have the run's lag and the rest one less."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "satjax", "lag-sweep", "--config",
           str(REPO / "configs/testbed.yaml"), "--out", str(tmp_path), "--variants", "gspo",
           "--lags", "2", "--seeds", "0", "--steps", "3", "--eval-every", "3", "--jobs", "1",
           "--set", "sft.steps=3", "--set", "eval.num_prompts=4", "--set", "eval.k=2",
           "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4",
           "--set", "rollout.partial=true"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    records = RunSpec("gspo", 2, 0).read_metrics(tmp_path)
    assert [m["lag_mean"] for m in records] == [0.0, 1.0, 2.0]  # the oldest tokens' lag
    assert records[0]["partial_frac"] == 0.0  # one version exists: nothing to move to
    for m in records[1:]:  # responses longer than one segment span two versions
        assert m["partial_frac"] > 0 and m["lag_token_mean"] < m["lag_mean"], m


@pytest.mark.slow
def test_long_answer_test_bed_runs_and_a_bounded_lag_follows_the_mismatch(tmp_path):
    """configs/testbed_long.yaml (16 separated digits, four updates per batch), cut to a
    few steps: the selection runs GSPO and the SAT-GSPO mechanism check; the bounded-lag
    row, with a target no batch meets and a one-batch window, lowers its lag each step."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "satjax", "lag-sweep", "--config",
           str(REPO / "configs/testbed_long.yaml"), "--out", str(tmp_path), "--lags", "0,2",
           "--seeds", "0,1", "--steps", "3", "--eval-every", "3", "--jobs", "2",
           "--set", "sft.steps=3", "--set", "eval.num_prompts=4", "--set", "eval.k=2",
           "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=4",
           "--set", "sat_gspo:objective.hparams.proxy=token",
           "--set", "gspo_bounded:train.mismatch_target=1e-12",
           "--set", "gspo_bounded:train.mismatch_window=1"]
    r = subprocess.run(cmd + ["--selection"], env=env, capture_output=True, text=True,
                       timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Mechanism (sat_gspo, lag 2, n=2, no score read): newly clipped " in r.stdout
    assert "sat_gspo-lag2-seed0: score not shown (mechanism check)" in r.stdout
    assert "sat_gspo-lag2-seed0: avg@" not in r.stdout
    assert sorted(p.parent.name for p in tmp_path.glob("runs/*/result.json")) == [
        "gspo-lag0-seed0", "gspo-lag0-seed1", "gspo-lag2-seed0", "gspo-lag2-seed1",
        "sat_gspo-lag2-seed0", "sat_gspo-lag2-seed1"]
    records = RunSpec("sat_gspo", 2, 0).read_metrics(tmp_path)
    assert all(m["response_len_mean"] > 8 for m in records)  # not the 7-token answers
    assert all(m["sat_tail_frac"] > 0 for m in records)  # the token proxy's tail
    r = subprocess.run(cmd + ["--variants", "gspo_bounded", "--lags", "2", "--seeds", "0"],
                       env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    records = RunSpec("gspo_bounded", 2, 0).read_metrics(tmp_path)
    # step 1: one version exists; each batch over the target lowers the limit by one
    assert [m["lag_mean"] for m in records] == [0.0, 1.0, 0.0]
    assert [m["lag_limit"] for m in records] == [1.0, 0.0, 0.0]


@pytest.mark.slow
def test_every_row_of_the_papers_grid_runs(tmp_path):
    """``--variants paper``: each of the 13 rows trains two steps in-process (``run_one``)
    from a fresh tiny policy at broadcast interval 2 and ends finite, having run the
    objective, routing replay and hyperparameters its row names: TIS rows weigh tokens
    (``is_weight_mean`` off 1 once the lag is 1), the others do not; R3 rows apply the
    engine's experts (no router mismatch applied)."""
    import math

    from satjax.app import lag_sweep

    rows = lag_sweep.variant_names("paper")
    assert rows == list(lag_sweep.PAPER_VARIANTS) and len(rows) == 13
    steps = 2
    for variant in rows:
        spec = RunSpec(variant, 2, 0, "broadcast")
        cfg = lag_sweep.run_config(
            spec, None,
            ["eval.num_prompts=2", "eval.k=1", "rollout.prompts_per_step=2",
             "rollout.group_size=2", "train.mesh={data: 1}"],
            str(tmp_path), "", steps, None)
        # No compile cache: it is JAX's process-wide setting and would outlive this test.
        result = lag_sweep.run_one(spec, cfg, str(tmp_path), steps, "key")
        row = lag_sweep.VARIANTS[variant]
        assert (result["objective"], result["replay"]) == (row["objective"], row["replay"])
        assert result["hparams"] == row.get("hparams", {}), variant
        assert math.isfinite(result["final_avg_at_k"]) and all(
            math.isfinite(r) for r in result["rewards"]), variant
        records = spec.read_metrics(tmp_path)
        assert [m["lag_mean"] for m in records] == [0.0, 1.0]
        assert all(math.isfinite(m["loss"]) and m["nonfinite_steps"] == 0 for m in records)
        tis = row.get("hparams", {}).get("is_correction") == "tis"
        assert (records[-1]["is_weight_mean"] != 1.0) == tis, (variant, records[-1])
        if row["replay"] == "experts":
            assert all(m["router_mismatch_applied"] == 0.0 for m in records), variant
    assert result["hparams"] == {} and result["objective"] == "sat_gspo"  # the last row


def _start_sweep(tmp_path, ignore_sigint=False):
    """A two-run sweep in its own session (its own process group), up to the point where
    its pool has started the runs; ``ignore_sigint`` starts it as a shell starts a
    background job (``trap '' INT`` then exec, no ``preexec_fn``: the pytest process may
    run gRPC threads, whose at-fork hooks must not run in a forked child)."""
    import time

    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "satjax", "lag-sweep", "--out", str(tmp_path), "--lags", "1",
           "--seeds", "0,1", "--steps", "50", "--jobs", "2", "--variants", "gspo",
           "--set", "sft.steps=2", "--compile-cache", "none"]
    if ignore_sigint:
        cmd = ["sh", "-c", "trap '' INT; exec \"$@\"", "sh", *cmd]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    for line in proc.stdout:  # the pool has started its runs
        if "in parallel" in line:
            break
    time.sleep(3)  # the runs import and compile
    return proc


def _wait_group_gone(proc) -> None:
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)  # any process of the sweep's group left?
        except ProcessLookupError:
            return
        time.sleep(0.2)
    pytest.fail("the sweep's runs outlived it by 30 s")


def test_ctrl_c_of_a_sweep_is_one_line_and_its_runs_stop(tmp_path):
    """A terminal's Ctrl-C reaches the sweep and every run's process: before, each printed
    its own traceback (230 lines in all). Now: one line, exit 130, the runs' processes gone
    (they ignore SIGINT and get SIGTERM from the kernel when the sweep exits)."""
    import signal

    proc = _start_sweep(tmp_path)
    try:
        os.killpg(proc.pid, signal.SIGINT)  # to its process group, as a terminal's would
        _, err = proc.communicate(timeout=60)
        _wait_group_gone(proc)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    after = err[err.rindex("lag sweep:"):].strip().splitlines()[1:]  # after its progress bar
    assert after == [
        f"satjax lag-sweep: interrupted; the finished runs are kept in {tmp_path} (the same "
        "command reuses them)"], err[-3000:]


def test_a_background_sweep_says_how_to_stop_it_and_sigterm_stops_its_runs(tmp_path):
    """A sweep started as a script's background job (``cmd &``) inherits SIGINT ignored, so
    ``kill -INT`` leaves it running (a sweep once went on for 50 minutes so): it says so
    with the command that stops it, and SIGTERM to its own pid ends it and its runs."""
    import signal
    import time

    proc = _start_sweep(tmp_path, ignore_sigint=True)
    try:
        os.kill(proc.pid, signal.SIGINT)  # ignored
        time.sleep(2)
        assert proc.poll() is None
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        _wait_group_gone(proc)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == -signal.SIGTERM, err[-3000:]
    assert (f"satjax lag-sweep: SIGINT is ignored here (a background job); stop it with "
            f"`kill {proc.pid}` (SIGTERM: the finished runs are kept)") in err, err[-3000:]
