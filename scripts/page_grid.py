"""The SAT page's grid beside a finished lag sweep's, row by row: what reproduces.

    python scripts/page_grid.py docs/results/paper-recipe [--page FILE] [--tie 0.5]

The authors' page reports one run per cell (its Result 3.4.1: AIME24 avg@8 at the best
checkpoint of Qwen3-30B-A3B-Base, lag 1 and lag 8 = a weight-broadcast interval of 8, and
which runs collapsed), in ``OUT/page_grid.json``. Another model, task and scale give other
numbers, so what a sweep can test are the page's *claims*, each a difference or an event:

1. each row against GSPO at lag 1 and at lag 8 (above, below);
2. each SAT row against its own base (SAT-GSPO+R3 against GSPO+R3, ...) at both lags;
3. each row's drop from lag 1 to lag 8;
4. which rows collapse at lag 8 (the page: GRPO and GSPO);
5. its Result 3.4.2: every row's training-inference mismatch d-bar (mean |log pi - log mu|
   over active tokens) is larger at lag 8 than at lag 1, and how the rows rank by it at 8.

The sweep's figure for 1-2 is the mean difference of final avg@k paired by seed with a
paired bootstrap 95% interval, for 3 the mean drop with a 95% t interval
(:mod:`satjax.app.sweep_report`), for 4 the collapsed runs and their steps, for 5 each
run's d-bar over its last quarter of steps (the page: its last epoch), the lag-8 minus
lag-1 difference paired by seed with a t interval, and the rank correlation of the rows'
lag-8 means with the page's. A page
difference smaller than ``--tie`` points (single runs: the page attaches no interval) is
read as no claim. Verdicts: ``reproduces`` (the interval excludes 0 on the page's side),
``reversed`` (it excludes 0 on the other side), ``not separated`` (it contains 0),
``consistent`` (page tie, interval contains 0), ``differs`` (page tie, interval excludes 0).

It reads the scores only once every run of the sweep's design (``sweep.json``) has
finished, and writes ``page_grid.md`` and ``page_grid.png`` in ``OUT``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from satjax.app.sweep_report import collapse_stats, mean_ci, paired_bootstrap_ci
from satjax.app.sweep_spec import RunSpec

PAGE_FILE = "page_grid.json"
# the SAT rows and the base each one contracts (the page's pairs)
SAT_PAIRS = (("sat_grpo", "grpo"), ("sat_gspo", "gspo"), ("sat_grpo_r3", "grpo_r3"),
             ("sat_gspo_r3", "gspo_r3"))
Scores = dict[tuple[str, int], dict[int, float]]  # (variant, lag) -> {seed: final avg@k}
TRAILING = 0.25  # d-bar over a run's last quarter of steps (the page: its last epoch)


def trailing_mismatch(rows: list[dict[str, Any]], frac: float = TRAILING) -> float | None:
    """A run's mean d-bar (``mismatch_abs_mean``) over its last ``frac`` of logged steps.

    >>> trailing_mismatch([{"mismatch_abs_mean": x} for x in (9.0, 9.0, 9.0, 1.0)])
    1.0
    """
    xs = [float(r["mismatch_abs_mean"]) for r in rows if "mismatch_abs_mean" in r]
    if not xs:
        return None
    return float(np.mean(xs[-max(1, int(np.ceil(frac * len(xs)))):]))


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (no ties expected).

    >>> round(spearman([1, 2, 3, 4], [10, 30, 20, 40]), 6), spearman([1, 2, 3], [3, 2, 1])
    (0.8, -1.0)
    """
    ra, rb = (np.argsort(np.argsort(x)).astype(np.float64) for x in (a, b))
    return float(np.corrcoef(ra, rb)[0, 1])


def design(sweep: dict[str, Any]) -> list[RunSpec]:
    """Every run of the sweep's design, as ``satjax lag-sweep`` recorded it in sweep.json."""
    seeds_of, lags_of = sweep.get("seeds_of") or {}, sweep.get("lags_of") or {}
    return [RunSpec(v, lag, s, sweep.get("lag_mode", "exact")) for v in sweep["variants"]
            for lag in lags_of.get(v, sweep["lags"]) for s in seeds_of.get(v, sweep["seeds"])]


