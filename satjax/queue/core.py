"""The queue's logic, independent of gRPC: groups, lag control, delivery, acks, pausing.

:class:`TrajectoryQueue` holds the lock and the durable state (``store``) and composes four
parts, each a job a reader can follow on its own: :class:`PayloadCache` (recent record
bytes), :class:`GroupIndex` (group assembly, consistency and staleness), :class:`Deliveries`
(delivered, unacknowledged batches and their cursors) and :func:`pause_decision`
(back-pressure and lag prediction).

Semantics (docs/queue.md has the long form):

* Sequence numbers: every stored trajectory gets the next ``seq`` (1, 2, ...).
* Groups: GetBatch delivers complete groups only (``group_size`` members of one
  ``group_id``), oldest group first; ``n`` must be a multiple of each delivered group's size.
* Lag: ``lag = trainer_version - policy_version``. A group is as stale as its oldest member;
  a group (complete or not) with ``lag > max_lag`` is dropped whole, counted, and its late
  members are dropped too.
* Cursor: every delivered batch gets a cursor larger than any delivered before it (also
  across server restarts: the high 32 bits are an epoch raised at every open).
  ``Ack(c)`` consumes every delivered, unacknowledged batch whose cursor is <= c, i.e.
  every batch delivered up to and including that one, whatever seqs they hold (groups
  complete out of order).
* One consumer at a time: GetBatch and Ack carry a ``consumer_id``; the first caller holds
  the lease, renewed by each call. Another id is refused (:class:`ConsumerLeaseError`)
  until the holder has been idle ``consumer_lease_s`` or the newcomer passes
  ``take_over``; either way the old holder's unacknowledged batches become pending again
  and its later calls are refused.
* Future versions: once a trainer has asked (version V), a Put with
  ``policy_version > V + 1 + future_slack`` is rejected (V + 1: the trainer publishes
  weights V + 1 before it asks for the batch of version V + 1).
* ShouldPause(w): a trajectory started now by a worker at version w is consumed at trainer
  version ``V' = V_next + pending_fresh // n`` (V_next = V while a GetBatch waits, else
  V + 1; n = last batch size); pause when ``V' - w > max_lag`` (it would arrive stale, i.e.
  be wasted) or when ``pending >= max_pending`` (back-pressure).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Container
from pathlib import Path
from typing import NamedTuple

from satjax import config as run_config
from satjax.queue.codec import TrajectoryView, WireError
from satjax.queue.protocol import PauseDecision, PutResult, Rejection, check_wait
from satjax.queue.store import (
    RECOVERY,
    STATE_FILE,
    ConsumerState,
    DataDirError,
    Location,
    RetiredIds,
    SegmentLog,
    StorageError,
    lock_data_dir,
    segment_paths,
)
from satjax.queue.validation import (
    ROUTER_FIELDS,
    Limits,
    Problem,
    newest_version,
    router_fields_of,
    validate,
)

log = logging.getLogger(__name__)

# Groups dropped as stale are remembered (their late members are dropped too) up to this many.
DROPPED_GROUPS_MEMORY = 100_000
# A waiting GetBatch checks this often whether its caller is still there: an abandoned call
# frees its server thread within this, instead of holding it for its whole timeout_s.
WAIT_SLICE_S = 0.25


def reply_bytes(record_length: int) -> int:
    """A stored record's share of a GetBatch reply: the record plus its field framing."""
    return record_length + 8


class QueueRequestError(ValueError):
    """A request that cannot be served as asked (bad n, batch too large...)."""

    def __init__(self, message: str, *, too_large: bool = False):
        super().__init__(message)
        self.too_large = too_large


class QueueClosedError(RuntimeError):
    """The queue is shutting down; the call may be retried against the restarted server."""


class ConsumerLeaseError(RuntimeError):
    """Another consumer holds the lease (or took it over from the caller)."""


@dataclasses.dataclass(frozen=True)
class QueueSettings:
    """Server-side knobs; ``fsync`` and ``max_lag_default`` default to the run config's."""

    fsync: str = run_config.QueueConfig().fsync
    segment_bytes: int = 64 << 20
    max_lag_default: int = run_config.TrainConfig().max_lag
    future_slack: int = 0
    max_pending: int = 100_000
    max_reply_bytes: int = 64 << 20
    dedup_window: int = 1_000_000
    cache_bytes: int = 256 << 20  # recent payloads kept in memory: GetBatch skips the read
    consumer_lease_s: float = 120.0  # idle time after which another consumer may take over
    limits: Limits = Limits()


