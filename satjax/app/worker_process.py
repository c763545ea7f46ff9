"""``satjax rollout``: one rollout worker process.

    satjax rollout --run-dir runs/tiny --queue 127.0.0.1:50051 --worker-id 0

Reads the run's ``config.yaml``, follows the weights the trainer publishes under
``<run-dir>/weights`` and puts trajectories on the queue until SIGTERM. The queue token
comes from ``SATJAX_QUEUE_TOKEN`` (never from the command line, where ``ps`` shows it).
"""

from __future__ import annotations

import argparse
import logging
import os
import zlib

from satjax.config import load_config
from satjax.data.pipeline import prompt_dataset
from satjax.factory import build_task, build_tokenizer, sampling_params
from satjax.rollout.factory import make_engine
from satjax.rollout.worker import RolloutWorker, WorkerConfig
from satjax.run_dir import RunDirs
from satjax.weight_sync import WeightSubscriber


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="satjax rollout",
        description="One rollout worker: samples groups with the policy the trainer "
                    "publishes in <run-dir>/weights and puts them on the queue, until "
                    "SIGTERM. The queue token comes from $SATJAX_QUEUE_TOKEN. `satjax train` "
                    "starts these itself; run one by hand to add a worker on another host.")
    p.add_argument("--run-dir", required=True, help="run directory holding config.yaml")
    p.add_argument("--queue", required=True, help="queue address host:port")
    p.add_argument("--worker-id", default="0",
                   help="this worker's id (seeds its prompts; default: %(default)s)")
    p.add_argument("--max-batches", type=int, default=None,
                   help="stop after this many batches (default: run until SIGTERM)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", force=True)
    token = os.environ.get("SATJAX_QUEUE_TOKEN")
    if not token:
        p.error("set SATJAX_QUEUE_TOKEN to the queue's bearer token")
    dirs = RunDirs(args.run_dir)
    if not dirs.config.is_file():
        p.error(f"--run-dir: must hold a run's {dirs.config.name}, got {args.run_dir!r}")
    cfg = load_config(dirs.config)
    tokenizer = build_tokenizer(cfg)
    task = build_task(cfg)
    from satjax.queue.client import QueueClient

    client = QueueClient(args.queue, token=token)
    client.wait_ready(timeout=60)
    wid = str(args.worker_id)
    seed = cfg.seed + 1000 * (1 + (int(wid) if wid.isdigit() else zlib.crc32(wid.encode()) % 997))
    subscriber = WeightSubscriber(dirs.weights)
    worker = RolloutWorker(
        make_engine(cfg.rollout, tokenizer, dirs.vllm_logs(wid), seed=cfg.seed),
        task, tokenizer, client,
        subscriber,
        iter(prompt_dataset(task, seed=seed)),
        WorkerConfig(
            group_size=cfg.rollout.group_size,
            prompts_per_batch=cfg.rollout.prompts_per_step,
            sampling=sampling_params(cfg, tokenizer),
            seed=seed,
            worker_id=f"w{wid}",
            record_routes=cfg.rollout.record_routes,
        ),
    )
    n = worker.run(max_batches=args.max_batches)
    logging.getLogger(__name__).info("worker %s stopped after %d trajectories", wid, n)
    return 0
