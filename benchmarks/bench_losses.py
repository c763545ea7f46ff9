"""Overhead of SAT over plain GSPO: jitted loss + gradient on one batch, side by side.

Run: PYTHONPATH=$PWD python benchmarks/bench_losses.py [--batch 256 --length 1024]
Prints the jax version, the median time of each variant (interleaved repeats), its ratio to
its base loss (GSPO, or PPO-clip for sat_ppo), the target ratio and whether it is met.
Targets: SAT-GSPO with the sequence proxy <= 1.05x GSPO; token-level SAT (sat_ppo, and
sat_gspo with the token proxy) <= 1.3x its base.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

if "--multi-thread" not in sys.argv:  # one XLA thread: steadier figures on a shared host
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_multi_thread_eigen=false"
                               " intra_op_parallelism_threads=1").strip()

import jax
import jax.numpy as jnp
import numpy as np

from satjax import losses

# Each objective's own default radii (the GSPO family's and the token-level ones).
EPS = {"eps_low": losses.GspoHParams.eps_low, "eps_high": losses.GspoHParams.eps_high}
TOK_EPS = {"eps_low": losses.PpoClipHParams.eps_low,
           "eps_high": losses.PpoClipHParams.eps_high}


# Target ratio to the base loss, by variant (token-level SAT is the paper's SAT-GRPO).
TARGETS = {"sat_gspo[hill,seq]": 1.05, "sat_gspo[gauss,seq]": 1.05,
           "sat_gspo[hill,token]": 1.3, "sat_gspo[gauss,token]": 1.3, "sat_ppo[hill]": 1.3}


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--inner", type=int, default=5, help="calls per timed sample")
    ap.add_argument("--multi-thread", action="store_true", help="let XLA use all cores")
    args = ap.parse_args()
    batch = make_batch(args.batch, args.length)
    variants = {
        "gspo": grad_fn(losses.gspo_loss, **EPS),
        "sat_gspo[hill,seq]": grad_fn(losses.sat_gspo_loss, **EPS),
        "sat_gspo[gauss,seq]": grad_fn(losses.sat_gspo_loss, kernel="gauss", **EPS),
        "sat_gspo[hill,token]": grad_fn(losses.sat_gspo_loss, proxy="token", **EPS),
        "sat_gspo[gauss,token]": grad_fn(losses.sat_gspo_loss, proxy="token",
                                         kernel="gauss", **EPS),
        "ppo_clip": grad_fn(losses.ppo_clip_loss, **TOK_EPS),
        "sat_ppo[hill]": grad_fn(losses.sat_ppo_loss, **TOK_EPS),
    }
    for fn in variants.values():  # compile + warm up
        jax.block_until_ready(fn(*batch))
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for rep in range(args.repeats):  # interleaved (and rotated) so load drift hits all alike
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            fn = variants[name]
            t0 = time.perf_counter()
            for _ in range(args.inner):
                out = fn(*batch)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / args.inner)
    med = {k: statistics.median(v) for k, v in times.items()}
    threads = "multi" if args.multi_thread else "single"
    print(f"jax {jax.__version__}, jaxlib {jax.lib.__version__}, numpy {np.__version__}, "
          f"python {platform.python_version()}, {os.cpu_count()} CPUs")
    print(f"B={args.batch} T={args.length} float32, backend={jax.default_backend()} "
          f"({threads}-threaded), "
          f"median of {args.repeats}x{args.inner} interleaved calls (loss + grad, jitted)")
    for name, m in med.items():
        ref = "ppo_clip" if name.startswith("sat_ppo") else "gspo"
        base = med[ref]
        line = f"  {name:24s} {m * 1e3:8.3f} ms"
        if name in TARGETS:
            ok = "met" if m / base <= TARGETS[name] else "NOT met"
            line += (f"   vs {ref} {base * 1e3:8.3f} ms: ratio {m / base:6.3f}, "
                     f"target <= {TARGETS[name]:.2f}: {ok}")
        print(line)


if __name__ == "__main__":
    main()