class Parsed(NamedTuple):
    """One item of a put, parsed and checked on its own (:meth:`TrajectoryQueue.parse`)."""

    raw: bytes
    msg: TrajectoryView | None  # None: not a Trajectory message
    problem: Problem | None     # the first stateless problem (validation.validate) or None


UNDECODABLE = Problem("trajectory", "trajectory: must be a valid Trajectory message")


def undecodable(error: WireError) -> Problem:
    """The problem of put bytes that are not a Trajectory, naming what is wrong with them."""
    return Problem(UNDECODABLE.field, f"{UNDECODABLE.message}, got bytes that are not ({error})")


@dataclasses.dataclass(frozen=True)
class StagedPut:
    """A put written to the log (:meth:`TrajectoryQueue.stage`), not yet acknowledged:
    :meth:`TrajectoryQueue.commit` waits until it is durable and makes it deliverable."""

    result: PutResult
    entries: list[Entry]
    payloads: list[bytes]
    durable_seq: int  # acknowledged once every record up to this one is durable


@dataclasses.dataclass(frozen=True)
class BatchResult:
    """A GetBatch answer as stored record bytes (the server splices them into the reply)."""

    payloads: list[bytes]
    cursor: int
    dropped_stale: int


class State(enum.Enum):
    STAGED = 2     # written, not yet durable: counts in its group, is not delivered
    PENDING = 0
    DELIVERED = 1


@dataclasses.dataclass(eq=False)
class Entry:
    seq: int
    trajectory_id: str
    group_id: str
    policy_version: int
    loc: Location
    state: State = State.PENDING
    payload: bytes | None = None  # cached record bytes (see PayloadCache)


@dataclasses.dataclass(eq=False)
class Group:
    group_id: str
    size: int
    prompt_id: str
    record: tuple[str, ...]  # the router fields its members carry (router_fields_of)
    members: list[Entry] = dataclasses.field(default_factory=list)
    nbytes: int = 0  # members' share of a GetBatch reply (record + framing)

    @property
    def min_version(self) -> int:
        return min(e.policy_version for e in self.members)

    @property
    def first_seq(self) -> int:
        return min(e.seq for e in self.members)

    @property
    def complete(self) -> bool:
        return len(self.members) >= self.size


@dataclasses.dataclass
class StagedGroup:
    """Members of one group accepted earlier in the put being checked, not yet indexed."""

    size: int
    prompt_id: str
    record: tuple[str, ...]
    count: int = 0
    nbytes: int = 0


def _fits(msg: TrajectoryView, total: int, nbytes: int, max_bytes: int) -> Problem | None:
    """The group of ``msg`` (``total`` bytes so far) still fits in one GetBatch reply:
    refused now, or the group could never be delivered and would hold up the queue."""
    if total + nbytes > max_bytes:
        return Problem("group_id", f"group_id: group {msg.group_id!r} must fit in one "
                                   f"message of {max_bytes} bytes (the server's max "
                                   f"message size), got {total + nbytes!r} bytes with "
                                   f"this member")
    return None


def _from_the_future(msg: TrajectoryView, trainer_v: int, newest: int) -> Problem | None:
    """A version of ``msg`` beyond ``newest``, the trainer being at ``trainer_v``: its
    policy_version, else a later token's (a record may start at a past version and claim
    future ones for its later tokens)."""
    for field, version in (("policy_version", msg.policy_version),
                           ("token_versions", newest_version(msg))):
        if version > newest:
            return Problem(field, f"{field}: must be <= {newest} (the trainer last asked for "
                                  f"version {trainer_v}; newer is from the future), "
                                  f"got {version!r}")
    return None


