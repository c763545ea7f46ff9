"""Data wait on the trainer's critical path: the paper's batch through the real queue, with
and without prefetching the next batch while the step runs.

A ``satjax serve-queue`` subprocess; ``--producers`` producer subprocesses put the
``bench_queue.py --paper`` load (its construction, imported: ``--paper-prompts`` (256) x
``--group-size`` (16) trajectories of ``--response`` (1024) tokens with 48-layer top-8
routes, ~2 GB a batch), one put per group as a rollout worker does, staying at most
``--ahead`` batches ahead of the trainer. This process is the trainer: it takes batches
with ``satjax.app.batch_source.BatchSource`` (the code ``satjax train`` takes them with;
GetBatch calls of ``--get-rows`` trajectories) around a step that sleeps ``--step-s``
seconds (the devices busy and the host free, as while a jitted step runs), and
acknowledges each batch after its step, as after a checkpoint. ``--make-batch`` also pads
each batch (``make_batch``, the default ``train.buckets``) and places it on the default
JAX device, as ``Trainer.prepare`` does (the padded int32 routes are ~6x the wire bytes:
use fewer prompts).

Blocks of ``--steps`` steps alternate, ``--repeats`` times: the loop without prefetch (each
batch fetched once the step before it has finished) and with it (the next batch fetched
from the start of the step, as ``satjax train`` does); a block's first step is not
counted (with prefetch, nothing was fetched ahead of it). Prints the versions line, the
settings, each step's wait and fetch, then per mode the mean time the loop waited for its
batch after the previous step, as ``data wait on the critical path: X%`` of the step time
(target < 5% with prefetch), and how long the fetch itself took (GetBatch calls, decoding,
``--make-batch``'s work: from its start to the batch being ready).

  PYTHONPATH=. python benchmarks/bench_pipeline.py [--paper-prompts 256] [--step-s 8]
  PYTHONPATH=. python benchmarks/bench_pipeline.py --paper-prompts 32 --make-batch
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_queue import (  # noqa: E402
    MAX_MESSAGE_MB,
    PAPER_PROMPTS,
    TOKEN,
    paper_group,
    paper_template,
    start_queue,
)
from benchmarks.machine import print_versions  # noqa: E402
from satjax.config import QueueConfig, TrainConfig  # noqa: E402
from satjax.queue.client import QueueClient  # noqa: E402
from satjax.queue.codec import encode  # noqa: E402
from satjax.utils import die_with_parent, retain_freed_memory  # noqa: E402

TARGET = 0.05  # data wait / step time with prefetch (issue "The paper's run fits", item 8)
MAX_LAG = 1 << 20  # the producers' trajectories are never stale: this measures the data path
# the producer flags that shape the load (passed on to the producer subprocesses)
LOAD_FLAGS = ("prompt", "response", "layers", "topk", "experts", "group_size",
              "paper_prompts", "ahead")


def client(port: int, **kwargs) -> QueueClient:
    return QueueClient(f"127.0.0.1:{port}", token=TOKEN, max_message_mb=MAX_MESSAGE_MB, **kwargs)


def rss_gb() -> float:
    """This process's resident memory (Linux), GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def produce(args: argparse.Namespace) -> None:
    """Producer ``args.produce`` of ``args.producers``: its share of ``args.batches``
    batches' groups, one put each, waiting while ``args.ahead`` batches are pending."""
    die_with_parent()  # the trainer's process: however it ends
    retain_freed_memory()
    template = paper_template(args)
    rows = args.paper_prompts * args.group_size
    with client(args.port) as c:
        for p in range(args.produce, args.paper_prompts * args.batches, args.producers):
            while c.stats()["pending"] >= args.ahead * rows:
                time.sleep(0.05)
            assert c.put(paper_group(template, p, args.experts)).ok


def make_prepare(args: argparse.Namespace, done_at: list[float], prepare_s: list[float]):
    """What the loop does with a batch before its step: nothing, or (``--make-batch``)
    ``Trainer.prepare``'s padding and placing (its seconds appended to ``prepare_s``);
    appends the time it finished to ``done_at`` (the end of the fetch)."""
    import jax

    from satjax.train.batch import make_batch

    buckets = TrainConfig().buckets

    def prepare(trajectories):
        if args.make_batch:
            t0 = time.perf_counter()
            batch = make_batch(trajectories, buckets=buckets, num_layers_moe=args.layers,
                               top_k=args.topk)
            trajectories = jax.block_until_ready(jax.device_put(batch))
            prepare_s.append(time.perf_counter() - t0)
        done_at.append(time.perf_counter())
        return trajectories

    return prepare


