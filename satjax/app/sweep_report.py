"""Tables, statistics and plots of a lag sweep: results.csv, results.md, selection.md, PNGs.

Statistics (every one over seeds; a run is one seed of one objective at one lag):

* a cell's score: the mean of its runs' final avg@k with a 95% Student-t interval,
  ``mean +- t_{0.975, n-1} * sd / sqrt(n)``;
* an objective's drop: ``score(lag_lo) - score(lag_hi)`` per seed, averaged (positive:
  staleness hurts), with its t interval; its difference from GSPO's drop gets a paired
  bootstrap interval (seeds resampled with replacement, the same seeds for both, 10,000
  resamples, percentile interval), so a shared seed's luck cancels;
* a collapsed run: its training reward (10-step trailing mean) ends below half its peak,
  i.e. it fell that far and did not recover by the last step; its step of collapse is the
  first step from which that mean stays below half the peak.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from satjax.app.sweep_spec import SESSIONS_FILE, RunSpec
from satjax.utils import atomic_write

SMOOTH_WINDOW = 10  # steps: a batch of 8 prompts gives a very noisy per-step reward
COLLAPSE_FRACTION = 0.5
BOOTSTRAP_RESAMPLES = 10_000
# the selection's mechanism check: SAT must newly clip at least this share of tokens at the
# largest lag (mean over steps and seeds), or there is nothing for it to change
MECHANISM_MIN_NEWLY_CLIPPED = 0.02
CSV_COLUMNS = ("variant", "lag", "seed", "steps", "k", "final_avg_at_k", "seconds",
               "reward_peak", "reward_final", "collapsed", "collapse_step")
# SAT's own per-step statistics, tabulated per lag for every objective that logs them: the
# gate q, the realised gate rate, the mean factor min(c+, c-) on gated units (a derived
# metric, DERIVED), the newly clipped share and the mean contracted radii
SAT_STATISTICS = ("sat_q", "sat_tail_frac", "sat_gated_factor", "sat_newly_clipped_frac",
                  "sat_mean_lo_radius", "sat_mean_hi_radius")
# Metrics computed from a step's logged ones. On a gated unit one of c+ and c- is the factor
# and the other is 1 (d has one sign), so the mean factor over gated units is
# mean c+ + mean c- - 1.
DERIVED = {"sat_gated_factor": lambda m: m["sat_c_plus_mean"] + m["sat_c_minus_mean"] - 1.0}
# per-step metrics the diagnostics table averages (over a run's steps, then over seeds)
DIAGNOSTICS = (("lag_mean", "served lag"), ("router_mismatch", "router flips"),
               ("router_mismatch_applied", "applied flips"),
               ("sat_tail_frac", "SAT gate rate"), ("sat_newly_clipped_frac", "SAT newly clipped"),
               ("clip_frac_low", "clipped low"), ("clip_frac_high", "clipped high"),
               ("token_extreme_frac", "F(log 2)"), ("mismatch_abs_mean", "d-bar"),
               ("kl_k3", "k3 KL"))


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` >= 1 degrees of freedom."""
    from scipy import stats

    return float(stats.t.ppf(0.975, df))


def mean_ci(xs: list[float] | np.ndarray) -> tuple[float, float]:
    """(mean, half-width of the 95% t interval); the half-width is nan for one value."""
    a = np.asarray(xs, np.float64)
    if a.size == 0:
        return float("nan"), float("nan")
    if a.size == 1:
        return float(a[0]), float("nan")
    return float(a.mean()), t_quantile_975(a.size - 1) * float(a.std(ddof=1)) / np.sqrt(a.size)