# ===================================================================================
# Payload cache: recent record bytes, so GetBatch rarely reads the segment files
# ===================================================================================
class PayloadCache:
    """Oldest-first eviction of ``Entry.payload`` once the total exceeds ``capacity`` bytes."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # seq -> entry holding payload
        self._size = 0

    def add(self, entry: Entry, payload: bytes) -> None:
        if len(payload) > self.capacity:
            return
        entry.payload = payload
        self._entries[entry.seq] = entry
        self._size += len(payload)
        while self._size > self.capacity:
            self.drop(next(iter(self._entries)))

    def drop(self, seq: int) -> None:
        entry = self._entries.pop(seq, None)
        if entry is not None and entry.payload is not None:
            self._size -= len(entry.payload)
            entry.payload = None


# ===================================================================================
# Group assembly: consistency on put, complete groups on get, staleness
# ===================================================================================
class GroupIndex:
    """Groups with unconsumed members, plus the ids of groups dropped as stale."""

    def __init__(self) -> None:
        self.groups: dict[str, Group] = {}
        self._dropped: OrderedDict[str, None] = OrderedDict()

    def add(self, entry: Entry, msg: TrajectoryView) -> None:
        group = self.groups.get(msg.group_id)
        if group is None:
            group = self.groups[msg.group_id] = Group(msg.group_id, msg.group_size,
                                                      msg.prompt_id, router_fields_of(msg))
        group.members.append(entry)
        group.nbytes += reply_bytes(entry.loc.length)

    def remove(self, entry: Entry) -> None:
        """Takes back a member that was never stored (its write failed)."""
        group = self.groups[entry.group_id]
        group.members.remove(entry)
        group.nbytes -= reply_bytes(entry.loc.length)
        if not group.members:
            del self.groups[entry.group_id]

    def discard_if_consumed(self, group_id: str, live: Container[int]) -> None:
        """Forgets ``group_id`` once none of its members' seqs is in ``live``."""
        group = self.groups.get(group_id)
        if group is not None and all(m.seq not in live for m in group.members):
            del self.groups[group_id]

    def check(self, msg: TrajectoryView, staged: dict[str, StagedGroup], nbytes: int,
              max_bytes: int) -> Problem | None:
        """Members of a group agree on group_size, prompt_id and which router fields they
        carry (a group the trainer could only batch in part would stop it on every
        delivery); no more than group_size; the whole group fits in one GetBatch reply of
        ``max_bytes``.

        ``staged``: the groups of items accepted earlier in the same put, not yet indexed;
        ``nbytes``: this item's share of a reply.
        """
        group, mine = self.groups.get(msg.group_id), staged.get(msg.group_id)
        if group is not None:
            size, prompt, record = group.size, group.prompt_id, group.record
            count, total = len(group.members), group.nbytes
        elif mine is not None:
            size, prompt, record, count, total = mine.size, mine.prompt_id, mine.record, 0, 0
        else:
            return _fits(msg, 0, nbytes, max_bytes)
        if mine is not None:
            count, total = count + mine.count, total + mine.nbytes
        if msg.group_size != size:
            return Problem("group_size", f"group_size: must be {size} like the rest of group "
                                         f"{msg.group_id!r}, got {msg.group_size!r}")
        if msg.prompt_id != prompt:
            return Problem("prompt_id", f"prompt_id: must be {prompt!r} like the rest of group "
                                        f"{msg.group_id!r}, got {msg.prompt_id!r}")
        mine_record = router_fields_of(msg)
        if mine_record != record:
            field = next(f for f in ROUTER_FIELDS if (f in record) != (f in mine_record))
            return Problem(field, f"{field}: must be {'present' if field in record else 'absent'}"
                                  f" like in the rest of group {msg.group_id!r} (a group "
                                  f"carries one router record: {', '.join(record) or 'none'})")
        if count >= size:
            return Problem("group_id", f"group_id: group {msg.group_id!r} already has its "
                                       f"{size} members")
        return _fits(msg, total, nbytes, max_bytes)

    def stale(self, trainer_version: int, max_lag: int) -> list[Entry]:
        """Pending members of groups whose oldest member has ``lag > max_lag``, or that were
        dropped before (a late member of a dropped group goes too)."""
        dropped: list[Entry] = []
        for gid, group in self.groups.items():
            pending = [e for e in group.members if e.state is State.PENDING]
            if not pending:
                continue
            if gid in self._dropped or trainer_version - group.min_version > max_lag:
                dropped.extend(pending)
                self._dropped[gid] = None
                if len(self._dropped) > DROPPED_GROUPS_MEMORY:
                    self._dropped.popitem(last=False)
        return dropped

    def select(self, n: int) -> list[Group]:
        """Oldest complete, undelivered groups totalling at most ``n`` trajectories."""
        ready = [g for g in self.groups.values()
                 if g.complete and all(e.state is State.PENDING for e in g.members)]
        ready.sort(key=lambda g: g.first_seq)
        chosen, total = [], 0
        for g in ready:
            if n % g.size:
                raise QueueRequestError(f"n: must be a multiple of group_size {g.size} "
                                        f"(group {g.group_id!r}), got {n!r}")
            if total + g.size <= n:
                chosen.append(g)
                total += g.size
            if total == n:
                break
        return chosen

    def incomplete(self) -> int:
        return sum(1 for g in self.groups.values() if not g.complete)


