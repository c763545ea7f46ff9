"""Weight publishing (satjax.train.publish): throughput and its cost on the train step.

Prints, measured side by side in one run:
  - the machine's sequential write bandwidth to the weights directory (fsync included),
    before and after the publishes;
  - publish throughput of a >= 300M-parameter bfloat16 MoE (bf16 as HF checkpoints of
    the paper's model are; it also halves this shared machine's memory use) from one
    process (1 device), GB/s of the whole publish (HF-layout copy, host copy, write,
    fsync, rename), and its ratio to the better sequential-write figure (target: >= 0.5);
  - step time of a real train step (make_train_step, the 26M-parameter MoE of
    bench_rollout, one device) with a publish after every step vs without, in interleaved
    blocks: median step time on / off (target: < 1.05); and, for reference, with each
    publish waited for at once (what a synchronous publish costs);
  - delta versions (satjax.weight_sync): the same 326M MoE with float32 master weights,
    trained --delta-steps real steps of Adam (make_optimizer) at lr 1e-6 and published
    after each as bfloat16, by one publisher writing full versions and one writing deltas:
    bytes and seconds per version of each, the compression (target: >= 4x fewer bytes than
    a full copy), what a worker spends reading a full version vs applying a delta, a check
    that the deltas rebuild the last full version bit for bit, and the figures
    extrapolated to Qwen3-30B-A3B (30.5B parameters) from the measured ratio and rates.

  PYTHONPATH=. python benchmarks/bench_publish.py [--dir /tmp] [--repeats 3] [--blocks 4]
      [--delta-steps 10] [--parts throughput,step,delta]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `python benchmarks/<this>.py`: `benchmarks` importable

os.environ.setdefault("JAX_PLATFORMS", "cpu")

BIG = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2048,
           moe_intermediate_size=512, num_hidden_layers=6, num_attention_heads=16,
           num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4)
STEP = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=512)  # 26M
PAPER_PARAMS = 30.5e9  # Qwen3-30B-A3B
DELTA_LR = 1e-6  # the paper's learning rate (configs/qwen3-30b-a3b.yaml)


def big_model(mesh_shape: tuple[int, int, int, int]):
    """The >= 300M-parameter MoE, bfloat16, sharded over ``mesh_shape`` (d, f, e, t)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from satjax import parallel
    from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = parallel.MeshConfig(*mesh_shape)
    mesh = parallel.make_mesh(config, devices=jax.devices()[:config.size])
    cfg = Qwen3MoeConfig.tiny(**BIG)
    def build():
        return Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                   param_dtype=jnp.bfloat16)

    abstract = nnx.eval_shape(build)
    graphdef, state = nnx.split(abstract)
    shardings = parallel.state_shardings(state, mesh)

    def init():  # built on the devices, already sharded: no host copy of the whole model
        return nnx.split(build())[1]

    state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state), mesh


def publish_times(model, mesh, root: Path, repeats: int) -> tuple[list[float], list[float],
                                                                  list[str]]:
    """(seconds until publish() returned, seconds until visible, files this process wrote)
    per publish of versions 0..repeats-1 into ``root``."""
    from satjax.train.publish import ShardedPublisher
    from satjax.weight_sync import WeightPublisher

    # full versions: the same weights every time, so a delta would be empty
    pub = ShardedPublisher(WeightPublisher(root, keep=1), mesh, [1, 5, 9, 17, 30, 2],
                           keyframe_every=1)
    pub.publish(model, 0)  # compiles the canary; not timed
    pub.wait()
    calls, totals = [], []
    for v in range(1, repeats + 1):
        t0 = time.perf_counter()
        pub.publish(model, v)
        t1 = time.perf_counter()
        pub.wait()
        calls.append(t1 - t0)
        totals.append(time.perf_counter() - t0)
    return calls, totals, pub.last_files


