"""``satjax rollout``: one rollout worker process, on the trainer's host or any other.

    satjax rollout --queue 10.0.0.2:50051 --weights /shared/runs/tiny/weights --worker-id 3

``--weights`` is the trainer's weights directory (``<run_dir>/weights``, on a file system
this host shares with the trainer). The run's config comes from the file the trainer
writes there (``run_config.yaml``), so a worker needs nothing else; ``--config`` reads
another one instead and ``--set`` changes keys for this worker (its engine, say). The
worker follows the versions published there and puts each group on the queue until
SIGTERM. The queue token comes from ``SATJAX_QUEUE_TOKEN`` (never from the command line,
where ``ps`` shows it).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import zlib
from pathlib import Path

from satjax.app.factory import build_task, build_tokenizer, model_config, worker_config
from satjax.config import ConfigError, load_config
from satjax.data.pipeline import prompt_dataset
from satjax.data.rewards import RewardError
from satjax.rollout.factory import make_engine
from satjax.rollout.worker import QueueRejectedError, RolloutWorker
from satjax.run_dir import weights_config
from satjax.weight_sync import WeightSubscriber, WeightSyncError

# How long a worker started before the trainer waits for the trainer's run_config.yaml.
CONFIG_WAIT_S = 600.0
QUEUE_WAIT_S = 60.0  # and for the queue to answer

log = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="satjax rollout",
        description="One rollout worker: samples groups with the policy the trainer "
                    "publishes in --weights and puts each group on the queue as soon as it "
                    "is complete, until SIGTERM. The queue token comes from "
                    "$SATJAX_QUEUE_TOKEN. `satjax train` starts these itself; run one by "
                    "hand to add a worker on another host (it may join or leave at any time).")
    p.add_argument("--queue", required=True, help="queue address host:port")
    p.add_argument("--weights", required=True, metavar="DIR",
                   help="the trainer's weights directory (<run_dir>/weights, shared with "
                        "the trainer's host); holds the run's run_config.yaml")
    p.add_argument("--config", default=None,
                   help="run config YAML to use instead of DIR/run_config.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of that config for this worker (repeatable), e.g. "
                        "--set rollout.engine=vllm --set rollout.vllm_python=/opt/vllm/bin/"
                        "python on a GPU node")
    p.add_argument("--worker-id", default="0",
                   help="this worker's id (seeds its prompts; give each worker its own; "
                        "default: %(default)s)")
    p.add_argument("--log-dir", default=None,
                   help="directory for a vLLM engine's server log (default: a new "
                        "temporary directory)")
    p.add_argument("--max-batches", type=int, default=None,
                   help="stop after this many batches (default: run until SIGTERM)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", force=True)
    token = os.environ.get("SATJAX_QUEUE_TOKEN")
    if not token:
        p.error("set SATJAX_QUEUE_TOKEN to the queue's bearer token")
    if args.max_batches is not None and args.max_batches < 1:
        p.error(f"--max-batches: must be >= 1, got {args.max_batches!r}")
    config_path = Path(args.config) if args.config else weights_config(args.weights)
    if args.config and not config_path.is_file():
        p.error(f"--config: must be a readable YAML file, got {args.config!r}")
    # A worker may start before the trainer has created the weights directory (all pods
    # of a job start together): it waits, saying what for.
    deadline = time.monotonic() + CONFIG_WAIT_S
    if not config_path.is_file():
        log.info("waiting for %s (the trainer writes it when it starts)", config_path)
    while not config_path.is_file():
        if time.monotonic() > deadline:
            p.error(f"--weights: must be a trainer's weights directory holding "
                    f"{config_path.name} (waited {CONFIG_WAIT_S:.0f}s), got {args.weights!r}")
        time.sleep(0.5)
    try:
        cfg = load_config(config_path, args.overrides)
    except ConfigError as e:
        p.error(f"{config_path}: {e}")
    tokenizer = build_tokenizer(cfg)
    task = build_task(cfg, tokenizer)
    from satjax.queue.client import NO_RETRY, QueueClient, QueueError, QueueUnavailableError

    # retries=0: the worker itself retries a queue it cannot reach (rollout.queue_retry_s,
    # one log line per try, a SIGTERM heard between tries)
    client = QueueClient(args.queue, token=token, retry=NO_RETRY)
    try:
        client.wait_ready(timeout=QUEUE_WAIT_S)
    except QueueUnavailableError:
        p.exit(1, f"{p.prog}: error: --queue {args.queue!r}: no queue answered within "
                  f"{QUEUE_WAIT_S:.0f}s\n")
    wid = str(args.worker_id)
    seed = cfg.seed + 1000 * (1 + (int(wid) if wid.isdigit() else zlib.crc32(wid.encode()) % 997))
    worker = RolloutWorker(
        make_engine(cfg.rollout, tokenizer, args.log_dir, seed=cfg.seed),
        task, tokenizer, client,
        WeightSubscriber(args.weights,
                         architecture=model_config(cfg, tokenizer).architecture()),
        iter(prompt_dataset(task, seed=seed)),
        worker_config(cfg, tokenizer, seed=seed, worker_id=f"w{wid}"),
    )
    try:
        n = worker.run(max_batches=args.max_batches)
    except (QueueError, QueueRejectedError, WeightSyncError, RewardError) as e:
        # the queue went away (stopped before this worker) or refuses what it makes, the
        # trainer published weights this worker must not serve, or the task's reward failed
        # (naming the example): one line, not a traceback
        log.error("worker %s stopped after %d trajectories: %s", wid, worker.produced, e)
        return 1
    log.info("worker %s stopped after %d trajectories (paused %.1f s of %.1f s)", wid, n,
             worker.paused_s, worker.active_s)
    return 0
