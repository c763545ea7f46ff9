"""``satjax train`` and ``satjax sft`` as functions: the asynchronous RL run, with real processes.

    queue server (subprocess) <- rollout workers (subprocesses, built-in engine or vLLM)
         |                                   ^
         v                                   | weights v+1 (WeightPublisher, canary)
    trainer: get_batch(max_lag) -> make_batch -> jitted SAT-GSPO step -> publish

Queue acks follow checkpoints: the queue cursor is acknowledged only once a checkpoint
holding it is on disk, so a trainer crash between checkpoints re-reads (after the queue
restarts) exactly the trajectories the lost steps had consumed.

The SFT warm-up lives here rather than in the library: it is run-directory orchestration
(cache the warm-up under ``<run_dir>/sft``, show progress) around ``satjax.train.sft.run_sft``;
the library :class:`~satjax.train.trainer.Trainer` just takes the policy it starts from.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import threading
import time
from typing import Any

from tqdm import tqdm

from satjax.app.launch import ProcessGroup, new_token
from satjax.config import Config, dump_config
from satjax.data.pipeline import prompt_dataset
from satjax.factory import build_model, build_task, build_tokenizer
from satjax.model import from_pretrained, save_pretrained
from satjax.run_dir import RunDirs
from satjax.train.metrics import MetricsLogger
from satjax.train.sft import run_sft
from satjax.train.trainer import Trainer
from satjax.utils import free_port

log = logging.getLogger(__name__)


def sft_seq_len(task, tokenizer, n: int = 512) -> int:
    """A padded length (multiple of 16) that fits BOS + prompt + answer + EOS of the first
    ``n`` training examples, so the SFT step compiles once."""
    longest = max(
        2 + len(tokenizer.encode(ex.prompt)) + len(tokenizer.encode(ex.answer))
        for ex in (task.example(i) for i in range(n))
    )
    return int(math.ceil((longest + 2) / 16) * 16)


def warm_start(cfg: Config, tokenizer, task, *, progress: bool = True):
    """The policy RL starts from: ``model.path``; else the cached SFT warm-up of this run;
    else a fresh tiny MoE trained with ``sft.steps`` supervised steps (then cached)."""
    dirs = RunDirs(cfg.run_dir)
    if cfg.model.path:
        return build_model(cfg, tokenizer)
    if (dirs.sft / "config.json").exists():
        return from_pretrained(str(dirs.sft))
    model = build_model(cfg, tokenizer)
    if cfg.sft.steps > 0:
        bar = tqdm(total=cfg.sft.steps, desc="sft warm-up", disable=not progress)

        def on_step(step: int, loss: float) -> None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")

        run_sft(
            model, iter(prompt_dataset(task, seed=cfg.seed + 1)), tokenizer,
            steps=cfg.sft.steps, batch_size=cfg.sft.batch_size,
            learning_rate=cfg.sft.learning_rate, seq_len=sft_seq_len(task, tokenizer),
            on_step=on_step,
        )
        bar.close()
    # written aside and renamed, so a crash never leaves a half-written cache behind
    tmp = dirs.sft.with_name(dirs.sft.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(model, str(tmp))
    os.replace(tmp, dirs.sft)
    return model


class _StopOnInterrupt:
    """First Ctrl-C (SIGINT) or SIGTERM: finish the current step (train, publish, log),
    then stop cleanly. A second Ctrl-C raises KeyboardInterrupt as usual."""

    def __init__(self) -> None:
        self.requested = False
        self._old: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("stop requested: finishing the current step, then checkpointing")

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def run_train(cfg: Config, *, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Runs ``cfg.train.steps`` RL steps with a local queue server and rollout workers
    (or the queue at ``cfg.queue.address``). Returns the last step's metrics."""
    from satjax.queue.client import QueueClient  # imported late: grpc is heavy

    dirs = RunDirs(cfg.run_dir)
    tokenizer, task = build_tokenizer(cfg), build_task(cfg)
    trainer = Trainer(cfg, warm_start(cfg, tokenizer, task, progress=progress), tokenizer,
                      resume=resume)
    dirs.root.mkdir(parents=True, exist_ok=True)
    dirs.config.write_text(dump_config(cfg))  # the workers build their pieces from it
    token = cfg.queue.token or os.environ.get("SATJAX_QUEUE_TOKEN") or new_token()
    env = {"SATJAX_QUEUE_TOKEN": token}
    n_rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    last: dict[str, Any] = {}
    with ProcessGroup() as procs, MetricsLogger(dirs.logs) as mlog:
        address = cfg.queue.address
        if not address:
            port = free_port()
            address = f"127.0.0.1:{port}"
            procs.start("queue", ["serve-queue", "--port", str(port), "--data-dir",
                                  cfg.queue.data_dir or str(dirs.queue), "--fsync",
                                  cfg.queue.fsync, "--max-lag-default",
                                  str(cfg.train.max_lag)],
                        log_file=dirs.process_log("queue"), env=env)
        client = QueueClient(address, token=token)
        client.wait_ready(timeout=60)
        trainer.publish()
        for i in range(cfg.rollout.num_workers):
            procs.start(f"worker{i}", ["rollout", "--run-dir", str(dirs.root), "--queue",
                                       address, "--worker-id", str(i)],
                        log_file=dirs.process_log(f"worker{i}"), env=env)
        bar = tqdm(total=cfg.train.steps, initial=trainer.step, desc="rl", disable=not progress)
        t_last = time.time()
        first_batch = True  # after a restart, re-read what the lost steps had consumed
        stop = _StopOnInterrupt()
        try:
            while trainer.step < cfg.train.steps and not stop.requested:
                got = None
                while got is None or not got.trajectories:
                    if stop.requested:
                        break
                    procs.check_alive()
                    # An empty reply means fewer than n_rows fresh trajectories so far.
                    got = client.get_batch(n_rows, trainer_version=trainer.policy_version,
                                           max_lag=cfg.train.max_lag, timeout=5.0,
                                           redeliver_unacked=first_batch)
                    first_batch = False
                if stop.requested:
                    break
                metrics = trainer.train_on(got.trajectories)
                trainer.queue_cursor = got.cursor
                now = time.time()
                metrics["queue/dropped_stale"] = float(got.dropped_stale)
                metrics["trajectories_per_s"] = len(got.trajectories) / max(now - t_last, 1e-9)
                t_last = now
                trainer.publish()
                if trainer.save():
                    trainer.ckpt.wait()
                    client.ack(trainer.queue_cursor)
                last = mlog.log(trainer.step, metrics)
                mlog.flush()
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}",
                                lag=f"{metrics['lag_mean']:.2f}",
                                traj_s=f"{metrics['trajectories_per_s']:.1f}")
        except KeyboardInterrupt:  # a second Ctrl-C: stop now, still checkpoint
            log.warning("interrupted: saving a checkpoint at step %d", trainer.step)
        finally:
            stop.restore()
            bar.close()
            if trainer.step > 0 and trainer.ckpt.latest_step() != trainer.step:
                trainer.save(force=True)
                trainer.ckpt.wait()
                try:
                    client.ack(trainer.queue_cursor)
                except Exception as e:  # the checkpoint is safe; a re-read is the worst case
                    log.error("final queue ack failed: %s", e)
            trainer.ckpt.close()
            procs.close()  # workers first (reverse start order), then the queue
    return last
