"""Per-device memory and FLOPs of the real train step, on paper: an ahead-of-time compile.

    PYTHONPATH=$PWD python benchmarks/bench_memory.py \\
        --config configs/qwen3-30b-a3b.yaml --devices 64 --seq-len 8192 \\
        [--layers 48 | --layers 2,4] [--micro-batch 1] [--set KEY=VALUE ...]

The train state is built abstractly from the config (``nnx.eval_shape``: no weights, no
allocation), the trainer's own step (``satjax.train.trainer.run_train_step``: the
config's objective, replay, grad_accum, remat, mesh and model options) is lowered for a
batch of ``--seq-len`` tokens per row, ``--micro-batch`` rows per device per micro-step
(``grad_accum`` micro-steps) and compiled by XLA for an emulated ``--devices``-device CPU
mesh. XLA's buffer assignment then gives each device's argument, output and temporary
bytes; nothing is allocated. Printed:

* the per-device bytes, and ``per-device peak: X GiB`` (arguments + outputs - donated
  aliases + temporaries: what one device holds during the step);
* ``activations per sequence: X GiB``: the temporaries one more sequence per device per
  micro-step adds (a second compile at twice the micro-batch), i.e. what one sequence of
  ``--seq-len`` tokens costs through the whole model, forward and backward; beside it
  the bytes the program itself keeps for the backward per sequence (``jax.vjp``'s
  residuals, before any compiler), which XLA:CPU's figure exceeds where it holds bf16
  buffers in float32;
* model FLOPs per token: XLA's cost analysis of the model's forward + backward next to the
  analytic 6 x active parameters + attention (see :func:`model_flops_per_token`);
* which accelerators the peak fits (HBM per chip).

``--layers 2,4`` compiles those depths and extrapolates every byte count linearly to the
config's depth (and says so); the default compiles the config's own depth (with
``model.scan_layers`` the compile time does not grow with it). XLA:CPU's buffer
assignment and fusion stand in for the accelerator's, so the figures are estimates of
the same program, not measurements on the device.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `python benchmarks/<this>.py`: `benchmarks` importable


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="a satjax YAML config")
    ap.add_argument("--devices", type=int, required=True,
                    help="emulated devices; train.mesh must use exactly this many")
    ap.add_argument("--seq-len", type=int, required=True, help="tokens per sequence (T)")
    ap.add_argument("--micro-batch", type=int, default=1,
                    help="sequences per device per micro-step (default: %(default)s)")
    ap.add_argument("--layers", default="",
                    help="depth(s) to compile: one number, or two (e.g. 2,4) to "
                         "extrapolate linearly to the config's depth; default: its depth")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="KEY=VALUE", help="override a config key (repeatable)")
    args = ap.parse_args(argv)
    for name in ("devices", "seq_len", "micro_batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1")
    return args


# HBM per chip, GiB (the comparison set)
CHIPS = {"TPU v5e": 16, "H100": 80, "TPU v5p": 95, "H200": 141}
GIB = 1 << 30


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # before jax is imported: the emulated devices
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}")
    os.environ["JAX_PLATFORMS"] = "cpu"
    from benchmarks.machine import print_versions
    from satjax.app.memory import (
        StepMemory,
        attention_flops_per_token,
        compile_step,
        model_flops_per_token,
        residuals_per_sequence,
    )
    from satjax.config import load_config
    from satjax.model.attention import causal_blocks

    cfg = load_config(args.config, args.overrides)
    if cfg.train.mesh.size != args.devices:
        sys.exit(f"bench_memory: train.mesh uses {cfg.train.mesh.size} devices, "
                 f"--devices is {args.devices}")
    print_versions()
    from satjax.app.factory import model_config

    mcfg = model_config(cfg, _tokenizer(cfg))
    depth = mcfg.num_hidden_layers
    layers = [int(x) for x in args.layers.split(",") if x] or [depth]
    if len(layers) not in (1, 2) or (len(layers) == 2 and layers[0] == layers[1]):
        sys.exit("bench_memory: --layers takes one depth or two different ones")
    print(f"model: {depth} layers, hidden {mcfg.hidden_size}, {mcfg.num_experts} experts "
          f"top-{mcfg.num_experts_per_tok}, vocab {mcfg.vocab_size}; compute "
          f"{cfg.model.dtype}, params {cfg.model.param_dtype}, remat {cfg.train.remat}, "
          f"attention {cfg.model.attention}, moe {cfg.model.moe_impl}, "
          f"scan_layers {cfg.model.scan_layers}")
    mesh = dict(zip(("data", "fsdp", "expert", "tensor"), cfg.train.mesh.shape, strict=True))
    print(f"step: mesh {mesh}, "
          f"{args.micro_batch} x {args.seq_len} tokens per device per micro-step, "
          f"grad_accum {cfg.train.grad_accum}, objective {cfg.objective.name}, "
          f"replay {cfg.train.replay}")
    stats = {}
    for n in layers:
        for mb in (args.micro_batch, 2 * args.micro_batch):
            t0 = time.perf_counter()
            stats[n, mb] = StepMemory.of(compile_step(cfg, mcfg, num_layers=n,
                                                      micro_batch=mb, seq_len=args.seq_len))
            print(f"compiled {n} layers, micro-batch {mb}: {time.perf_counter() - t0:.0f} s "
                  f"({stats[n, mb].summary()})", flush=True)
    if len(layers) == 1:
        one, two = stats[layers[0], args.micro_batch], stats[layers[0], 2 * args.micro_batch]
        if layers[0] != depth:
            print(f"NOTE: compiled {layers[0]} of the model's {depth} layers; figures are "
                  f"for {layers[0]} layers")
    else:
        a, b = layers
        one = stats[a, args.micro_batch].extrapolate(stats[b, args.micro_batch], a, b, depth)
        two = stats[a, 2 * args.micro_batch].extrapolate(
            stats[b, 2 * args.micro_batch], a, b, depth)
        print(f"EXTRAPOLATED linearly from {a} and {b} layers to {depth}")
    print(f"per-device bytes: arguments {one.arguments / GIB:.2f} GiB, outputs "
          f"{one.outputs / GIB:.2f} GiB (donated {one.aliased / GIB:.2f} GiB), "
          f"temporaries {one.temporaries / GIB:.2f} GiB")
    print(f"per-device peak: {one.peak / GIB:.2f} GiB")
    per_seq = (two.temporaries - one.temporaries) / args.micro_batch
    print(f"activations per sequence: {per_seq / GIB:.2f} GiB")
    saved = residuals_per_sequence(cfg, mcfg, args.seq_len)
    print(f"saved for the backward per sequence by the program ({depth} layers, jax.vjp "
          f"residuals, before XLA): {saved / GIB:.2f} GiB")
    xla, analytic = model_flops_per_token(cfg, mcfg, args.seq_len)
    blocks = causal_blocks(args.seq_len)
    as_run = analytic + attention_flops_per_token(
        mcfg, args.seq_len, (blocks + 1) / (2 * blocks) - 0.5)
    print(f"model FLOPs per token (fwd+bwd): XLA cost analysis {xla / 1e9:.4g} GFLOP, "
          f"analytic 6 x active params + causal attention {analytic / 1e9:.4g} GFLOP "
          f"(XLA / analytic {xla / analytic:.3f}; the XLA count runs the reference "
          f"attention's {blocks} query blocks, {blocks + 1}/{2 * blocks} of T x T: "
          f"analytic at that {as_run / 1e9:.4g} GFLOP, XLA / it {xla / as_run:.3f})")
    fits = [f"{chip} ({gib} GiB): {'fits' if one.peak <= gib * GIB else 'does not fit'}"
            for chip, gib in CHIPS.items()]
    print("per-device peak vs HBM: " + "; ".join(fits))


def _tokenizer(cfg):
    """The tiny preset is sized to its tokenizer; a written-out architecture needs none."""
    if cfg.model.preset != "tiny" or cfg.model.path:
        return None
    from satjax.app.factory import build_tokenizer

    return build_tokenizer(cfg)


if __name__ == "__main__":
    main()
