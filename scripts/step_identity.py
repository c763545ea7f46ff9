"""Checks that the train step of one checkout is bit-identical to another's.

    python scripts/step_identity.py /path/to/old/checkout /path/to/new/checkout

Runs each checkout's step (tests/train/conftest.py's tiny model, two synthetic batches
with foreign engine routes) with its defaults, with ``grad_accum=2`` (alone, with the
entropy term, and under two mini-batches of two updates) and with ``objective="ppo_clip"``,
each checkout in its own process, and compares every array of the final train state and
every metric (names, order, values) for exact equality. Used to show that
new step options at their defaults leave the step as it was (docs/training.md), and
that a refactoring of the step changes none of its results.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile

CHILD = r"""
import pickle, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests/train"]
import jax, conftest as c
batches = [c._synthetic_batch(i, routed=True) for i in range(2)]
out = {}
for kw in ({}, {"grad_accum": 2}, {"objective": "ppo_clip"},
           {"grad_accum": 2, "entropy_coef": 0.1},
           {"grad_accum": 2, "updates_per_batch": 2, "mini_batches": 2}):
    state, metrics = c._run_steps(batches, **kw)
    out[str(kw)] = (jax.tree.leaves(state), metrics)
pickle.dump(out, open(sys.argv[2], "wb"))
"""


def run(checkout: str, path: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(checkout), path], check=True,
                   env=env)
    with open(path, "rb") as f:
        return pickle.load(f)


def main() -> int:
    import numpy as np

    old_dir, new_dir = sys.argv[1:3]
    with tempfile.TemporaryDirectory() as tmp:
        old = run(old_dir, os.path.join(tmp, "old.pkl"))
        new = run(new_dir, os.path.join(tmp, "new.pkl"))
    ok = True
    for key, (old_state, old_metrics) in old.items():
        new_state, new_metrics = new[key]
        state_same = all(np.array_equal(a, b) for a, b in zip(old_state, new_state, strict=True))
        metrics_same = all(list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a)
                           for a, b in zip(old_metrics, new_metrics, strict=True))
        print(f"{key or '{}'}: state bit-identical {state_same}, metrics identical "
              f"{metrics_same}")
        ok &= state_same and metrics_same
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
