"""Durable storage of the trajectory queue: an append-only segment log plus consumer state.

Layout of ``data_dir``::

    LOCK                             flock held by the one server of this directory (its pid)
    seg-<first seq, 20 digits>.log   records: u32 length | u32 crc32 | u64 seq | payload
    state.json                       consumer state (watermark, acks above it, versions),
                                     replaced atomically (temp + fsync + rename + dir fsync);
                                     written when the directory is created, so a log without
                                     it means the file was lost
    retired_ids.jsonl                ids of garbage-collected records (de-duplication memory)
    quarantine/                      bytes of damaged records found mid-log, set aside

``length`` counts the payload, ``crc32`` covers seq and payload; seqs increase along the log
(gaps are allowed: a quarantined record leaves one). A record whose header or checksum does
not verify is either damage in the middle of a segment (an intact record follows: the bytes
up to it are copied to ``quarantine/`` and skipped) or a torn tail after ``kill -9``
(nothing intact follows: truncated away on open). Records are written before the Put that
carried them replies; the fsync policy decides when they reach the disk (docs/queue.md).
Under ``always`` a put waits (:meth:`SegmentLog.wait_durable`) for a group commit: one
background thread fsyncs whatever has been written so far, so concurrent puts share
fsyncs, and the disk flushes one chunk of a long Put stream while the next is received.
A failed write is rolled back (the segment is cut back to its last whole record) so that
the log stays well-formed and the next append, once the disk has room, just works; under
``always`` a failed write or fsync cuts the log back to the last durable record and fails
every put waiting above it.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import queue
import re
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

from zlib_ng.zlib_ng import crc32  # zlib's CRC-32 (same values), SIMD: ~4x faster here

from satjax.utils import LockHeldError, PidLock, atomic_write, fsync_dir, writev_all

log = logging.getLogger(__name__)

HEADER = struct.Struct("<IIQ")  # payload length, crc32(seq + payload), seq
SEQ = struct.Struct("<Q")
FSYNC_POLICIES = ("always", "batch", "never")
MAX_RECORD_BYTES = 1 << 31
STATE_FILE = "state.json"
SEGMENT_NAME = re.compile(r"seg-(\d{20})\.log")  # seg-<first seq, 20 digits>.log


class DataDirError(RuntimeError):
    """The data directory cannot be served as it is; the message says why and what to do."""


class StorageError(OSError):
    """A write failed (disk full, I/O error) and was rolled back: nothing of it is stored."""


def segment_paths(data_dir: Path) -> list[Path]:
    """The segment files of ``data_dir``, oldest first.

    Any other ``seg-*.log`` there is refused (:class:`DataDirError`) rather than skipped:
    a renamed or copied segment may hold records the log needs, and replaying around it
    would silently lose or duplicate them.
    """
    paths = sorted(data_dir.glob("seg-*.log"))
    for path in paths:
        if not SEGMENT_NAME.fullmatch(path.name) or not path.is_file():
            raise DataDirError(
                f"data_dir {str(data_dir)!r}: {path.name!r} is not a segment of this queue "
                f"(segments are files named seg-<first seq, 20 digits>.log); move it out of "
                f"the directory")
    return paths


def lock_data_dir(data_dir: Path) -> PidLock:
    """Exclusive lock on ``data_dir/LOCK`` (:class:`satjax.utils.PidLock`): one server per
    data directory; :class:`DataDirError` naming the holder's pid when another has it."""
    try:
        return PidLock(data_dir / "LOCK", mode=0o600)
    except LockHeldError as e:
        raise DataDirError(f"data_dir {str(data_dir)!r}: already served by pid {e.holder} "
                           f"(it holds {e.path.name}); stop that server first") from None


@dataclasses.dataclass
class Segment:
    path: Path
    first_seq: int
    last_seq: int        # first_seq - 1 while empty
    size: int
    read_fd: int


@dataclasses.dataclass(frozen=True)
class Location:
    segment: int         # first_seq of the segment
    offset: int          # of the payload
    length: int


def _record_crc(seq: int, payload: bytes | memoryview) -> int:
    """The record checksum: CRC32 of the u64 little-endian seq, then the payload."""
    return crc32(payload, crc32(SEQ.pack(seq)))