# ===================================================================================
# Delivery bookkeeping: cursors of delivered, unacknowledged batches
# ===================================================================================
class Deliveries:
    """cursor -> entries of a delivered batch, until acked or redelivered.

    Cursors count deliveries (``epoch << 32 | n``), not seqs: a batch delivered later always
    has a larger cursor, so acking the last batch's cursor covers every earlier one even
    when a later batch holds older seqs (a group that completed late).
    """

    def __init__(self, epoch: int):
        self._batches: dict[int, list[Entry]] = {}
        self._epoch, self._count = epoch, 0

    def deliver(self, entries: list[Entry]) -> int:
        """Marks ``entries`` delivered; returns their cursor (0 for an empty batch)."""
        if not entries:
            return 0
        for e in entries:
            e.state = State.DELIVERED
        self._count += 1
        cursor = (self._epoch << 32) | self._count
        self._batches[cursor] = entries
        return cursor

    def requeue_all(self) -> None:
        """Makes every unacknowledged entry pending again."""
        for entries in self._batches.values():
            for e in entries:
                e.state = State.PENDING
        self._batches.clear()

    def requeue(self, cursor: int) -> list[Entry]:
        """Makes the batch of ``cursor`` pending again; its entries (none if acknowledged)."""
        entries = self._batches.pop(cursor, [])
        for e in entries:
            e.state = State.PENDING
        return entries

    def unacked(self) -> int:
        return sum(len(v) for v in self._batches.values())

    def take_acked(self, cursor: int) -> list[Entry]:
        """Entries of every batch whose cursor is <= ``cursor`` (acks are cumulative)."""
        done = [k for k in self._batches if k <= cursor]
        return [e for k in done for e in self._batches.pop(k)]


# ===================================================================================
# Back-pressure and lag prediction
# ===================================================================================
def pause_decision(consumer: ConsumerState, pending: list[Entry], worker_version: int, *,
                   max_lag: int, max_pending: int, trainer_waiting: bool) -> PauseDecision:
    """The decision for a worker at ``worker_version`` (see module docstring)."""
    decide = functools.partial(PauseDecision, trainer_version=consumer.trainer_version,
                               max_lag=max_lag)
    if len(pending) >= max_pending:
        return decide(pause=True, reason=f"{len(pending)} trajectories pending >= "
                                         f"max_pending {max_pending}",
                      predicted_lag=0, pending_fresh=len(pending))
    if consumer.trainer_version < 0:
        return decide(pause=False, reason="no trainer has asked for a batch yet",
                      predicted_lag=0, pending_fresh=len(pending))
    fresh = sum(1 for e in pending if consumer.trainer_version - e.policy_version <= max_lag)
    v_next = consumer.trainer_version if trainer_waiting else consumer.trainer_version + 1
    predicted = v_next + fresh // max(1, consumer.batch_n) - worker_version
    reason = ""
    if predicted > max_lag:
        reason = (f"a trajectory from version {worker_version} would be consumed at "
                  f"trainer version {predicted + worker_version}, lag {predicted} > "
                  f"max_lag {max_lag}")
    return decide(pause=predicted > max_lag, reason=reason, predicted_lag=predicted,
                  pending_fresh=fresh)