def paired_bootstrap_ci(a: np.ndarray, b: np.ndarray, *, resamples: int = BOOTSTRAP_RESAMPLES,
                        seed: int = 0) -> tuple[float, float, float]:
    """``mean(a - b)`` and its 95% percentile interval, resampling the pairs ``(a_i, b_i)``.

    ``a`` and ``b`` are [n] per-seed values of two objectives (same seeds, same order).
    """
    diff = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    if diff.ndim != 1 or diff.size < 2:
        raise ValueError(f"a, b: need two paired [n >= 2] arrays, got {diff.shape}")
    idx = np.random.default_rng(seed).integers(0, diff.size, (resamples, diff.size))
    means = diff[idx].mean(axis=1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return float(diff.mean()), float(lo), float(hi)


def smooth(ys: list[float] | np.ndarray, window: int = SMOOTH_WINDOW) -> np.ndarray:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    y = np.asarray(ys, np.float64)
    c = np.cumsum(np.insert(y, 0, 0.0))
    i = np.arange(1, y.size + 1)
    n = np.minimum(i, window)
    return (c[i] - c[i - n]) / n


def collapse_stats(rewards: list[float]) -> dict[str, Any]:
    """Peak and final smoothed training reward, whether the run collapsed (its final
    smoothed reward is below ``COLLAPSE_FRACTION`` of its peak) and the step of the
    collapse: the first step (1-based) from which the smoothed reward stays below that
    level to the end (None if the run did not collapse).

    >>> c = collapse_stats([1.0] * 20 + [0.0] * 20)
    >>> c["collapsed"], c["collapse_step"]  # the 10-step mean falls under 0.5 at step 26
    (True, 26)
    """
    s = smooth(rewards)
    peak, final = float(s.max()), float(s[-1])
    collapsed = bool(peak > 0 and final < COLLAPSE_FRACTION * peak)
    step = None
    if collapsed:
        above = np.flatnonzero(s >= COLLAPSE_FRACTION * peak)  # the peak is among them
        step = int(above[-1]) + 2  # the step after the last one at or above the level
    return {"reward_peak": peak, "reward_final": final, "collapsed": collapsed,
            "collapse_step": step}


def _fmt_ci(m: float, h: float) -> str:
    if np.isnan(m):  # a cell the sweep did not run (per-variant --lags-of / --seeds-of)
        return "—"
    return f"{m:.3f}" if np.isnan(h) else f"{m:.3f} ± {h:.3f}"


def _fmt_paired(a: np.ndarray, b: np.ndarray) -> str:
    """``mean(a - b) [95% paired bootstrap]``, marked when the interval excludes 0."""
    dm, blo, bhi = paired_bootstrap_ci(a, b)
    sep = " (separates)" if blo > 0 or bhi < 0 else ""
    return f"{dm:+.3f} [{blo:+.3f}, {bhi:+.3f}]{sep}"


def _by_cell(results: list[dict[str, Any]]) -> dict[tuple[str, int], dict[int, float]]:
    by: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
    for r in results:
        by[(r["variant"], r["lag"])][r["seed"]] = r["final_avg_at_k"]
    return by


def shown_lags(lags: list[int]) -> list[int]:
    """The lags the per-lag diagnostics show: every lag when there are at most three (a
    paper-recipe sweep's 1, 8 and 16), else the smallest and the largest."""
    unique = sorted(set(lags))
    return unique if len(unique) <= 3 else [unique[0], unique[-1]]


def drops(results: list[dict[str, Any]], lo: int, hi: int) -> dict[str, dict[int, float]]:
    """Per variant run at both lags, its per-seed drops ``{seed: score(lo) - score(hi)}``
    over the seeds run at both."""
    by = _by_cell(results)
    out = {}
    for v in dict.fromkeys(r["variant"] for r in results):
        seeds = sorted(set(by[(v, lo)]) & set(by[(v, hi)]))
        if seeds:
            out[v] = {s: by[(v, lo)][s] - by[(v, hi)][s] for s in seeds}
    return out


def write_csv_table_plots(results: list[dict[str, Any]], out: Path, lags: list[int], *,
                          warmup_avg_at_k: float | None = None) -> None:
    """results.csv, results.md (scores, drops, collapses) and the PNG plots in ``out``."""
    out = Path(out)
    rows = []
    for r in results:
        c = collapse_stats(r["rewards"])
        rows.append([r["variant"], r["lag"], r["seed"], r["steps"], r["k"],
                     f"{r['final_avg_at_k']:.4f}", f"{r['seconds']:.1f}",
                     f"{c['reward_peak']:.4f}", f"{c['reward_final']:.4f}", int(c["collapsed"]),
                     "" if c["collapse_step"] is None else c["collapse_step"]])
    lines = [",".join(CSV_COLUMNS)] + [",".join(str(x) for x in row) for row in rows]
    atomic_write(out / "results.csv", "\n".join(lines) + "\n")
    metrics = run_metrics(results, out)  # read once: the diagnostics table and the plots
    atomic_write(out / "results.md", results_markdown(results, lags, warmup_avg_at_k) + "\n"
                 + diagnostics_markdown(results, metrics, lags) + "\n"
                 + sat_markdown(results, metrics, lags) + "\n" + sessions_markdown(out))
    _plots(results, metrics, out, lags, list(dict.fromkeys(r["variant"] for r in results)))


def results_markdown(results: list[dict[str, Any]], lags: list[int],
                     warmup_avg_at_k: float | None) -> str:
    """The markdown report: score table, drop table with the GSPO comparison, collapses."""
    by = _by_cell(results)
    variants = list(dict.fromkeys(r["variant"] for r in results))
    k = results[0]["k"] if results else 0
    lo, hi = min(lags), max(lags)
    seeds = sorted({r["seed"] for r in results})
    warm = "" if warmup_avg_at_k is None else f" Warm-up policy: {warmup_avg_at_k:.3f}."
    # a broadcast sweep's "lag N" is its weight-broadcast interval, not one fixed lag
    mode = (" Lag N: weights broadcast every N versions, the rollout one step ahead "
            "(served lag 1..N)." if any(RunSpec.of(r).lag_mode == "broadcast"
                                        for r in results) else "")
    text = [f"Final avg@{k} on the held-out split: mean ± 95% t-interval half-width over "
            f"{len(seeds)} seed(s).{warm}{mode}", "",
            "| objective | " + " | ".join(f"lag {lag}" for lag in lags) + " |",
            "|---" * (len(lags) + 1) + "|"]
    for v in variants:
        text.append(f"| {v} | " + " | ".join(
            _fmt_ci(*mean_ci(list(by[(v, lag)].values()))) for lag in lags) + " |")
    text += ["", *versus_gspo_markdown(results, lags)]
    for hi in [lag for lag in lags if lag != lo]:
        text += ["", *drop_markdown(results, lo, hi)]
    steps: dict[tuple[str, int], list[int]] = defaultdict(list)  # of the collapsed runs
    n_runs: dict[tuple[str, int], int] = defaultdict(int)
    for r in results:
        n_runs[(r["variant"], r["lag"])] += 1
        step = collapse_stats(r["rewards"])["collapse_step"]
        if step is not None:
            steps[(r["variant"], r["lag"])].append(step)

    def cell(v: str, lag: int) -> str:
        if not n_runs[(v, lag)]:
            return "—"  # not run (per-variant --lags-of / --seeds-of)
        at = sorted(steps[(v, lag)])
        return f"{len(at)}/{n_runs[(v, lag)]}" + (
            f" (step {', '.join(map(str, at))})" if at else "")

    text += ["", f"Collapsed runs (training reward, {SMOOTH_WINDOW}-step mean, ends below "
             f"{COLLAPSE_FRACTION:g} x its peak), of the runs in each cell, with the step "
             "from which each stays below that level:", "",
             "| objective | " + " | ".join(f"lag {lag}" for lag in lags) + " | total |",
             "|---" * (len(lags) + 2) + "|"]
    for v in variants:
        total = sum(len(steps[(v, lag)]) for lag in lags)
        text.append(f"| {v} | " + " | ".join(cell(v, lag) for lag in lags) + f" | {total} |")
    return "\n".join(text) + "\n"


def versus_gspo_markdown(results: list[dict[str, Any]], lags: list[int]) -> list[str]:
    """Each objective's score minus GSPO's at each lag, paired by seed, with a paired
    bootstrap interval (lines of markdown; none without GSPO runs): the paper's ordering is
    a statement about these differences, not about the drops."""
    by = _by_cell(results)
    if not any(v == "gspo" for v, _ in by):
        return []
    text = ["Score minus GSPO's at the same lag (per seed, over the seeds both ran; positive: "
            "above GSPO), with a paired bootstrap 95% interval:", "",
            "| objective | " + " | ".join(f"lag {lag}" for lag in lags) + " |",
            "|---" * (len(lags) + 1) + "|"]
    for v in dict.fromkeys(r["variant"] for r in results):
        if v == "gspo":
            continue
        cells = []
        for lag in lags:
            seeds = sorted(set(by[(v, lag)]) & set(by[("gspo", lag)]))
            if len(seeds) < 2:
                cells.append("—")
                continue
            cells.append(_fmt_paired(np.array([by[(v, lag)][s] for s in seeds]),
                                     np.array([by[("gspo", lag)][s] for s in seeds])))
        text.append(f"| {v} | " + " | ".join(cells) + " |")
    return text


def drop_markdown(results: list[dict[str, Any]], lo: int, hi: int) -> list[str]:
    """The drop table from lag ``lo`` to ``hi``, with each drop's paired bootstrap
    difference from GSPO's (lines of markdown)."""
    d = drops(results, lo, hi)  # only the objectives run at both lags
    text = [f"Drop lag {lo} -> lag {hi} (score at lag {lo} minus lag {hi}, per seed; "
            "positive: staleness hurts), and its difference from GSPO's drop over the seeds "
            "both ran with a paired bootstrap 95% interval (negative: degrades less than "
            "GSPO):", "",
            "| objective | drop [95% t-interval] | minus GSPO's drop [95% bootstrap] |",
            "|---|---|---|"]
    gspo = d.get("gspo", {})
    for v, dv in d.items():
        m, h = mean_ci(list(dv.values()))
        cell = f"{m:+.3f}" if np.isnan(h) else f"{m:+.3f} [{m - h:+.3f}, {m + h:+.3f}]"
        seeds = sorted(set(dv) & set(gspo))
        if v == "gspo" or len(seeds) < 2:
            cmp = "—"
        else:
            cmp = _fmt_paired(np.array([dv[s] for s in seeds]),
                              np.array([gspo[s] for s in seeds]))
        text.append(f"| {v} | {cell} | {cmp} |")
    return text


def sat_markdown(results: list[dict[str, Any]], metrics: dict[RunKey, list[dict[str, Any]]],
                 lags: list[int]) -> str:
    """SAT's own statistics per objective and lag (:data:`SAT_STATISTICS`, each averaged
    over a run's steps, then over seeds), for the objectives that narrow (a nonzero tail)."""
    cell = run_means(results, metrics, SAT_STATISTICS)
    sat = [v for v in dict.fromkeys(r["variant"] for r in results)
           if any(np.mean(cell[(v, lag)]["sat_tail_frac"] or [0.0]) > 0 for lag in lags)]
    text = ["SAT's own statistics, each per-step value averaged over a run's steps, then over "
            "the seeds (q: the gate; gate rate: the share of SAT's units, tokens or sequences "
            "by the proxy, past the gate; factor: the mean min(c+, c-) on gated units; newly "
            "clipped: the share of tokens clipped by SAT's interval but not by the base one; "
            "radii: the mean 1 - lo and hi - 1):", "",
            "| objective | lag | q | gate rate | factor on gated | newly clipped "
            "| mean low radius | mean high radius |",
            "|---|---|---|---|---|---|---|---|"]
    ran = {(r["variant"], r["lag"]) for r in results}
    for v in sat:
        for lag in [lag for lag in lags if (v, lag) in ran]:
            c = cell[(v, lag)]
            text.append(f"| {v} | {lag} | " + " | ".join(
                _fmt_statistic(n, float(np.mean(c[n]))) if c[n] else "—"
                for n in SAT_STATISTICS) + " |")
    return "\n".join(text) + "\n"


def selection_summary(results: list[dict[str, Any]], lags: list[int],
                      warmup_avg_at_k: float | None = None) -> dict[str, Any]:
    """The selection phase's verdict for its one objective: mean score at the smallest and
    largest lag, the drop, its standard error ``sqrt(sd_lo^2/n_lo + sd_hi^2/n_hi)`` and
    whether the drop exceeds 2 of them; given the warm-up's score (one fixed policy, no
    seed spread), whether the smallest lag learns: its gain over the warm-up exceeds 2
    standard errors ``sd_lo / sqrt(n_lo)``."""
    lo, hi = min(lags), max(lags)
    (v,) = {r["variant"] for r in results}
    a = np.array([r["final_avg_at_k"] for r in results if r["lag"] == lo], np.float64)
    b = np.array([r["final_avg_at_k"] for r in results if r["lag"] == hi], np.float64)
    if a.size < 2 or b.size < 2:
        raise ValueError(f"selection: need >= 2 seeds at lags {lo} and {hi}, got "
                         f"{a.size} and {b.size}")
    se = float(np.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size))
    drop = float(a.mean() - b.mean())
    collapsed = {lag: sum(collapse_stats(r["rewards"])["collapsed"] for r in results
                          if r["lag"] == lag) for lag in (lo, hi)}
    learns: dict[str, Any] = {}
    if warmup_avg_at_k is not None:
        gain, se_lo = float(a.mean() - warmup_avg_at_k), float(a.std(ddof=1) / np.sqrt(a.size))
        learns = {"gain_lo": gain, "se_lo": se_lo,
                  "gain_in_se": gain / se_lo if se_lo > 0 else float("inf"),
                  "learns": bool(gain > 2 * se_lo)}
    return {"variant": v, "lag_lo": lo, "lag_hi": hi, "n_lo": int(a.size),
            "n_hi": int(b.size), "mean_lo": float(a.mean()), "mean_hi": float(b.mean()),
            "drop": drop, "se": se, "drop_in_se": drop / se if se > 0 else float("inf"),
            "degrades": bool(drop > 2 * se), "collapsed": collapsed, **learns}


