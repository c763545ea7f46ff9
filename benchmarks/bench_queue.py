"""Throughput of the trajectory queue on loopback against a raw gRPC echo of the same bytes.

Both servers run as subprocesses in the same run (each its own Python process). One cycle
moves a batch of B realistic trajectories client -> server -> client:
  queue: QueueClient.put(B) + get_batch(B) + ack;
  echo:  one unary call carrying the same serialized bytes, answered with them unchanged.
Prints the versions line, the machine figures the queue is bounded by (memory copy and
sequential write bandwidth, measured now), then per fsync policy trajectories/s, MB/s
(payload bytes each way) and queue/echo ratios for the server path (pre-encoded bytes in,
zero-copy views out; target >= 0.5) and end to end (int32 Trajectory objects in and out,
client encode/decode included; target >= 0.4), "MISSED" where missed, plus p50/p99
GetBatch latency, and beside echo what the disk itself does with the same records in the
same run (os.write + os.fsync of each, one fsync per batch as a group commit of one put
gets at best, no fsync): a put under fsync=always cannot be faster than its batch's
fsync. Timings are the best of --repeats interleaved repeats.

--paper instead times one training step of a paper-sized load: --paper-prompts (256) x
--group-size (16) trajectories of --response (1024) tokens with 48-layer top-8 routes
(~2 GB): the workers' puts (one per group), the trainer's GetBatch calls (--paper-get
trajectories each, 32 by default) and its one ack, in seconds per step (scaled to 256
prompts when run with fewer, and said so). With --paper-producers N the groups are put
by N concurrent clients, as N rollout workers would (each its own QueueClient, one put
per group; the put time is then the wall time of all of them, encoding included): under
fsync=always their puts share fsyncs (group commit).

--concurrent-puts T instead times the storage alone (TrajectoryQueue in this process, no
gRPC): T threads, each putting --concurrent-items (40) trajectories one per put, as puts/s
per fsync policy; under fsync=always concurrent puts share fsyncs (group commit).

--in-process instead times the queue's own work in a cycle, without gRPC: the same
batches through a TrajectoryQueue in this process (parse and check, put, GetBatch, Ack),
as median ms per cycle over --in-process-cycles cycles; what the server path costs beyond
it is the transport.

  PYTHONPATH=. python benchmarks/bench_queue.py [--fsync always,never] [--repeats 5]
  PYTHONPATH=. python benchmarks/bench_queue.py --paper [--paper-prompts 256]
  PYTHONPATH=. python benchmarks/bench_queue.py --concurrent-puts 8 --fsync always,never
  PYTHONPATH=. python benchmarks/bench_queue.py --in-process --fsync never,always
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.machine import (  # noqa: E402
    memory_bandwidth_gbs,
    print_versions,
    sequential_write_gbs,
)
from satjax.queue.client import QueueClient  # noqa: E402
from satjax.queue.codec import encode  # noqa: E402
from satjax.queue.core import QueueSettings, TrajectoryQueue  # noqa: E402
from satjax.queue.store import FSYNC_POLICIES  # noqa: E402
from satjax.trajectory import Trajectory  # noqa: E402
from satjax.utils import die_with_parent, free_port, retain_freed_memory  # noqa: E402

TOKEN = "bench-token-0123456789"  # the server wants >= 16 characters
MB = 1 << 20
MAX_MESSAGE_MB = 256
OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_MB * MB),
           ("grpc.max_send_message_length", MAX_MESSAGE_MB * MB)]
SERVER_TARGET, E2E_TARGET = 0.5, 0.4  # queue / echo time ratios (issue #14)
PAPER_PROMPTS = 256  # one step of the paper's load: 256 prompts x 16 samples


def serve_echo(port: int) -> None:
    """A trivial generic-handler echo server (bytes in, same bytes out), with the allocator
    setting every ``satjax`` process has, so that the two differ only in what the queue does."""
    retain_freed_memory()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)}),))
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print(f"echo listening on {port}", flush=True)
    server.wait_for_termination()


def make_traj(i: int, p: int, n: int, layers: int, k: int, experts: int,
              group_size: int) -> Trajectory:
    """A trajectory as a worker recording routes sends it: the experts of every token and
    layer with their gate weights (``rollout.record_routes``; the queue of a run requires
    both), float16 weights in [0, 1] summing to 1 over the top-k like a router's."""
    rng = np.random.default_rng(i)
    gates = rng.random((p + n - 1, layers, k), dtype=np.float32)
    gates /= gates.sum(-1, keepdims=True)
    return Trajectory(
        trajectory_id=f"t{i}", group_id=f"g{i // group_size}", prompt_id=f"p{i // group_size}",
        prompt_tokens=rng.integers(0, 150000, p, dtype=np.int32),
        response_tokens=rng.integers(0, 150000, n, dtype=np.int32),
        behavior_logprobs=-rng.random(n, dtype=np.float32) * 5, policy_version=0,
        reward=1.0, group_size=group_size, finish_reason="length", engine="bench",
        routed_experts=rng.integers(0, experts, (p + n - 1, layers, k), dtype=np.int32),
        routed_gates=gates.astype(np.float16))


