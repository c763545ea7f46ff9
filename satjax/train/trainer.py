"""``satjax train``: the asynchronous RL loop, with real processes.

    queue server (subprocess) <- rollout workers (subprocesses, built-in engine or vLLM)
         |                                   ^
         v                                   | weights v+1 (WeightPublisher, canary)
    trainer: get_batch(max_lag) -> make_batch -> jitted SAT-GSPO step -> publish

Queue acks follow checkpoints: the queue cursor is acknowledged only once a checkpoint
holding it is on disk, so a trainer crash between checkpoints re-reads (after the queue
restarts) exactly the trajectories the lost steps had consumed.
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
from collections import Counter
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from satjax import parallel
from satjax.app.launch import ProcessGroup, new_token
from satjax.config import Config, dump_config
from satjax.data.pipeline import prompt_dataset
from satjax.factory import build_model, build_task, build_tokenizer
from satjax.model import canary_logprobs, from_pretrained, save_pretrained
from satjax.train.batch import make_batch
from satjax.train.checkpoint import Checkpointer
from satjax.train.metrics import MetricsLogger
from satjax.train.sft import run_sft
from satjax.train.state import TrainState, make_optimizer
from satjax.train.step import make_train_step
from satjax.utils import free_port
from satjax.weight_sync import WeightPublisher, published_versions

log = logging.getLogger(__name__)

CANARY_TEXT = "12+34=46"


@dataclasses.dataclass(frozen=True)
class RunDirs:
    root: Path

    @property
    def ckpt(self) -> Path:
        return self.root / "checkpoints"

    @property
    def sync(self) -> Path:
        return self.root / "weights"

    @property
    def queue(self) -> Path:
        return self.root / "queue"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def sft(self) -> Path:
        return self.root / "sft"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"


def sft_seq_len(task, tokenizer, n: int = 512) -> int:
    longest = max(
        2 + len(tokenizer.encode(ex.prompt)) + len(tokenizer.encode(ex.answer))
        for ex in (task.example(i) for i in range(n))
    )
    return int(math.ceil((longest + 2) / 16) * 16)


def warm_start(cfg: Config, dirs: RunDirs, tokenizer, task, *, progress: bool = True):
    """The policy RL starts from: ``model.path``; else the cached SFT warm-up of this run;
    else a fresh tiny MoE trained with ``sft.steps`` supervised steps (then cached)."""
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
    tmp = dirs.sft.with_name("sft.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(model, str(tmp))
    os.replace(tmp, dirs.sft)
    return model


class Trainer:
    """The trainer side of a run: state, jitted step, checkpoints, metrics, weight sync."""

    def __init__(self, cfg: Config, *, resume: bool = False, progress: bool = True) -> None:
        self.cfg, self.progress = cfg, progress
        self.dirs = RunDirs(Path(cfg.run_dir))
        if not resume and self.dirs.ckpt.exists() and any(self.dirs.ckpt.iterdir()):
            raise FileExistsError(
                f"run_dir {cfg.run_dir} already has checkpoints; pass --resume to continue "
                f"it or choose another run_dir"
            )
        self.dirs.root.mkdir(parents=True, exist_ok=True)
        self.dirs.config.write_text(dump_config(cfg))
        self.tokenizer = build_tokenizer(cfg)
        self.task = build_task(cfg)
        model = warm_start(cfg, self.dirs, self.tokenizer, self.task, progress=progress)
        self.model_config = model.config
        t = cfg.train
        mesh_cfg = parallel.MeshConfig(**dataclasses.asdict(t.mesh))
        devices = jax.devices()
        if mesh_cfg.size < len(devices):
            log.warning("train.mesh uses %d of %d devices", mesh_cfg.size, len(devices))
        self.mesh = parallel.make_mesh(mesh_cfg, devices[: mesh_cfg.size])
        schedule = optax.linear_schedule(0.0, t.learning_rate, max(1, t.warmup_steps)) \
            if t.warmup_steps > 0 else optax.constant_schedule(t.learning_rate)
        tx = make_optimizer(schedule, max_grad_norm=t.max_grad_norm, weight_decay=t.weight_decay)
        self.graphdef, state = nnx.split(TrainState(model, tx))
        self.step_fn = make_train_step(
            self.graphdef, state, mesh=self.mesh, objective=cfg.objective.name,
            objective_hp=cfg.objective.hparams, replay=t.replay, grad_accum=t.grad_accum,
            temperature=max(cfg.rollout.temperature, 1e-6),
            lr_schedule=schedule,
        )
        self.state = self.step_fn.place_state(state)
        self.ckpt = Checkpointer(self.dirs.ckpt, save_every=cfg.checkpoint.every,
                                 keep=cfg.checkpoint.keep)
        self.step = 0
        self.queue_cursor = 0
        if resume and self.ckpt.latest_step() is not None:
            r = self.ckpt.restore(self.state, self.step_fn.state_shardings)
            self.state, self.step, self.queue_cursor = r.state, r.step, r.queue_cursor
            log.info("resumed at step %d (queue cursor %d)", self.step, self.queue_cursor)
        keep = max(3, cfg.train.exact_lag + 2)
        self.publisher = WeightPublisher(self.dirs.sync, keep=keep)
        self.canary_tokens = self.tokenizer.encode(CANARY_TEXT, add_bos=True, add_eos=True)

    @property
    def policy_version(self) -> int:
        return int(jax.device_get(self.state["policy_version"][...]))

    def train_state(self) -> TrainState:
        return nnx.merge(self.graphdef, self.state)

    def publish(self) -> None:
        """Publishes the current weights as version ``policy_version`` (idempotent on
        resume: versions beyond a restored checkpoint are deleted first)."""
        v = self.policy_version
        for stale in published_versions(self.dirs.sync):
            if stale >= v:  # from a timeline a crash discarded, or this very version
                shutil.rmtree(self.dirs.sync / f"v{stale:08d}", ignore_errors=True)
        model = self.train_state().model
        lag = self.cfg.train.exact_lag
        self.publisher.publish(
            v, lambda d: save_pretrained(model, str(d)),
            canary={"tokens": self.canary_tokens,
                    "logprobs": canary_logprobs(model, self.canary_tokens)},
            target_version=max(0, v - lag) if lag >= 0 else None,
        )

    def train_on(self, trajectories) -> dict[str, float]:
        cfg = self.cfg
        batch = make_batch(
            trajectories, buckets=cfg.train.buckets, pad_id=self.tokenizer.pad_id,
            num_layers_moe=len(self.model_config.moe_layer_indices),
            top_k=self.model_config.num_experts_per_tok,
            batch_multiple=parallel.data_parallel_size(self.mesh) * cfg.train.grad_accum,
        )
        self.state, metrics = self.step_fn(self.state, self.step_fn.place_batch(batch))
        self.step += 1
        out = {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
        rewards = np.array([t.reward for t in trajectories], np.float32)
        out["reward_mean"] = float(rewards.mean())
        out["reward_max"] = float(rewards.max())
        out["response_len_mean"] = float(np.mean([len(t.response_tokens) for t in trajectories]))
        out["num_compilations"] = float(self.step_fn.num_compilations)
        return out

    def save(self, *, force: bool = False) -> bool:
        if force:
            return self.ckpt.save(self.step, self.state, queue_cursor=self.queue_cursor)
        return self.ckpt.maybe_save(self.step, self.state, queue_cursor=self.queue_cursor)


def lag_stats(trainer_version: int, trajectories) -> dict[str, float]:
    lags = [trainer_version - t.policy_version for t in trajectories]
    hist = Counter(lags)
    out = {"lag_mean": float(np.mean(lags)), "lag_max": float(max(lags))}
    out.update({f"lag_hist/{k}": float(v) for k, v in sorted(hist.items())})
    return out


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

    trainer = Trainer(cfg, resume=resume, progress=progress)
    dirs = trainer.dirs
    token = cfg.queue.token or os.environ.get("SATJAX_QUEUE_TOKEN") or new_token()
    env = {"SATJAX_QUEUE_TOKEN": token}
    n_rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    last: dict[str, Any] = {}
    with ProcessGroup(dirs.logs) as procs, MetricsLogger(dirs.logs) as mlog:
        address = cfg.queue.address
        if not address:
            port = free_port()
            address = f"127.0.0.1:{port}"
            procs.start("queue", ["serve-queue", "--port", str(port), "--data-dir",
                                  cfg.queue.data_dir or str(dirs.queue), "--fsync",
                                  cfg.queue.fsync, "--max-lag-default",
                                  str(cfg.train.max_lag)], env=env)
        client = QueueClient(address, token=token)
        client.wait_ready(timeout=60)
        trainer.publish()
        for i in range(cfg.rollout.num_workers):
            procs.start(f"worker{i}", ["rollout", "--run-dir", str(dirs.root), "--queue",
                                       address, "--worker-id", str(i)], env=env)
        bar = tqdm(total=cfg.train.steps, initial=trainer.step, desc="rl", disable=not progress)
        t_last = time.time()
        first_batch = True  # after a restart, re-read what the lost steps had consumed
        stop = _StopOnInterrupt()
        try:
            while trainer.step < cfg.train.steps and not stop.requested:
                version = trainer.policy_version
                got = None
                while got is None or not got.trajectories:
                    if stop.requested:
                        break
                    procs.check_alive()
                    # An empty reply means fewer than n_rows fresh trajectories so far.
                    got = client.get_batch(n_rows, trainer_version=version,
                                           max_lag=cfg.train.max_lag, timeout=5.0,
                                           redeliver_unacked=first_batch)
                    first_batch = False
                if stop.requested:
                    break
                metrics = trainer.train_on(got.trajectories)
                trainer.queue_cursor = got.cursor
                metrics.update(lag_stats(version, got.trajectories))
                metrics["queue/dropped_stale"] = float(got.dropped_stale)
                now = time.time()
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