def step_times(blocks: int, steps: int, directory: str
               ) -> tuple[list[float], list[float], list[float], float]:
    """Per-step seconds (train step + metrics to host [+ publish() call [+ its wait]])
    without, with, and with a synchronous publish after every step, in interleaved
    blocks; and one background publish's seconds. The first step of each block is dropped
    (it waits for the other mode's leftovers)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.bench_train_step import synthetic_batch
    from satjax import parallel
    from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from satjax.train.publish import ShardedPublisher
    from satjax.train.state import TrainState, make_optimizer
    from satjax.train.step import make_train_step
    from satjax.weight_sync import WeightPublisher

    cfg = Qwen3MoeConfig.tiny(**STEP)
    mesh = parallel.make_mesh(parallel.MeshConfig(), devices=jax.devices()[:1])
    model = Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    graphdef, state = nnx.split(TrainState(model, make_optimizer(1e-5, max_grad_norm=1.0)))
    step = make_train_step(graphdef, state, mesh=mesh)  # sat_gspo: the default
    state = step.place_state(state)
    batch = step.place_batch(synthetic_batch(cfg, 8, 128, 4, seed=0))
    root = Path(tempfile.mkdtemp(prefix="bench-publish-step-", dir=directory))
    # full versions, as the figures in docs/parallel.md were measured (the delta part
    # measures what deltas cost)
    pub = ShardedPublisher(WeightPublisher(root, keep=2), mesh, [1, 5, 9, 17, 30, 2],
                           keyframe_every=1)
    version = 0
    print(f"step model: {n_params / 1e6:.1f}M parameters, B=8, T=128, sat_gspo, 1 device",
          flush=True)

    def run(publish: bool, sync: bool = False) -> list[float]:
        nonlocal state, version
        out = []
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            jax.device_get(metrics)
            if publish:
                version += 1
                pub.publish(nnx.merge(graphdef, state).model, version)
                if sync:
                    pub.wait()
            out.append(time.perf_counter() - t0)
        return out[1:]

    run(False)  # compile
    run(True)
    pub.wait()
    off, on, sync = [], [], []
    for _ in range(blocks):
        off += run(False)
        on += run(True)
        sync += run(True, sync=True)
    pub.wait()
    background = pub.last_seconds
    shutil.rmtree(root)
    return off, on, sync, background


def throughput() -> None:
    """The publish-throughput lines of the module docstring."""
    from benchmarks.machine import sequential_write_gbs
    from satjax.model import Qwen3MoeConfig
    from satjax.model.hf_io import hf_tensors

    cfg = Qwen3MoeConfig.tiny(**BIG)
    # one device: the canary forward of an fsdp-sharded model all-gathers it on each of
    # several emulated devices (2 cores), which measures the emulation, not publishing.
    # Several processes: tests/train/test_multiprocess.py (each writes its own files)
    model, mesh = big_model((1, 1, 1, 1))
    import jax
    from flax import nnx

    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    nbytes = 2 * n_params
    free = shutil.disk_usage(ARGS.dir).free
    if free < 3 * nbytes + (2 << 30):
        sys.exit(f"--dir {ARGS.dir}: {free / 1e9:.1f} GB free, this benchmark needs "
                 f"{(3 * nbytes + (2 << 30)) / 1e9:.1f} GB")
    print(f"publish model: {n_params / 1e6:.0f}M parameters bfloat16 ({nbytes / 1e9:.2f} GB, "
          f"{len(hf_tensors(cfg))} HF tensors), L={cfg.num_hidden_layers}, "
          f"E={cfg.num_experts}, D={cfg.hidden_size}; --dir {ARGS.dir}", flush=True)
    mb = min(4096, nbytes >> 20)
    seq = [sequential_write_gbs(ARGS.dir, mbytes=mb)]
    print(f"sequential write before: {seq[0]:.2f} GB/s ({mb} MB, fsync)", flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-publish-", dir=ARGS.dir))
    try:
        calls, totals, files = publish_times(model, mesh, root, ARGS.repeats)
        del model
        seq.append(sequential_write_gbs(ARGS.dir, mbytes=mb))
        print(f"sequential write after:  {seq[1]:.2f} GB/s", flush=True)
        gbs = nbytes / statistics.median(totals) / 1e9
        print(f"1 process (1 device): publish {statistics.median(totals):.2f} s "
              f"median of {ARGS.repeats} (publish() returns after "
              f"{statistics.median(calls):.2f} s), {len(files)} files, "
              f"{gbs:.2f} GB/s = {gbs / max(seq):.2f} x sequential write "
              f"(target >= 0.5: {'met' if gbs / max(seq) >= 0.5 else 'MISSED'})", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def version_bytes(root: Path, version: int) -> int:
    """Bytes of the files of a published version (weights or deltas, config, index)."""
    from satjax.weight_sync import WeightSubscriber

    return sum(WeightSubscriber(root).manifest(version)["files"].values())


def delta_figures(steps: int, directory: str) -> None:
    """The delta part of the module docstring: prints its lines."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from benchmarks.bench_train_step import synthetic_batch
    from satjax import parallel
    from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from satjax.train.publish import WRITE_THREADS, ShardedPublisher
    from satjax.train.state import TrainState, make_optimizer
    from satjax.train.step import make_train_step
    from satjax.weight_sync import (
        WeightMirror,
        WeightPublisher,
        WeightSubscriber,
        encode_delta,
    )

    cfg = Qwen3MoeConfig.tiny(**BIG)
    mesh = parallel.make_mesh(parallel.MeshConfig(), devices=jax.devices()[:1])
    model = Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32,
                                param_dtype=jnp.float32)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    graphdef, state = nnx.split(TrainState(model, make_optimizer(DELTA_LR, max_grad_norm=1.0)))
    del model
    step = make_train_step(graphdef, state, mesh=mesh)  # sat_gspo: the default
    state = step.place_state(state)
    roots = {kind: Path(tempfile.mkdtemp(prefix=f"bench-publish-{kind}-", dir=directory))
             for kind in ("full", "delta")}
    tokens = [1, 5, 9, 17, 30, 2]
    pubs = {"full": ShardedPublisher(WeightPublisher(roots["full"], keep=2), mesh, tokens,
                                     keyframe_every=1, dtype="bfloat16"),
            "delta": ShardedPublisher(WeightPublisher(roots["delta"], keep=2), mesh, tokens,
                                      keyframe_every=steps + 1, dtype="bfloat16")}
    print(f"delta model: {n_params / 1e6:.0f}M parameters float32, Adam (make_optimizer) "
          f"lr {DELTA_LR:g}, max_grad_norm 1; published as bfloat16 after each of {steps} "
          f"train steps (sat_gspo, B=8, T=128, 1 device); --dir {directory}", flush=True)
    seconds: dict[str, list[float]] = {"full": [], "delta": []}
    nbytes: dict[str, list[int]] = {"full": [], "delta": []}
    try:
        for version in range(steps + 1):
            if version:
                state, _ = step(state, step.place_batch(
                    synthetic_batch(cfg, 8, 128, 4, seed=version)))
            model = nnx.merge(graphdef, state).model
            jax.block_until_ready(nnx.state(model))
            for kind, pub in pubs.items():
                t0 = time.perf_counter()
                pub.publish(model, version)
                pub.wait()
                if version:  # version 0 compiles the publisher's programs: not timed
                    seconds[kind].append(time.perf_counter() - t0)
                    nbytes[kind].append(version_bytes(roots[kind], version))
        # a worker: the full version 0, then every delta, against the full last version
        sub = WeightSubscriber(roots["delta"])
        mirror = WeightMirror()
        t0 = time.perf_counter()
        mirror.load_full(sub.checkpoint_dir(0))
        read_s = time.perf_counter() - t0
        apply_s = []
        for version in range(1, steps + 1):
            if version == steps:  # version steps - 1, to time the encoding of the last delta
                before = {k: t.data.copy() for k, t in mirror.tensors.items()}
            t0 = time.perf_counter()
            mirror.apply_delta(sub.checkpoint_dir(version))
            apply_s.append(time.perf_counter() - t0)
        # what each thread of a publishing process does per tensor, in one thread here
        t0 = time.perf_counter()
        encoded = sum(len(encode_delta(t.data, before[k]) or b"")
                      for k, t in mirror.tensors.items())
        encode_s = time.perf_counter() - t0
        del before
        last = WeightMirror()
        last.load_full(WeightSubscriber(roots["full"]).checkpoint_dir(steps))
        exact = last.tensors.keys() == mirror.tensors.keys() and all(
            np.array_equal(last.tensors[k].data, mirror.tensors[k].data) for k in last.tensors)
    finally:
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)
    full_b, delta_b = statistics.median(nbytes["full"]), statistics.median(nbytes["delta"])
    full_s, delta_s = statistics.median(seconds["full"]), statistics.median(seconds["delta"])
    ratio = full_b / delta_b
    print(f"full version: {full_b / 1e9:.3f} GB, {full_s:.2f} s per version "
          f"({full_b / full_s / 1e9:.2f} GB/s); median of {steps}", flush=True)
    print(f"delta version: {delta_b / 1e9:.3f} GB (median; {min(nbytes['delta']) / 1e9:.3f}"
          f"-{max(nbytes['delta']) / 1e9:.3f} over the {steps} versions), {delta_s:.2f} s "
          f"per version ({min(seconds['delta']):.2f}-{max(seconds['delta']):.2f})",
          flush=True)
    print(f"delta / full: {ratio:.1f}x fewer bytes than a full copy (target >= 4x: "
          f"{'met' if ratio >= 4 else 'MISSED'}), {full_s / delta_s:.2f}x the publish speed",
          flush=True)
    print(f"worker: reading the full version {read_s:.2f} s, applying a delta "
          f"{statistics.median(apply_s):.2f} s (median); deltas 1..{steps} applied to "
          f"version 0 rebuild version {steps} bit for bit: {'yes' if exact else 'NO'}",
          flush=True)
    encode_gbs = full_b / encode_s / 1e9
    print(f"encoding the last delta (XOR + zstd of every tensor, 1 thread): {encode_s:.2f} s, "
          f"{encode_gbs:.2f} GB/s of weights, {encoded / 1e9:.3f} GB", flush=True)
    paper = 2 * PAPER_PARAMS  # bf16 bytes
    scale = paper / full_b
    delta_paper = paper / ratio
    print(f"extrapolated to Qwen3-30B-A3B ({PAPER_PARAMS / 1e9:.1f}B parameters, bf16 "
          f"{paper / 1e9:.1f} GB per full version) with this ratio and these rates: a delta "
          f"{delta_paper / 1e9:.1f} GB; with a keyframe every 10 versions "
          f"{(paper + 9 * delta_paper) / 10 / 1e9:.1f} GB per version on average. Writing at "
          f"this run's full-publish rate ({full_b / full_s / 1e9:.2f} GB/s, 1 process): full "
          f"{full_s * scale:.0f} s, a delta's bytes {delta_paper / (full_b / full_s):.0f} s "
          f"plus {paper / 1e9 / encode_gbs:.0f} thread-seconds of encoding, split over every "
          f"process's {WRITE_THREADS} threads; a worker applies a delta in "
          f"{statistics.median(apply_s) * scale:.0f} s vs reading a full version in "
          f"{read_s * scale:.0f} s (this machine's 2 cores)", flush=True)


