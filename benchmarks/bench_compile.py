"""jit compile time of the model's forward + backward, layers unrolled vs one ``lax.scan``.

    PYTHONPATH=$PWD python benchmarks/bench_compile.py [--layers 48 --batch 2 --seq 32]

A deep config with tiny widths isolates the cost that grows with depth (XLA compiling the
same layer L times when unrolled); prints the versions line, both times and their ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `python benchmarks/<this>.py`: `benchmarks` importable

from benchmarks.machine import print_versions  # noqa: E402
from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM, token_logprobs  # noqa: E402


def compile_seconds(cfg: Qwen3MoeConfig, scan_layers: bool, ids: jax.Array) -> float:
    """Trace + lower + XLA-compile time of grad(mean token log-prob) w.r.t. the params."""
    model = Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0), scan_layers=scan_layers)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        lp, _ = token_logprobs(nnx.merge(graphdef, p, rest), ids)
        return lp.mean()

    t0 = time.perf_counter()
    jax.jit(jax.value_and_grad(loss)).lower(params).compile()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    args = ap.parse_args()
    cfg = Qwen3MoeConfig.tiny(num_hidden_layers=args.layers, hidden_size=32,
                              intermediate_size=64, moe_intermediate_size=32)
    ids = jnp.ones((args.batch, args.seq), jnp.int32)
    print_versions()
    unrolled = compile_seconds(cfg, False, ids)
    scanned = compile_seconds(cfg, True, ids)
    print(f"backend {jax.default_backend()}; {args.layers} MoE layers, "
          f"hidden {cfg.hidden_size}, {cfg.num_experts} experts, batch {args.batch} x {args.seq}")
    print(f"fwd+bwd compile, layers unrolled: {unrolled:7.2f} s")
    print(f"fwd+bwd compile, lax.scan layers: {scanned:7.2f} s")
    print(f"ratio unrolled / scan: {unrolled / scanned:.1f}x")


if __name__ == "__main__":
    main()
