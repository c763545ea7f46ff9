"""``satjax train`` and ``satjax sft`` as functions: the asynchronous RL run, with real processes.

    queue server (subprocess) <- rollout workers (subprocesses, built-in engine or vLLM)
         |                                   ^
         v                                   | weights v+1 (ShardedPublisher: background, canary)
    trainer: BatchSource.next -> jitted SAT-GSPO step -> publish -> checkpoint
             (the next batch's GetBatch, make_batch and placing run while the step does:
             ``satjax/app/batch_source.py``)

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

import contextlib
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

from satjax.app.evaluate import eval_during_training
from satjax.app.factory import (
    build_model,
    build_task,
    build_tokenizer,
    model_options,
    prompt_format,
)
from satjax.app.launch import ProcessGroup, new_token
from satjax.config import (
    Config,
    config_digest,
    dump_config,
    recorded_router_fields,
    train_buckets,
)
from satjax.data.pipeline import encode_prompt, prompt_dataset
from satjax.data.prompts import PromptFormat
from satjax.model import Qwen3MoeConfig, from_pretrained, save_pretrained
from satjax.run_dir import RunDirError, RunDirs, RunLock
from satjax.train.metrics import MetricsLogger
from satjax.train.sft import run_sft, warmup_enabled
from satjax.train.trainer import Trainer
from satjax.trajectory import MAX_VERSION, ROUTER_FIELDS
from satjax.utils import atomic_write, free_port

log = logging.getLogger(__name__)


def sft_seq_len(task, tokenizer, prompt: PromptFormat, n: int = 512) -> int:
    """A padded length (multiple of 16) that fits prompt + answer + EOS of the first
    ``n`` training examples, so the SFT step compiles once."""
    longest = max(
        1 + len(encode_prompt(tokenizer, ex, prompt)) + len(tokenizer.encode(ex.answer))
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
    # model.path only when the warm-up starts from it (lag-sweep's runs load the warm-up
    # as their model.path)
    return json.loads(json.dumps({
        "seed": cfg.seed, "sft": dataclasses.asdict(cfg.sft),
        # how long a reward may take is no part of the warm-up (a --resume may change it)
        "task": {k: v for k, v in dataclasses.asdict(cfg.task).items()
                 if k != "reward_timeout_s"},
        "model": {k: v for k, v in dataclasses.asdict(cfg.model).items()
                  if k != "path" or cfg.model.path},
    }))  # through JSON: tuples become lists, as they read back


def _cached_warm_start(dirs: RunDirs, settings: dict[str, Any]) -> bool | None:
    """Whether ``dirs.sft`` holds the warm-up made with ``settings`` (None: no cache)."""
    if not (dirs.sft / "config.json").exists():
        return None
    cached = json.loads(dirs.sft_settings.read_text()) if dirs.sft_settings.exists() else {}
    return cached == settings


def wait_for_warm_start(cfg: Config, poll_s: float = 1.0) -> None:
    """Blocks (a multi-process run's other processes) until process 0's warm-up for
    ``cfg`` is in the run directory; returns at once with ``model.path`` (nothing to
    wait for). If process 0 dies meanwhile, jax.distributed's heartbeat ends this one."""
    dirs, settings = RunDirs(cfg.run_dir), sft_settings(cfg)
    while warmup_enabled(cfg) and not _cached_warm_start(dirs, settings):
        time.sleep(poll_s)


def warm_start(cfg: Config, tokenizer, task, *, progress: bool = True, log_every: int = 10):
    """The policy RL starts from: without the warm-up (``warmup_enabled``), ``model.path``
    or a fresh tiny MoE; else the cached SFT warm-up of this run if it was made with the
    same settings (:func:`sft_settings`); else the policy trained with ``sft.steps``
    supervised steps (then cached in ``<run_dir>/sft``)."""
    dirs = RunDirs(cfg.run_dir)
    if not warmup_enabled(cfg):
        status(f"loading the policy from {cfg.model.path} (no warm-up: sft.mode "
               f"{cfg.sft.mode})" if cfg.model.path
               else "a freshly initialised policy (no warm-up: sft.mode never)")
        return build_model(cfg, tokenizer)
    settings = sft_settings(cfg)
    cached = _cached_warm_start(dirs, settings)
    if cached:
        status(f"loading the cached warm-up from {dirs.sft}")
        return from_pretrained(str(dirs.sft), **model_options(cfg))
    if cached is False:
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
            learning_rate=cfg.sft.learning_rate,
            seq_len=sft_seq_len(task, tokenizer, prompt_format(cfg)), on_step=on_step,
            prompt=prompt_format(cfg),
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


# A queue server exits with this code when its data directory is held by another server:
# after a crash, the orphaned one is still shutting down; retried for this long.
QUEUE_DATA_DIR_HELD = 1
QUEUE_START_TIMEOUT_S = 60.0


class QueueUnreachableError(RuntimeError):
    """``queue.address`` did not answer within ``queue.ready_timeout_s`` (one-line message)."""


def public_config(cfg: Config) -> Config:
    """``cfg`` as written to ``run_dir/config.yaml``: without the queue token (children get
    it from ``SATJAX_QUEUE_TOKEN`` in their environment, never from a file)."""
    return dataclasses.replace(cfg, queue=dataclasses.replace(cfg.queue, token=""))


def write_run_config(dirs: RunDirs, cfg: Config) -> None:
    """The run's config files, each replaced atomically: ``config.yaml`` (the workers build
    their pieces from it and ``--resume`` reloads it), its digest (``--resume`` refuses a
    hand-edited one: :func:`satjax.config.config_digest`) and ``weights/run_config.yaml``
    (all a worker on another host reads)."""
    public = public_config(cfg)
    text = dump_config(public)
    dirs.root.mkdir(parents=True, exist_ok=True)
    atomic_write(dirs.config, text)
    atomic_write(dirs.config_digest, config_digest(public) + "\n")
    dirs.weights.mkdir(parents=True, exist_ok=True)
    atomic_write(dirs.weights_config, text)


def queue_limit_flags(cfg: Config, model_config: Qwen3MoeConfig) -> list[str]:
    """``serve-queue`` flags that make the queue refuse what this model cannot train on:
    token ids, expert ids, route shapes, lengths beyond the largest bucket, wrong groups,
    versions beyond the trainer's int32 ones, and trajectories without the router record
    the run's workers make, or with router fields they do not make (a batch mixing rows
    with and without a field cannot be trained on): refused at put, such a group would
    stop the trainer on every delivery."""
    moe = bool(model_config.moe_layer_indices)
    required = recorded_router_fields(cfg) if moe else ()
    refused = [field for field in ROUTER_FIELDS if field not in required]
    # a dense model's trajectories carry no routes (all refused): nothing to bound
    routes = ["--num-experts", str(model_config.num_experts),
              "--moe-layers", str(len(model_config.moe_layer_indices)),
              "--top-k", str(model_config.num_experts_per_tok)] if moe else []
    return ["--vocab-size", str(model_config.vocab_size), *routes,
            "--max-seq-len", str(max(train_buckets(cfg))),
            "--group-size", str(cfg.rollout.group_size),
            "--max-version", str(MAX_VERSION),
            *(arg for field in required for arg in ("--require-record", field)),
            *(arg for field in refused for arg in ("--refuse-record", field))]


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
        self._old_wakeup_fd = -1
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
            # while steps run, Ctrl-C is this handler's alone (not an exit-at-once watcher's
            # reading the wakeup fd: satjax.app.commands.ExitOnInterrupt)
            self._old_wakeup_fd = signal.set_wakeup_fd(-1)

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
        if self._old:
            signal.set_wakeup_fd(self._old_wakeup_fd)


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
    status line per that many steps.

    In a multi-process run (``parallel.init_distributed`` called first) every process
    calls it: process 0 alone holds the run directory's lock (:class:`RunLock`: a second
    start or ``--resume`` of a running run is refused with :class:`RunDirError`),
    writes its files, runs the queue and the workers, consumes and acknowledges batches,
    logs metrics and shows progress; every process trains on the batch process 0 read
    (``satjax.app.multihost``), checkpoints cooperatively and takes part in publishing.

    Before the run directory is touched, what the user's input can get wrong is checked:
    every data row and the reward (:func:`~satjax.app.factory.build_task`: a bad row used to
    leave a half-made run directory) and the queue at ``queue.address``
    (:func:`wait_for_queue`: its wait bounds the failure, not the warm-up). Then four
    phases: :func:`start_trainer` (the warm start), :func:`start_services` (queue, first
    publish, workers), :func:`batch_source` and the :class:`TrainLoop`, whose
    :meth:`~TrainLoop.finish` checkpoints what was trained and stops the children.
    """
    from satjax.app.multihost import Peers

    peers = Peers()
    dirs = RunDirs(cfg.run_dir)
    tokenizer = build_tokenizer(cfg)
    task = build_task(cfg, tokenizer)
    token = cfg.queue.token or os.environ.get("SATJAX_QUEUE_TOKEN") or new_token()
    if peers.primary and cfg.queue.address:
        wait_for_queue(cfg.queue.address, token, cfg.queue.ready_timeout_s)
    with contextlib.ExitStack() as stack:
        if peers.primary:  # before anything in the run directory is read or written
            stack.enter_context(RunLock(dirs.root))
        if not resume and dirs.has_checkpoint():
            # checked here too (the Trainer does) so that this run's config.yaml is never
            # written over the one of the run that is there
            raise FileExistsError(f"run_dir {cfg.run_dir!r}: already has checkpoints; pass "
                                  "--resume to continue it or choose another run_dir")
        if resume and not dirs.has_checkpoint():
            # the Trainer would start from step 0: a fresh run the user did not ask for
            raise RunDirError(f"run_dir {cfg.run_dir!r}: has no checkpoint to resume from "
                              "(the run stopped before its first); start it again without "
                              "--resume")
        if peers.primary:
            write_run_config(dirs, cfg)
        trainer = start_trainer(cfg, peers, tokenizer, task, resume=resume,
                                progress=progress, log_every=log_every)
        services = start_services(cfg, trainer, peers, stack, token)
        source = batch_source(cfg, trainer, peers, services, resume=resume)
        # closed after the final checkpoint, before the queue stops (the stack closes in
        # reverse): a batch fetched but not trained on stays unacknowledged and is
        # delivered again
        stack.callback(source.close)
        loop = TrainLoop(cfg, trainer, peers, services, task, tokenizer, progress=progress,
                         log_every=log_every)
        try:
            loop.run(source)
        except KeyboardInterrupt:  # a second Ctrl-C: stop now, still checkpoint
            log.warning("interrupted: stopping after step %d", loop.logged_step)
        except BaseException:
            # the peers wait in a collective this process will never join, and a final
            # save is collective too: it would hang; the caller ends this process, and
            # jax.distributed's heartbeat then stops the peers
            loop.abandon = peers.count > 1
            raise
        finally:
            outcome = loop.finish()
    return outcome


def wait_for_queue(address: str, token: str, wait_s: float) -> None:
    """Waits up to ``wait_s`` (``queue.ready_timeout_s``) for the queue at ``address``,
    saying so; :class:`QueueUnreachableError` when none answers. Called before the warm
    start, so that the wait (plus the imports before it) bounds an unreachable queue's
    failure."""
    from satjax.queue.client import QueueClient, QueueUnavailableError

    status(f"waiting for the queue at {address} (up to {wait_s:g}s: queue.ready_timeout_s)")
    with QueueClient(address, token=token) as client:
        try:
            client.wait_ready(timeout=wait_s)
        except QueueUnavailableError:
            raise QueueUnreachableError(
                f"queue.address {address!r}: no queue answered within {wait_s:g}s (is "
                "`satjax serve-queue` running there, and reachable from here? "
                "queue.ready_timeout_s waits longer)") from None


def start_trainer(cfg: Config, peers, tokenizer, task, *, resume: bool, progress: bool,
                  log_every: int) -> Trainer:
    """The warm start: the :class:`Trainer` on the policy RL starts from
    (:func:`warm_start`; a non-primary process waits for process 0's), restored from the
    run's latest checkpoint on ``resume``."""
    if not peers.primary:  # process 0 makes (or finds) the warm-up; the others load it
        wait_for_warm_start(cfg)
    reference = (from_pretrained(cfg.model.ref_path, **model_options(cfg))
                 if cfg.objective.kl_coef > 0 and cfg.model.ref_path else None)
    policy = warm_start(cfg, tokenizer, task, progress=progress and peers.primary,
                        log_every=log_every)
    trainer = Trainer(cfg, policy, tokenizer, resume=resume, reference=reference)
    if trainer.step and peers.primary:
        status(f"resumed from the checkpoint at step {trainer.step}")
    return trainer


@dataclasses.dataclass
class Services:
    """What runs beside the trainer: the child processes (empty on a non-primary
    process), and on the primary the queue's address and a client of it."""

    procs: ProcessGroup
    address: str
    client: Any  # QueueClient on the primary, else None
    publish_s: float  # how long the first publish took (the first step's time/publish_s)


def start_services(cfg: Config, trainer: Trainer, peers, stack: contextlib.ExitStack,
                   token: str) -> Services:
    """Process 0 starts the queue server (unless ``queue.address`` names one, answering
    already: :func:`wait_for_queue`); every process publishes the starting weights;
    process 0 then starts the rollout workers. The children are stopped when ``stack``
    closes."""
    from satjax.queue.client import QueueClient, QueueUnavailableError

    dirs = RunDirs(cfg.run_dir)
    procs = stack.enter_context(ProcessGroup())
    env = {"SATJAX_QUEUE_TOKEN": token}
    address = cfg.queue.address or f"127.0.0.1:{free_port()}"
    client = None
    if peers.primary:
        # routes as the wire's uint8/uint16 views: make_batch widens them once, into the
        # batch; decoded to int32 they would take 4x the bytes, twice with one prefetched
        client = QueueClient(address, token=token, compact_routes=True)
        stack.callback(client.close)
        if not cfg.queue.address:
            def queue_ready() -> bool:
                try:
                    client.wait_ready(timeout=1.0)
                    return True
                except QueueUnavailableError:
                    return False

            status(f"starting the queue server on {address} (log: {dirs.process_log('queue')})")
            procs.start_until_ready(
                "queue", ["serve-queue", "--port", address.rsplit(":", 1)[1], "--data-dir",
                          cfg.queue.data_dir or str(dirs.queue), "--fsync", cfg.queue.fsync,
                          "--max-lag-default", str(cfg.train.max_lag),
                          *([] if cfg.queue.max_pending is None
                            else ["--max-pending", str(cfg.queue.max_pending)]),
                          *queue_limit_flags(cfg, trainer.model_config)],
                log_file=dirs.process_log("queue"), env=env, ready=queue_ready,
                timeout=max(QUEUE_START_TIMEOUT_S, cfg.queue.ready_timeout_s),
                retry_codes=(QUEUE_DATA_DIR_HELD,))
    if peers.primary:
        status(f"publishing weights v{trainer.policy_version}")
    t0 = time.perf_counter()
    trainer.publish()
    publish_s = time.perf_counter() - t0
    if peers.primary:
        status(f"starting {cfg.rollout.num_workers} rollout worker(s) "
               f"(logs: {dirs.process_log('worker0')}, ...)" if cfg.rollout.num_workers
               else f"no local workers: `satjax rollout --queue {address} --weights "
                    f"{dirs.weights}`")
        for i in range(cfg.rollout.num_workers):
            procs.start(f"worker{i}", ["rollout", "--queue", address, "--weights",
                                       str(dirs.weights), "--worker-id", str(i),
                                       "--log-dir", str(dirs.vllm_logs(str(i)))],
                        log_file=dirs.process_log(f"worker{i}"), env=env)
    return Services(procs=procs, address=address, client=client, publish_s=publish_s)


def batch_source(cfg: Config, trainer: Trainer, peers, services: Services, *, resume: bool):
    """The :class:`~satjax.app.batch_source.BatchSource` the loop trains from: batches of
    ``prompts_per_step * group_size`` trajectories at most ``trainer.lag_limit`` versions
    stale, fetched one step ahead. On ``resume`` it takes the queue over from a dead
    predecessor, whose unacknowledged batches (what the lost steps had consumed) come first.
    """
    from satjax.app.batch_source import BatchSource  # imported late: grpc is heavy

    return BatchSource(peers, services.client,
                       rows=cfg.rollout.prompts_per_step * cfg.rollout.group_size,
                       max_lag=trainer.lag_limit, prepare=trainer.prepare,
                       num_experts=trainer.model_config.num_experts, take_over=resume,
                       group_size=cfg.rollout.group_size, on_poll=services.procs.check_alive,
                       drop_uniform_groups=cfg.train.drop_uniform_groups,
                       max_fetches=cfg.train.max_fetches)


class TrainLoop:
    """The RL steps (:meth:`run`) and the finish step (:meth:`finish`).

    Each step: the batch (:meth:`BatchSource.next`), the next one's prefetch, the jitted
    update, the metrics record, the publish, and a checkpoint when due, after which the
    batches it holds are acknowledged. The first Ctrl-C or SIGTERM lets the step in flight
    finish, then stops (:class:`_StopOnInterrupt`).
    """

    def __init__(self, cfg: Config, trainer: Trainer, peers, services: Services, task,
                 tokenizer, *, progress: bool, log_every: int) -> None:
        self.cfg, self.trainer, self.peers, self.services = cfg, trainer, peers, services
        self.task, self.tokenizer = task, tokenizer
        self.client = services.client
        self.last: dict[str, Any] = {}
        self.logged_step = trainer.step  # the newest step whose metrics are in metrics.jsonl
        self.unacked = PendingAcks()
        self.abandon = False  # set when a multi-process run fails: no more collectives
        # each record times the loop since the previous one: the previous step's publish
        # and checkpoint (they follow its record), the wait for this step's batch, the step
        self.tail = {"time/publish_s": services.publish_s, "time/checkpoint_s": 0.0}
        self.mlog = self.bar = None
        if peers.primary:
            # records after the step this start trains from (a resume's re-run steps, a
            # fresh start's predecessor that crashed before its first checkpoint) go
            self.mlog = MetricsLogger(RunDirs(cfg.run_dir).logs, resume_step=trainer.step)
            self.bar = Progress("rl", cfg.train.steps, initial=trainer.step, enabled=progress,
                                log_every=log_every)
        self.stop = _StopOnInterrupt(cfg.train.preempt_grace_s)

    def say(self, message: str) -> None:
        if self.peers.primary:
            status(message)

    def run(self, source) -> None:
        """Trains until ``train.steps`` or a stop request."""
        trainer, cfg = self.trainer, self.cfg
        t_last = time.time()
        while trainer.step < cfg.train.steps:
            if not self.last:
                self.say("waiting for the first rollouts (workers load the model and "
                         "compile the sampler)")
            t0 = time.perf_counter()
            delivered = source.next(trainer.policy_version, lambda: self.stop.requested)
            if delivered is None:
                break
            wait_s = time.perf_counter() - t0
            if trainer.step + 1 < cfg.train.steps:
                # fetched while this step runs, for the version this step makes: the
                # queue's stale drops and lags are those of the step that trains it
                source.prefetch(trainer.policy_version + 1)
            if not self.last:
                self.say("compiling the train step (the first step; later ones are fast)")
            t0 = time.perf_counter()
            metrics = trainer.train_on(delivered.trajectories, delivered.batch)
            source.max_lag = trainer.lag_limit  # train.mismatch_target's decision
            metrics.update({"time/wait_data_s": wait_s,
                            "time/step_s": time.perf_counter() - t0, **self.tail})
            metrics.update(eval_during_training(cfg, trainer.step, trainer.train_state().model,
                                                self.task, self.tokenizer))
            self.last = metrics
            if self.mlog is not None:
                assert delivered.reply is not None
                # batches skipped for this one (they could not be assembled) are
                # acknowledged with it: a --resume does not meet them again
                for cursor in (*delivered.skipped, delivered.reply.cursor):
                    self.unacked.add(cursor)
                trainer.queue_cursor = max(self.unacked.cursors)
                now = time.time()
                metrics["queue/dropped_stale"] = float(delivered.reply.dropped_stale)
                metrics["queue/skipped_batches"] = float(len(delivered.skipped))
                if cfg.train.drop_uniform_groups:
                    metrics["dropped_uniform_groups"] = float(delivered.dropped_uniform_groups)
                    metrics["queue/fetches"] = float(delivered.fetches)
                metrics["trajectories_per_s"] = (len(delivered.trajectories)
                                                 / max(now - t_last, 1e-9))
                t_last = now
                # logged before publishing and checkpointing, so that a checkpoint (also
                # the one a second Ctrl-C forces) never holds a step missing from
                # metrics.jsonl
                self.last = self.mlog.log(trainer.step, metrics)
                self.mlog.flush()
            self.logged_step = trainer.step
            # also when stopping: the write runs in the background, next to the
            # checkpoint, and leaves the published weights at the checkpointed step
            t0 = time.perf_counter()
            trainer.publish()
            t1 = time.perf_counter()
            if trainer.save():
                trainer.ckpt.wait()
                self._ack()
            self.tail = {"time/publish_s": t1 - t0,
                         "time/checkpoint_s": time.perf_counter() - t1}
            if self.bar is not None:
                self.bar.update(step_postfix(metrics))

    def _ack(self) -> None:
        if self.client is not None:
            self.unacked.ack(self.client)

    def finish(self) -> RunOutcome:
        """Checkpoints the last step trained (unless a failed multi-process run abandons
        it), acknowledges what that checkpoint holds and closes the metrics log; the
        caller's stack then ends the fetch in flight and stops the children (workers
        first)."""
        trainer, cfg = self.trainer, self.cfg
        interrupted = self.stop.requested or self.logged_step < cfg.train.steps
        if self.bar is not None:
            self.bar.close()
        checkpointed = 0
        try:
            if not self.abandon:
                # A step interrupted between its update and its metrics is not checkpointed
                # (the queue re-delivers its trajectories on resume).
                if self.logged_step > 0 and trainer.ckpt.latest_step() != self.logged_step \
                        and trainer.step == self.logged_step:
                    self.say(f"saving a checkpoint at step {self.logged_step}")
                    trainer.save(force=True)
                    trainer.ckpt.wait()
                    try:
                        self._ack()
                    except Exception as e:  # the checkpoint is safe; a re-read is the worst case
                        log.error("final queue ack failed: %s", e)
                checkpointed = trainer.ckpt.latest_step() or 0
                self.stop.checkpointed.set()
                trainer.close()  # also waits for the last publish (raises its error)
        finally:
            # after the final checkpoint: a Ctrl-C during it is a second Ctrl-C (stop now)
            self.stop.restore()
            if self.mlog is not None:
                self.mlog.close()
        return RunOutcome(step=checkpointed, total=cfg.train.steps, last=self.last,
                          interrupted=interrupted)


def step_postfix(metrics: dict[str, Any]) -> dict[str, str]:
    """The fields the RL progress bar (and each --no-progress line) shows."""
    return {"reward": f"{metrics['reward_mean']:.3f}", "lag": f"{metrics['lag_mean']:.2f}",
            "traj_s": f"{metrics['trajectories_per_s']:.1f}"}