def mechanism_check(results: list[dict[str, Any]], out: Path, variant: str) -> dict[str, Any]:
    """``variant``'s SAT statistics at its largest lag, from the runs' per-step metrics (no
    score is read): the newly clipped share, the tail share, the mean radii (each averaged
    over a run's steps, then over seeds), and whether the newly clipped share reaches
    :data:`MECHANISM_MIN_NEWLY_CLIPPED`."""
    runs = [r for r in results if r["variant"] == variant]
    if not runs:
        raise ValueError(f"mechanism check: no {variant} runs")
    lag = max(r["lag"] for r in runs)
    runs = [r for r in runs if r["lag"] == lag]
    cell = run_means(runs, run_metrics(runs, out), SAT_STATISTICS)[(variant, lag)]
    stats = {name: float(np.mean(cell[name])) for name in SAT_STATISTICS}
    return {"variant": variant, "lag": lag, "n": len(runs), **stats,
            "acts": bool(stats["sat_newly_clipped_frac"] >= MECHANISM_MIN_NEWLY_CLIPPED)}


def write_selection(results: list[dict[str, Any]], out: Path, lags: list[int], *,
                    warmup_avg_at_k: float | None = None, mechanism: str | None = None) -> str:
    """Writes ``selection.md`` (the verdict, then the report of the selection objective's
    runs) and ``selection.json`` in ``out``; returns the verdict. With ``mechanism``, the
    runs of that variant are the mechanism check (:func:`mechanism_check`): its SAT
    statistics are reported, never its score."""
    mech = None
    if mechanism is not None:
        mech = mechanism_check(results, out, mechanism)
        results = [r for r in results if r["variant"] != mechanism]
    s = selection_summary(results, lags, warmup_avg_at_k)

    def yes(flag: bool) -> str:
        return "yes" if flag else "no"

    learns = ("" if "learns" not in s else
              f"lag {s['lag_lo']} vs the warm-up's {warmup_avg_at_k:.3f}: {s['gain_lo']:+.3f}, "
              f"SE {s['se_lo']:.3f} ({s['gain_in_se']:.1f} SE); learns (> 2 SE): "
              f"{yes(s['learns'])}; ")
    text = (f"Selection ({s['variant']} only): avg@k {s['mean_lo']:.3f} at lag {s['lag_lo']} "
            f"(n={s['n_lo']}), {s['mean_hi']:.3f} at lag {s['lag_hi']} (n={s['n_hi']}); "
            f"drop {s['drop']:+.3f}, SE {s['se']:.3f} ({s['drop_in_se']:.1f} SE); "
            f"drop > 2 SE: {yes(s['degrades'])}; {learns}collapsed runs: "
            f"{s['collapsed'][s['lag_lo']]} at lag {s['lag_lo']}, "
            f"{s['collapsed'][s['lag_hi']]} at lag {s['lag_hi']}.\n")
    if mech is not None:
        text += (f"Mechanism ({mech['variant']}, lag {mech['lag']}, n={mech['n']}, no score "
                 f"read): newly clipped {mech['sat_newly_clipped_frac']:.2%} of tokens, tail "
                 f"{mech['sat_tail_frac']:.2%} (the gate rate; q {mech['sat_q']:.2e}), mean "
                 f"factor on gated units {mech['sat_gated_factor']:.3f}, mean radii low "
                 f"{mech['sat_mean_lo_radius']:.2e}"
                 f" high {mech['sat_mean_hi_radius']:.2e}; newly clipped >= "
                 f"{MECHANISM_MIN_NEWLY_CLIPPED:.0%}: {yes(mech['acts'])}.\n")
        s = {**s, "mechanism": mech}
    atomic_write(Path(out) / "selection.json", json.dumps(s, indent=1))
    report = results_markdown(results, sorted({s["lag_lo"], s["lag_hi"]}), warmup_avg_at_k)
    atomic_write(Path(out) / "selection.md", text + "\n" + report + "\n"
                 + sessions_markdown(Path(out)))
    return text