def disk_rates(directory: str | None, records: list[bytes], group: int) -> dict[str, float]:
    """Seconds to write ``records`` sequentially to a fresh file in ``directory``: with an
    fsync after each record, after each ``group`` records, and with none."""
    out = {}
    for name, every in (("each", 1), ("group", group), ("none", 0)):
        fd, path = tempfile.mkstemp(prefix="bench-disk-", dir=directory)
        try:
            t0 = time.perf_counter()
            for i, record in enumerate(records, 1):
                os.write(fd, record)
                if every and i % every == 0:
                    os.fsync(fd)
            out[name] = time.perf_counter() - t0
        finally:
            os.close(fd)
            os.unlink(path)
    return out


def start(cmd: list[str], marker: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "SATJAX_QUEUE_TOKEN": TOKEN}
    # dies with this process, however it ends (an OOM kill included)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True,
                            preexec_fn=die_with_parent)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if marker not in line:
        proc.kill()
        raise RuntimeError(f"server failed to start: {line!r}")
    return proc


def start_queue(args: argparse.Namespace, fsync: str, data_dir: Path) -> tuple[subprocess.Popen,
                                                                               int]:
    port = free_port()
    proc = start([sys.executable, "-m", "satjax", "serve-queue", "--port", str(port),
                  "--data-dir", str(data_dir), "--fsync", fsync,
                  "--max-message-mb", str(MAX_MESSAGE_MB), "--log-level", "WARNING",
                  "--num-experts", str(args.experts)], "listening on")
    return proc, port