class SegmentLog:
    """Append-only, CRC-checked, rolled segment files. Callers serialise appends and reads
    (one lock); ``wait_durable`` may be called from any thread."""

    def __init__(self, data_dir: Path, *, segment_bytes: int = 64 << 20,
                 fsync: str = "always", batch_interval_s: float = 0.05):
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync: must be one of {FSYNC_POLICIES}, got {fsync!r}")
        if segment_bytes <= HEADER.size:
            raise ValueError(f"segment_bytes: must be > {HEADER.size}, got {segment_bytes!r}")
        self.dir = Path(data_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self.segments: dict[int, Segment] = {}
        self.quarantined = 0             # damaged regions set aside by replay
        self._write_fd: int | None = None
        self._write_seg: int | None = None  # first_seq of the segment _write_fd appends to
        self._cut_pending = False         # a failed write left bytes past the last record
        self._dirty = False
        self._io_lock = threading.Lock()  # guards the write descriptor and the fields below
        # group commit (fsync="always"): records <= _durable_seq are on the disk unless a
        # failure cut them (_lost: (after, upto] seq ranges, whose waiters fail; seqs are
        # never reused); cutting the log back to _durable_point (segment, size, last_seq)
        # loses nothing acknowledged
        self._written_seq = self._durable_seq = 0
        self._durable_point: tuple[int, int, int] | None = None
        self._lost: list[tuple[int, int]] = []
        self._cuts = 0  # cut-backs so far: a flush that started before one proves nothing
        self._committing = False  # the commit thread runs: waiting for it makes sense
        self._to_sync = threading.Condition(self._io_lock)  # the commit thread waits on it
        self._synced = threading.Condition(self._io_lock)   # waiting puts wait on it
        self._stop = threading.Event()
        self._syncer: threading.Thread | None = None
        self._doomed: queue.SimpleQueue[list[Path] | None] = queue.SimpleQueue()
        self._deleter: threading.Thread | None = None  # unlinks deleted segments' files
        if fsync == "batch":
            self._syncer = threading.Thread(target=self._sync_loop, args=(batch_interval_s,),
                                            name="queue-fsync", daemon=True)
        elif fsync == "always":
            self._syncer = threading.Thread(target=self._commit_loop, name="queue-fsync",
                                            daemon=True)

    # -- opening and replay ---------------------------------------------------------------
    def replay(self) -> Iterator[tuple[int, Location, bytes]]:
        """Yields (seq, location, payload) of every intact record, quarantining mid-log
        damage and truncating torn tails.

        Must be consumed fully before appending; opens the last segment for appends.
        :class:`DataDirError` names a ``seg-*.log`` that is not a segment (see
        :func:`segment_paths`).
        """
        last = 0
        for path in segment_paths(self.dir):
            first = int(path.stem.split("-")[1])
            seg = Segment(path, first, first - 1, 0, os.open(path, os.O_RDONLY))
            self.segments[first] = seg
            for record in self._scan(seg, max(last, first - 1)):
                last = record[0]
                yield record
        if self.segments:
            self._open_for_append(max(self.segments))
            seg = self.segments[max(self.segments)]
            # replayed records are on the disk (a truncated tail was fsynced)
            self._written_seq = self._durable_seq = self.last_seq
            self._durable_point = (seg.first_seq, seg.size, seg.last_seq)
        if self._syncer is not None:
            self._committing = self.fsync == "always"
            self._syncer.start()

    def _record_at(self, buf: bytes | memoryview, pos: int, after: int
                   ) -> tuple[int, int] | None:
        """(seq, payload length) of an intact record at ``pos`` of ``buf`` with seq > after."""
        if pos + HEADER.size > len(buf):
            return None
        length, crc, seq = HEADER.unpack_from(buf, pos)
        end = pos + HEADER.size + length
        if seq <= after or end > len(buf):
            return None
        if _record_crc(seq, buf[pos + HEADER.size:end]) != crc:
            return None
        return seq, length

    def _scan(self, seg: Segment, after: int) -> Iterator[tuple[int, Location, bytes]]:
        buf = memoryview(os.pread(seg.read_fd, os.fstat(seg.read_fd).st_size, 0))
        offset, last = 0, after
        while offset < len(buf):
            record = self._record_at(buf, offset, last)
            if record is None:
                resume = next((p for p in range(offset + 1, len(buf) - HEADER.size + 1)
                               if self._record_at(buf, p, last) is not None), None)
                if resume is None:
                    break  # nothing intact follows: a torn tail
                self._quarantine(seg, offset, buf[offset:resume])
                offset = resume
                continue
            seq, length = record
            yield seq, Location(seg.first_seq, offset + HEADER.size, length), bytes(
                buf[offset + HEADER.size:offset + HEADER.size + length])
            offset += HEADER.size + length
            last = seq
        seg.size, seg.last_seq = offset, max(last, seg.first_seq - 1)
        if offset < len(buf):
            log.warning("%s: invalid record at byte %d of %d (torn tail): truncating",
                        seg.path.name, offset, len(buf))
            os.truncate(seg.path, offset)
            fd = os.open(seg.path, os.O_WRONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _quarantine(self, seg: Segment, offset: int, damaged: memoryview) -> None:
        """Copies a damaged region aside; the intact records around it stay in the log."""
        qdir = self.dir / "quarantine"
        qdir.mkdir(exist_ok=True)
        target = qdir / f"{seg.path.stem}-at-{offset}.bin"
        atomic_write(target, bytes(damaged), mode=0o600)
        self.quarantined += 1
        log.error("%s: damaged record at byte %d (%d bytes): copied to %s and skipped; the "
                  "intact records after it are kept", seg.path.name, offset, len(damaged),
                  target)

    # -- appends ------------------------------------------------------------------------
    def _open_for_append(self, first_seq: int) -> None:
        if self._write_fd is not None:
            os.close(self._write_fd)
        self._write_fd = os.open(self.segments[first_seq].path, os.O_WRONLY | os.O_APPEND)
        self._write_seg = first_seq

    def _roll(self, first_seq: int) -> Segment:
        if self._write_fd is not None:
            if self.fsync != "never":
                os.fsync(self._write_fd)
            os.close(self._write_fd)
            self._write_fd = self._write_seg = None
        path = self.dir / f"seg-{first_seq:020d}.log"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        seg = Segment(path, first_seq, first_seq - 1, 0, os.open(path, os.O_RDONLY))
        self.segments[first_seq] = seg
        self._write_fd, self._write_seg = fd, first_seq
        if self.fsync != "never":
            fsync_dir(self.dir)
        return seg

    def append(self, first_seq: int, payloads: list[bytes]) -> list[Location]:
        """Writes records ``first_seq, first_seq+1, ...``; durable per the fsync policy.

        One ``writev`` per segment touched (headers and payloads as they are, no joined
        copy). All or nothing: on a failed write (:class:`StorageError`) nothing of it is
        kept (under ``always``, nothing that was not durable yet: see :meth:`wait_durable`).
        With ``fsync="always"`` the records are not durable on return: acknowledge them
        only once ``wait_durable`` of the last one has returned.
        """
        if payloads and first_seq <= self._written_seq:
            # a seq of a failed write may still be awaited (and must fail): never reuse one
            raise ValueError(f"first_seq: must be > {self._written_seq} (written before), "
                             f"got {first_seq!r}")
        for payload in payloads:
            if len(payload) >= MAX_RECORD_BYTES:
                raise ValueError(f"payload: must be < {MAX_RECORD_BYTES} bytes, "
                                 f"got {len(payload)!r}")
        # checksums before taking the I/O lock: the background fsync need not wait for them
        crcs = [_record_crc(first_seq + i, p) for i, p in enumerate(payloads)]
        locations = []
        with self._io_lock:
            active = self.active_segment
            before = (self.segments[active].size, self.segments[active].last_seq) if (
                active is not None) else None
            try:
                self._finish_cut()
                buffers: list[bytes] = []  # records for the segment _write_fd appends to
                for i, payload in enumerate(payloads):
                    seq = first_seq + i
                    seg = self.segments[max(self.segments)] if self.segments else None
                    if seg is None or (seg.size > 0 and seg.size >= self.segment_bytes):
                        if buffers:
                            assert self._write_fd is not None
                            writev_all(self._write_fd, buffers)
                            buffers = []
                        seg = self._roll(seq)
                    if seq <= seg.last_seq:
                        raise RuntimeError(f"seq {seq} does not follow {seg.last_seq}")
                    buffers += [HEADER.pack(len(payload), crcs[i], seq), payload]
                    locations.append(Location(seg.first_seq, seg.size + HEADER.size,
                                              len(payload)))
                    seg.size += HEADER.size + len(payload)
                    seg.last_seq = seq
                if buffers:
                    assert self._write_fd is not None
                    writev_all(self._write_fd, buffers)
            except OSError as e:
                if self.fsync == "always":
                    # a failed roll's fsync leaves earlier, unsynced records of other puts
                    # behind too: cut back to what is known durable and fail their waiters
                    self._written_seq = max(self._written_seq, first_seq + len(payloads) - 1)
                    self._cut_to_durable()
                else:
                    self._roll_back(active, before)
                raise StorageError(e.errno or errno.EIO, (
                    f"data_dir {str(self.dir)!r}: write failed ({e.strerror or e}); nothing of "
                    f"this put was stored, retry once the disk has room")) from e
            self._dirty = True
            if payloads:
                self._written_seq = first_seq + len(payloads) - 1
                self._to_sync.notify()
        return locations

    def wait_durable(self, seq: int) -> None:
        """Returns once record ``seq`` and every record before it are on the disk (at once
        unless ``fsync="always"``).

        :class:`StorageError` when a failed write or fsync cut ``seq`` from the log: the
        put that wrote it was not stored and must fail (its producer retries).
        """
        if self.fsync != "always":
            return
        with self._io_lock:
            while True:
                if any(after < seq <= upto for after, upto in self._lost):
                    raise StorageError(errno.EIO, (
                        f"data_dir {str(self.dir)!r}: flushing to the disk failed; nothing "
                        f"of this put was stored, retry once the disk is healthy"))
                if seq <= self._durable_seq:
                    return
                if not self._committing:
                    raise StorageError(errno.EIO, f"data_dir {str(self.dir)!r}: the log is "
                                                  f"closed; this put was not acknowledged")
                self._synced.wait()

    def _cut_to_durable(self) -> None:
        """Cuts the log back to its last durable record (lock held) and records the seqs
        above it as lost, so that every put waiting for one of them fails."""
        if self._written_seq > self._durable_seq:
            self._lost.append((self._durable_seq, self._written_seq))
            self._durable_seq = self._written_seq  # each seq up to here: durable or lost
        self._cuts += 1
        point = self._durable_point
        if point is not None and point[0] in self.segments:
            self._roll_back(point[0], point[1:])
        else:  # nothing durable yet, or its segment was consumed and deleted since
            self._roll_back(point[0] if point else None, None)
        self._synced.notify_all()

    def _roll_back(self, active: int | None, before: tuple[int, int] | None) -> None:
        """Forgets segments created by a failed append and cuts the old active one back."""
        for first in [k for k in self.segments if active is None or k > active]:
            seg = self.segments.pop(first)
            os.close(seg.read_fd)
            if self._write_seg == first and self._write_fd is not None:
                os.close(self._write_fd)
                self._write_fd = self._write_seg = None
            seg.path.unlink(missing_ok=True)
        if active is None or before is None:
            return
        seg = self.segments[active]
        seg.size, seg.last_seq = before
        self._cut_pending = True
        try:
            if self._write_seg != active:
                self._open_for_append(active)
            self._finish_cut()
        except OSError as e:  # retried before the next append
            log.error("%s: could not cut back a failed write yet: %s", seg.path.name, e)

    def _finish_cut(self) -> None:
        if not self._cut_pending:
            return
        assert self._write_fd is not None and self._write_seg is not None
        os.ftruncate(self._write_fd, self.segments[self._write_seg].size)
        if self.fsync != "never":
            os.fsync(self._write_fd)
        self._cut_pending = False

    def _commit_loop(self) -> None:
        """Group commit: fsyncs everything written so far, as long as anything is unsynced;
        puts written meanwhile wait for the next round, which covers them all."""
        try:
            self._commit_rounds()
        except Exception:  # e.g. no descriptor left to dup: say so, once, loudly
            log.exception("%s: the group-commit thread stopped; every put under "
                          "fsync=always fails until the server restarts", self.dir)
        finally:  # however it ends, no put may wait for it forever: they fail instead
            with self._io_lock:
                self._committing = False
                self._synced.notify_all()

    def _commit_rounds(self) -> None:
        while True:
            with self._io_lock:
                while self._written_seq <= self._durable_seq and not self._stop.is_set():
                    self._to_sync.wait()
                if self._written_seq <= self._durable_seq:
                    return  # stopped, and nothing is waiting
                # fsync a duplicate outside the lock (appends go on; a roll fsyncs and
                # closes the original, so the records before it are durable anyway)
                assert self._write_fd is not None and self._write_seg is not None
                seg = self.segments[self._write_seg]
                target, point = self._written_seq, (seg.first_seq, seg.size, seg.last_seq)
                cuts, fd = self._cuts, os.dup(self._write_fd)
            try:
                os.fsync(fd)
                failure = None
            except OSError as e:
                failure = e
            finally:
                os.close(fd)
            with self._io_lock:
                if cuts != self._cuts:
                    continue  # a cut-back meanwhile: what this round covered is gone anyway
                if failure is not None:
                    log.error("%s: fsync failed, the puts waiting for it fail: %s", self.dir,
                              failure)
                    self._cut_to_durable()
                elif target > self._durable_seq:
                    self._durable_seq, self._durable_point = target, point
                    self._synced.notify_all()

    def _sync_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            # fsync a duplicate of the descriptor outside the I/O lock: appends go on while
            # the disk flushes (a roll may close the original meanwhile; it fsyncs it first)
            with self._io_lock:
                if not self._dirty or self._write_fd is None:
                    continue
                fd, self._dirty = os.dup(self._write_fd), False
            try:
                os.fsync(fd)
            except OSError as e:  # dirty again: retried next interval
                with self._io_lock:
                    self._dirty = True
                log.error("%s: background fsync failed: %s", self.dir, e)
            finally:
                os.close(fd)

    # -- reads and garbage collection -----------------------------------------------------
    def read(self, loc: Location) -> bytes:
        return os.pread(self.segments[loc.segment].read_fd, loc.length, loc.offset)

    @property
    def active_segment(self) -> int | None:
        return max(self.segments) if self.segments else None

    @property
    def last_seq(self) -> int:
        """Largest seq in the log (0 when it holds no record)."""
        return max((s.last_seq for s in self.segments.values() if s.size), default=0)

    def delete(self, first_seqs: list[int]) -> None:
        """Drops (fully consumed, inactive) segments from the log now; their files are
        unlinked by a background thread (``close`` waits for it).

        An unlink of 64 MB takes ~30 ms on ext4 with online discard, so a GC of a step's
        segments would hold the lock (and the Ack) for a second. A crash before the unlink
        leaves consumed records only, which the next open deletes again.
        """
        if self.active_segment in first_seqs:
            raise ValueError("cannot delete the active segment")
        paths = []
        for first in first_seqs:
            seg = self.segments.pop(first)
            os.close(seg.read_fd)
            paths.append(seg.path)
        if paths:
            if self._deleter is None:
                self._deleter = threading.Thread(target=self._delete_loop, name="queue-gc",
                                                 daemon=True)
                self._deleter.start()
            self._doomed.put(paths)

    def _delete_loop(self) -> None:
        while (paths := self._doomed.get()) is not None:
            try:
                for path in paths:
                    path.unlink(missing_ok=True)
                if self.fsync != "never":
                    fsync_dir(self.dir)
            except OSError as e:  # the records are consumed: the next open deletes them
                log.error("%s: could not delete consumed segments: %s", self.dir, e)

    def bytes_on_disk(self) -> int:
        return sum(s.size for s in self.segments.values())

    def close(self) -> None:
        with self._io_lock:
            self._stop.set()
            self._to_sync.notify()
        if self._syncer is not None and self._syncer.is_alive():
            self._syncer.join()  # the commit thread first flushes what puts wait for
        if self._deleter is not None:
            self._doomed.put(None)
            self._deleter.join()
            self._deleter = None
        with self._io_lock:
            if self._write_fd is not None:
                if self.fsync != "never":
                    try:
                        os.fsync(self._write_fd)
                    except OSError as e:
                        log.error("%s: final fsync failed: %s", self.dir, e)
                os.close(self._write_fd)
                self._write_fd = self._write_seg = None
            for seg in self.segments.values():
                os.close(seg.read_fd)
            self.segments.clear()


@dataclasses.dataclass
class ConsumerState:
    """What the consumer has consumed; persisted atomically in ``state.json``.

    watermark: every seq <= watermark is consumed (acked or dropped as stale).
    done_above: consumed seqs > watermark (groups complete out of order).
    epoch: raised at every open (to at least the unix time), so cursors of an earlier
    server life never match new ones.
    """

    watermark: int = 0
    done_above: set[int] = dataclasses.field(default_factory=set)
    trainer_version: int = -1
    max_lag: int = -1
    batch_n: int = 0
    epoch: int = 0

    def mark_done(self, seq: int) -> None:
        if seq > self.watermark:
            self.done_above.add(seq)
        while self.watermark + 1 in self.done_above:
            self.watermark += 1
            self.done_above.remove(self.watermark)

    def is_done(self, seq: int) -> bool:
        return seq <= self.watermark or seq in self.done_above

    def save(self, path: Path, *, fsync: bool = True) -> None:
        body = {"format": 1, "watermark": self.watermark, "done_above": sorted(self.done_above),
                "trainer_version": self.trainer_version, "max_lag": self.max_lag,
                "batch_n": self.batch_n, "epoch": self.epoch}
        atomic_write(path, json.dumps(body).encode(), fsync=fsync, mode=0o600)

    @classmethod
    def load(cls, path: Path) -> ConsumerState:
        """The state in ``path``; :class:`DataDirError` when it is unreadable or damaged."""
        try:
            body = json.loads(path.read_text())
            state = cls(int(body["watermark"]), {int(s) for s in body["done_above"]},
                        int(body["trainer_version"]), int(body["max_lag"]),
                        int(body["batch_n"]), int(body.get("epoch", 0)))
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise DataDirError(f"{path}: consumer state is damaged ({type(e).__name__}: {e}); "
                               f"{RECOVERY}") from None
        if state.watermark < 0 or any(s <= state.watermark for s in state.done_above):
            raise DataDirError(f"{path}: consumer state is inconsistent (watermark "
                               f"{state.watermark!r}); {RECOVERY}")
        return state


RECOVERY = ("restore the file from a backup, or start the server once with "
            "--reset-consumer-state to deliver every record still in the log again")


class RetiredIds:
    """Trajectory ids of garbage-collected records, so late retries stay de-duplicated.

    Bounded: keeps the most recent ``window`` ids (the file is compacted at 2x window).
    """

    def __init__(self, path: Path, window: int = 1_000_000):
        self.path, self.window = path, window
        self.ids: dict[str, None] = {}  # insertion-ordered set
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    self.ids[json.loads(line)] = None
                except ValueError:
                    break  # torn last line
        self._lines = len(self.ids)
        self._trim()

    def __contains__(self, tid: str) -> bool:
        return tid in self.ids

    def add(self, ids: list[str]) -> None:
        if not ids:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(t) + "\n" for t in ids))
            f.flush()
            os.fsync(f.fileno())
        for t in ids:
            self.ids[t] = None
        self._lines += len(ids)
        self._trim()
        if self._lines > 2 * self.window:
            body = "".join(json.dumps(t) + "\n" for t in self.ids).encode()
            atomic_write(self.path, body, mode=0o600)
            self._lines = len(self.ids)

    def _trim(self) -> None:
        while len(self.ids) > self.window:
            del self.ids[next(iter(self.ids))]
