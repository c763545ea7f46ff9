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

import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import sys
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


def status(message: str) -> None:
    """One line on stderr saying what a silent phase is doing (above any progress bar)."""
    tqdm.write(f"satjax: {message}", file=sys.stderr)


def _format_seconds(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class Progress:
    """A phase's progress: a tqdm bar, or (``enabled=False``) one log line every
    ``log_every`` steps. Rates and ETAs leave out the first step this process runs: it
    includes compiling the step, which would otherwise dominate the early ETAs."""

    def __init__(self, desc: str, total: int, *, initial: int = 0, enabled: bool = True,
                 log_every: int = 10) -> None:
        self.desc, self.total, self.log_every = desc, total, max(1, log_every)
        self.enabled = enabled
        # smoothing=0: the rate is (n - initial) / elapsed; update() restarts both after
        # the first step
        self.bar = tqdm(total=total, initial=initial, desc=desc, disable=not enabled,
                        smoothing=0)
        self.n = initial
        self._timed_from: tuple[int, float] | None = None  # (step, time) after the first step

    def update(self, postfix: dict[str, str]) -> None:
        self.n += 1
        now = time.time()
        if self._timed_from is None:
            self._timed_from = (self.n, now)
            self.bar.initial, self.bar.start_t = self.n, now
        self.bar.update(1)
        self.bar.set_postfix(postfix)
        if not self.enabled and (self.n % self.log_every == 0 or self.n == self.total):
            done, t0 = self._timed_from
            rate = (self.n - done) / (now - t0) if self.n > done else 0.0
            eta = f", eta {_format_seconds((self.total - self.n) / rate)}" if rate else ""
            fields = ", ".join(f"{k}={v}" for k, v in postfix.items())
            status(f"{self.desc} {self.n}/{self.total} [{fields}{eta}]")

    def close(self) -> None:
        self.bar.close()


def sft_settings(cfg: Config) -> dict[str, Any]:
    """The config keys that determine the SFT warm-up; its cache is reused only if equal."""
    return json.loads(json.dumps({
        "seed": cfg.seed, "sft": dataclasses.asdict(cfg.sft),
        "task": dataclasses.asdict(cfg.task),
        "model": {k: v for k, v in dataclasses.asdict(cfg.model).items() if k != "path"},
    }))  # through JSON: tuples become lists, as they read back


def warm_start(cfg: Config, tokenizer, task, *, progress: bool = True, log_every: int = 10):
    """The policy RL starts from: ``model.path``; else the cached SFT warm-up of this run
    if it was made with the same settings (:func:`sft_settings`); else a fresh tiny MoE
    trained with ``sft.steps`` supervised steps (then cached)."""
    dirs = RunDirs(cfg.run_dir)
    if cfg.model.path:
        status(f"loading the policy from {cfg.model.path}")
        return build_model(cfg, tokenizer)
    settings = sft_settings(cfg)
    if (dirs.sft / "config.json").exists():
        cached = json.loads(dirs.sft_settings.read_text()) if dirs.sft_settings.exists() else {}
        if cached == settings:
            status(f"loading the cached warm-up from {dirs.sft}")
            return from_pretrained(str(dirs.sft))
        status(f"the cached warm-up in {dirs.sft} was made with other settings; re-running it")
    model = build_model(cfg, tokenizer)
    if cfg.sft.steps > 0:
        status("sft warm-up: compiling the first step")
        bar = Progress("sft warm-up", cfg.sft.steps, enabled=progress, log_every=log_every)

        def on_step(step: int, loss: float) -> None:
            bar.update({"loss": f"{loss:.3f}"})

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
    (tmp / dirs.sft_settings.name).write_text(json.dumps(settings))
    shutil.rmtree(dirs.sft, ignore_errors=True)
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


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """How :func:`run_train` ended."""

    step: int  # the step the run reached (checkpointed, with its metrics logged)
    total: int  # train.steps
    last: dict[str, Any]  # that step's metrics; {} when this process trained no step
    interrupted: bool  # stopped by Ctrl-C / SIGTERM before reaching ``total``


def run_train(cfg: Config, *, resume: bool = False, progress: bool = True,
              log_every: int = 10) -> RunOutcome:
    """Runs ``cfg.train.steps`` RL steps with a local queue server and rollout workers
    (or the queue at ``cfg.queue.address``). ``log_every``: with ``progress`` off, one
    status line per that many steps."""
    from satjax.queue.client import QueueClient  # imported late: grpc is heavy

    dirs = RunDirs(cfg.run_dir)
    if not resume and dirs.checkpoints.is_dir() and any(dirs.checkpoints.iterdir()):
        # checked here too (the Trainer does) so that this run's config.yaml is never
        # written over the one of the run that is there
        raise FileExistsError(f"run_dir {cfg.run_dir!r}: already has checkpoints; pass "
                              "--resume to continue it or choose another run_dir")
    dirs.root.mkdir(parents=True, exist_ok=True)
    # written first: the workers build their pieces from it and --resume reloads it
    dirs.config.write_text(dump_config(cfg))
    tokenizer, task = build_tokenizer(cfg), build_task(cfg)
    trainer = Trainer(cfg, warm_start(cfg, tokenizer, task, progress=progress,
                                      log_every=log_every), tokenizer, resume=resume)
    if trainer.step:
        status(f"resumed from the checkpoint at step {trainer.step}")
    token = cfg.queue.token or os.environ.get("SATJAX_QUEUE_TOKEN") or new_token()
    env = {"SATJAX_QUEUE_TOKEN": token}
    n_rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    last: dict[str, Any] = {}
    interrupted = False
    with ProcessGroup() as procs, MetricsLogger(dirs.logs) as mlog:
        address = cfg.queue.address
        if not address:
            port = free_port()
            address = f"127.0.0.1:{port}"
            status(f"starting the queue server on {address} (log: {dirs.process_log('queue')})")
            procs.start("queue", ["serve-queue", "--port", str(port), "--data-dir",
                                  cfg.queue.data_dir or str(dirs.queue), "--fsync",
                                  cfg.queue.fsync, "--max-lag-default",
                                  str(cfg.train.max_lag)],
                        log_file=dirs.process_log("queue"), env=env)
        client = QueueClient(address, token=token)
        client.wait_ready(timeout=60)
        status(f"publishing weights v{trainer.policy_version}")
        trainer.publish()
        status(f"starting {cfg.rollout.num_workers} rollout worker(s) "
               f"(logs: {dirs.process_log('worker0')}, ...)")
        for i in range(cfg.rollout.num_workers):
            procs.start(f"worker{i}", ["rollout", "--run-dir", str(dirs.root), "--queue",
                                       address, "--worker-id", str(i)],
                        log_file=dirs.process_log(f"worker{i}"), env=env)
        bar = Progress("rl", cfg.train.steps, initial=trainer.step, enabled=progress,
                       log_every=log_every)
        t_last = time.time()
        first_batch = True  # after a restart, re-read what the lost steps had consumed
        logged_step = trainer.step  # the newest step whose metrics are in metrics.jsonl
        stop = _StopOnInterrupt()
        try:
            while trainer.step < cfg.train.steps and not stop.requested:
                got = None
                if first_batch:
                    status("waiting for the first rollouts (workers load the model and "
                           "compile the sampler)")
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
                if not last:
                    status("compiling the train step (the first step; later ones are fast)")
                metrics = trainer.train_on(got.trajectories)
                trainer.queue_cursor = got.cursor
                now = time.time()
                metrics["queue/dropped_stale"] = float(got.dropped_stale)
                metrics["trajectories_per_s"] = len(got.trajectories) / max(now - t_last, 1e-9)
                t_last = now
                # logged before publishing and checkpointing, so that a checkpoint (also the
                # one a second Ctrl-C forces) never holds a step missing from metrics.jsonl
                last = mlog.log(trainer.step, metrics)
                mlog.flush()
                logged_step = trainer.step
                trainer.publish()
                if trainer.save():
                    trainer.ckpt.wait()
                    client.ack(trainer.queue_cursor)
                bar.update(step_postfix(metrics))
        except KeyboardInterrupt:  # a second Ctrl-C: stop now, still checkpoint
            log.warning("interrupted: stopping after step %d", logged_step)
        finally:
            interrupted = stop.requested or logged_step < cfg.train.steps
            stop.restore()
            bar.close()
            # A step interrupted between its update and its metrics is not checkpointed
            # (the queue re-delivers its trajectories on resume).
            if logged_step > 0 and trainer.ckpt.latest_step() != logged_step \
                    and trainer.step == logged_step:
                status(f"saving a checkpoint at step {logged_step}")
                trainer.save(force=True)
                trainer.ckpt.wait()
                try:
                    client.ack(trainer.queue_cursor)
                except Exception as e:  # the checkpoint is safe; a re-read is the worst case
                    log.error("final queue ack failed: %s", e)
            checkpointed = trainer.ckpt.latest_step() or 0
            trainer.ckpt.close()
            procs.close()  # workers first (reverse start order), then the queue
    return RunOutcome(step=checkpointed, total=cfg.train.steps, last=last,
                      interrupted=interrupted)


def step_postfix(metrics: dict[str, Any]) -> dict[str, str]:
    """The fields the RL progress bar (and each --no-progress line) shows."""
    return {"reward": f"{metrics['reward_mean']:.3f}", "lag": f"{metrics['lag_mean']:.2f}",
            "traj_s": f"{metrics['trajectories_per_s']:.1f}"}