def bench(args: argparse.Namespace, fsync: str) -> dict[str, float]:
    trajs = [make_traj(i, args.prompt, args.response, args.layers, args.topk, args.experts,
                       args.group_size) for i in range(args.batch)]
    raws = [encode(t, num_experts=args.experts) for t in trajs]
    per_traj = sum(map(len, raws)) / len(raws)
    echo_blob = b"".join(raws)
    data_dir = Path(tempfile.mkdtemp(prefix="bench-queue-", dir=args.data_dir))
    queue, qport = start_queue(args, fsync, data_dir)
    eport = free_port()
    echo = start([sys.executable, __file__, "--serve-echo", str(eport)], "echo listening")
    # two clients, one consumer: they share the queue's consumer lease
    wire_client = QueueClient(f"127.0.0.1:{qport}", token=TOKEN, max_message_mb=MAX_MESSAGE_MB,
                              compact_routes=True, consumer_id="bench")
    e2e_client = QueueClient(f"127.0.0.1:{qport}", token=TOKEN, max_message_mb=MAX_MESSAGE_MB,
                             num_experts=args.experts, consumer_id="bench")
    channel = grpc.insecure_channel(f"127.0.0.1:{eport}", options=OPTIONS)
    echo_call = channel.unary_unary("/bench.Echo/Echo")
    counter = [0]

    def fresh_ids() -> list[Trajectory]:  # the queue de-duplicates on trajectory_id
        out = []
        for t in trajs:
            i = counter[0]
            counter[0] += 1
            out.append(dataclasses.replace(t, trajectory_id=f"t{i}",
                                           group_id=f"g{i // args.group_size}"))
        return out

    def server_path_cycle() -> None:
        """Pre-encoded bytes in, zero-copy views out: what the server and transport cost."""
        assert wire_client.put(wire_batches.pop()).ok
        batch = wire_client.get_batch(args.batch, 0, max_lag=10)
        assert len(batch.trajectories) == args.batch
        wire_client.ack(batch.cursor)

    def end_to_end_cycle() -> None:
        """Trajectory (int32 routes) in, Trajectory (int32 routes) out."""
        assert e2e_client.put(fresh_ids()).ok
        batch = e2e_client.get_batch(args.batch, 0, max_lag=10)
        assert len(batch.trajectories) == args.batch
        e2e_client.ack(batch.cursor)

    def echo_cycle() -> None:
        assert len(echo_call(echo_blob)) == len(echo_blob)

    total_cycles = (args.repeats * args.rounds + 1)
    wire_batches = [[encode(t, num_experts=args.experts) for t in fresh_ids()]
                    for _ in range(total_cycles)]
    cycles = {"server": server_path_cycle, "e2e": end_to_end_cycle, "echo": echo_cycle}
    try:
        wire_client.wait_ready(30)
        for fn in cycles.values():  # warm up
            fn()
        times: dict[str, list[float]] = {name: [] for name in cycles}
        disk: dict[str, list[float]] = {"each": [], "group": [], "none": []}
        for _ in range(args.repeats):  # interleaved so all see the same machine load
            for name, fn in cycles.items():
                t0 = time.perf_counter()
                for _ in range(args.rounds):
                    fn()
                times[name].append(time.perf_counter() - t0)
            for name, sec in disk_rates(args.data_dir, raws * args.rounds, args.batch).items():
                disk[name].append(sec)
        # GetBatch latency with data waiting in the queue
        for _ in range(args.latency_calls):
            wire_client.put([encode(t, num_experts=args.experts) for t in fresh_ids()])
        lat = []
        for _ in range(args.latency_calls):
            t0 = time.perf_counter()
            b = wire_client.get_batch(args.batch, 0, max_lag=10)
            lat.append(time.perf_counter() - t0)
            wire_client.ack(b.cursor)
    finally:
        wire_client.close()
        e2e_client.close()
        channel.close()
        for proc in (queue, echo):
            proc.terminate()
            proc.wait()
        shutil.rmtree(data_dir, ignore_errors=True)
    n = args.batch * args.rounds
    # best of the repeats: on a shared machine the least disturbed run is the estimate
    best = {name: float(np.min(v)) for name, v in times.items()}
    out = {"traj_bytes": per_traj, "p50_ms": 1e3 * float(np.percentile(lat, 50)),
           "p99_ms": 1e3 * float(np.percentile(lat, 99)),
           "echo_cycle_s": best["echo"] / args.rounds}
    for name, v in disk.items():  # the same bytes per round as a cycle moves each way
        out[f"disk_{name}_mbs"] = n * per_traj / float(np.min(v)) / MB
        out[f"disk_{name}_ratio"] = best["echo"] / float(np.min(v))
    for name, sec in best.items():
        out[f"{name}_tps"], out[f"{name}_mbs"] = n / sec, n * per_traj / sec / MB
        out[f"{name}_ratio"] = best["echo"] / sec
    return out


def verdict(ratio: float, target: float) -> str:
    return f"target >= {target:.2f}: {'met' if ratio >= target else 'MISSED'}"


def report(args: argparse.Namespace, fsync: str, r: dict[str, float]) -> None:
    batch_bytes = args.batch * r["traj_bytes"]
    print(f"fsync={fsync} (trajectory {r['traj_bytes'] / 1024:.0f} KiB on the wire, "
          f"{batch_bytes / MB:.1f} MiB a batch)")
    for name, label, target in (
            ("echo", "raw gRPC echo, same bytes", None),
            ("server", "queue put+get+ack, wire bytes in/out", SERVER_TARGET),
            ("e2e", "queue put+get+ack, int32 Trajectory in/out", E2E_TARGET)):
        line = f"  {label:44s} {r[name + '_tps']:7.1f} traj/s {r[name + '_mbs']:7.1f} MB/s"
        if target is not None:
            ratio = r[name + "_ratio"]
            line += f"  ratio to echo {ratio:.2f} ({verdict(ratio, target)})"
        print(line)
    print(f"  GetBatch(n={args.batch}) latency p50 {r['p50_ms']:.1f} ms p99 {r['p99_ms']:.1f} ms")
    print(f"  disk, same records, same run: fsync each {r['disk_each_mbs']:.0f} MB/s "
          f"({r['disk_each_ratio']:.2f} of echo), one fsync per {args.batch} "
          f"{r['disk_group_mbs']:.0f} MB/s ({r['disk_group_ratio']:.2f}), no fsync "
          f"{r['disk_none_mbs']:.0f} MB/s ({r['disk_none_ratio']:.2f})")
    if fsync == "always":
        # the put may not reply before its bytes are on the disk: at the group-fsync rate
        # that alone takes this long, on top of an echo-like transfer, unless it overlaps
        disk_s = batch_bytes / (r["disk_group_mbs"] * MB)
        bound = r["echo_cycle_s"] / (r["echo_cycle_s"] + disk_s)
        print(f"  bound: {batch_bytes / MB:.1f} MiB with one fsync takes {1e3 * disk_s:.1f} ms "
              f"against an echo cycle of {1e3 * r['echo_cycle_s']:.1f} ms: ratio <= "
              f"{bound:.2f} without overlap, <= {min(1.0, r['disk_group_ratio']):.2f} with "
              f"the transfer and the disk fully overlapped")