def load_results(out: Path) -> list[dict[str, Any]]:
    """The finished results of the sweep's design, each with its trailing d-bar
    (``d_bar``); refuses while any run is unfinished."""
    sweep_path = out / "sweep.json"
    if not sweep_path.is_file():
        raise SystemExit(f"page_grid: {sweep_path} not found (not a lag sweep's --out?)")
    specs = design(json.loads(sweep_path.read_text()))
    missing = [s.name for s in specs if not s.result_path(out).is_file()]
    if missing:
        raise SystemExit(f"page_grid: {len(missing)} of the {len(specs)} runs of {out}'s "
                         f"design have not finished (e.g. {missing[0]}); the scores are "
                         f"read only once all have")
    return [{**json.loads(s.result_path(out).read_text()),
             "d_bar": trailing_mismatch(s.read_metrics(out))} for s in specs]


def claim(page_value: float, lo: float, hi: float, tie: float) -> str:
    """The verdict on one claim: the page's signed value against the sweep's interval.

    >>> claim(1.2, 0.01, 0.03, 0.5), claim(1.2, -0.03, -0.01, 0.5), claim(1.2, -0.01, 0.02, 0.5)
    ('reproduces', 'reversed', 'not separated')
    >>> claim(0.2, -0.01, 0.02, 0.5), claim(-0.3, 0.01, 0.02, 0.5)
    ('consistent', 'differs')
    """
    ours = 0 if lo <= 0 <= hi else (1 if lo > 0 else -1)
    if abs(page_value) < tie:
        return "consistent" if ours == 0 else "differs"
    if ours == 0:
        return "not separated"
    return "reproduces" if ours == np.sign(page_value) else "reversed"


def paired(scores: Scores, a: str, b: str, lag: int) -> tuple[float, float, float, int] | None:
    """mean(a - b) over the seeds both ran at ``lag``, its paired bootstrap interval, n."""
    seeds = sorted(set(scores.get((a, lag), {})) & set(scores.get((b, lag), {})))
    if len(seeds) < 2:
        return None
    x = np.array([scores[(a, lag)][s] for s in seeds])
    y = np.array([scores[(b, lag)][s] for s in seeds])
    return (*paired_bootstrap_ci(x, y), len(seeds))


def _versus(page: dict[str, Any], scores: Scores, pairs: list[tuple[str, str]], tie: float,
            lags: list[int]) -> tuple[list[str], list[dict[str, Any]]]:
    rows = page["rows"]
    head = "| row | against | " + " | ".join(
        f"lag {lag}: page | lag {lag}: here | lag {lag}: verdict" for lag in lags) + " |"
    text, points = [head, "|---|---" + "|---|---|---" * len(lags) + "|"], []
    for a, b in pairs:
        cells = []
        for i, lag in enumerate(lags):
            page_diff = rows[a]["score"][i] - rows[b]["score"][i]
            ours = paired(scores, a, b, lag)
            if ours is None:
                cells += [f"{page_diff:+.2f}", "not run", "—"]
                continue
            m, lo, hi, n = ours
            verdict = claim(page_diff, lo, hi, tie)
            cells += [f"{page_diff:+.2f}", f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}] (n={n})", verdict]
            points.append({"row": a, "against": b, "lag": lag, "page": page_diff, "mean": m,
                           "lo": lo, "hi": hi, "verdict": verdict})
        text.append(f"| {rows[a]['label']} | {rows[b]['label']} | " + " | ".join(cells) + " |")
    return text, points


