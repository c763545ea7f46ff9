"""Durable storage of the trajectory queue: an append-only segment log plus consumer state.

Layout of ``data_dir``::

    seg-<first seq, 20 digits>.log   records: u32 length | u32 crc32 | u64 seq | payload
    state.json                       consumer state (watermark, acks above it, versions),
                                     replaced atomically (temp + fsync + rename + dir fsync)
    retired_ids.jsonl                ids of garbage-collected records (de-duplication memory)

``length`` counts the payload, ``crc32`` covers seq and payload. A record whose header or
checksum does not verify ends its segment: after ``kill -9`` that is a torn tail, which is
truncated away on open. Records are written before the Put that carried them replies; the
fsync policy decides when they reach the disk (see docs/queue.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

from satjax.utils import atomic_write, fsync_dir, write_all

log = logging.getLogger(__name__)

HEADER = struct.Struct("<IIQ")  # payload length, crc32(seq + payload), seq
SEQ = struct.Struct("<Q")
FSYNC_POLICIES = ("always", "batch", "never")
MAX_RECORD_BYTES = 1 << 31


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


class SegmentLog:
    """Append-only, CRC-checked, rolled segment files. Not thread-safe: callers lock."""

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
        self._write_fd: int | None = None
        self._dirty = False
        self._io_lock = threading.Lock()  # serialises the background fsync with appends
        self._stop = threading.Event()
        self._syncer: threading.Thread | None = None
        if fsync == "batch":
            self._syncer = threading.Thread(target=self._sync_loop, args=(batch_interval_s,),
                                            name="queue-fsync", daemon=True)

    # -- opening and replay ---------------------------------------------------------------
    def replay(self) -> Iterator[tuple[int, Location, bytes]]:
        """Yields (seq, location, payload) of every valid record; truncates torn tails.

        Must be consumed fully before appending; opens the last segment for appends.
        """
        paths = sorted(self.dir.glob("seg-*.log"))
        for path in paths:
            first = int(path.stem.split("-")[1])
            seg = Segment(path, first, first - 1, 0, os.open(path, os.O_RDONLY))
            self.segments[first] = seg
            yield from self._scan(seg)
        if self.segments:
            last = self.segments[max(self.segments)]
            self._write_fd = os.open(last.path, os.O_WRONLY | os.O_APPEND)
        if self._syncer is not None:
            self._syncer.start()

    def _scan(self, seg: Segment) -> Iterator[tuple[int, Location, bytes]]:
        file_size = os.fstat(seg.read_fd).st_size
        offset = 0
        expected = seg.first_seq
        while offset < file_size:
            header = os.pread(seg.read_fd, HEADER.size, offset)
            if len(header) < HEADER.size:
                break
            length, crc, seq = HEADER.unpack(header)
            if seq != expected or offset + HEADER.size + length > file_size:
                break
            payload = os.pread(seg.read_fd, length, offset + HEADER.size)
            if len(payload) != length or zlib.crc32(payload, zlib.crc32(SEQ.pack(seq))) != crc:
                break
            yield seq, Location(seg.first_seq, offset + HEADER.size, length), payload
            offset += HEADER.size + length
            expected += 1
        seg.size, seg.last_seq = offset, expected - 1
        if offset < file_size:
            log.warning("%s: invalid record at byte %d of %d (torn tail): truncating",
                        seg.path.name, offset, file_size)
            os.truncate(seg.path, offset)
            fd = os.open(seg.path, os.O_WRONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    # -- appends ------------------------------------------------------------------------
    def _roll(self, first_seq: int) -> Segment:
        if self._write_fd is not None:
            if self.fsync != "never":
                os.fsync(self._write_fd)
            os.close(self._write_fd)
        path = self.dir / f"seg-{first_seq:020d}.log"
        self._write_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        if self.fsync != "never":
            fsync_dir(self.dir)
        seg = Segment(path, first_seq, first_seq - 1, 0, os.open(path, os.O_RDONLY))
        self.segments[first_seq] = seg
        return seg

    def append(self, first_seq: int, payloads: list[bytes]) -> list[Location]:
        """Writes records ``first_seq, first_seq+1, ...``; durable per the fsync policy."""
        locations = []
        with self._io_lock:
            for i, payload in enumerate(payloads):
                if len(payload) >= MAX_RECORD_BYTES:
                    raise ValueError(f"payload: must be < {MAX_RECORD_BYTES} bytes, "
                                     f"got {len(payload)!r}")
                seq = first_seq + i
                seg = self.segments[max(self.segments)] if self.segments else None
                if seg is None or (seg.size > 0 and seg.size >= self.segment_bytes):
                    seg = self._roll(seq)
                if seq != seg.last_seq + 1:
                    raise RuntimeError(f"seq {seq} does not follow {seg.last_seq}")
                crc = zlib.crc32(payload, zlib.crc32(SEQ.pack(seq)))
                assert self._write_fd is not None
                write_all(self._write_fd, HEADER.pack(len(payload), crc, seq))
                write_all(self._write_fd, payload)
                locations.append(Location(seg.first_seq, seg.size + HEADER.size, len(payload)))
                seg.size += HEADER.size + len(payload)
                seg.last_seq = seq
            if self.fsync == "always" and self._write_fd is not None:
                os.fsync(self._write_fd)
            self._dirty = True
        return locations

    def _sync_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            with self._io_lock:
                if self._dirty and self._write_fd is not None:
                    os.fsync(self._write_fd)
                    self._dirty = False

    # -- reads and garbage collection -----------------------------------------------------
    def read(self, loc: Location) -> bytes:
        return os.pread(self.segments[loc.segment].read_fd, loc.length, loc.offset)

    @property
    def active_segment(self) -> int | None:
        return max(self.segments) if self.segments else None

    def delete(self, first_seq: int) -> None:
        """Removes a (fully consumed, inactive) segment."""
        if first_seq == self.active_segment:
            raise ValueError("cannot delete the active segment")
        seg = self.segments.pop(first_seq)
        os.close(seg.read_fd)
        seg.path.unlink()
        if self.fsync != "never":
            fsync_dir(self.dir)

    def bytes_on_disk(self) -> int:
        return sum(s.size for s in self.segments.values())

    def close(self) -> None:
        self._stop.set()
        if self._syncer is not None and self._syncer.is_alive():
            self._syncer.join()
        with self._io_lock:
            if self._write_fd is not None:
                if self.fsync != "never":
                    os.fsync(self._write_fd)
                os.close(self._write_fd)
                self._write_fd = None
            for seg in self.segments.values():
                os.close(seg.read_fd)
            self.segments.clear()


@dataclasses.dataclass
class ConsumerState:
    """What the consumer has consumed; persisted atomically in ``state.json``.

    watermark: every seq <= watermark is consumed (acked or dropped as stale).
    done_above: consumed seqs > watermark (groups complete out of order).
    """

    watermark: int = 0
    done_above: set[int] = dataclasses.field(default_factory=set)
    trainer_version: int = -1
    max_lag: int = -1
    batch_n: int = 0

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
                "batch_n": self.batch_n}
        atomic_write(path, json.dumps(body).encode(), fsync=fsync, mode=0o600)

    @classmethod
    def load(cls, path: Path) -> ConsumerState:
        if not path.exists():
            return cls()
        body = json.loads(path.read_text())
        return cls(int(body["watermark"]), set(body["done_above"]), int(body["trainer_version"]),
                   int(body["max_lag"]), int(body["batch_n"]))


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