def main() -> None:
    from benchmarks.machine import PACKAGES, print_versions

    print_versions((*PACKAGES, "zstandard"))
    parts = set(ARGS.parts.split(","))
    if "throughput" in parts:
        throughput()
    if "step" in parts:
        off, on, sync, background = step_times(ARGS.blocks, ARGS.steps, ARGS.dir)
        ratio = statistics.median(on) / statistics.median(off)
        print(f"step time: off {statistics.median(off):.3f} s, on "
              f"{statistics.median(on):.3f} s, synchronous publish "
              f"{statistics.median(sync):.3f} s (median of {len(off)} steps each, "
              f"{ARGS.blocks} interleaved blocks; the last background publish took "
              f"{background:.2f} s): on/off {ratio:.3f} (target < 1.05: "
              f"{'met' if ratio < 1.05 else 'MISSED'}), synchronous/off "
              f"{statistics.median(sync) / statistics.median(off):.3f}", flush=True)
    if "delta" in parts and ARGS.delta_steps > 0:
        delta_figures(ARGS.delta_steps, ARGS.dir)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(),
                    help="where to publish (the file system the weights would live on)")
    ap.add_argument("--repeats", type=int, default=3, help="timed publishes of the big model")
    ap.add_argument("--blocks", type=int, default=4, help="interleaved on/off blocks")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per block")
    ap.add_argument("--delta-steps", type=int, default=10,
                    help="train steps (versions) of the delta part; 0 skips it")
    ap.add_argument("--parts", default="throughput,step,delta",
                    help="which parts to run, comma-separated: throughput, step, delta")
    ARGS = ap.parse_args()
    main()
