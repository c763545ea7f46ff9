"""``satjax train`` and ``satjax sft`` as functions: the asynchronous RL run, with real processes.

    queue server (subprocess) <- rollout workers (subprocesses, built-in engine or vLLM)
         |                                   ^
         v                                   | weights v+1 (WeightPublisher, canary)
    trainer: get_batch(max_lag) -> make_batch -> jitted SAT-GSPO step -> publish

Queue acks follow checkpoints: the batches trained on since the last checkpoint are
acknowledged (all of them, however their groups completed) only once a checkpoint holding
them is on disk, so a trainer crash between checkpoints re-reads (after the queue restarts)
exactly the trajectories the lost steps had consumed, and nothing a checkpoint holds.

The children die with the trainer whatever kills it (``satjax/app/launch.py``), so
``--resume`` after a crash starts a fresh queue server on the same data directory; one
that a dying orphan still holds is retried until the orphan is gone.

The SFT warm-up lives here rather than in the library: it is run-directory orchestration
(cache the warm-up under ``<run_dir>/sft``, show progress) around ``satjax.train.sft.run_sft``;
the library :class:`~satjax.train.trainer.Trainer` just takes the policy it starts from.
"""

from __future__ import annotations

import dataclasses
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
from satjax.model import Qwen3MoeConfig, from_pretrained, save_pretrained
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


# A queue server exits with this code when its data directory is held by another server:
# after a crash, the orphaned one is still shutting down; retried for this long.
QUEUE_DATA_DIR_HELD = 1
QUEUE_START_TIMEOUT_S = 60.0


def public_config(cfg: Config) -> Config:
    """``cfg`` as written to ``run_dir/config.yaml``: without the queue token (children get
    it from ``SATJAX_QUEUE_TOKEN`` in their environment, never from a file)."""
    return dataclasses.replace(cfg, queue=dataclasses.replace(cfg.queue, token=""))


def queue_limit_flags(cfg: Config, model_config: Qwen3MoeConfig) -> list[str]:
    """``serve-queue`` flags that make the queue refuse what this model cannot train on:
    token ids, expert ids, route shapes, lengths beyond the largest bucket, wrong groups."""
    return ["--vocab-size", str(model_config.vocab_size),
            "--num-experts", str(model_config.num_experts),
            "--moe-layers", str(len(model_config.moe_layer_indices)),
            "--top-k", str(model_config.num_experts_per_tok),
            "--max-seq-len", str(max(cfg.train.buckets)),
            "--group-size", str(cfg.rollout.group_size)]


class PendingAcks:
    """Cursors of the batches trained on since the last acknowledgement.

    :meth:`ack` (called once a checkpoint holding them is durable) acknowledges every one
    of them, not just the last: groups complete out of order, so a later batch can carry
    a smaller cursor than an earlier one. An ack covers every batch delivered up to its
    cursor, so acking the largest covers them all.
    """

    def __init__(self) -> None:
        self.cursors: list[int] = []

    def add(self, cursor: int) -> None:
        self.cursors.append(int(cursor))

    def ack(self, client) -> None:
        if self.cursors:
            client.ack(max(self.cursors))
            self.cursors.clear()


