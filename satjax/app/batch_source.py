"""The trainer's batches from the queue, the next one fetched while the step runs.

One batch ahead, never more::

    devices           |==== step n ====|                  |==== step n+1 ====|
    main thread    next(V) prefetch(V+1) train_on  log, publish, checkpoint  next(V+1) ...
    fetch thread                 |-- GetBatch(V+1), decode, make_batch, place --|

``prefetch(V + 1)`` starts, in a background thread of the primary, the GetBatch calls for
the batch that step n+1 trains on, while step n runs on the devices (JAX dispatch is
asynchronous, and the main thread waits for the step's metrics without holding the GIL).
The queue is asked with the version that batch is trained at, ``V + 1``, so its stale drops
(``lag > max_lag``) are exactly those of the step that trains it, as when the batch is
fetched after the step. In a single-process run the thread also pads the
batch (``make_batch``) and places it on the mesh; in a multi-process run the processes first
agree on it (collectives, ``satjax.app.multihost``) and placing is itself a collective, so
both happen on the main thread, in :meth:`BatchSource.next`, in the same order everywhere.

Dynamic sampling (``drop_uniform_groups``, DAPO's): groups whose rewards are all equal have
zero group-normalised advantages and teach nothing, so the fetch drops them as they arrive
and asks the queue for more, until the batch holds ``rows`` trajectories of informative
groups or ``max_fetches`` GetBatch answers have come; then it trains on what it has (the
step pads it to the full size with masked rows, so its shape does not change). The dropped
groups are acknowledged with the batch, like the groups trained on.

A batch that cannot be assembled (``prepare`` raises
:class:`~satjax.train.batch.UnbatchableError`, e.g. rows with and without router logits) is
skipped: one log line, another batch fetched in its place, and its cursor handed to the loop
(``Delivery.skipped``) to be acknowledged with the batch trained on. Stopping on it instead
would stop again at every ``--resume``, the queue delivering it again each time.

A fetched batch is only *delivered* by the queue until the trainer acknowledges it after a
durable checkpoint, so a batch fetched but never trained on (the run stopped, crashed, or
was interrupted) is delivered again to the next trainer (``redeliver_unacked`` on its first
GetBatch) and the resumed run trains the same sequence of batches.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from satjax.app.multihost import Peers, Poll
from satjax.queue.client import QueueClient, QueueTooLargeError, TrajectoryBatch
from satjax.train.batch import UnbatchableError
from satjax.trajectory import Trajectory

log = logging.getLogger(__name__)

# How long the primary waits for the batch before the processes agree to go on waiting:
# stop requests travel with each agreement, so this bounds how long a stop requested on
# another process takes to be seen.
POLL_S = 5.0
# Each GetBatch's own wait for data: bounds how long close() waits for a fetch in flight.
CALL_S = 1.0
WAKE_S = 0.25  # while waiting, how often a stop request and the children are checked


@dataclasses.dataclass(frozen=True)
class Delivery:
    """A batch, the same on every process: its trajectories, what the step takes
    (``prepare(trajectories)``), and on the primary the queue's answer (``cursor`` to
    acknowledge once a checkpoint holds the step; stale drops; None on other processes)."""

    trajectories: list[Trajectory]
    batch: Any
    reply: TrajectoryBatch | None
    dropped_uniform_groups: int = 0  # groups dropped for equal rewards (primary only)
    fetches: int = 0  # GetBatch answers with trajectories this batch took (primary only)
    # batches skipped before this one (could not be assembled): their cursors on the
    # primary, to acknowledge with this batch's; 0 on other processes
    skipped: tuple[int, ...] = ()


class _Fetch:
    """One batch being fetched by the fetch thread; ``done`` once it has a result."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.done = threading.Event()
        self.reply: TrajectoryBatch | None = None
        self.dropped_uniform_groups = 0
        self.fetches = 0
        self.batch: Any = None  # prepared in the thread (single-process runs)
        self.error: BaseException | None = None
        self.skipped: list[int] = []  # cursors of batches fetched but not assembled


