"""Attention fwd+bwd: compiled temporary memory and CPU time, "reference" vs "blockwise".

    PYTHONPATH=$PWD python benchmarks/bench_attention.py [--memory-lens 2048 4096 8192]
        [--time-lens 256 512 1024 2048 4096] [--tokens 8192] [--repeats 3]
        [--block-sizes 128 256 512]

Memory: ``jax.jit(...).lower(...).compile().memory_analysis().temp_size_in_bytes`` of one
Qwen3-30B-A3B attention layer's core (B=1, H=32, Hkv=4, Dh=128, bfloat16 and float32),
forward and the vjp w.r.t. q, k, v; compile only, nothing runs, so the figures are XLA's
buffer plan on the backend it runs on. (XLA:CPU runs bfloat16 dots on float32 copies of
their operands, hoisted out of the block loops: its bfloat16 blockwise figure includes
float32 copies of q, v and the output cotangent that a GPU/TPU compile would not have.)
Time: best-of-``repeats`` wall time of the same jitted fwd+bwd at the tiny model's
attention shape (H=4, Hkv=2, Dh=32, float32) with B = tokens / T rows, so each length does
the same number of tokens: the measurement behind
``satjax.model.attention.CPU_BLOCKWISE_MIN_LEN``; ``--block-sizes`` adds the blockwise time
per block size (behind ``BLOCKWISE_BLOCK``).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `python benchmarks/<this>.py`: `benchmarks` importable

from benchmarks.machine import print_versions  # noqa: E402
from satjax.model.attention import blockwise_attention, reference_attention  # noqa: E402

IMPLS = {"reference": reference_attention, "blockwise": blockwise_attention}


def fwd_bwd(attend):
    """(q, k, v, valid, d_out) -> (out, dq, dk, dv) of ``attend``."""
    def run(q, k, v, valid, d_out):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, valid), q, k, v)
        return (out, *vjp(d_out))
    return run


def inputs(b: int, t: int, h: int, hkv: int, d: int, dtype, abstract: bool):
    shapes = [(b, t, h, d), (b, t, hkv, d), (b, t, hkv, d), (b, t), (b, t, h, d)]
    dtypes = [dtype, dtype, dtype, jnp.bool_, dtype]
    if abstract:
        return [jax.ShapeDtypeStruct(s, dt) for s, dt in zip(shapes, dtypes, strict=True)]
    keys = jax.random.split(jax.random.key(0), 5)
    return [jnp.ones(s, dt) if dt == jnp.bool_ else jax.random.normal(key, s, dt)
            for key, s, dt in zip(keys, shapes, dtypes, strict=True)]


def temp_bytes(attend, t: int, dtype) -> int:
    args = inputs(1, t, 32, 4, 128, dtype, abstract=True)
    compiled = jax.jit(fwd_bwd(attend)).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def seconds(attend, t: int, tokens: int, repeats: int) -> float:
    args = inputs(max(tokens // t, 1), t, 4, 2, 32, jnp.float32, abstract=False)
    fn = jax.jit(fwd_bwd(attend))
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory-lens", type=int, nargs="*", default=[2048, 4096, 8192])
    ap.add_argument("--time-lens", type=int, nargs="*", default=[256, 512, 1024, 2048, 4096])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-sizes", type=int, nargs="*", default=[])
    args = ap.parse_args()
    print_versions()
    print(f"backend {jax.default_backend()}")
    if args.memory_lens:
        print("compiled fwd+bwd temporaries, Qwen3-30B-A3B attention layer "
              "(B=1, H=32, Hkv=4, Dh=128):")
        for dtype in (jnp.bfloat16, jnp.float32):
            for t in args.memory_lens:
                mib = {name: temp_bytes(fn, t, dtype) / 2**20 for name, fn in IMPLS.items()}
                print(f"  {jnp.dtype(dtype).name:8s} T={t:6d}  "
                      f"reference {mib['reference']:9.1f} MiB  "
                      f"blockwise {mib['blockwise']:7.1f} MiB")
    if args.time_lens:
        print(f"fwd+bwd wall time, tiny attention (H=4, Hkv=2, Dh=32, f32), "
              f"{args.tokens} tokens per call, best of {args.repeats}:")
        for t in args.time_lens:
            secs = {name: seconds(fn, t, args.tokens, args.repeats)
                    for name, fn in IMPLS.items()}
            line = (f"  T={t:6d}  reference {secs['reference'] * 1e3:8.1f} ms  "
                    f"blockwise {secs['blockwise'] * 1e3:8.1f} ms  "
                    f"ratio {secs['blockwise'] / secs['reference']:.2f}")
            for c in args.block_sizes:
                fn = functools.partial(blockwise_attention, block_size=c)
                line += f"  block {c}: {seconds(fn, t, args.tokens, args.repeats) * 1e3:.1f} ms"
            print(line)


if __name__ == "__main__":
    main()
