"""Throughput of the trajectory queue on loopback against a raw gRPC echo of the same bytes.

Both servers run as subprocesses in the same run (each its own Python process). One cycle
moves a batch of B realistic trajectories client -> server -> client:
  queue: QueueClient.put(B) + get_batch(B) (+ ack), parsed back into Trajectory objects;
  echo:  one unary call carrying the same serialized bytes, answered with them unchanged.
Prints trajectories/s, MB/s (payload bytes each way) and queue/echo ratios (target >= 0.5)
for the server path (pre-encoded bytes in, zero-copy views out) and end to end (int32
Trajectory objects in and out, client encode/decode included), plus p50/p99 GetBatch
latency. Timings are the best of --repeats interleaved repeats.

  PYTHONPATH=. python benchmarks/bench_queue.py [--fsync always,never] [--rounds 8]
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

from satjax.queue.client import QueueClient  # noqa: E402
from satjax.queue.codec import encode  # noqa: E402
from satjax.queue.store import FSYNC_POLICIES  # noqa: E402
from satjax.trajectory import Trajectory  # noqa: E402
from satjax.utils import free_port, retain_freed_memory  # noqa: E402

TOKEN = "bench-token-0123456789"  # the server wants >= 16 characters
MB = 1 << 20
OPTIONS = [("grpc.max_receive_message_length", 256 * MB),
           ("grpc.max_send_message_length", 256 * MB)]


def serve_echo(port: int) -> None:
    """A trivial generic-handler echo server (bytes in, same bytes out), with the queue
    server's allocator setting so that the two differ only in what the queue does."""
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
    rng = np.random.default_rng(i)
    return Trajectory(
        trajectory_id=f"t{i}", group_id=f"g{i // group_size}", prompt_id=f"p{i // group_size}",
        prompt_tokens=rng.integers(0, 150000, p, dtype=np.int32),
        response_tokens=rng.integers(0, 150000, n, dtype=np.int32),
        behavior_logprobs=-rng.random(n, dtype=np.float32) * 5, policy_version=0,
        reward=1.0, group_size=group_size, finish_reason="length", engine="bench",
        routed_experts=rng.integers(0, experts, (p + n - 1, layers, k), dtype=np.int32))


def start(cmd: list[str], marker: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "SATJAX_QUEUE_TOKEN": TOKEN}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if marker not in line:
        proc.kill()
        raise RuntimeError(f"server failed to start: {line!r}")
    return proc


def bench(args: argparse.Namespace, fsync: str) -> dict[str, float]:
    trajs = [make_traj(i, args.prompt, args.response, args.layers, args.topk, args.experts,
                       args.group_size) for i in range(args.batch)]
    raws = [encode(t, num_experts=args.experts) for t in trajs]
    per_traj = sum(map(len, raws)) / len(raws)
    echo_blob = b"".join(raws)
    data_dir = Path(tempfile.mkdtemp(prefix="bench-queue-", dir=args.data_dir))
    qport, eport = free_port(), free_port()
    queue = start([sys.executable, "-m", "satjax", "serve-queue", "--port", str(qport),
                   "--data-dir", str(data_dir), "--fsync", fsync, "--max-message-mb", "256",
                   "--log-level", "WARNING", "--num-experts", str(args.experts)],
                  "listening on")
    echo = start([sys.executable, __file__, "--serve-echo", str(eport)], "echo listening")
    # two clients, one consumer: they share the queue's consumer lease
    wire_client = QueueClient(f"127.0.0.1:{qport}", token=TOKEN, max_message_mb=256,
                              compact_routes=True, consumer_id="bench")
    e2e_client = QueueClient(f"127.0.0.1:{qport}", token=TOKEN, max_message_mb=256,
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
        for _ in range(args.repeats):  # interleaved so all see the same machine load
            for name, fn in cycles.items():
                t0 = time.perf_counter()
                for _ in range(args.rounds):
                    fn()
                times[name].append(time.perf_counter() - t0)
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
    med = {name: float(np.min(v)) for name, v in times.items()}
    out = {"traj_bytes": per_traj, "p50_ms": 1e3 * float(np.percentile(lat, 50)),
           "p99_ms": 1e3 * float(np.percentile(lat, 99))}
    for name, sec in med.items():
        out[f"{name}_tps"], out[f"{name}_mbs"] = n / sec, n * per_traj / sec / MB
        out[f"{name}_ratio"] = med["echo"] / sec
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve-echo", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--latency-calls", type=int, default=40)
    ap.add_argument("--fsync", default="always,never",
                    help=f"comma-separated, each one of {', '.join(FSYNC_POLICIES)}")
    ap.add_argument("--data-dir", help="where the queue's log goes (default: a temp dir)")
    args = ap.parse_args()
    for fsync in args.fsync.split(","):
        if fsync not in FSYNC_POLICIES:
            ap.error(f"--fsync: must be one of {FSYNC_POLICIES}, got {fsync!r}")
    if args.serve_echo is not None:
        serve_echo(args.serve_echo)
        return
    print(f"data dir under {args.data_dir or tempfile.gettempdir()}; "
          f"trajectory: P={args.prompt} N={args.response} routes {args.layers}x top-"
          f"{args.topk} of {args.experts} experts; batch {args.batch}, "
          f"{args.rounds} rounds, best of {args.repeats} repeats")
    for fsync in args.fsync.split(","):
        r = bench(args, fsync)
        print(f"fsync={fsync} (trajectory {r['traj_bytes'] / 1024:.0f} KiB on the wire)")
        for name, label in (("echo", "raw gRPC echo, same bytes"),
                            ("server", "queue put+get+ack, wire bytes in/out"),
                            ("e2e", "queue put+get+ack, int32 Trajectory in/out")):
            print(f"  {label:44s} {r[name + '_tps']:7.1f} traj/s {r[name + '_mbs']:7.1f} MB/s"
                  f"  ratio to echo {r[name + '_ratio']:.2f}")
        print(f"  GetBatch(n={args.batch}) latency p50 {r['p50_ms']:.1f} ms "
              f"p99 {r['p99_ms']:.1f} ms   (target: server-path ratio >= 0.50)", flush=True)


if __name__ == "__main__":
    main()