def report(results: list[dict[str, Any]], page: dict[str, Any], tie: float,
           ) -> tuple[str, list[dict[str, Any]]]:
    """The markdown comparison and the points of its plot."""
    lags = list(page["lags"])
    scores: Scores = defaultdict(dict)
    collapses: dict[tuple[str, int], list[int | None]] = defaultdict(list)
    for r in results:
        scores[(r["variant"], r["lag"])][r["seed"]] = r["final_avg_at_k"]
        collapses[(r["variant"], r["lag"])].append(collapse_stats(r["rewards"])["collapse_step"])
    rows = [v for v in page["rows"] if any((v, lag) in scores for lag in lags)]
    text = [f"The page's grid ({page['metric']}; {page['source']}) beside this sweep's final "
            f"avg@k, row by row. A page difference under {tie:g} points is read as no claim "
            "(the page's cells are single runs). Here: mean over seeds with a 95% interval "
            "(paired bootstrap for differences, t for drops).", "",
            "**1. Each row against GSPO at the same lag**", ""]
    part, points = _versus(page, scores, [(v, "gspo") for v in rows if v != "gspo"], tie, lags)
    text += part
    text += ["", "**2. Each SAT row against its base** (the page: SAT above its base in every "
             "cell)", ""]
    part, more = _versus(page, scores, [p for p in SAT_PAIRS if p[0] in rows and p[1] in rows],
                         tie, lags)
    text += part
    points += more
    lo, hi = lags[0], lags[-1]
    text += ["", f"**3. Drop from lag {lo} to lag {hi}** (positive: staleness hurts) and "
             f"**4. collapses at lag {hi}**", "",
             "| row | page drop | here | verdict | page: collapsed | here: collapsed (step) "
             "| verdict |", "|---|---|---|---|---|---|---|"]
    for v in rows:
        page_row = page["rows"][v]
        page_drop = page_row["score"][0] - page_row["score"][-1]
        seeds = sorted(set(scores.get((v, lo), {})) & set(scores.get((v, hi), {})))
        d = [scores[(v, lo)][s] - scores[(v, hi)][s] for s in seeds]
        m, h = mean_ci(d)
        drop = ("not run", "—") if len(d) < 2 else (
            f"{m:+.3f} ± {h:.3f} (n={len(d)})", claim(page_drop, m - h, m + h, tie))
        steps = collapses.get((v, hi), [])
        at = sorted(s for s in steps if s is not None)
        page_collapsed = page_row["collapsed"][-1]
        collapse_verdict = ("reproduces" if page_collapsed and at else
                            "not reproduced" if page_collapsed else
                            "consistent" if not at else "differs")
        here = f"{len(at)}/{len(steps)}" + (f" ({', '.join(map(str, at))})" if at else "")
        text.append(f"| {page_row['label']} | {page_drop:+.2f} | {drop[0]} | {drop[1]} | "
                    f"{'yes' if page_collapsed else 'no'} | {here} | {collapse_verdict} |")
    text += ["", *_mismatch_markdown(results, page, lags)]
    counts: dict[str, int] = defaultdict(int)
    for p in points:
        counts[p["verdict"]] += 1
    text += ["", "Verdicts of the differences (tables 1 and 2): " + ", ".join(
        f"{k} {n}" for k, n in sorted(counts.items())) + "."]
    return "\n".join(text) + "\n", points