def paper_template(args: argparse.Namespace) -> list[Trajectory]:
    """One group of the ``--paper`` load: ``group_size`` trajectories of ``prompt`` +
    ``response`` tokens with ``layers`` x top-``topk`` routes of ``experts`` experts; its
    routes narrowed once here, so that encoding a fresh id per trajectory is one copy."""
    return [dataclasses.replace(t, routed_experts=t.routed_experts.astype(np.uint8))
            for t in (make_traj(i, args.prompt, args.response, args.layers, args.topk,
                                args.experts, args.group_size)
                      for i in range(args.group_size))]


def paper_group(template: list[Trajectory], p: int, experts: int) -> list[bytes]:
    """Group ``p`` of the load: ``template`` under fresh ids (the queue de-duplicates on
    ``trajectory_id``), encoded for the wire as a worker puts it."""
    return [encode(dataclasses.replace(t, trajectory_id=f"p{p}-{j}", group_id=f"g{p}",
                                       prompt_id=f"p{p}"), num_experts=experts)
            for j, t in enumerate(template)]


def paper(args: argparse.Namespace, fsync: str) -> None:
    """Seconds per training step of ``args.paper_prompts`` x ``group_size`` trajectories:
    every group put (one call each, as a worker does), taken by GetBatch calls of
    ``paper_get`` trajectories, and acked once (the ack covers every batch)."""
    g, prompts = args.group_size, args.paper_prompts
    if args.paper_get % g:
        raise SystemExit(f"--paper-get: must be a multiple of --group-size {g}, "
                         f"got {args.paper_get}")
    template = paper_template(args)
    traj_bytes = len(encode(template[0], num_experts=args.experts))
    total = prompts * g * traj_bytes
    data_dir = Path(tempfile.mkdtemp(prefix="bench-queue-paper-", dir=args.data_dir))
    free_disk = shutil.disk_usage(data_dir).free
    if free_disk < 2 * total:
        shutil.rmtree(data_dir, ignore_errors=True)
        raise SystemExit(f"--paper: {total / 1e9:.1f} GB of log needs {2 * total / 1e9:.1f} GB "
                         f"free in {data_dir.parent}, have {free_disk / 1e9:.1f} GB; lower "
                         f"--paper-prompts or pass --data-dir")
    print(f"paper step fsync={fsync}: {prompts} prompts x {g} samples = {prompts * g} "
          f"trajectories of {traj_bytes / 1024:.0f} KiB = {total / 1e9:.2f} GB; puts of one "
          f"group by {args.paper_producers} producer(s), GetBatch of {args.paper_get}",
          flush=True)
    queue, port = start_queue(args, fsync, data_dir)

    def new_client() -> QueueClient:
        return QueueClient(f"127.0.0.1:{port}", token=TOKEN, max_message_mb=MAX_MESSAGE_MB,
                           compact_routes=True, consumer_id="bench")

    client = new_client()
    producers = [new_client() for _ in range(args.paper_producers)] if (
        args.paper_producers > 1) else []
    put_s = get_s = ack_s = 0.0
    try:
        client.wait_ready(30)
        if producers:
            def work(k: int) -> None:
                for p in range(k, prompts, len(producers)):
                    assert producers[k].put(paper_group(template, p, args.experts)).ok

            t0 = time.perf_counter()
            with futures.ThreadPoolExecutor(len(producers)) as pool:
                list(pool.map(work, range(len(producers))))
            put_s = time.perf_counter() - t0
        for p in range(prompts if not producers else 0):
            raws = paper_group(template, p, args.experts)
            t0 = time.perf_counter()
            assert client.put(raws).ok
            put_s += time.perf_counter() - t0
        got, cursor = 0, 0
        while got < prompts * g:
            t0 = time.perf_counter()
            batch = client.get_batch(min(args.paper_get, prompts * g - got), 0, max_lag=10)
            get_s += time.perf_counter() - t0
            assert batch.trajectories, "the queue returned an empty batch"
            got += len(batch.trajectories)
            cursor = batch.cursor
            del batch
        t0 = time.perf_counter()
        assert client.ack(cursor) == prompts * g
        ack_s = time.perf_counter() - t0
    finally:
        for c in (client, *producers):
            c.close()
        queue.terminate()
        queue.wait()
        shutil.rmtree(data_dir, ignore_errors=True)
    step = put_s + get_s + ack_s
    print(f"  put {put_s:.2f} s + get {get_s:.2f} s + ack {ack_s:.2f} s = {step:.2f} s per step "
          f"({2 * total / step / 1e9:.2f} GB/s moved, in and out)")
    if prompts != PAPER_PROMPTS:
        scale = PAPER_PROMPTS / prompts
        print(f"  ran {prompts} of {PAPER_PROMPTS} prompts: scaled x{scale:g} to the paper's "
              f"step, {step * scale:.2f} s per step (assumes time linear in the load)")