class _StopOnInterrupt:
    """First Ctrl-C (SIGINT) or SIGTERM: finish the current step, checkpoint, stop.
    A second Ctrl-C raises KeyboardInterrupt as usual.

    SIGTERM is a preemption (spot VM, Kubernetes): the node goes away ``grace_s`` later.
    If the checkpoint is not on disk by then (the step in flight took too long), the
    process exits at once: the previous checkpoint is the last completed state, and the
    batches after it were never acknowledged, so the queue delivers them again.
    """

    def __init__(self, grace_s: float) -> None:
        self.requested = False
        self.grace_s = grace_s
        self.checkpointed = threading.Event()  # set once the final checkpoint is durable
        self._old: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if signum == signal.SIGTERM and not self.requested:
            log.warning("SIGTERM: checkpointing within %.0fs", self.grace_s)
            threading.Thread(target=self._deadline, daemon=True).start()
        self.requested = True
        log.warning("stop requested: finishing the current step, then checkpointing")

    def _deadline(self) -> None:
        if not self.checkpointed.wait(self.grace_s):
            log.error("no checkpoint %.0fs after SIGTERM: exiting; --resume continues from "
                      "the last checkpoint on disk", self.grace_s)
            os._exit(128 + signal.SIGTERM)

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def run_train(cfg: Config, *, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Runs ``cfg.train.steps`` RL steps with a local queue server and rollout workers
    (or the queue at ``cfg.queue.address``). Returns the last step's metrics."""
    from satjax.queue.client import (  # imported late: grpc is heavy
        QueueClient,
        QueueUnavailableError,
    )

    dirs = RunDirs(cfg.run_dir)
    tokenizer, task = build_tokenizer(cfg), build_task(cfg)
    trainer = Trainer(cfg, warm_start(cfg, tokenizer, task, progress=progress), tokenizer,
                      resume=resume)
    dirs.root.mkdir(parents=True, exist_ok=True)
    dirs.config.write_text(dump_config(public_config(cfg)))  # workers build their pieces from it
    token = cfg.queue.token or os.environ.get("SATJAX_QUEUE_TOKEN") or new_token()
    env = {"SATJAX_QUEUE_TOKEN": token}
    n_rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    last: dict[str, Any] = {}
    resume_step = trainer.step if resume else None  # re-run steps replace their old lines
    with ProcessGroup() as procs, MetricsLogger(dirs.logs, resume_step=resume_step) as mlog:
        address = cfg.queue.address or f"127.0.0.1:{free_port()}"
        client = QueueClient(address, token=token)

        def queue_ready() -> bool:
            try:
                client.wait_ready(timeout=1.0)
                return True
            except QueueUnavailableError:
                return False

        if cfg.queue.address:
            client.wait_ready(timeout=QUEUE_START_TIMEOUT_S)
        else:
            procs.start_until_ready(
                "queue", ["serve-queue", "--port", address.rsplit(":", 1)[1], "--data-dir",
                          cfg.queue.data_dir or str(dirs.queue), "--fsync", cfg.queue.fsync,
                          "--max-lag-default", str(cfg.train.max_lag),
                          *queue_limit_flags(cfg, trainer.model_config)],
                log_file=dirs.process_log("queue"), env=env, ready=queue_ready,
                timeout=QUEUE_START_TIMEOUT_S, retry_codes=(QUEUE_DATA_DIR_HELD,))
        trainer.publish()
        for i in range(cfg.rollout.num_workers):
            procs.start(f"worker{i}", ["rollout", "--run-dir", str(dirs.root), "--queue",
                                       address, "--worker-id", str(i)],
                        log_file=dirs.process_log(f"worker{i}"), env=env)
        bar = tqdm(total=cfg.train.steps, initial=trainer.step, desc="rl", disable=not progress)
        t_last = time.time()
        first_batch = True  # after a restart, re-read what the lost steps had consumed
        unacked = PendingAcks()
        stop = _StopOnInterrupt(cfg.train.preempt_grace_s)
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
                unacked.add(got.cursor)
                trainer.queue_cursor = max(unacked.cursors)
                now = time.time()
                metrics["queue/dropped_stale"] = float(got.dropped_stale)
                metrics["trajectories_per_s"] = len(got.trajectories) / max(now - t_last, 1e-9)
                t_last = now
                if not stop.requested:  # stopping: the grace period is for the checkpoint
                    trainer.publish()
                if trainer.save():
                    trainer.ckpt.wait()
                    unacked.ack(client)
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
                    unacked.ack(client)
                except Exception as e:  # the checkpoint is safe; a re-read is the worst case
                    log.error("final queue ack failed: %s", e)
            stop.checkpointed.set()
            trainer.ckpt.close()
            procs.close()  # workers first (reverse start order), then the queue
    return last