# ===================================================================================
# The queue
# ===================================================================================
class TrajectoryQueue:
    """Thread-safe durable queue; one consumer (the trainer), many producers."""

    def __init__(self, data_dir: str | Path, settings: QueueSettings = QueueSettings(), *,
                 reset_consumer_state: bool = False):
        """Opens (or creates) the queue in ``data_dir``; :class:`DataDirError` when another
        server holds it or its consumer state is missing, damaged or ahead of the log.

        ``reset_consumer_state``: forget the consumer state; every record still in the log
        is delivered again (the recovery the DataDirError messages name).
        """
        self.settings = settings
        self.dir = Path(data_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._dir_lock = lock_data_dir(self.dir)
        try:
            self._open(reset_consumer_state)
        except BaseException:
            self._dir_lock.release()
            raise

    def _open(self, reset_consumer_state: bool) -> None:
        settings = self.settings
        self._state_path = self.dir / STATE_FILE
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        has_log = bool(segment_paths(self.dir))  # a stray seg-*.log name: DataDirError
        if reset_consumer_state or not (has_log or self._state_path.exists()):
            consumer = None  # set from the log below
        elif not self._state_path.exists():
            # state.json is written before the first record, so the log proves it existed
            raise DataDirError(f"{self._state_path}: consumer state is missing but the log "
                               f"holds records; {RECOVERY}")
        else:
            consumer = ConsumerState.load(self._state_path)
        self._retired = RetiredIds(self.dir / "retired_ids.jsonl", settings.dedup_window)
        self._log = SegmentLog(self.dir, segment_bytes=settings.segment_bytes,
                               fsync=settings.fsync)
        self._entries: dict[int, Entry] = {}        # not yet consumed
        self._ids: dict[str, int] = {}              # trajectory_id -> seq, records on disk
        self._seg_ids: dict[int, list[str]] = {}    # segment -> trajectory ids in it
        self._groups = GroupIndex()
        self._cache = PayloadCache(settings.cache_bytes)
        self._waiting = 0
        self._polls = 0  # GetBatch calls so far: a waiting call ends when a newer one comes
        self._closed = False
        self._holder: str | None = None  # consumer_id holding the lease
        self._holder_seen = 0.0
        self.counters: Counter[str] = Counter()  # the *_total fields of StatsReply
        unreadable = 0
        for seq, loc, payload in self._log.replay():
            if consumer is None:  # no state to trust: everything in the log is unconsumed
                consumer = ConsumerState(watermark=seq - 1)
            try:
                msg = TrajectoryView(payload)
            except WireError as e:
                # stored by a version whose codec was laxer (a field of the wrong wire type
                # read as its default): never delivered; the record stays until its segment
                # is retired
                log.error("record %d in %s no longer parses (%s): consumed without delivery",
                          seq, self.dir, e)
                consumer.mark_done(seq)
                unreadable += 1
                continue
            self._ids[msg.trajectory_id] = seq
            self._seg_ids.setdefault(loc.segment, []).append(msg.trajectory_id)
            if not consumer.is_done(seq):
                self._index(seq, msg, loc)
        consumer = consumer or ConsumerState()
        last = self._log.last_seq
        if consumer.watermark > last or any(s > last for s in consumer.done_above):
            self._log.close()
            raise DataDirError(f"{self._state_path}: consumer state is ahead of the log "
                               f"(watermark {consumer.watermark}, last seq in the log "
                               f"{last}); {RECOVERY}")
        self._consumer = consumer
        self._next_seq = max(consumer.watermark, last) + 1
        # never below the clock, so that cursors stay monotonic even if state.json was reset
        consumer.epoch = max(consumer.epoch + 1, int(time.time()))
        self._deliveries = Deliveries(consumer.epoch)
        try:
            self._save_state()  # the new epoch; also marks the directory as initialised
        except BaseException:
            self._log.close()
            raise
        self.counters["accepted_total"] = len(self._ids)
        self.counters["quarantined_total"] = self._log.quarantined + unreadable
        self._gc()
        log.info("queue at %s: %d pending, next seq %d", self.dir, len(self._entries),
                 self._next_seq)

    # -- helpers (lock held) ----------------------------------------------------------------
    def _index(self, seq: int, msg: TrajectoryView, loc: Location,
               state: State = State.PENDING) -> Entry:
        entry = Entry(seq, msg.trajectory_id, msg.group_id, msg.policy_version, loc, state)
        self._entries[seq] = entry
        self._groups.add(entry, msg)
        return entry

    def _consume(self, entries: list[Entry]) -> None:
        for e in entries:
            self._entries.pop(e.seq, None)
            self._cache.drop(e.seq)
            self._consumer.mark_done(e.seq)
            self._groups.discard_if_consumed(e.group_id, self._entries)

    def _gc(self) -> None:
        """Deletes inactive segments whose records are all consumed; their ids are retired
        (durably, one fsync for all) before any of them goes."""
        active = self._log.active_segment
        done = [first for first, seg in sorted(self._log.segments.items())
                if first != active and seg.last_seq <= self._consumer.watermark]
        ids = [tid for first in done for tid in self._seg_ids.get(first, [])]
        self._retired.add(ids)  # a failure here leaves everything for the next try
        for first in done:
            self._seg_ids.pop(first, None)
        for tid in ids:
            self._ids.pop(tid, None)
        self._log.delete(done)

    def _gc_or_storage_error(self) -> None:
        try:
            self._gc()
        except OSError as e:  # retried by the next ack; the consumer state is saved already
            raise StorageError(e.errno, f"data_dir {str(self.dir)!r}: could not retire "
                                        f"consumed segments ({e.strerror or e})") from e

    def _save_state(self) -> None:
        # fsync=never: the rename alone survives a process crash (not a power cut)
        try:
            self._consumer.save(self._state_path, fsync=self.settings.fsync != "never")
        except OSError as e:
            raise StorageError(e.errno, f"data_dir {str(self.dir)!r}: could not save the "
                                        f"consumer state ({e.strerror or e})") from e

    def _claim(self, consumer_id: str, take_over: bool) -> None:
        """Holds (or renews) the consumer lease for ``consumer_id``; see the module docs."""
        now = time.monotonic()
        holder = self._holder
        if holder is not None and holder != consumer_id:
            idle = now - self._holder_seen
            if not take_over and idle < self.settings.consumer_lease_s:
                raise ConsumerLeaseError(
                    f"consumer_id: must be the lease holder {holder!r} (active {idle:.0f}s "
                    f"ago, lease {self.settings.consumer_lease_s:g}s) or pass take_over, "
                    f"got {consumer_id!r}")
            log.warning("consumer %r replaces %r (%s): its %d unacknowledged trajectories "
                        "are pending again", consumer_id, holder,
                        "take-over" if take_over else f"idle {idle:.0f}s",
                        self._deliveries.unacked())
            self._deliveries.requeue_all()
        self._holder, self._holder_seen = consumer_id, now

    def _check_open(self) -> None:
        if self._closed:
            raise QueueClosedError("queue is shutting down")

    def _current_max_lag(self) -> int:
        """The trainer's last max_lag, or the default before it has asked."""
        c = self._consumer
        return c.max_lag if c.max_lag >= 0 else self.settings.max_lag_default

    def _pending(self) -> list[Entry]:
        return [e for e in self._entries.values() if e.state is State.PENDING]

    # -- producer side ------------------------------------------------------------------------
    def parse(self, raw: bytes) -> Parsed:
        """Parses and checks one put item on its own: no lock, no state, so the server does
        it as each item arrives (while the next is still on the wire)."""
        try:
            msg = TrajectoryView(raw)
        except WireError as e:
            return Parsed(raw, None, undecodable(e))
        return Parsed(raw, msg, validate(msg, self.settings.limits))

    def put(self, items: list[Parsed]) -> PutResult:
        """Stores the valid ``items`` (from :meth:`parse`) durably, in one write.

        Rejection indices are positions in ``items``.
        """
        return self.commit(self.stage(items))

    def stage(self, items: list[Parsed]) -> StagedPut:
        """Checks ``items`` and writes the valid ones to the log in one write; they count
        for de-duplication and group checks at once but are neither acknowledged nor
        delivered before :meth:`commit`, which every stage must be passed to.

        Split from ``commit`` so that a put waits for the disk without the lock: puts of
        other producers are written meanwhile and share the next fsync (group commit,
        fsync="always"), and the server writes each chunk of a Put stream as it arrives.
        Rejection indices are positions in ``items``.
        """
        result = PutResult([], [], [])
        with self._lock:
            self._check_open()
            trainer_v = self._consumer.trainer_version
            newest = trainer_v + 1 + self.settings.future_slack
            staged: dict[str, StagedGroup] = {}
            seen: set[str] = set()
            to_store: list[tuple[bytes, TrajectoryView]] = []
            # a duplicate of a staged item is acknowledged only once that item is durable
            # (a retired id's record was consumed, so durable: 0)
            durable_seq = 0
            for i, (raw, msg, bad) in enumerate(items):
                if msg is None:
                    bad = bad or UNDECODABLE
                    result.rejected.append(Rejection(i, "", bad.field, bad.message))
                    continue
                tid = msg.trajectory_id
                if bad is None and (tid in self._ids or tid in self._retired or tid in seen):
                    result.duplicates.append(tid)
                    result.accepted.append(tid)
                    durable_seq = max(durable_seq, self._ids.get(tid, 0))
                    continue
                if bad is None and trainer_v >= 0:
                    bad = _from_the_future(msg, trainer_v, newest)
                if bad is None:
                    bad = self._groups.check(msg, staged, reply_bytes(len(raw)),
                                             self.settings.max_reply_bytes)
                if bad is not None:
                    result.rejected.append(Rejection(i, tid, bad.field, bad.message))
                    continue
                seen.add(tid)
                mine = staged.setdefault(msg.group_id, StagedGroup(
                    msg.group_size, msg.prompt_id, router_fields_of(msg)))
                mine.count += 1
                mine.nbytes += reply_bytes(len(raw))
                to_store.append((raw, msg))
            entries = []
            if to_store:
                seq0 = self._next_seq
                # a failed write's seqs are not reused either (the log refuses them)
                self._next_seq += len(to_store)
                locs = self._log.append(seq0, [raw for raw, _ in to_store])
                for j, ((_, msg), loc) in enumerate(zip(to_store, locs, strict=True)):
                    self._ids[msg.trajectory_id] = seq0 + j
                    self._seg_ids.setdefault(loc.segment, []).append(msg.trajectory_id)
                    entries.append(self._index(seq0 + j, msg, loc, state=State.STAGED))
                    result.accepted.append(msg.trajectory_id)
                durable_seq = max(durable_seq, self._next_seq - 1)
        return StagedPut(result, entries, [raw for raw, _ in to_store], durable_seq)

    def commit(self, staged: StagedPut) -> PutResult:
        """Waits until ``staged`` is durable (per the fsync policy), then makes its items
        deliverable and returns the put's result. :class:`StorageError` when the write
        was cut from the log instead: nothing of the put is kept."""
        try:
            self._log.wait_durable(staged.durable_seq)
        except StorageError:
            with self._lock:
                for e in staged.entries:
                    self._entries.pop(e.seq, None)
                    if self._ids.get(e.trajectory_id) == e.seq:
                        del self._ids[e.trajectory_id]
                    seg_ids = self._seg_ids.get(e.loc.segment, [])
                    if e.trajectory_id in seg_ids:
                        seg_ids.remove(e.trajectory_id)
                    if not seg_ids:
                        self._seg_ids.pop(e.loc.segment, None)
                    self._groups.remove(e)
            raise
        result = staged.result
        with self._lock:
            for e, payload in zip(staged.entries, staged.payloads, strict=True):
                e.state = State.PENDING
                self._cache.add(e, payload)
            if staged.entries:
                self._cond.notify_all()
            self.counters["accepted_total"] += len(staged.entries)
            self.counters["duplicates_total"] += len(result.duplicates)
            self.counters["rejected_total"] += len(result.rejected)
        return result

    # -- consumer side ------------------------------------------------------------------------
    def get_batch(self, n: int, trainer_version: int, max_lag: int | None = None,
                  timeout_s: float = 0.0, *, allow_partial: bool = False,
                  redeliver_unacked: bool = False, consumer_id: str = "",
                  take_over: bool = False, batch_rows: int | None = None,
                  alive: Callable[[], bool] = lambda: True) -> BatchResult:
        """Up to ``n`` trajectories in complete, fresh groups (see module docstring).

        ``batch_rows``: the trainer's whole batch when it fetches it in several calls of
        ``n`` (ShouldPause predicts lags in batches of it); None: ``n``.
        ``alive``: whether the caller still listens (the server's ``context.is_active``);
        checked every :data:`WAIT_SLICE_S` of the wait and before handing anything out: a
        call whose caller is gone returns empty, delivering nothing, and frees its thread.
        A consumer waits in one call at a time: its newer call ends an older waiting one
        the same way (a caller that vanished without closing its connection looks alive).
        """
        if n <= 0:
            raise QueueRequestError(f"n: must be positive, got {n!r}")
        batch_rows = n if batch_rows is None else batch_rows
        if batch_rows < n:
            raise QueueRequestError(f"batch_rows: must be >= n ({n}), got {batch_rows!r}")
        lag = self.settings.max_lag_default if max_lag is None else max_lag
        if lag < 0:
            raise QueueRequestError(f"max_lag: must be >= 0, got {lag!r}")
        try:
            timeout_s = check_wait("timeout_s", timeout_s)
        except ValueError as e:
            raise QueueRequestError(str(e)) from None
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._check_open()
            self._claim(consumer_id, take_over)
            self._polls += 1
            poll = self._polls
            self._cond.notify_all()  # an older waiting call of the consumer ends (docstring)
            if redeliver_unacked:
                self._deliveries.requeue_all()
            # the trainer's version / lag / batch size drive ShouldPause and survive restarts
            c = self._consumer
            changed = ((c.trainer_version, c.max_lag, c.batch_n)
                       != (trainer_version, lag, batch_rows))
            c.trainer_version, c.max_lag, c.batch_n = trainer_version, lag, batch_rows
            # wait for n fresh trajectories in whole groups, dropping stale ones as we go
            dropped = 0
            self._waiting += 1
            try:
                while True:
                    stale = self._groups.stale(trainer_version, lag)
                    self._consume(stale)
                    dropped += len(stale)
                    chosen = self._groups.select(n)
                    total = sum(g.size for g in chosen)
                    remaining = deadline - time.monotonic()
                    if total == n or remaining <= 0:
                        break
                    self._cond.wait(min(remaining, WAIT_SLICE_S))
                    self._check_open()
                    if self._holder != consumer_id:
                        raise ConsumerLeaseError(f"consumer_id: {consumer_id!r} was replaced "
                                                 f"by {self._holder!r} while waiting")
                    if self._polls != poll or not alive():
                        break  # superseded, or the caller is gone: delivers nothing
            finally:
                self._waiting -= 1
            # deliver: read the payloads, mark them delivered under a new cursor
            if (total < n and not allow_partial) or self._polls != poll or not alive():
                chosen = []
            entries = [e for g in chosen for e in sorted(g.members, key=lambda e: e.seq)]
            size = sum(reply_bytes(e.loc.length) for e in entries)
            if size > self.settings.max_reply_bytes:
                raise QueueRequestError(
                    f"n: a batch of {n} trajectories is {size} bytes, over the max message "
                    f"size {self.settings.max_reply_bytes}; lower n or raise --max-message-mb",
                    too_large=True)
            payloads = [e.payload if e.payload is not None else self._log.read(e.loc)
                        for e in entries]
            self.counters["dropped_stale_total"] += dropped
            if changed or dropped:  # drops and the trainer version survive restarts
                self._save_state()  # before delivering: a failed save delivers nothing
            cursor = self._deliveries.deliver(entries)
            if dropped:
                self._gc_or_storage_error()
        return BatchResult(payloads, cursor, dropped)

    def undeliver(self, cursor: int) -> int:
        """Makes the batch delivered under ``cursor`` pending again (its caller left before
        the reply was sent); returns how many trajectories."""
        with self._lock:
            entries = self._deliveries.requeue(cursor)
            if entries:
                self._cond.notify_all()
            return len(entries)

    def ack(self, cursor: int, consumer_id: str = "") -> tuple[int, int]:
        """Consumes every delivered batch with cursor <= ``cursor``; returns (acked, watermark)."""
        with self._lock:
            self._check_open()
            self._claim(consumer_id, take_over=False)
            entries = self._deliveries.take_acked(cursor)
            self._consume(entries)
            self._save_state()
            self.counters["acked_total"] += len(entries)
            self._gc_or_storage_error()
            return len(entries), self._consumer.watermark

    # -- control ------------------------------------------------------------------------------
    def should_pause(self, worker_version: int) -> PauseDecision:
        """Decision for a worker at ``worker_version`` (see module docstring)."""
        with self._lock:
            return pause_decision(self._consumer, self._pending(), worker_version,
                                  max_lag=self._current_max_lag(),
                                  max_pending=self.settings.max_pending,
                                  trainer_waiting=bool(self._waiting))

    def stats(self) -> dict:
        """StatsReply fields."""
        with self._lock:
            pending = len(self._pending())
            delivered = sum(1 for e in self._entries.values() if e.state is State.DELIVERED)
            totals = ("accepted_total", "duplicates_total", "rejected_total", "acked_total",
                      "dropped_stale_total", "quarantined_total")
            return {
                "pending": pending,
                "delivered_unacked": delivered,
                **{name: self.counters[name] for name in totals},
                "trainer_version": self._consumer.trainer_version,
                "max_lag": self._current_max_lag(),
                "watermark": self._consumer.watermark,
                "segments": len(self._log.segments),
                "bytes_on_disk": self._log.bytes_on_disk(),
                "incomplete_groups": self._groups.incomplete(),
                "next_seq": self._next_seq,
            }

    def shutdown(self) -> None:
        """Refuses further calls and wakes waiting GetBatch calls (QueueClosedError)."""
        with self._lock:
            self._closed = True
            self._cond.notify_all()

    def close(self) -> None:
        """``shutdown`` and close the log (a call already writing finishes first)."""
        self.shutdown()
        with self._lock:
            self._log.close()
            self._dir_lock.release()