def concurrent_puts(args: argparse.Namespace, fsync: str) -> None:
    """Puts/s of ``args.concurrent_puts`` threads putting one trajectory per put into a
    TrajectoryQueue in this process: what the log and its fsync policy allow."""
    threads, n = args.concurrent_puts, args.concurrent_items
    template = make_traj(0, args.prompt, args.response, args.layers, args.topk,
                         args.experts, 1)
    data_dir = Path(tempfile.mkdtemp(prefix="bench-queue-puts-", dir=args.data_dir))
    queue = TrajectoryQueue(data_dir, QueueSettings(fsync=fsync))
    try:
        items = [[queue.parse(encode(dataclasses.replace(
            template, trajectory_id=f"t{k}-{i}", group_id=f"g{k}-{i}"),
            num_experts=args.experts)) for i in range(n)] for k in range(threads)]
        size = len(items[0][0].raw)

        def work(k: int) -> None:
            for item in items[k]:
                assert queue.put([item]).ok

        t0 = time.perf_counter()
        with futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, range(threads)))
        sec = time.perf_counter() - t0
    finally:
        queue.close()
        shutil.rmtree(data_dir, ignore_errors=True)
    print(f"fsync={fsync}: {threads} threads x {n} puts of one {size / 1024:.0f} KiB "
          f"trajectory: {threads * n / sec:.0f} puts/s, {threads * n * size / sec / MB:.0f} "
          f"MB/s", flush=True)


