"""A reduced-layer model of a config, trained a few steps on the accelerator, its measured
peak memory next to the on-paper estimate (benchmarks/bench_memory.py) of the same step.

    PYTHONPATH=$PWD python scripts/device_check.py --config configs/qwen3-30b-a3b.yaml \\
        [--layers 2] [--seq-len 8192] [--steps 3] [--set KEY=VALUE ...]

On the default JAX backend's devices (all of them, as one ``fsdp`` axis) it builds the
config's model at ``--layers`` deep with random weights (no checkpoint needed), the
trainer's own step (``satjax.train.trainer.run_train_step``: the config's dtype, remat,
attention, dispatch and objective) and a random batch of one ``--seq-len``-token
sequence per device per micro-step (``train.grad_accum`` micro-steps, routes replayed;
more rows where a micro-step must hold whole groups),
runs ``--steps`` steps and prints each step's time and the device's peak bytes in use
(``Device.memory_stats``; backends without it, e.g. CPU, print n/a). Then it compiles
the same step for an emulated CPU mesh of the same size in a subprocess (the
estimate the paper's figures come from) and, on a GPU, ``satjax plan --topology h100:N``'s
deviceless XLA:GPU compile of it for this GPU's own target config, and prints them all.
scripts/device_check.sh runs it on the paper's config.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="KEY=VALUE")
    args = ap.parse_args()

    import jax
    import numpy as np
    from flax import nnx

    from satjax import parallel
    from satjax.app.factory import build_tokenizer, model_config, model_options
    from satjax.app.memory import abstract_batch
    from satjax.config import load_config
    from satjax.model import Qwen3MoeForCausalLM
    from satjax.train.batch import Batch
    from satjax.train.state import TrainState
    from satjax.train.trainer import run_optimizer, run_train_step
    from satjax.utils import versions_line

    n = jax.device_count()
    overrides = [*args.overrides, f"train.mesh={{data: 1, fsdp: {n}, expert: 1, tensor: 1}}"]
    cfg = load_config(args.config, overrides)
    tokenizer = build_tokenizer(cfg) if cfg.model.preset == "tiny" else None
    full = model_config(cfg, tokenizer)
    shape = dataclasses.replace(full, num_hidden_layers=args.layers, mlp_only_layers=tuple(
        i for i in full.mlp_only_layers if i < args.layers))
    print(versions_line(("satjax", "jax", "jaxlib", "flax", "optax", "numpy")), flush=True)
    print(f"device: {n} x {jax.devices()[0].device_kind} ({jax.default_backend()}); model "
          f"{args.layers} of {full.num_hidden_layers} layers; "
          f"{args.seq_len} tokens per device per micro-step, grad_accum {cfg.train.grad_accum}",
          flush=True)

    mesh = parallel.make_mesh(cfg.train.mesh)
    model = Qwen3MoeForCausalLM(shape, rngs=nnx.Rngs(0), **model_options(cfg))
    graphdef, state = nnx.split(TrainState(model, run_optimizer(cfg)))
    step = run_train_step(cfg, graphdef, state, mesh)
    state = step.place_state(state)
    del model

    rows = parallel.data_parallel_size(mesh) * cfg.train.grad_accum
    rows = int(np.lcm(rows, cfg.rollout.group_size))
    spec = abstract_batch(cfg, shape, rows, args.seq_len)
    r = np.random.default_rng(0)
    tokens = r.integers(3, shape.vocab_size, spec.tokens.shape).astype(np.int32)
    loss_mask = np.zeros(spec.tokens.shape, np.float32)
    loss_mask[:, args.seq_len // 8:] = 1.0  # a short prompt, a long response
    routes = None
    if spec.routed_experts is not None:  # k distinct experts per token and layer
        keys = r.random((*spec.routed_experts.shape[:3], shape.num_experts), np.float32)
        routes = np.argsort(keys, axis=-1)[..., : shape.num_experts_per_tok].astype(np.int32)
    batch = Batch(
        tokens=tokens, attention_mask=np.ones_like(tokens), loss_mask=loss_mask,
        behavior_logprobs=(loss_mask * (np.log(1 / shape.vocab_size)
                                        + 0.1 * r.standard_normal(tokens.shape))
                           ).astype(np.float32),
        rewards=r.standard_normal(rows).astype(np.float32),
        group_ids=np.repeat(np.arange(rows // cfg.rollout.group_size),
                            cfg.rollout.group_size).astype(np.int32),
        policy_versions=np.zeros(rows, np.int32), routed_experts=routes,
        group_size=cfg.rollout.group_size)
    placed = step.place_batch(batch)
    for i in range(args.steps):
        t0 = time.perf_counter()
        state, metrics = step(state, placed)
        loss = float(jax.device_get(metrics["loss"]))
        print(f"step {i}: {time.perf_counter() - t0:.2f} s (loss {loss:.4g}"
              f"{', includes compiling' if i == 0 else ''})", flush=True)
    stats = jax.local_devices()[0].memory_stats()
    measured = stats.get("peak_bytes_in_use") if stats else None
    print("device peak: " + (f"{measured / GIB:.2f} GiB" if measured else
                             f"n/a ({jax.default_backend()} reports no memory_stats)"))

    # the on-paper estimate of the same step, compiled for n emulated CPU devices
    cmd = [sys.executable, str(REPO / "benchmarks/bench_memory.py"), "--config", args.config,
           "--devices", str(n), "--seq-len", str(args.seq_len), "--layers", str(args.layers),
           "--micro-batch", str(rows // (parallel.data_parallel_size(mesh)
                                         * cfg.train.grad_accum))]
    for o in overrides:
        cmd += ["--set", o]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    found = re.search(r"^per-device peak: ([0-9.]+) GiB", out.stdout, re.M)
    if out.returncode or not found:
        sys.exit(f"device_check: the CPU estimate failed:\n{out.stdout}\n{out.stderr[-3000:]}")
    estimate = float(found.group(1))
    print(f"CPU estimate (bench_memory.py, same step): {estimate:.2f} GiB"
          + _ratio(measured, estimate), flush=True)
    if jax.default_backend() == "gpu":
        micro_batch = rows // (parallel.data_parallel_size(mesh) * cfg.train.grad_accum)
        _gpu_plan(args, overrides, n, micro_batch, measured)


def _ratio(measured: int | None, estimate_gib: float) -> str:
    return f"; measured / estimate {measured / GIB / estimate_gib:.2f}" if measured else ""


def _gpu_plan(args: argparse.Namespace, overrides: list[str], n: int, micro_batch: int,
              measured: int | None) -> None:
    """``satjax plan``'s estimate of the same step: XLA:GPU compiling, deviceless, for this
    GPU's own target config (dumped here), as it would for GPUs it does not have."""
    import json
    import tempfile

    import jax
    from jaxlib import xla_client

    with tempfile.NamedTemporaryFile("w", suffix=".txtpb", delete=False) as fh:
        fh.write(xla_client.get_topology_for_devices(jax.devices()).target_config)
    cmd = [sys.executable, "-m", "satjax", "plan", "--config", args.config, "--topology",
           f"h100:{n}", "--target-config", fh.name, "--seq-len", str(args.seq_len),
           "--micro-batch", str(micro_batch), "--no-sampler", "--no-alternatives", "--json",
           "--set", f"model.overrides.num_hidden_layers={args.layers}"]
    for o in overrides:
        cmd += ["--set", o]
    # the compile is deviceless: this process keeps the GPU
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    os.unlink(fh.name)
    if out.returncode:
        sys.exit(f"device_check: satjax plan failed:\n{out.stderr[-3000:]}")
    peak = json.loads(out.stdout)["peak_gib"]
    print(f"XLA:GPU estimate (satjax plan --topology h100:{n}, this GPU's target config, "
          f"no autotuning): {peak:.2f} GiB" + _ratio(measured, peak), flush=True)


if __name__ == "__main__":
    main()