def sessions_markdown(out: Path) -> str:
    """The compute each invocation of the sweep in ``out`` spent (its
    :data:`~satjax.app.sweep_spec.SESSIONS_FILE`, one line per invocation, written by
    ``satjax lag-sweep``), and the total.

    >>> import tempfile, json
    >>> out = Path(tempfile.mkdtemp())
    >>> line = {"started": "2026-12-07T03:00:00Z", "wall_s": 3600.0, "runs": 10,
    ...         "run_seconds": 7000.0, "jobs": 2, "cpus": 2, "commit": "abc1234"}
    >>> _ = (out / "sessions.jsonl").write_text(json.dumps(line) + "\\n")
    >>> print(sessions_markdown(out).splitlines()[-1])
    | total | | 10 | 1.00 h | 1.94 h | |
    """
    path = out / SESSIONS_FILE
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] \
        if path.exists() else []
    text = ["Compute, per invocation of the sweep (wall: from its start to its last finished "
            "run; process: the runs' own seconds, several at a time):", "",
            "| started (UTC) | commit | runs | wall | process | jobs / CPUs |",
            "|---|---|---|---|---|---|"]
    for s in lines:
        text.append(f"| {s['started']} | {s.get('commit') or '—'} | {s['runs']} | "
                    f"{s['wall_s'] / 3600:.2f} h | {s['run_seconds'] / 3600:.2f} h | "
                    f"{s['jobs']} / {s['cpus']} |")
    text.append(f"| total | | {sum(s['runs'] for s in lines)} | "
                f"{sum(s['wall_s'] for s in lines) / 3600:.2f} h | "
                f"{sum(s['run_seconds'] for s in lines) / 3600:.2f} h | |")
    return "\n".join(text) + "\n"


