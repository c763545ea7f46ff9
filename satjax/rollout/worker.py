"""The rollout worker loop shared by every engine.

prompts (Grain) -> engine.generate (group_size samples per prompt) -> reward ->
Trajectory stamped with the engine's policy version -> queue ``put``.

The worker honours the queue's backpressure (``should_pause``), follows the trainer's
published weights (``WeightSubscriber``: the deltas after the version it serves when it
can, else the newest full version and the deltas after it; checksum- and canary-checked;
a version it cannot load is refused, and it goes on serving the one it has until the next
loads), and on SIGTERM finishes and puts the groups it is working on before exiting, so no
finished trajectory is lost.

Each group is put on its own as soon as it is scored (a put is one durable write on the
queue's side, all of the group or nothing), so a worker that disappears (kill -9, a lost
host) loses only the groups it was still sampling: the ``prompts_per_step`` groups of
the engine call in flight, or the rest of that batch if it died between puts. Workers
may therefore join and leave at any time. A group the queue refuses (e.g. longer than
the trainer's largest bucket) stops the worker with :class:`QueueRejectedError` naming
the reason: never a silently lost group. A queue that cannot be reached (restarted,
a network blip) is waited for, the group kept in memory, with exponential backoff for up
to ``queue_retry_s`` (``rollout.queue_retry_s``); a put repeated after a put the server
stored but did not answer is a no-op (the queue is exactly-once by ``trajectory_id``).

The sampling itself (prompts -> engine -> stop strings -> reward -> trajectories) is
:class:`GroupSampler`, which needs neither a queue nor a weight subscriber: the lag sweep
drives it directly, with the engine's weights set by hand.

With ``partial`` (``rollout.partial``) a batch is not bound to one version: between two
segments of its decode the worker loads the version the trainer wants, and the engine goes
on with it (the built-in sampler from its KV cache; vLLM from the prompt + prefix it is
given again). Each token then carries the version that sampled it
(``Trajectory.token_versions``, with its log-prob and its routes from that version), and
``policy_version`` is the oldest token's, so the queue's lag rule and ``max_lag`` apply
to the oldest token without any change on the queue's side.

Responses cut at ``max_new_tokens`` are kept (``finish_reason`` "length",
``Trajectory.truncated``), with DAPO's overlong penalty added to their reward when
``rollout.overlong`` is "penalty" (the trainer masks them out for "mask").
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import signal
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np

from satjax.config import RolloutConfig
from satjax.data.pipeline import Task, decode_response, encode_prompt
from satjax.data.prompts import PromptFormat
from satjax.data.rewards import overlong_penalty
from satjax.data.tasks import Example
from satjax.queue.client import (
    QueueStorageError,
    QueueTimeoutError,
    QueueUnavailableError,
)
from satjax.queue.protocol import PutResult
from satjax.rollout.engine import Completion, Engine, SamplingParams, Sync
from satjax.trajectory import Trajectory
from satjax.weight_sync import (
    ForeignModelError,
    WeightSubscriber,
    WeightSyncError,
    check_canary,
    verify_files,
    version_complete,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# On a bucket mount a version's files appear one by one (its rename is a copy): how long a
# worker waits for the rest once the manifest is there.
FILES_WAIT_S = 120.0
# Backoff between tries to reach a queue that does not answer: doubling from the first to
# the cap (a restarted queue is back within seconds; a cap keeps a long outage from
# stretching one wait far past the moment it is back).
QUEUE_RETRY_FIRST_S, QUEUE_RETRY_CAP_S = 0.5, 10.0

_ROLLOUT = RolloutConfig()  # the defaults of the keys a WorkerConfig carries


@dataclasses.dataclass
class WorkerConfig:
    """A worker's settings; :func:`satjax.app.factory.worker_config` fills them from a run's
    config (the fields named as the ``rollout.*`` keys they come from, with their defaults)."""

    group_size: int = _ROLLOUT.group_size
    prompts_per_step: int = _ROLLOUT.prompts_per_step  # groups sampled in one engine call
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    seed: int = 0
    worker_id: str = "w0"
    pause_poll_s: float = 0.05
    record_routes: bool = _ROLLOUT.record_routes  # routed experts and their gate weights
    # partial rollouts: load new weights between decode segments of a batch (see above)
    partial: bool = _ROLLOUT.partial
    # how long an unreachable queue is waited for (backoff, the group kept) before the
    # worker gives up with QueueUnavailableError
    queue_retry_s: float = _ROLLOUT.queue_retry_s
    prompt: PromptFormat = dataclasses.field(default_factory=PromptFormat)
    # stop strings of several tokens (one-token ones are sampling.stop_token_ids): a
    # response is cut after the first token that completes one
    stop_strings: tuple[str, ...] = ()
    # what a response cut at max_new_tokens gets (config.RolloutConfig.overlong): "keep" /
    # "mask" leave its reward as scored (the trainer masks "mask"), "penalty" adds DAPO's
    overlong: str = _ROLLOUT.overlong
    overlong_buffer: int = _ROLLOUT.overlong_buffer
    overlong_penalty: float = _ROLLOUT.overlong_penalty


class QueueRejectedError(RuntimeError):
    """The queue refused trajectories of a group (their reasons in the message): the
    worker stops rather than drop the group, since every later one would go the same way."""


def cut_at_stop(c: Completion, tokenizer, stops: tuple[str, ...]) -> Completion:
    """``c`` ending at the first token whose text completes one of ``stops`` (that token
    kept, as a stop token is), with ``finish_reason`` "stop"; ``c`` itself if none does.

    The tokens kept and their log-probs are what was sampled, so the trajectory stays
    on-policy: only tokens after the stop are dropped. Binary search over prefixes (a
    prefix holding a stop string stays one when extended): O(log N) decodes."""
    tokens = [int(t) for t in c.response_tokens]
    if not stops or not any(s in tokenizer.decode(tokens) for s in stops):
        return c
    lo, hi = 1, len(tokens)  # the shortest prefix containing a stop string is in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in tokenizer.decode(tokens[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return dataclasses.replace(c.cut(lo), finish_reason="stop")


class GroupSampler:
    """Samples batches of scored groups with the weights the engine serves: prompts ->
    ``engine.generate`` (``group_size`` samples per prompt) -> :func:`cut_at_stop` ->
    reward (plus DAPO's overlong penalty under ``overlong`` "penalty") -> :class:`Trajectory`.

    Pure sampling: no queue, no weight subscriber; the caller sets the engine's weights
    (:class:`RolloutWorker` from the trainer's published versions, the lag sweep by hand).
    Batch ``b`` of a sampler is seeded by ``crc32(f"{seed}/{worker_id}/{b}")``, so a
    sampler's batches reproduce across processes.
    """

    def __init__(self, engine: Engine, task: Task, tokenizer, examples: Iterator[Example],
                 cfg: WorkerConfig) -> None:
        if cfg.group_size < 1 or cfg.prompts_per_step < 1:
            raise ValueError(f"group_size and prompts_per_step: must be >= 1, got "
                             f"{cfg.group_size!r} and {cfg.prompts_per_step!r}")
        self.engine, self.task, self.tok = engine, task, tokenizer
        self.examples, self.cfg = examples, cfg
        self._batches = 0

    def sample(self, sync: Sync | None = None) -> list[Trajectory]:
        """One batch: ``prompts_per_step`` groups of ``group_size`` trajectories each,
        contiguous. ``sync``: what the engine calls between decode segments (a partial
        rollout: it may move the engine to newer weights mid-batch; each token then
        records the version that sampled it, and ``policy_version`` is the oldest's)."""
        cfg = self.cfg
        examples = [next(self.examples) for _ in range(cfg.prompts_per_step)]
        prompts = [encode_prompt(self.tok, ex, cfg.prompt)
                   for ex in examples for _ in range(cfg.group_size)]
        # crc32, not hash(): string hashing is salted per process, seeds must reproduce
        seed = zlib.crc32(f"{cfg.seed}/{cfg.worker_id}/{self._batches}".encode()) & 0x7FFFFFFF
        self._batches += 1
        version = self.engine.version
        if version is None:
            raise RuntimeError("sample called before the engine served any weights")
        t0 = time.time()
        completions = self.engine.generate(prompts, cfg.sampling, seed, sync=sync)
        seconds = (time.time() - t0) / max(1, len(completions))
        out = []
        for g, ex in enumerate(examples):
            group_id = uuid.uuid4().hex
            for j in range(cfg.group_size):
                c = cut_at_stop(completions[g * cfg.group_size + j], self.tok,
                                cfg.stop_strings)
                reward = float(self.task.reward(decode_response(self.tok, c.response_tokens), ex))
                if cfg.overlong == "penalty":
                    reward += overlong_penalty(len(c.response_tokens),
                                               c.finish_reason == "length",
                                               cfg.sampling.max_new_tokens,
                                               cfg.overlong_buffer, cfg.overlong_penalty)
                versions = (np.full(len(c.response_tokens), version, np.int32)
                            if c.token_versions is None
                            else np.asarray(c.token_versions, np.int32))
                spans = bool(versions.size) and versions.min() != versions.max()
                routes = cfg.record_routes
                out.append(
                    Trajectory(
                        trajectory_id=f"{group_id}-{j}",
                        group_id=group_id,
                        prompt_id=ex.prompt_id,
                        prompt_tokens=np.asarray(c.prompt_tokens, np.int32),
                        response_tokens=np.asarray(c.response_tokens, np.int32),
                        behavior_logprobs=np.asarray(c.logprobs, np.float32),
                        # the oldest token's: the queue's lag rule and max_lag apply to it
                        policy_version=int(versions.min()) if versions.size else int(version),
                        reward=reward,
                        group_size=cfg.group_size,
                        finish_reason=c.finish_reason,
                        routed_experts=(
                            np.asarray(c.routed_experts, np.int32) if routes else None
                        ),
                        routed_gates=(None if not routes or c.routed_gates is None
                                      else np.asarray(c.routed_gates, np.float16)),
                        router_logits=(None if c.router_logits is None
                                       else np.asarray(c.router_logits, np.float16)),
                        # only a partial rollout sends them; else all are policy_version
                        token_versions=versions if spans else None,
                        engine=self.engine.name,
                        created_unix=time.time(),
                        generation_seconds=seconds,
                    )
                )
        return out



class RolloutWorker:
    """A :class:`GroupSampler` fed by the trainer's published weights (``subscriber``),
    putting each group on the queue (``client``): see the module's docstring."""

    def __init__(
        self,
        engine: Engine,
        task: Task,
        tokenizer,
        client,
        subscriber: WeightSubscriber,
        examples: Iterator[Example],
        cfg: WorkerConfig,
    ) -> None:
        self.sampler = GroupSampler(engine, task, tokenizer, examples, cfg)
        self.engine, self.client, self.subscriber, self.cfg = engine, client, subscriber, cfg
        self.stop_event = threading.Event()
        # (version, manifest id) the engine serves, when this worker loaded it: the base
        # that deltas can be applied to
        self._served: tuple[int, str | None] | None = None
        self.refused: int | None = None  # the last version refused (maybe_sync)
        self.produced = 0
        # seconds of run() after the first weights, and of them paused by the queue's
        # back-pressure: the rollout side's capacity is what it makes while not paused
        self.active_s = 0.0
        self.paused_s = 0.0

    # -- weights -------------------------------------------------------------------
    def maybe_sync(self, wait: bool = False) -> bool:
        """Loads the version the trainer wants served, if it differs; True if loaded.

        From the version served, the deltas up to it when that version is on its chain;
        else its chain's full version, then the deltas. Every file read is checked against
        its published checksum before the engine is touched, and the canary of the version
        reached after.

        A version that cannot be loaded (a damaged or cut-short file, a base gone, files
        still missing after ``FILES_WAIT_S``, a wrong canary) is refused: logged, never
        tried again, and the worker goes on serving the version it holds (if the engine
        was already changed, nothing until a newer version loads) and loads the next one
        the trainer publishes. None of its trajectories is stamped with the refused
        version. Weights of another model stop the worker instead
        (:class:`ForeignModelError`): every later version would be refused the same way."""
        wanted = self.subscriber.wanted_version()
        while wanted is None and wait and not self.stop_event.is_set():
            time.sleep(self.cfg.pause_poll_s)
            wanted = self.subscriber.wanted_version()
        if wanted is None or wanted in (self.engine.version, self.refused):
            return False
        try:
            return self._load(wanted)
        except ForeignModelError:
            raise
        except (WeightSyncError, OSError) as e:
            self.refused = wanted
            held = "nothing" if self.engine.version is None else f"version {self.engine.version}"
            log.error("worker %s refused version %d: %s; serving %s until a newer version "
                      "loads", self.cfg.worker_id, wanted, e, held)
            return False

    def _load(self, wanted: int) -> bool:
        """:meth:`maybe_sync`'s load of ``wanted``; False if stopped while waiting."""
        self.subscriber.wait_for(wanted)
        served = self._served if self._served and self._served[0] == self.engine.version \
            else None
        steps = self.subscriber.sync_plan(wanted, served)
        deadline = time.monotonic() + FILES_WAIT_S
        for step in steps:
            while not version_complete(step.path, step.manifest):
                if time.monotonic() > deadline:
                    raise WeightSyncError(
                        f"version {step.version} in {step.path}: files still missing "
                        f"{FILES_WAIT_S:.0f}s after its manifest appeared")
                if self.stop_event.wait(self.cfg.pause_poll_s):
                    return False
        for step in steps:  # before the engine is touched: it keeps serving what it has
            verify_files(step)
        if not steps[0].is_delta:
            # weights of another model (another run's, another shape) are never served
            self.subscriber.check_architecture(steps[0])
        self._served = None  # until the engine holds a whole, checked version again
        manifest = steps[-1].manifest
        canary = manifest.get("canary")
        err = 0.0
        try:
            if not steps[0].is_delta:
                self.engine.load(steps[0].path, steps[0].version)
            deltas = [s.path for s in steps if s.is_delta]
            if deltas:
                self.engine.apply_deltas(deltas, wanted)
            if canary:
                err = check_canary(
                    manifest, self.engine.canary_logprobs(list(canary["tokens"])),
                    atol=self.engine.canary_atol,
                )
        except BaseException:
            # it may hold part of a version, or one that failed its canary: nothing to serve
            self.engine.version = None
            raise
        log.info("worker %s loaded v%d (read %s; canary err %.2e)", self.cfg.worker_id,
                 wanted, ", ".join(f"v{s.version} {'delta' if s.is_delta else 'full'}"
                                   for s in steps), err)
        self._served = (wanted, manifest.get("id"))
        return True

    # -- queue -----------------------------------------------------------------------
    def _queue_call(self, what: str, fn: Callable[[], T], held: str) -> T | None:
        """``fn()`` (a call on the queue), retried with backoff (from QUEUE_RETRY_FIRST_S
        doubling to QUEUE_RETRY_CAP_S, one log line per try) while the queue cannot store
        (a full disk: the server kept nothing; for as long as it lasts) or cannot be
        reached (for up to ``queue_retry_s``, then :class:`QueueUnavailableError`).
        ``held``: what the worker keeps meanwhile, for the log. None when a stop arrives
        while waiting.

        Repeating a put is safe: the queue stores a group whole or not at all and is
        exactly-once by ``trajectory_id``, so a put the server stored but whose answer was
        lost comes back as duplicates, stored once."""
        delay, deadline = QUEUE_RETRY_FIRST_S, None
        while True:
            started = time.monotonic()
            try:
                return fn()
            except QueueStorageError as e:
                wait = delay
                log.warning("queue at %s cannot store (%s), retrying in %.1f s (%s)",
                            self.client.address, e, wait, held)
            except (QueueUnavailableError, QueueTimeoutError) as e:
                if deadline is None:
                    deadline = started + self.cfg.queue_retry_s
                left = deadline - time.monotonic()
                if left <= 0:
                    raise QueueUnavailableError(
                        f"queue at {self.client.address} unreachable for "
                        f"{self.cfg.queue_retry_s:g} s (rollout.queue_retry_s), giving up "
                        f"({what}; {held}): {e}", e.code) from e
                wait = min(delay, left)
                log.warning("queue at %s unreachable, retrying in %.1f s (%s)",
                            self.client.address, wait, held)
            delay = min(2 * delay, QUEUE_RETRY_CAP_S)
            if self.stop_event.wait(wait):
                return None

    def _put_until_stored(self, group: list[Trajectory]) -> PutResult | None:
        """Puts one group (see :meth:`_queue_call`); None if stopped before it was stored."""
        result = self._queue_call("put", functools.partial(self.client.put, group),
                                  f"group {group[0].group_id} kept")
        if result is not None:
            # one line per put: what a vanished worker had delivered can be counted
            log.info("worker %s put group %s: %d of %d stored", self.cfg.worker_id,
                     group[0].group_id, len(result.accepted), len(group))
        return result

    # -- loop ----------------------------------------------------------------------
    def run(self, max_batches: int | None = None, install_signal_handlers: bool = True) -> int:
        """Runs until SIGTERM/SIGINT, ``stop_event`` or ``max_batches``; returns the
        number of trajectories put on the queue."""
        if install_signal_handlers and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop_event.set())
        self.maybe_sync(wait=True)
        t_start = time.perf_counter()
        try:
            return self._loop(max_batches)
        finally:
            self.active_s = time.perf_counter() - t_start

    def _loop(self, max_batches: int | None) -> int:
        """run's loop: pause on the queue's back-pressure, sample a batch, put its groups."""
        done = 0
        cfg = self.cfg
        while not self.stop_event.is_set() and (max_batches is None or done < max_batches):
            self.maybe_sync()
            if self.engine.version is None:  # a refused version left nothing to serve
                self.stop_event.wait(cfg.pause_poll_s)
                continue
            decision = self._queue_call(
                "should_pause",
                functools.partial(self.client.should_pause, int(self.engine.version or 0)),
                "no group held")
            if decision is None:
                break
            if decision.pause:
                t0 = time.perf_counter()
                self.stop_event.wait(cfg.pause_poll_s)
                self.paused_s += time.perf_counter() - t0
                continue
            trajectories = self.sampler.sample(self.maybe_sync if cfg.partial else None)
            # Put even if a stop arrived while sampling: the work is finished, keep it.
            for i in range(0, len(trajectories), cfg.group_size):
                group = trajectories[i:i + cfg.group_size]
                result = self._put_until_stored(group)
                if result is None:  # stopped while the queue could not take it: group lost
                    return self.produced
                self.produced += len(group) - len(result.rejected)
                if result.rejected:
                    reasons = sorted({r.message for r in result.rejected})
                    raise QueueRejectedError(
                        f"worker {cfg.worker_id}: the queue refused {len(result.rejected)} of "
                        f"the {len(group)} trajectories of group {group[0].group_id}: "
                        f"{'; '.join(reasons)}")
            done += 1
        return self.produced
