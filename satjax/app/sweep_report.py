"""Tables and plots of a lag sweep: results.csv, results.md, PNG figures."""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from satjax.app.lag_sweep import RunSpec
from satjax.run_dir import RunDirs


def _mean_std(xs: list[float]) -> tuple[float, float]:
    a = np.asarray(xs, np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_csv_table_plots(results: list[dict[str, Any]], out: Path, lags: list[int]) -> None:
    out = Path(out)
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "lag", "seed", "steps", "k", "final_avg_at_k", "seconds"])
        for r in results:
            w.writerow([r["variant"], r["lag"], r["seed"], r["steps"], r["k"],
                        f"{r['final_avg_at_k']:.4f}", f"{r['seconds']:.1f}"])
    by = defaultdict(list)
    for r in results:
        by[(r["variant"], r["lag"])].append(r["final_avg_at_k"])
    variants = list(dict.fromkeys(r["variant"] for r in results))
    k = results[0]["k"] if results else 0
    lo, hi = min(lags), max(lags)
    lines = [
        "| objective | " + " | ".join(f"lag {lag}" for lag in lags) + f" | drop {lo}->{hi} |",
        "|---" * (len(lags) + 2) + "|",
    ]
    for v in variants:
        cells = []
        for lag in lags:
            m, s = _mean_std(by[(v, lag)]) if by[(v, lag)] else (float("nan"), 0.0)
            cells.append(f"{m:.3f} ± {s:.3f}" if len(by[(v, lag)]) > 1 else f"{m:.3f}")
        drop = _mean_std(by[(v, lo)])[0] - _mean_std(by[(v, hi)])[0]
        lines.append(f"| {v} | " + " | ".join(cells) + f" | {drop:+.3f} |")
    seeds = sorted({r["seed"] for r in results})
    header = (f"Final avg@{k} on the held-out split (mean over {len(seeds)} seed(s); "
              f"± is the std over seeds).\n\n")
    (out / "results.md").write_text(header + "\n".join(lines) + "\n")
    _plots(results, out, lags, variants)


def _plots(results: list[dict[str, Any]], out: Path, lags: list[int], variants: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {(r["variant"], r["lag"], r["seed"]): r for r in results}
    metrics = {key: _read_metrics(RunDirs(RunSpec(*key).run_dir(out)).metrics) for key in runs}

    def series(key, name):
        rows = [m for m in metrics[key] if name in m and not isinstance(m[name], str)]
        return [m["step"] for m in rows], [m[name] for m in rows]

    def smooth(ys, window=10):
        # trailing mean: a batch of 8 prompts gives a very noisy per-step reward
        c = np.cumsum(np.insert(np.asarray(ys, np.float64), 0, 0.0))
        n = np.minimum(np.arange(1, len(ys) + 1), window)
        return (c[1:] - c[np.arange(1, len(ys) + 1) - n]) / n

    # 1. training reward vs step, one panel per lag
    fig, axes = plt.subplots(1, len(lags), figsize=(4 * len(lags), 3.2), sharey=True, squeeze=False)
    for ax, lag in zip(axes[0], lags, strict=True):
        for v in variants:
            keys = [k for k in runs if k[0] == v and k[1] == lag]
            if not keys:
                continue
            xs, _ = series(keys[0], "reward_mean")
            ys = np.mean([series(k, "reward_mean")[1] for k in keys], axis=0)
            ax.plot(xs, smooth(ys), label=v, lw=1.2)
        ax.set_title(f"lag {lag}")
        ax.set_xlabel("step")
    axes[0][0].set_ylabel("training reward (10-step mean)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "reward_vs_step.png", dpi=120)
    plt.close(fig)

    # 2. final score vs lag per objective
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for v in variants:
        ms = [_mean_std([r["final_avg_at_k"] for r in results if r["variant"] == v
                         and r["lag"] == lag])[0] for lag in lags]
        ax.plot(lags, ms, marker="o", label=v)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lags, [str(x) for x in lags])
    ax.set_xlabel("policy lag (versions)")
    ax.set_ylabel("final avg@k")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "score_vs_lag.png", dpi=120)
    plt.close(fig)

    # 3. SAT tail / newly clipped fractions and router flip rates vs lag
    def per_lag(v, name):
        out = []
        for lag in lags:
            vals = [np.mean(series(k, name)[1]) for k in runs
                    if k[0] == v and k[1] == lag and series(k, name)[1]]
            out.append(float(np.mean(vals)) if vals else np.nan)
        return out

    panels = (("sat_tail_frac", "SAT tail fraction"),
              ("sat_newly_clipped_frac", "clipped by SAT, not by the base clip"),
              ("router_mismatch", "expert-set flips: router vs engine"))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    for ax, (name, label) in zip(axes, panels, strict=True):
        for i, v in enumerate(variants):
            line, = ax.plot(lags, per_lag(v, name), marker="o", label=v)
            if name == "router_mismatch" and any(v == k[0] for k in runs):
                # what the trainer actually used: 0 under routing replay
                ax.plot(lags, per_lag(v, "router_mismatch_applied"), ls="--",
                        color=line.get_color(), lw=0.8,
                        label="applied (dashed)" if i == 0 else None)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lags, [str(x) for x in lags])
        ax.set_xlabel("policy lag (versions)")
        ax.set_ylabel(label)
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "tail_and_flips_vs_lag.png", dpi=120)
    plt.close(fig)
