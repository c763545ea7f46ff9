"""Short ``satjax train`` runs of the tiny config showing the loop options at work.

    PYTHONPATH=$PWD python scripts/loop_options_demo.py [--out DIR] [--steps 30]

1. ``mismatch``: ``train.mismatch_target`` on ``kl_k3`` (window 2) at a learning rate high
   enough (1e-3) for the policy to drift between versions, ``--steps`` steps, then
   ``--resume`` for 10 more: the lag limit the controller decides after each batch
   (``lag_limit``) next to the measured ``kl_k3`` and the lags the batches had, and the
   limit carried across the resume.
2. ``options``: ``updates_per_batch=2``, ``mini_batches=2``, ``objective.kl_coef=0.05``
   (k3), ``objective.entropy_coef=0.001`` and ``train.drop_uniform_groups`` for 10 steps:
   the metrics that show each (``kl_ref``, ``entropy``, ``policy_loss``,
   ``dropped_uniform_groups``, ``queue/fetches``, the last update's clip fractions).

Prints the package versions first, then one table per run (figures measured on the
machine it runs on; the rollouts are sampled, so values vary from run to run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from satjax.utils import versions_line  # noqa: E402

BASE = ["--config", str(REPO / "configs/tiny.yaml"), "--no-progress",
        "--set", "rollout.prompts_per_step=4", "--set", "rollout.group_size=4"]


def train(run_dir: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "satjax", "train", "--set", f"run_dir={run_dir}", *args]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)


def table(run_dir: Path, keys: list[str]) -> None:
    print("| step | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for line in (run_dir / "logs/metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        cells = [f"{m[k]:.4g}" if isinstance(m.get(k), float) else str(m.get(k, "-"))
                 for k in keys]
        print(f"| {m['step']} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="", help="where the run directories go (default: a "
                   "temporary directory)")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="satjax-loop-demo-"))
    print(versions_line(("satjax", "jax", "jaxlib", "flax", "optax", "numpy")), flush=True)

    run = out / "mismatch"
    train(run, *BASE, "--set", f"train.steps={args.steps}", "--set", "checkpoint.every=10",
          "--set", "train.learning_rate=1e-3", "--set", "train.mismatch_target=0.001",
          "--set", "train.mismatch_window=2")
    train(run, "--no-progress", "--resume", "--set", f"train.steps={args.steps + 10}")
    table(run, ["kl_k3", "lag_limit", "lag_mean", "lag_max", "queue/dropped_stale",
                "reward_mean"])

    run = out / "options"
    train(run, *BASE, "--set", "train.steps=10", "--set", "train.updates_per_batch=2",
          "--set", "train.mini_batches=2", "--set", "objective.kl_coef=0.05",
          "--set", "objective.entropy_coef=0.001", "--set", "train.drop_uniform_groups=true")
    table(run, ["loss", "policy_loss", "kl_ref", "entropy", "clip_frac_high",
                "dropped_uniform_groups", "queue/fetches", "reward_mean"])


if __name__ == "__main__":
    main()