def _mismatch_markdown(results: list[dict[str, Any]], page: dict[str, Any],
                       lags: list[int]) -> list[str]:
    """Table 5: d-bar per row at both lags, its rise paired by seed, the rank correlation."""
    lo, hi = lags[0], lags[-1]
    d: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
    for r in results:
        if r.get("d_bar") is not None:
            d[(r["variant"], r["lag"])][r["seed"]] = r["d_bar"]
    text = [f"**5. Mismatch d-bar** (mean |log pi - log mu| over active tokens; the page: "
            f"{page.get('d_bar_source', 'its Result 3.4.2')}; here: each run's last "
            f"{TRAILING:.0%} of steps, mean ± 95% t interval over seeds)", "",
            f"| row | page lag {lo} | page lag {hi} | here lag {lo} | here lag {hi} | "
            f"here: rise {lo} -> {hi} (paired) | verdict (page: rises) |",
            "|---|---|---|---|---|---|---|"]
    ranked: list[tuple[float, float]] = []
    for v, row in page["rows"].items():
        if "d_bar" not in row or not (d.get((v, lo)) or d.get((v, hi))):
            continue
        cells = []
        for lag in (lo, hi):
            m, h = mean_ci(list(d.get((v, lag), {}).values()))
            cells.append("—" if np.isnan(m) else f"{m:.4f}" + ("" if np.isnan(h) else
                                                                f" ± {h:.4f}"))
        seeds = sorted(set(d.get((v, lo), {})) & set(d.get((v, hi), {})))
        rise = [d[(v, hi)][s] - d[(v, lo)][s] for s in seeds]
        m, h = mean_ci(rise)
        page_rise = row["d_bar"][-1] - row["d_bar"][0]
        verdict = "—" if len(rise) < 2 else claim(page_rise, m - h, m + h, 0.0)
        if d.get((v, hi)):
            ranked.append((row["d_bar"][-1], float(np.mean(list(d[(v, hi)].values())))))
        text.append(f"| {row['label']} | {row['d_bar'][0]:.4f} | {row['d_bar'][-1]:.4f} | "
                    f"{cells[0]} | {cells[1]} | "
                    + ("—" if len(rise) < 2 else f"{m:+.4f} ± {h:.4f} (n={len(rise)})")
                    + f" | {verdict} |")
    if len(ranked) >= 3:
        rho = spearman([p for p, _ in ranked], [o for _, o in ranked])
        text += ["", f"Rank correlation (Spearman) of the rows' lag-{hi} d-bar, the page's "
                 f"against this sweep's means: {rho:+.2f} over {len(ranked)} rows."]
    return text


def plot(points: list[dict[str, Any]], lags: list[int], tie: float, path: Path) -> None:
    """The page's difference against this sweep's, one panel per lag (tables 1 and 2); the
    band of page differences read as no claim is shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(lags), figsize=(5.5 * len(lags), 4.6), squeeze=False)
    colors = {"reproduces": "C2", "reversed": "C3", "not separated": "0.5",
              "consistent": "0.5", "differs": "C1"}
    for ax, lag in zip(axes[0], lags, strict=True):
        for p in (p for p in points if p["lag"] == lag):
            ax.errorbar(p["page"], p["mean"], yerr=[[p["mean"] - p["lo"]], [p["hi"] - p["mean"]]],
                        fmt="o" if p["against"] == "gspo" else "s", color=colors[p["verdict"]],
                        ms=4, capsize=2)
            ax.annotate(f"{p['row']}" + ("" if p["against"] == "gspo" else f" vs {p['against']}"),
                        (p["page"], p["mean"]), fontsize=6, xytext=(3, 2),
                        textcoords="offset points")
        ax.axvspan(-tie, tie, color="0.92", lw=0)
        ax.axhline(0, color="k", lw=0.6)
        ax.axvline(0, color="k", lw=0.6)
        ax.set_title(f"lag {lag}: circles against GSPO, squares against the SAT row's base",
                     fontsize=8)
        ax.set_xlabel("the page: difference in AIME24 avg@8 points (one run)")
        ax.set_ylabel("here: difference in final avg@k (seeds, 95% interval)")
    fig.suptitle("green: reproduces, red: reversed, grey: not separated or consistent, orange: "
                 f"differs (page within ±{tie:g}, shaded)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the lag sweep's --out")
    p.add_argument("--page", type=Path, default=None,
                   help=f"the page's grid (default: OUT/{PAGE_FILE})")
    p.add_argument("--tie", type=float, default=0.5,
                   help="page differences under this many points are no claim (default: 0.5)")
    args = p.parse_args(argv)
    page_path = args.page or args.out / PAGE_FILE
    if not page_path.is_file():
        raise SystemExit(f"page_grid: {page_path} not found")
    page = json.loads(page_path.read_text())
    text, points = report(load_results(args.out), page, args.tie)
    (args.out / "page_grid.md").write_text(text)
    plot(points, list(page["lags"]), args.tie, args.out / "page_grid.png")
    print(text, end="")
    print(f"wrote {args.out / 'page_grid.md'} and {args.out / 'page_grid.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
