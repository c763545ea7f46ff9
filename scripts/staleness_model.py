"""A finished ``satjax train`` run's realised lag beside the SAT page's staleness model.

    python scripts/staleness_model.py runs/staleness [--skip 10] [--png lag.png]

The SAT authors' page (after Applied Compute, 2026) predicts the mean token lag of fully
asynchronous RL from five figures of the system: the rollout-to-trainer throughput ratio
``rho = v_R / v_T`` (tokens/s), the rollout concurrency ``C`` and the trainer's pull ``B``
(responses), the response-length tail ``M_tail = E[max(L_1..L_G)] / E[L]`` within a group,
and the queue's capacity ``Q`` (``q_Q = Q / B``)::

    n = C M_tail / B + rho                               rho < 1 (rollout-bound)
    n = C M_tail / (rho B) + (2 q_Q + rho - 1) / (2 rho)  rho > 1 (train-bound)

This script reads the inputs from the run itself: ``v_R`` is what the workers made while not
paused by the queue's back-pressure (each worker's last log line: ``stopped after N
trajectories (paused P s of T s)``; N x the mean response length over T - P, summed over
workers: generation, weight loads and puts included), ``v_T`` the trained tokens over the
trainer's own time per step (train step, publish, checkpoint; its wait for data excluded),
``C`` the workers times one worker's batch (``prompts_per_step x group_size`` responses
sampled at once), ``B`` the trainer's batch, ``Q`` ``queue.max_pending``, ``M_tail`` from
``response_len_group_max_mean`` and ``response_len_mean``. It prints them, the prediction,
and the realised lag (each token's trainer version minus the version that sampled it:
``lag_token_mean``, and the distribution by trajectory from ``lag_hist/*``), over the steps
after ``--skip`` (the start, before the pipeline fills). Nothing here is fitted.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np
import yaml

from satjax.queue.core import QueueSettings

STOP_LINE = re.compile(r"stopped after (\d+) trajectories \(paused ([\d.]+) s of ([\d.]+) s\)")


def predicted_lag(rho: float, c: float, b: float, m_tail: float, q: float) -> dict[str, float]:
    """The page's steady-state mean token lag and its pre-queue / in-queue parts.

    >>> p = predicted_lag(rho=0.5, c=64, b=64, m_tail=1.0, q=1000)
    >>> p["pre_queue"], p["in_queue"], p["mean"]
    (1.0, 0.5, 1.5)
    >>> p = predicted_lag(rho=2.0, c=64, b=64, m_tail=1.0, q=128)  # q_Q = 2
    >>> p["pre_queue"], p["in_queue"]
    (0.5, 1.25)
    """
    if rho == 1.0:
        raise ValueError("rho = 1: the model's two branches meet; it gives no value there")
    q_q = q / b
    if rho < 1.0:
        pre, inq = c * m_tail / b, rho
    else:
        pre, inq = c * m_tail / (rho * b), (2 * q_q + rho - 1) / (2 * rho)
    return {"pre_queue": pre, "in_queue": inq, "mean": pre + inq}


def worker_capacity(logs: Path, workers: int) -> dict[str, float]:
    """From each worker's stop line: the workers' summed rate while not paused
    (trajectories per unpaused second, each worker's, added up) and the paused share."""
    rate, unpaused, paused = 0.0, 0.0, 0.0
    for w in range(workers):
        path = logs / f"worker{w}.log"
        found = [m for line in (path.read_text().splitlines() if path.is_file() else [])
                 if (m := STOP_LINE.search(line))]
        if not found:
            raise SystemExit(f"staleness_model: no stop line in {path} (a worker that ended "
                             f"early, or a run made before workers logged their pauses)")
        n, p, total = found[-1].groups()
        rate += int(n) / max(float(total) - float(p), 1e-9)
        unpaused += float(total) - float(p)
        paused += float(p)
    return {"trajectories_per_s": rate, "paused_share": paused / max(paused + unpaused, 1e-9)}


def inputs(run_dir: Path, skip: int) -> dict[str, float]:
    """The model's inputs and the realised lag, from the run's config and metrics."""
    cfg_path, metrics_path = run_dir / "config.yaml", run_dir / "logs" / "metrics.jsonl"
    for path in (cfg_path, metrics_path):
        if not path.is_file():
            raise SystemExit(f"staleness_model: {path} not found (not a satjax train run?)")
    cfg = yaml.safe_load(cfg_path.read_text())
    rows = [r for r in map(json.loads, metrics_path.read_text().splitlines())
            if "rollout_tokens_per_s" in r]
    if len(rows) <= skip + 2:
        raise SystemExit(f"staleness_model: {len(rows)} steps with the model's metrics in "
                         f"{metrics_path}; need more than --skip {skip} + 2")
    rows = rows[skip:]
    rollout = cfg["rollout"]
    workers = int(rollout["num_workers"])
    batch = int(rollout["prompts_per_step"]) * int(rollout["group_size"])
    # null: the server's own default (serve-queue's --max-pending)
    max_pending = cfg.get("queue", {}).get("max_pending") or QueueSettings.max_pending

    def mean(name: str) -> float:
        return float(np.mean([r[name] for r in rows]))

    tokens = [r["response_len_mean"] * r["sequences"] for r in rows]
    busy = [r["time/step_s"] + r.get("time/publish_s", 0.0) + r.get("time/checkpoint_s", 0.0)
            for r in rows]
    made = worker_capacity(run_dir / "logs", workers)
    v_r = made["trajectories_per_s"] * mean("response_len_mean")
    v_t = float(np.sum(tokens) / np.sum(busy))
    hist: dict[int, float] = {}
    for r in rows:
        for key, count in r.items():
            if key.startswith("lag_hist/"):
                lag = int(key.split("/", 1)[1])
                hist[lag] = hist.get(lag, 0.0) + count
    return {"workers": workers, "v_R": v_r, "paused_share": made["paused_share"],
            "generating_rate": workers * mean("rollout_tokens_per_s"), "v_T": v_t, "rho": v_r / v_t,
            "C": workers * batch, "B": batch, "Q": float(max_pending),
            "M_tail": mean("response_len_group_max_mean") / mean("response_len_mean"),
            "steps": len(rows), "realised_mean": mean("lag_token_mean"),
            "realised_sd_over_steps": float(np.std([r["lag_token_mean"] for r in rows])),
            "wait_share": float(np.sum([r["time/wait_data_s"] for r in rows])
                                / (np.sum([r["time/wait_data_s"] for r in rows]) + np.sum(busy))),
            "hist": dict(sorted(hist.items()))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--skip", type=int, default=10,
                   help="steps left out at the start, while the pipeline fills (default: 10)")
    p.add_argument("--png", type=Path, default=None,
                   help="also plot the realised lag distribution beside the prediction")
    args = p.parse_args(argv)
    x = inputs(args.run_dir, args.skip)
    pred = predicted_lag(x["rho"], x["C"], x["B"], x["M_tail"], x["Q"])
    regime = "rollout-bound (rho < 1)" if x["rho"] < 1 else "train-bound (rho > 1)"
    print(f"run {args.run_dir}, steps after the first {args.skip}: {x['steps']}")
    print(f"  v_R {x['v_R']:.0f} tok/s ({x['workers']} workers, paused "
          f"{x['paused_share']:.0%} of their time; {x['generating_rate']:.0f} tok/s while "
          f"generating), v_T {x['v_T']:.0f} tok/s, rho {x['rho']:.2f}: {regime}; the trainer "
          f"waited for data {x['wait_share']:.0%} of its time")
    print(f"  C {x['C']:.0f}, B {x['B']:.0f}, Q {x['Q']:.0f} (q_Q {x['Q'] / x['B']:.1f}), "
          f"M_tail {x['M_tail']:.3f}")
    print(f"  predicted mean token lag {pred['mean']:.2f} (pre-queue {pred['pre_queue']:.2f} "
          f"+ in-queue {pred['in_queue']:.2f})")
    total = sum(x["hist"].values())
    dist = ", ".join(f"{lag}: {n / total:.0%}" for lag, n in x["hist"].items())
    print(f"  realised mean token lag {x['realised_mean']:.2f} (sd over steps "
          f"{x['realised_sd_over_steps']:.2f}); trajectories by lag: {dist}")
    if args.png is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        lags = list(x["hist"])
        ax.bar(lags, [x["hist"][k] / total for k in lags], color="0.6",
               label="realised (share of trajectories)")
        ax.axvline(x["realised_mean"], color="k", label=f"realised mean {x['realised_mean']:.2f}")
        ax.axvline(pred["mean"], color="C3", ls="--", label=f"predicted {pred['mean']:.2f}")
        ax.set_xlabel("lag (trainer version - sampling version)")
        ax.set_ylabel("share")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
