"""Overhead of SAT over its base loss: jitted loss + gradient on one batch, side by side.

Run: PYTHONPATH=$PWD python benchmarks/bench_losses.py [--batch 256 --length 1024]
Prints the versions line, then the median time of each variant (interleaved, rotated
repeats) by wall clock and by process CPU time (steadier on a shared host: XLA runs
single-threaded here, so CPU time is the work of this process alone), its ratio to its
base loss (GSPO, or PPO-clip for sat_ppo), the target and "met" or "MISSED" (judged on
the CPU-time ratio: on a loaded host the wall clock also counts time the process waited
for a core). Targets: SAT-GSPO with the per-sequence proxy <= 1.05x GSPO; SAT with a
statistic over all B*T tokens (SAT-GSPO's default broadcast proxy and its token proxy,
sat_grpo, sat_ppo) <= 1.3x its base (GSPO, GRPO, PPO-clip).

Then the exact token quantile alone: the paper's lower quantile ("inverted_cdf") against
numpy's linear one, by algorithm ("select", "radix", "sort"; target: the lower quantile
<= 1.05x the linear one with the same algorithm), and the floor of token-level SAT: one
scatter-add histogram pass over all B*T entries (an exact selection needs at least one)
and one reduction pass.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if "--multi-thread" not in sys.argv:  # one XLA thread: steadier figures on a shared host
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_multi_thread_eigen=false"
                               " intra_op_parallelism_threads=1").strip()

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `python benchmarks/<this>.py`: `benchmarks` importable

from benchmarks.machine import print_versions  # noqa: E402
from satjax import losses  # noqa: E402

# Each objective's own default radii (the GSPO family's and the token-level ones).
EPS = {"eps_low": losses.GspoHParams.eps_low, "eps_high": losses.GspoHParams.eps_high}
TOK_EPS = {"eps_low": losses.PpoClipHParams.eps_low,
           "eps_high": losses.PpoClipHParams.eps_high}


# Target ratio to the base loss, by variant: (base, target).
TARGETS = {"sat_gspo[paper,broadcast]": ("gspo", 1.3), "sat_gspo[paper,seq]": ("gspo", 1.05),
           "sat_gspo[smooth,seq]": ("gspo", 1.05), "sat_gspo[gauss,seq]": ("gspo", 1.05),
           "sat_gspo[paper,token]": ("gspo", 1.3), "sat_grpo[paper]": ("grpo", 1.3),
           "sat_ppo[paper]": ("ppo_clip", 1.3),
           # the paper's lower quantile against the linear one, same algorithm
           "quantile[lower,select]": ("quantile[linear,select]", 1.05),
           "quantile[lower,radix]": ("quantile[linear,radix]", 1.05),
           "quantile[lower,sort]": ("quantile[linear,sort]", 1.05)}


def make_batch(b: int, t: int, seed: int = 0) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    lp = rng.normal(-1.0, 0.5, (b, t)).astype(np.float32)
    # Heavy-tailed staleness so the SAT tail is populated.
    mu = lp + rng.standard_t(3, (b, t)).astype(np.float32) * 0.05
    lengths = rng.integers(t // 4, t + 1, b)
    mask = np.arange(t)[None, :] < lengths[:, None]
    adv = rng.normal(size=b).astype(np.float32)
    return tuple(jnp.asarray(x) for x in (lp, mu, adv, mask.astype(np.float32)))


def grad_fn(loss_fn, **kw):
    def f(lp, mu, adv, mask):
        return loss_fn(lp, mu, adv, mask, **kw)

    # has_aux: the metrics a trainer logs are part of the measured work.
    return jax.jit(jax.value_and_grad(f, has_aux=True))


def floor_parts(batch: tuple[jax.Array, ...]) -> dict[str, tuple]:
    """The pieces token-level SAT cannot avoid, each jitted on the batch's |d|."""
    lp, mu, _, mask = batch
    valid = mask > 0
    a = jnp.where(valid, jnp.abs(lp - mu), 0.0)

    def quantile(method, algorithm):
        return jax.jit(lambda a, v: losses.masked_quantile(a, 0.9, v, method=method,
                                                           algorithm=algorithm))

    def scatter_pass(a):  # one 2^16-bin histogram of the float bit pattern
        bins = jax.lax.bitcast_convert_type(a, jnp.int32) >> 15
        return jnp.zeros(1 << 16, jnp.int32).at[bins].add(1, mode="promise_in_bounds")

    methods = {"linear": "linear", "lower": "inverted_cdf"}
    return {**{f"quantile[{m},{alg}]": (quantile(method, alg), a, valid)
               for alg in ("select", "radix", "sort") for m, method in methods.items()},
            "one scatter-add pass": (jax.jit(scatter_pass), a),
            "one reduction pass": (jax.jit(lambda a: jnp.sum(a * a)), a)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--inner", type=int, default=5, help="calls per timed sample")
    ap.add_argument("--multi-thread", action="store_true", help="let XLA use all cores")
    args = ap.parse_args()
    print_versions()
    batch = make_batch(args.batch, args.length)
    calls = {name: (fn, *batch) for name, fn in {
        "gspo": grad_fn(losses.gspo_loss, **EPS),
        "sat_gspo[paper,broadcast]": grad_fn(losses.sat_gspo_loss, **EPS),
        "sat_gspo[paper,seq]": grad_fn(losses.sat_gspo_loss, proxy="sequence", **EPS),
        "sat_gspo[smooth,seq]": grad_fn(losses.sat_gspo_loss, proxy="sequence",
                                        kernel="smooth", **EPS),
        "sat_gspo[gauss,seq]": grad_fn(losses.sat_gspo_loss, proxy="sequence",
                                       kernel="gauss", **EPS),
        "sat_gspo[paper,token]": grad_fn(losses.sat_gspo_loss, proxy="token", **EPS),
        "grpo": grad_fn(losses.grpo_loss, **TOK_EPS),
        "sat_grpo[paper]": grad_fn(losses.sat_grpo_loss, **TOK_EPS),
        "ppo_clip": grad_fn(losses.ppo_clip_loss, **TOK_EPS),
        "sat_ppo[paper]": grad_fn(losses.sat_ppo_loss, **TOK_EPS),
    }.items()}
    calls.update(floor_parts(batch))
    for fn, *fn_args in calls.values():  # compile + warm up
        jax.block_until_ready(fn(*fn_args))
    wall: dict[str, list[float]] = {k: [] for k in calls}
    cpu: dict[str, list[float]] = {k: [] for k in calls}
    names = list(calls)
    for rep in range(args.repeats):  # interleaved (and rotated) so load drift hits all alike
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            fn, *fn_args = calls[name]
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.inner):
                out = fn(*fn_args)
            jax.block_until_ready(out)
            wall[name].append((time.perf_counter() - t0) / args.inner)
            cpu[name].append((time.process_time() - c0) / args.inner)
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    threads = "multi" if args.multi_thread else "single"
    print(f"B={args.batch} T={args.length} float32, backend={jax.default_backend()} "
          f"({threads}-threaded), median of {args.repeats}x{args.inner} interleaved calls "
          f"(loss + grad + aux, jitted); ms wall / ms CPU")
    for name in names:
        line = f"  {name:26s} {med[name] * 1e3:7.3f} / {med_cpu[name] * 1e3:7.3f}"
        if name in TARGETS:
            ref, target = TARGETS[name]
            ratio, ratio_cpu = med[name] / med[ref], med_cpu[name] / med_cpu[ref]
            ok = "met" if ratio_cpu <= target else "MISSED"
            line += (f"   ratio to {ref}: {ratio:5.2f} wall, {ratio_cpu:5.2f} CPU; "
                     f"target <= {target:.2f}: {ok}")
        if name == "quantile[linear,select]":
            print("the exact |d| quantile alone at q=0.9 over the B*T entries, and the floor:")
        print(line)
    # The least any exact token-level SAT adds: one scatter pass for the selection and one
    # pass to apply the kernel to every token.
    least = med_cpu["one scatter-add pass"] + med_cpu["one reduction pass"]
    for base in ("ppo_clip", "gspo"):
        print(f"  floor vs {base} (CPU): 1 scatter + 1 pass = {least * 1e3:.3f} ms -> at least "
              f"{1 + least / med_cpu[base]:.2f}x; with quantile[select] "
              f"{1 + med_cpu['quantile[lower,select]'] / med_cpu[base]:.2f}x before kernel "
              f"+ metrics")


if __name__ == "__main__":
    main()