def consume(args: argparse.Namespace) -> None:
    from satjax.app.batch_source import BatchSource
    from satjax.app.multihost import Peers

    rows = args.paper_prompts * args.group_size
    template = paper_template(args)
    traj_bytes = len(encode(template[0], num_experts=args.experts))
    batches = args.repeats * 2 * (args.steps + 1)
    data_dir = Path(tempfile.mkdtemp(prefix="bench-pipeline-", dir=args.data_dir))
    free = shutil.disk_usage(data_dir).free
    need = (args.ahead + 2) * rows * traj_bytes
    if free < 2 * need:
        shutil.rmtree(data_dir, ignore_errors=True)
        raise SystemExit(f"{need / 1e9:.1f} GB of log in flight needs {2 * need / 1e9:.1f} GB "
                         f"free in {data_dir.parent}, have {free / 1e9:.1f} GB")
    print(f"pipeline: {args.paper_prompts} prompts x {args.group_size} = {rows} trajectories "
          f"of {traj_bytes / 1024:.0f} KiB = {rows * traj_bytes / 1e9:.2f} GB a batch; "
          f"{args.producers} producer process(es), one put per group, <= {args.ahead} "
          f"batches ahead; queue fsync={args.fsync}; GetBatch of {args.get_rows}; step: "
          f"time.sleep({args.step_s:g} s); before the step: "
          f"{'make_batch + jax.device_put' if args.make_batch else 'nothing (decoded only)'}"
          f"; {args.repeats} x (off, on) blocks of 1 + {args.steps} steps", flush=True)
    if args.paper_prompts != PAPER_PROMPTS:
        print(f"  ({args.paper_prompts} of the paper's {PAPER_PROMPTS} prompts)", flush=True)
    queue, port = start_queue(args, args.fsync, data_dir)
    producers: list[subprocess.Popen] = []
    trainer = client(port, compact_routes=True)  # as satjax train's
    done_at: list[float] = []
    prepare_s: list[float] = []
    source = BatchSource(Peers(), trainer, rows=rows, max_lag=MAX_LAG,
                         prepare=make_prepare(args, done_at, prepare_s),
                         rows_per_call=args.get_rows)
    waits: dict[str, list[float]] = {"off": [], "on": []}
    fetches: dict[str, list[float]] = {"off": [], "on": []}
    try:
        trainer.wait_ready(30)
        load = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in LOAD_FLAGS]
        producers = [subprocess.Popen(
            [sys.executable, __file__, "--produce", str(k), "--producers",
             str(args.producers), "--port", str(port), "--batches", str(batches), *load])
            for k in range(args.producers)]
        version, fetch_from = 0, None  # when the fetch of the next batch started
        for _ in range(args.repeats):
            for mode in ("off", "on"):
                for i in range(args.steps + 1):
                    t0 = time.perf_counter()
                    got = source.next(version, lambda: False)
                    wait = time.perf_counter() - t0
                    fetch = done_at[-1] - (t0 if fetch_from is None else fetch_from)
                    fetch_from = None
                    assert got is not None and got.reply is not None
                    if mode == "on" and i < args.steps:
                        fetch_from = time.perf_counter()
                        source.prefetch(version + 1)
                    time.sleep(args.step_s)  # the step
                    trainer.ack(got.reply.cursor)
                    del got  # as the loop drops a batch once trained on
                    version += 1
                    if i:
                        waits[mode].append(wait)
                        fetches[mode].append(fetch)
                    print(f"  prefetch {mode:3s} step {i}: waited {wait:6.2f} s, its fetch "
                          f"took {fetch:6.2f} s, trainer RSS {rss_gb():.1f} GB"
                          f"{'' if i else ' (not counted)'}", flush=True)
        for p in producers:
            assert p.wait(timeout=60) == 0, "a producer failed"
    finally:
        source.close()
        trainer.close()
        for p in producers:
            p.kill()
        queue.terminate()
        queue.wait()
        shutil.rmtree(data_dir, ignore_errors=True)
    for mode in ("off", "on"):
        w = np.asarray(waits[mode])
        share = float(w.mean()) / args.step_s
        verdict = f" (target < {TARGET:.0%}: {'met' if share < TARGET else 'MISSED'})" \
            if mode == "on" else ""
        print(f"prefetch {mode:3s}: data wait on the critical path: {share:.1%} of step time"
              f"{verdict}; {w.mean():.2f} s per {args.step_s:g} s step (min {w.min():.2f}, "
              f"max {w.max():.2f}, {len(w)} steps); the fetch took "
              f"{np.mean(fetches[mode]):.2f} s", flush=True)
    if prepare_s:
        print(f"make_batch + jax.device_put of a batch: {np.mean(prepare_s):.2f} s (mean of "
              f"{len(prepare_s)}; part of each fetch)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--produce", type=int, help=argparse.SUPPRESS)  # a producer subprocess
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--batches", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--paper-prompts", type=int, default=PAPER_PROMPTS,
                    help="prompts per batch (default: the paper's %(default)s)")
    ap.add_argument("--step-s", type=float, default=8.0,
                    help="the step's duration in seconds (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=3,
                    help="counted steps per block (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="(off, on) block pairs (default: %(default)s)")
    ap.add_argument("--producers", type=int, default=2,
                    help="producer processes (default: %(default)s)")
    ap.add_argument("--ahead", type=int, default=2,
                    help="batches the producers may be ahead (default: %(default)s)")
    ap.add_argument("--get-rows", type=int, default=32,
                    help="trajectories per GetBatch call (default: %(default)s, 16 MB: see "
                         "bench_queue.py --paper-get)")
    ap.add_argument("--fsync", default=QueueConfig().fsync,
                    help="the queue's fsync policy (default: satjax train's, %(default)s)")
    ap.add_argument("--make-batch", action="store_true",
                    help="pad and place each batch before its step, as Trainer.prepare")
    ap.add_argument("--data-dir", help="where the queue's log goes (default: a temp dir)")
    args = ap.parse_args()
    if args.produce is not None:
        produce(args)
        return
    if min(args.paper_prompts, args.steps, args.repeats, args.producers, args.ahead) < 1:
        ap.error("--paper-prompts, --steps, --repeats, --producers, --ahead: must be >= 1")
    if args.get_rows % args.group_size:
        ap.error(f"--get-rows: must be a multiple of --group-size {args.group_size}")
    retain_freed_memory()  # as every satjax process
    print_versions()
    consume(args)


if __name__ == "__main__":
    main()