class BatchSource:
    """Batches of ``rows`` trajectories from the queue at ``client`` (the primary's; None on
    other processes), agreed on by every process (``peers``) and prepared for the step by
    ``prepare`` (e.g. :meth:`satjax.train.trainer.Trainer.prepare`: pad and place).

    The loop calls :meth:`next` with the version the batch is trained at, and may call
    :meth:`prefetch` with the next version as soon as it has the batch, before the step:
    the next batch is then fetched while the step runs. Without ``prefetch``, :meth:`next`
    fetches when called. ``max_lag``: the queue drops trajectories staler than this; the
    loop may change it between batches (``train.mismatch_target``), each GetBatch call
    reads it.
    ``take_over``: the first GetBatch fences a previous trainer that still holds the queue
    (a resumed run). ``rows_per_call``: fetch in GetBatch calls of at most this many
    trajectories (a multiple of ``group_size``); None: the whole batch in one call, halved
    (in whole groups) each time the queue answers that it is over one gRPC message (the
    paper's 2 GB batch against the 64 MiB default), so no size has to be configured. Each
    call tells the queue the whole batch's size (``batch_rows``: its ShouldPause predicts
    lags in whole batches). ``on_poll``: called on the main thread while the primary waits
    (e.g. raise if a child process died). ``drop_uniform_groups``, ``max_fetches``: dynamic
    sampling (module docstring).
    """

    def __init__(self, peers: Peers, client: QueueClient | None, *, rows: int, max_lag: int,
                 prepare: Callable[[list[Trajectory]], Any], num_experts: int | None = None,
                 take_over: bool = False, rows_per_call: int | None = None,
                 group_size: int = 1, on_poll: Callable[[], None] = lambda: None,
                 poll_s: float = POLL_S, drop_uniform_groups: bool = False,
                 max_fetches: int = 1) -> None:
        if peers.primary and client is None:
            raise ValueError("client: the primary process needs a QueueClient")
        if rows < 1 or group_size < 1 or rows % group_size or (
                rows_per_call is not None and (rows_per_call < 1 or rows_per_call % group_size)):
            raise ValueError(f"rows, rows_per_call: must be positive multiples of group_size "
                             f"{group_size}, got {rows}, {rows_per_call}")
        self.peers, self.client = peers, client
        self.rows, self.max_lag, self.prepare = rows, max_lag, prepare
        self.num_experts, self.take_over = num_experts, take_over
        self.rows_per_call, self.group_size = rows_per_call or rows, group_size
        self.on_poll, self.poll_s = on_poll, poll_s
        if max_fetches < 1:
            raise ValueError(f"max_fetches: must be >= 1, got {max_fetches}")
        self.drop_uniform_groups, self.max_fetches = drop_uniform_groups, max_fetches
        # a batch placed by the fetch thread needs no collective: single-process runs only
        self._prepare_in_thread = peers.count == 1
        self._first_call = True  # the first GetBatch re-reads what no trainer acknowledged
        self._skipped: list[int] = []  # skipped on the main thread, for the next Delivery
        self._fetch: _Fetch | None = None  # the fetch requested and not yet taken by next()
        self._cancel = threading.Event()
        # One thread for all fetches, started by the first: a thread per batch would leave
        # each batch's freed buffers in a malloc arena the next thread does not reuse
        # (measured: the process grew by a batch per step).
        self._requests: queue.SimpleQueue[_Fetch | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    # -- the fetch thread (primary) -------------------------------------------------------
    def prefetch(self, version: int) -> None:
        """Starts fetching the batch trained at policy ``version`` (primary: in the fetch
        thread; other processes: nothing to do). One fetch at a time: :meth:`next` takes it."""
        if not self.peers.primary:
            return
        if self._fetch is not None:
            raise RuntimeError(f"prefetch: the batch for version {self._fetch.version} is "
                               "still to be taken by next()")
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, daemon=True,
                                            name="batch-fetch")
            self._thread.start()
        self._fetch = _Fetch(version)
        self._requests.put(self._fetch)

    def _serve(self) -> None:
        """The fetch thread: one fetch after another, until close() sends None."""
        while (fetch := self._requests.get()) is not None:
            try:
                self._get(fetch)
                while fetch.reply is not None and self._prepare_in_thread:
                    try:
                        fetch.batch = self.prepare(fetch.reply.trajectories)
                        break
                    except UnbatchableError as e:
                        fetch.skipped.append(_skip(fetch.version, fetch.reply.cursor, e))
                        fetch.reply = None  # stays None if close() cancels the next one
                        self._get(fetch)
            except BaseException as e:  # raised on the main thread by next()
                fetch.error = e
            finally:
                fetch.done.set()
            del fetch  # the batch is next()'s now: not held here until the next request

    def _get(self, fetch: _Fetch) -> None:
        """The GetBatch calls of one batch, repeated until it is whole, into ``fetch``
        (``reply`` None: cancelled; what it had got stays unacknowledged, so the queue
        delivers it again). With ``drop_uniform_groups``: whole once it holds ``rows``
        trajectories of informative groups, or after ``max_fetches`` rounds (a round asks
        for what is missing, in as many calls as one message allows)."""
        assert self.client is not None  # the primary's, checked in __init__
        parts: list[TrajectoryBatch] = []
        kept: list[Trajectory] = []
        last_dropped: list[Trajectory] = []
        dropped = rounds = 0
        while len(kept) < self.rows:
            if self.drop_uniform_groups and rounds >= self.max_fetches:
                log.info("dynamic sampling: %d of %d trajectories informative after %d "
                         "fetches; training on them", len(kept), self.rows, rounds)
                break
            need = self.rows - len(kept)
            got: list[Trajectory] = []
            while len(got) < need:
                if self._cancel.is_set():
                    return
                try:
                    reply = self.client.get_batch(
                        min(self.rows_per_call, need - len(got)),
                        trainer_version=fetch.version, max_lag=self.max_lag, timeout=CALL_S,
                        redeliver_unacked=self._first_call,
                        # a resumed trainer fences its dead predecessor explicitly (the
                        # queue refuses a second consumer)
                        take_over=self._first_call and self.take_over, batch_rows=self.rows)
                except QueueTooLargeError:  # nothing was delivered: ask for fewer groups
                    half = self.rows_per_call // 2 // self.group_size * self.group_size
                    if half < self.group_size:  # the queue refuses such groups at put time
                        raise
                    log.warning("a GetBatch of %d trajectories is over the queue's message "
                                "size: fetching batches in calls of %d",
                                self.rows_per_call, half)
                    self.rows_per_call = half
                    continue
                self._first_call = False
                dropped += reply.dropped_stale
                if reply.trajectories:  # empty: fewer fresh trajectories than asked so far
                    parts.append(reply)
                    got.extend(reply.trajectories)
            rounds += 1
            if self.drop_uniform_groups:
                informative, last_dropped = split_uniform_groups(got)
                kept.extend(informative)
                fetch.dropped_uniform_groups += (len({t.group_id for t in got})
                                                 - len({t.group_id for t in informative}))
            else:
                kept.extend(got)
        if not kept:  # every group of every fetch uniform: train on the last ones (A = 0)
            kept = last_dropped
            fetch.dropped_uniform_groups -= len({t.group_id for t in kept})
        fetch.fetches = rounds
        # the cursor of every answer, dropped groups included: they are acknowledged too
        fetch.reply = TrajectoryBatch(kept, cursor=max(p.cursor for p in parts),
                                      dropped_stale=dropped)

    # -- the main thread ------------------------------------------------------------------
    def _wait(self, version: int, stop: Callable[[], bool]) -> _Fetch | None:
        """The primary's fetch for ``version`` once done (started now if none is in flight),
        or None after ``poll_s`` or on a stop request (the fetch goes on)."""
        if self._fetch is None:
            self.prefetch(version)
        fetch = self._fetch
        assert fetch is not None
        if fetch.version != version:
            raise RuntimeError(f"next: asked for the batch of version {version}, the one in "
                               f"flight is for version {fetch.version}")
        deadline = time.monotonic() + self.poll_s
        while not fetch.done.wait(min(WAKE_S, max(0.0, deadline - time.monotonic()))):
            if stop() or time.monotonic() >= deadline:
                return None
            self.on_poll()
        self._fetch = None
        if fetch.error is not None:
            raise fetch.error
        return fetch

    def next(self, version: int, stop: Callable[[], bool]) -> Delivery | None:
        """The batch trained at policy ``version`` (the one :meth:`prefetch` started, else
        fetched now), the same on every process; None to stop: a stop request (``stop()``
        true on any process) or a failed agreement. Every process calls it, in the same
        order, on the thread that runs the step: it makes the run's collectives."""
        while True:
            poll, fetch = (Poll.STOP if stop() else Poll.EMPTY), None
            if self.peers.primary and poll == Poll.EMPTY:
                self.on_poll()
                fetch = self._wait(version, stop)
                poll = Poll.BATCH if fetch is not None else Poll.EMPTY
            reply = fetch.reply if fetch is not None else None
            poll, trajectories, any_stop = self.peers.agree(
                poll, reply.trajectories if reply is not None else None, stop=stop(),
                num_experts=self.num_experts)
            if any_stop or poll == Poll.STOP:
                if reply is not None:
                    log.info("stopping: the batch fetched for version %d (cursor %d) was not "
                             "trained on; the queue delivers it again", version, reply.cursor)
                return None
            if poll == Poll.BATCH:
                try:
                    batch = fetch.batch if fetch is not None and fetch.batch is not None \
                        else self.prepare(trajectories)
                except UnbatchableError as e:  # the same on every process: all skip it
                    self._skipped.append(_skip(version, reply.cursor if reply else 0, e))
                    continue
                skipped = (*self._skipped, *(fetch.skipped if fetch is not None else ()))
                self._skipped = []
                return Delivery(trajectories, batch, reply,
                                dropped_uniform_groups=fetch.dropped_uniform_groups
                                if fetch is not None else 0,
                                fetches=fetch.fetches if fetch is not None else 0,
                                skipped=skipped)

    def close(self) -> None:
        """Stops the fetch in flight, if any (within one GetBatch call); a batch it got is
        not acknowledged, so the queue delivers it again to the next trainer."""
        self._cancel.set()
        fetch, self._fetch = self._fetch, None
        if self._thread is not None:
            self._requests.put(None)
            self._thread.join(timeout=CALL_S + 60.0)  # a call's own deadline (QueueClient)
        if fetch is not None and fetch.reply is not None:
            log.info("a batch fetched for version %d (cursor %d) was not trained on; the "
                     "queue delivers it again", fetch.version, fetch.reply.cursor)


def _skip(version: int, cursor: int, error: UnbatchableError) -> int:
    """Reports a batch that cannot be assembled (one line); returns its cursor."""
    log.error("skipping the batch fetched for version %d (cursor %d): it cannot be "
              "assembled (%s); it is acknowledged with the next batch trained on",
              version, cursor, error)
    return cursor


def split_uniform_groups(trajectories: list[Trajectory]
                         ) -> tuple[list[Trajectory], list[Trajectory]]:
    """(informative, uniform): the trajectories of groups whose rewards differ, and of
    groups whose rewards are all equal (zero group-normalised advantage), order kept.

    References:
      DAPO: Yu et al. 2025, arXiv:2503.14476 (dynamic sampling).
    """
    rewards: dict[str, set[float]] = collections.defaultdict(set)
    for t in trajectories:
        rewards[t.group_id].add(float(t.reward))
    informative = [t for t in trajectories if len(rewards[t.group_id]) > 1]
    uniform = [t for t in trajectories if len(rewards[t.group_id]) == 1]
    return informative, uniform
