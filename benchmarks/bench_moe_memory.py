"""Memory of each MoE dispatch at the paper's shape: one block's forward + backward, on paper.

    PYTHONPATH=$PWD python benchmarks/bench_moe_memory.py [--tokens 8192] [--dtype bfloat16]

One Qwen3-30B-A3B MoE block (hidden 2048, 128 experts of width 768, top-8) on the tokens of
one 8k sequence (one device's micro-batch in configs/qwen3-30b-a3b.yaml). For every
dispatch of ``satjax.model.moe``, on all tokens at once and (``/chunks``) as the model
runs the sorted ones, ``MOE_CHUNK_TOKENS`` tokens at a time (``in_token_chunks``), it
prints

* the largest intermediate array of the traced program (the jaxpr of the gradient: what
  any backend is asked to compute, before XLA's fusion), and
* XLA:CPU's temporaries for the compiled gradient (``memory_analysis``; nothing is run),

beside the per-token sizes the issue forbids: a copy of the expert weights per token,
and [tokens, experts, ...] intermediates. XLA:CPU lowers ``ragged_dot`` densely, so its
compiled figure for "ragged" is XLA:CPU's, not that of the grouped-GEMM kernels GPU and
TPU lower it to (Megablox on TPU); the jaxpr column is the program they get.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `python benchmarks/<this>.py`: `benchmarks` importable

from benchmarks.machine import print_versions  # noqa: E402
from satjax.model.moe import (  # noqa: E402
    MOE_CHUNK_TOKENS,
    dense_einsum_experts,
    grouped_experts,
    in_token_chunks,
    ragged_experts,
    route,
)

# the dispatches on all tokens at once, and as SparseMoeBlock runs the sorted ones
IMPLS = {"grouped": grouped_experts, "ragged": ragged_experts,
         "dense_einsum": dense_einsum_experts,
         "grouped/chunks": in_token_chunks(grouped_experts),
         "ragged/chunks": in_token_chunks(ragged_experts)}
MIB = 1 << 20


def largest_intermediate(jaxpr) -> tuple[int, str]:
    """(bytes, "dtype[shape] primitive") of the largest value any equation produces,
    sub-jaxprs (loops, custom VJPs) included."""
    best = (0, "")

    def walk(jp) -> None:
        nonlocal best
        for eqn in jp.eqns:
            for v in eqn.outvars:
                aval = v.aval
                if hasattr(aval, "shape") and hasattr(aval, "dtype") \
                        and aval.dtype != jax.dtypes.float0:
                    size = int(np.prod(aval.shape)) * aval.dtype.itemsize
                    if size > best[0]:
                        best = (size, f"{aval.dtype}{list(aval.shape)} {eqn.primitive.name}")
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--impls", default=",".join(IMPLS))
    args = ap.parse_args()
    n, d, f, e, k = args.tokens, 2048, 768, 128, 8
    dtype = jnp.dtype(args.dtype)
    print_versions()
    print(f"one MoE block: {n} tokens, hidden {d}, {e} experts x {f}, top-{k}, {dtype}; "
          f"chunks of {MOE_CHUNK_TOKENS} tokens")
    weights_per_token = 3 * d * f * dtype.itemsize
    print(f"forbidden sizes: expert weights per token {n * k * weights_per_token / MIB:.0f} "
          f"MiB (k copies), [tokens, experts, F] {n * e * f * dtype.itemsize / MIB:.0f} MiB, "
          f"[tokens, experts, D] {n * e * d * dtype.itemsize / MIB:.0f} MiB; the expert "
          f"weights themselves {e * weights_per_token / MIB:.0f} MiB")
    s = jax.ShapeDtypeStruct
    x = s((n, d), dtype)
    logits = s((n, e), jnp.float32)
    ws = (s((e, d, f), dtype), s((e, d, f), dtype), s((e, f, d), dtype))
    for name in args.impls.split(","):
        impl = IMPLS[name]

        def loss(x, logits, wg, wu, wd, impl=impl):
            rec = route(logits, k, True)
            out = impl(x, rec.experts_used, rec.weights.astype(x.dtype), wg, wu, wd)
            return jnp.sum(out.astype(jnp.float32))

        grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
        size, what = largest_intermediate(jax.make_jaxpr(grad)(x, logits, *ws).jaxpr)
        temps = jax.jit(grad).lower(x, logits, *ws).compile().memory_analysis() \
            .temp_size_in_bytes
        print(f"{name:>14}: largest traced intermediate {size / MIB:8.0f} MiB ({what}); "
              f"XLA:CPU temporaries {temps / MIB:8.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
