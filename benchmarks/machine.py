"""What every benchmark prints first: package versions and the machine figures it compares with.

A ratio is only meaningful next to what it ran on, and a speed only next to what the
machine can do, so each ``bench_*.py`` starts with :func:`print_versions` and measures the
limits it compares against (matmul peak, memory bandwidth, sequential write bandwidth) in
the same run, with these functions.

    PYTHONPATH=$PWD python benchmarks/machine.py   # versions and all three machine figures
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from satjax.utils import versions_line

PACKAGES = ("satjax", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "grpcio",
            "protobuf", "safetensors", "torch", "transformers", "vllm")


def print_versions(packages: tuple[str, ...] = PACKAGES) -> None:
    """One line: ``versions: python 3.11.9, jax 0.10.2, ...; 2 CPUs, Linux x86_64``."""
    print(versions_line(packages), flush=True)


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (compile, page faults)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_peak_gflops(n: int = 1024, dtype: str = "float32", repeats: int = 5) -> float:
    """Achieved GFLOP/s of one jitted ``n x n @ n x n`` matmul on the default JAX device:
    the practical peak a model's FLOP/s is compared with."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    secs = _best_seconds(lambda: f(a).block_until_ready(), repeats)
    return 2 * n**3 / secs / 1e9


def memory_bandwidth_gbs(mbytes: int = 512, repeats: int = 5) -> float:
    """Copy bandwidth of host memory in GB/s (read + write bytes of one large array copy):
    the bound a memory-bound decode step is compared with."""
    src = np.ones(mbytes * (1 << 20) // 4, np.float32)
    dst = np.empty_like(src)
    secs = _best_seconds(lambda: np.copyto(dst, src), repeats)
    return 2 * src.nbytes / secs / 1e9


def sequential_write_gbs(directory: str | None = None, mbytes: int = 1024,
                         chunk_mb: int = 64) -> float:
    """Sequential write bandwidth to ``directory`` in GB/s, fsync included (what a durable
    checkpoint or weight publish is compared with); the file is removed afterwards."""
    chunk = np.random.default_rng(0).integers(0, 255, chunk_mb << 20, np.uint8).tobytes()
    fd, path = tempfile.mkstemp(prefix="bench-write-", dir=directory)
    try:
        t0 = time.perf_counter()
        for _ in range(max(1, mbytes // chunk_mb)):
            os.write(fd, chunk)
        os.fsync(fd)
        secs = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    return max(1, mbytes // chunk_mb) * len(chunk) / secs / 1e9


if __name__ == "__main__":
    print_versions()
    print(f"jitted fp32 matmul peak: {matmul_peak_gflops():.0f} GFLOP/s")
    print(f"memory copy bandwidth:   {memory_bandwidth_gbs():.1f} GB/s")
    print(f"sequential write (fsync): {sequential_write_gbs():.2f} GB/s")
