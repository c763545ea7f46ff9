"""The figures README quotes for a finished run, from its logs/metrics.jsonl.

    python scripts/run_figures.py runs/tiny

Prints the training reward as README states it (the mean of the first 10 steps, of steps
110-150, the last step and the mean of the last 20; one step is 64 samples, so a single
step's mean moves by ~0.06 from noise alone), how long the RL steps' metrics span, the lag
each step trained at (a count per value), and the versions it ran on.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path


def figures(run_dir: Path) -> dict[str, float | dict[float, int]]:
    """The README's figures of the run in ``run_dir`` (its RL steps' records)."""
    path = run_dir / "logs" / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"run_figures: {path} not found (not a finished satjax run?)")
    steps = [r for r in map(json.loads, path.read_text().splitlines()) if "reward_mean" in r]
    if len(steps) < 20:
        raise SystemExit(f"run_figures: {path} holds {len(steps)} RL steps; need >= 20")
    reward = [r["reward_mean"] for r in steps]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    return {"steps": len(steps), "reward_first10": mean(reward[:10]),
            "reward_110_150": mean(reward[110:150]) if len(reward) >= 150 else float("nan"),
            "reward_last": reward[-1], "reward_last20": mean(reward[-20:]),
            "rl_span_s": steps[-1]["time"] - steps[0]["time"],
            "lags": dict(sorted(collections.Counter(r["lag_mean"] for r in steps).items()))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    args = p.parse_args(argv)
    from satjax.utils import versions_line

    out = figures(args.run_dir)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))
    print(versions_line(("jax", "jaxlib", "flax", "optax", "numpy")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