def in_process(args: argparse.Namespace, fsync: str) -> None:
    """The server's share of a server-path cycle: parse + put + get_batch + ack of one batch
    on a TrajectoryQueue in this process, median ms of each over the cycles."""
    trajs = [make_traj(i, args.prompt, args.response, args.layers, args.topk, args.experts,
                       args.group_size) for i in range(args.batch)]
    cycles = args.in_process_cycles
    data_dir = Path(tempfile.mkdtemp(prefix="bench-queue-inproc-", dir=args.data_dir))
    queue = TrajectoryQueue(data_dir, QueueSettings(fsync=fsync))
    times: dict[str, list[float]] = {"parse": [], "put": [], "get": [], "ack": []}
    try:
        for c in range(cycles):
            # encoded untimed, one batch at a time (all cycles' batches at once: ~1.5 GiB)
            raws = [encode(dataclasses.replace(t, trajectory_id=f"t{c}-{i}",
                                               group_id=f"g{c}-{i // args.group_size}"),
                           num_experts=args.experts) for i, t in enumerate(trajs)]
            t0 = time.perf_counter()
            items = [queue.parse(raw) for raw in raws]
            t1 = time.perf_counter()
            assert queue.put(items).ok
            t2 = time.perf_counter()
            batch = queue.get_batch(args.batch, 0, max_lag=10)
            t3 = time.perf_counter()
            assert len(batch.payloads) == args.batch
            queue.ack(batch.cursor)
            t4 = time.perf_counter()
            for name, sec in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                times[name].append(sec)
    finally:
        queue.close()
        shutil.rmtree(data_dir, ignore_errors=True)
    med = {name: 1e3 * float(np.median(v)) for name, v in times.items()}
    print(f"fsync={fsync}: queue work per cycle of {args.batch} (in process, no gRPC, median "
          f"of {cycles}): parse+check {med['parse']:.2f} ms, put {med['put']:.2f} ms, "
          f"GetBatch {med['get']:.2f} ms, Ack {med['ack']:.2f} ms; total "
          f"{sum(med.values()):.2f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve-echo", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=None,
                    help="samples per prompt (default: 8, or 16 with --paper)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--latency-calls", type=int, default=40)
    ap.add_argument("--fsync", default="always,never",
                    help=f"comma-separated, each one of {', '.join(FSYNC_POLICIES)}")
    ap.add_argument("--data-dir", help="where the queue's log goes (default: a temp dir)")
    ap.add_argument("--paper", action="store_true",
                    help="time one step of the paper-sized load instead (see above)")
    ap.add_argument("--paper-prompts", type=int, default=PAPER_PROMPTS,
                    help="prompts of the --paper step (fewer: the time is scaled, and said so)")
    ap.add_argument("--concurrent-puts", type=int, default=0,
                    help="time T threads of single-trajectory puts on the storage instead")
    ap.add_argument("--concurrent-items", type=int, default=40,
                    help="puts per thread of --concurrent-puts (default 40)")
    ap.add_argument("--in-process", action="store_true",
                    help="time the queue's own work per cycle without gRPC instead")
    ap.add_argument("--in-process-cycles", type=int, default=200,
                    help="cycles of --in-process (default 200)")
    ap.add_argument("--paper-producers", type=int, default=1,
                    help="concurrent producers putting the --paper step's groups (default 1)")
    ap.add_argument("--paper-get", type=int, default=32,
                    help="trajectories per GetBatch of the --paper step (default 32, 16 MB: a "
                         "reply over glibc's 32 MB mmap threshold gets fresh pages and costs "
                         "~8x more per byte, measured)")
    args = ap.parse_args()
    if args.serve_echo is not None:
        serve_echo(args.serve_echo)
        return
    policies = args.fsync.split(",")
    for fsync in policies:
        if fsync not in FSYNC_POLICIES:
            ap.error(f"--fsync: must be one of {FSYNC_POLICIES}, got {fsync!r}")
    if args.paper_prompts < 1:
        ap.error(f"--paper-prompts: must be >= 1, got {args.paper_prompts}")
    if args.in_process_cycles < 1:
        ap.error(f"--in-process-cycles: must be >= 1, got {args.in_process_cycles}")
    if args.paper_producers < 1:
        ap.error(f"--paper-producers: must be >= 1, got {args.paper_producers}")
    if args.group_size is None:
        args.group_size = 16 if args.paper else 8
    # this process is the queue's client, like a satjax trainer or worker: same allocator
    retain_freed_memory()
    print_versions()
    directory = args.data_dir or tempfile.gettempdir()
    write_gbs = sequential_write_gbs(directory, mbytes=512)
    print(f"machine: memory copy {memory_bandwidth_gbs(256):.1f} GB/s, sequential write "
          f"{write_gbs:.2f} GB/s (fsync included) in {directory}", flush=True)
    if args.paper:
        for fsync in policies:
            paper(args, fsync)
        return
    if args.in_process:
        for fsync in policies:
            in_process(args, fsync)
        return
    if args.concurrent_puts > 0:
        for fsync in policies:
            concurrent_puts(args, fsync)
        return
    print(f"trajectory: P={args.prompt} N={args.response} routes and gates {args.layers}x "
          f"top-{args.topk} of {args.experts} experts; batch {args.batch}, "
          f"{args.rounds} rounds, best of {args.repeats} repeats", flush=True)
    for fsync in policies:
        report(args, fsync, bench(args, fsync))


if __name__ == "__main__":
    main()