def _fmt_statistic(name: str, value: float) -> str:
    if "radius" in name or name == "sat_q":
        return f"{value:.2e}"
    return f"{value:.3f}" if name == "sat_gated_factor" else f"{value:.2%}"


RunKey = tuple[str, int, int]  # (variant, lag, seed)


def run_metrics(results: list[dict[str, Any]], out: Path) -> dict[RunKey, list[dict[str, Any]]]:
    """Each run's per-step metrics rows (:meth:`RunSpec.read_metrics`)."""
    return {(r["variant"], r["lag"], r["seed"]): RunSpec.of(r).read_metrics(out)
            for r in results}


def _value(row: dict[str, Any], name: str) -> float | None:
    """A step's metric ``name`` (logged, or :data:`DERIVED` from logged ones), None if absent."""
    if name in DERIVED:
        try:
            return float(DERIVED[name](row))
        except (KeyError, TypeError):
            return None
    value = row.get(name)
    return float(value) if isinstance(value, int | float) else None


def run_means(results: list[dict[str, Any]], metrics: dict[RunKey, list[dict[str, Any]]],
              names: Sequence[str]) -> dict[tuple[str, int], dict[str, list[float]]]:
    """Per (objective, lag) and metric name, each run's mean of that per-step metric over
    its steps (``metrics``: :func:`run_metrics`); a run that never logged it is left out."""
    cell: dict[tuple[str, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        rows = metrics[(r["variant"], r["lag"], r["seed"])]
        for name in names:
            xs = [x for x in (_value(m, name) for m in rows) if x is not None]
            if xs:
                cell[(r["variant"], r["lag"])][name].append(float(np.mean(xs)))
    return cell


def diagnostics_markdown(results: list[dict[str, Any]],
                         metrics: dict[RunKey, list[dict[str, Any]]], lags: list[int]) -> str:
    """Per objective at each of :func:`shown_lags` it ran, each :data:`DIAGNOSTICS` metric
    averaged over a run's steps (``metrics``: :func:`run_metrics`), then over its seeds
    (``—``: none of its runs logged it)."""
    edge = shown_lags(lags)
    variants = list(dict.fromkeys(r["variant"] for r in results))
    ran = {(r["variant"], r["lag"]) for r in results}
    means = run_means([r for r in results if r["lag"] in edge], metrics,
                      [name for name, _ in DIAGNOSTICS])
    text = ["Diagnostics: each per-step metric's mean over a run's steps, averaged over the "
            "seeds (served lag: the versions between the sampling and the trained policy, "
            "below the nominal lag while fewer versions exist, and under a bounded lag; "
            "router flips: the engine's and the trainer's expert sets differ, per "
            "(token, layer); applied: the flips the trainer's forward used, 0 under replay; "
            "SAT newly clipped: clipped by SAT's narrowed interval but not by the base clip):",
            "", "| objective | lag | " + " | ".join(label for _, label in DIAGNOSTICS) + " |",
            "|---" * (len(DIAGNOSTICS) + 2) + "|"]
    for v in variants:
        for lag in [lag for lag in edge if (v, lag) in ran]:
            cell = means[(v, lag)]
            text.append(f"| {v} | {lag} | " + " | ".join(
                f"{np.mean(cell[name]):.3f}" if cell[name] else "—"
                for name, _ in DIAGNOSTICS) + " |")
    return "\n".join(text) + "\n"


def _plots(results: list[dict[str, Any]], metrics: dict[RunKey, list[dict[str, Any]]],
           out: Path, lags: list[int], variants: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {(r["variant"], r["lag"], r["seed"]): r for r in results}

    def series(key, name):
        rows = [m for m in metrics[key] if name in m and not isinstance(m[name], str)]
        return np.array([m["step"] for m in rows]), np.array([m[name] for m in rows], float)

    def keys_of(v, lag):
        return [k for k in runs if k[0] == v and k[1] == lag]

    # x offsets keep the error bars of different objectives apart on the log-lag axis
    offset = {v: 2 ** (0.06 * (i - (len(variants) - 1) / 2)) for i, v in enumerate(variants)}

    def lag_axis(ax, ylabel):
        # lags double; a lag of 0 (on-policy) needs the linear stretch of symlog
        if min(lags) > 0:
            ax.set_xscale("log", base=2)
        else:
            ax.set_xscale("symlog", base=2, linthresh=1)
        ax.set_xticks(lags, [str(x) for x in lags])
        ax.set_xlabel("policy lag (versions)")
        ax.set_ylabel(ylabel)

    def band(ax, xs, stack, label, **kw):
        m = stack.mean(axis=0)
        line, = ax.plot(xs, m, label=label, lw=1.2, **kw)
        if len(stack) > 1:
            se = stack.std(axis=0, ddof=1) / np.sqrt(len(stack))
            ax.fill_between(xs, m - se, m + se, color=line.get_color(), alpha=0.2, lw=0)

    # 1. final score vs lag, mean and 95% t interval over seeds
    fig, ax = plt.subplots(figsize=(6, 4))
    for v in variants:
        cis = [mean_ci([runs[k]["final_avg_at_k"] for k in keys_of(v, lag)]) for lag in lags]
        ax.errorbar([lag * offset[v] for lag in lags], [c[0] for c in cis],
                    yerr=[0 if np.isnan(c[1]) else c[1] for c in cis], marker="o", capsize=3,
                    label=v)
    lag_axis(ax, "final avg@k (mean, 95% CI)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "score_vs_lag.png", dpi=120)
    plt.close(fig)

    # 2. training reward vs step, one panel per lag, mean +- SE over seeds
    fig, axes = plt.subplots(1, len(lags), figsize=(3.6 * len(lags), 3.2), sharey=True,
                             squeeze=False)
    for ax, lag in zip(axes[0], lags, strict=True):
        for v in variants:
            keys = keys_of(v, lag)
            if keys:
                stack = np.stack([smooth(runs[k]["rewards"]) for k in keys])
                band(ax, np.arange(1, stack.shape[1] + 1), stack, v)
        ax.set_title(f"lag {lag}")
        ax.set_xlabel("step")
    axes[0][0].set_ylabel(f"training reward ({SMOOTH_WINDOW}-step mean, ± SE)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "reward_vs_step.png", dpi=120)
    plt.close(fig)

    # 3. SAT gate rate / newly clipped fractions and router flips vs lag (run means, 95% CI)
    def per_lag(v, name):
        return [mean_ci([float(np.mean(series(k, name)[1])) for k in keys_of(v, lag)
                         if series(k, name)[1].size]) for lag in lags]

    def errorbar(ax, v, name, **kw):
        cis = per_lag(v, name)
        return ax.errorbar([lag * offset[v] for lag in lags], [c[0] for c in cis],
                           yerr=[0 if np.isnan(c[1]) else c[1] for c in cis], marker="o",
                           capsize=3, **kw)

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for v in variants:
        errorbar(axes[0], v, "sat_tail_frac", label=v)
        errorbar(axes[1], v, "sat_newly_clipped_frac", label=v)
        bars = errorbar(axes[2], v, "router_mismatch", label=v)
        errorbar(axes[2], v, "router_mismatch_applied", ls="--", color=bars[0].get_color(),
                 lw=0.8, label=None)
    lag_axis(axes[0], "SAT gate rate (units past the gate)")
    lag_axis(axes[1], "clipped by SAT, not by the base clip")
    lag_axis(axes[2], "expert-set flips (solid: engine vs router;\n"
                      "dashed: applied, 0 under replay)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "tail_and_flips_vs_lag.png", dpi=120)
    plt.close(fig)

    # 4. per-step staleness diagnostics at each of shown_lags
    names = (("mismatch_abs_mean", "d-bar: mean |log pi - log mu|"),
             ("token_extreme_frac", "F(log 2): tokens with |d| > log 2"),
             ("kl_k3", "k3 KL(behaviour || current)"), ("grad_norm", "gradient norm"))
    edge = shown_lags(lags)
    fig, axes = plt.subplots(len(edge), len(names), figsize=(15, 3.2 * len(edge)),
                             squeeze=False)
    for row, lag in zip(axes, edge, strict=True):
        for ax, (name, label) in zip(row, names, strict=True):
            for v in variants:
                ys = [series(k, name) for k in keys_of(v, lag)]
                ys = [y for y in ys if y[1].size]
                if ys:
                    n = min(y[1].size for y in ys)
                    band(ax, ys[0][0][:n], np.stack([smooth(y[1][:n]) for y in ys]), v)
            ax.set_title(f"lag {lag}: {label}", fontsize=9)
            ax.set_xlabel("step")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "diagnostics_vs_step.png", dpi=120)
    plt.close(fig)
