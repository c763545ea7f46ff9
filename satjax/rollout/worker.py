"""The rollout worker loop shared by every engine.

prompts (Grain) -> engine.generate (group_size samples per prompt) -> reward ->
Trajectory stamped with the engine's policy version -> queue ``put``.

The worker honours the queue's backpressure (``should_pause``), follows the trainer's
published weights (``WeightSubscriber``: the deltas after the version it serves when it
can, else the newest full version and the deltas after it; canary-checked), and on
SIGTERM finishes and puts the groups it is working on before exiting, so no finished
trajectory is lost.

Each group is put on its own as soon as it is scored (a put is one durable write on the
queue's side, all of the group or nothing), so a worker that disappears (kill -9, a lost
host) loses only the groups it was still sampling: the ``prompts_per_batch`` groups of
the engine call in flight, or the rest of that batch if it died between puts. Workers
may therefore join and leave at any time. A group the queue refuses (e.g. longer than
the trainer's largest bucket) stops the worker with :class:`QueueRejectedError` naming
the reason: never a silently lost group.

With ``partial`` (``rollout.partial``) a batch is not bound to one version: between two
segments of its decode the worker loads the version the trainer wants, and the engine goes
on with it (the built-in sampler from its KV cache). Each token then carries the version
that sampled it (``Trajectory.token_versions``, with its log-prob and its routes from that
version), and ``policy_version`` is the oldest token's, so the queue's lag rule and
``max_lag`` apply to the oldest token without any change on the queue's side.

Responses cut at ``max_new_tokens`` are kept (``finish_reason`` "length",
``Trajectory.truncated``), with DAPO's overlong penalty added to their reward when
``rollout.overlong`` is "penalty" (the trainer masks them out for "mask").
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
import uuid
import zlib
from collections.abc import Iterator

import numpy as np

from satjax.data.pipeline import Task, decode_response, encode_prompt
from satjax.data.prompts import PromptFormat
from satjax.data.rewards import overlong_penalty
from satjax.data.tasks import Example
from satjax.queue.client import QueueStorageError
from satjax.rollout.engine import Completion, Engine, SamplingParams, Sync
from satjax.trajectory import Trajectory
from satjax.weight_sync import (
    WeightSubscriber,
    WeightSyncError,
    check_canary,
    version_complete,
)

log = logging.getLogger(__name__)

# On a bucket mount a version's files appear one by one (its rename is a copy): how long a
# worker waits for the rest once the manifest is there.
FILES_WAIT_S = 120.0


@dataclasses.dataclass
class WorkerConfig:
    group_size: int = 8
    prompts_per_batch: int = 4
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    seed: int = 0
    worker_id: str = "w0"
    pause_poll_s: float = 0.05
    record_routes: bool = True  # routed experts and their gate weights
    # partial rollouts: load new weights between decode segments of a batch (see above)
    partial: bool = False
    prompt: PromptFormat = dataclasses.field(default_factory=PromptFormat)
    # stop strings of several tokens (one-token ones are sampling.stop_token_ids): a
    # response is cut after the first token that completes one
    stop_strings: tuple[str, ...] = ()
    # what a response cut at max_new_tokens gets (config.RolloutConfig.overlong): "keep" /
    # "mask" leave its reward as scored (the trainer masks "mask"), "penalty" adds DAPO's
    overlong: str = "keep"
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0


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


class RolloutWorker:
    def __init__(
        self,
        engine: Engine,
        task: Task,
        tokenizer,
        client,
        subscriber: WeightSubscriber | None,  # None: the caller loads the engine's weights
        examples: Iterator[Example],
        cfg: WorkerConfig,
    ) -> None:
        if cfg.group_size < 1 or cfg.prompts_per_batch < 1:
            raise ValueError("group_size and prompts_per_batch must be >= 1")
        self.engine, self.task, self.tok, self.client = engine, task, tokenizer, client
        self.subscriber, self.examples, self.cfg = subscriber, examples, cfg
        self.stop_event = threading.Event()
        # (version, manifest id) the engine serves, when this worker loaded it: the base
        # that deltas can be applied to
        self._served: tuple[int, str | None] | None = None
        self._batches = 0
        self.produced = 0

    # -- weights -------------------------------------------------------------------
    def maybe_sync(self, wait: bool = False) -> bool:
        """Loads the version the trainer wants served, if it differs; True if loaded.

        From the version served, the deltas up to it when that version is on its chain;
        else its chain's full version, then the deltas. The canary of the version reached
        is checked in either case."""
        assert self.subscriber is not None, "a worker without a subscriber never syncs"
        wanted = self.subscriber.wanted_version()
        while wanted is None and wait and not self.stop_event.is_set():
            time.sleep(self.cfg.pause_poll_s)
            wanted = self.subscriber.wanted_version()
        if wanted is None or wanted == self.engine.version:
            return False
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
        self._served = None  # until the engine holds a whole, checked version again
        if not steps[0].is_delta:
            self.engine.load(steps[0].path, steps[0].version)
        deltas = [s.path for s in steps if s.is_delta]
        if deltas:
            self.engine.apply_deltas(deltas, wanted)
        manifest = steps[-1].manifest
        canary = manifest.get("canary")
        err = 0.0
        if canary:
            err = check_canary(
                manifest, self.engine.canary_logprobs(list(canary["tokens"])),
                atol=self.engine.canary_atol,
            )
        log.info("worker %s loaded v%d (read %s; canary err %.2e)", self.cfg.worker_id,
                 wanted, ", ".join(f"v{s.version} {'delta' if s.is_delta else 'full'}"
                                   for s in steps), err)
        self._served = (wanted, manifest.get("id"))
        return True

    # -- one batch -----------------------------------------------------------------
    def generate_groups(self, sync: Sync | None = None) -> list[Trajectory]:
        """Samples one batch of groups with the loaded weights and scores it; the groups
        are contiguous, ``group_size`` trajectories each. ``sync``: what the engine calls
        between decode segments (default: :meth:`maybe_sync` under ``partial``, nothing
        otherwise)."""
        cfg = self.cfg
        examples = [next(self.examples) for _ in range(cfg.prompts_per_batch)]
        prompts = [encode_prompt(self.tok, ex, cfg.prompt)
                   for ex in examples for _ in range(cfg.group_size)]
        # crc32, not hash(): string hashing is salted per process, seeds must reproduce
        seed = zlib.crc32(f"{cfg.seed}/{cfg.worker_id}/{self._batches}".encode()) & 0x7FFFFFFF
        self._batches += 1
        version = self.engine.version
        if version is None:
            raise RuntimeError("generate_groups called before any weights were loaded")
        t0 = time.time()
        if sync is None and cfg.partial and self.subscriber is not None:
            sync = self.maybe_sync
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

    # -- loop ----------------------------------------------------------------------
    def _put_until_stored(self, group: list[Trajectory]):
        """Puts one group, waiting out a full disk on the queue's side (the server keeps
        nothing of a refused put, and ids make a repeated put idempotent)."""
        while True:
            try:
                result = self.client.put(group)
            except QueueStorageError as e:
                log.warning("queue cannot store the group (%s); retrying", e)
                if self.stop_event.wait(self.cfg.pause_poll_s):
                    return None
                continue
            # one line per put: what a vanished worker had delivered can be counted
            log.info("worker %s put group %s: %d of %d stored", self.cfg.worker_id,
                     group[0].group_id, len(result.accepted), len(group))
            return result

    def run(self, max_batches: int | None = None, install_signal_handlers: bool = True) -> int:
        """Runs until SIGTERM/SIGINT, ``stop_event`` or ``max_batches``; returns the
        number of trajectories put on the queue."""
        if install_signal_handlers and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop_event.set())
        self.maybe_sync(wait=True)
        done = 0
        while not self.stop_event.is_set() and (max_batches is None or done < max_batches):
            self.maybe_sync()
            if self.client.should_pause(int(self.engine.version or 0)).pause:
                self.stop_event.wait(self.cfg.pause_poll_s)
                continue
            cfg = self.cfg
            trajectories = self.generate_groups()
            # Put even if a stop arrived while sampling: the work is finished, keep it.
            for i in range(0, len(trajectories), self.cfg.group_size):
                group = trajectories[i:i + self.cfg.group_size]
                result = self._put_until_stored(group)
                if result is None:  # stopped while the queue's disk was full: group lost
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
