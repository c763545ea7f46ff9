"""``kill -9`` of a publisher in the middle of a publish, then a resumed one, over and over,
while a reader polls ``LATEST`` and ``TARGET`` every 10 ms: a pointer never names a version
that is missing, partial, damaged or whose chain of bases is gone."""

from __future__ import annotations

import collections
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from satjax.weight_sync import (
    WeightSubscriber,
    WeightSyncError,
    published_versions,
    verify_files,
    version_complete,
)

HELPER = Path(__file__).with_name("weight_publisher_proc.py")
POLL_S = 0.01
POINTERS = ("LATEST", "TARGET")
# where each round's kill is aimed (a prefix of the helper's phase lines), in turn: a file
# being staged, the manifest's rename, the version's rename into place, each pointer's
# replacement, a version's removal (retention, or a resumed run's discard: its directory
# removed, or renamed away then removed)
TARGETS = (("write ",), ("replace manifest.json",), ("replace .v",), ("replace LATEST",),
           ("replace TARGET",), ("rmtree v", "replace v", "rmtree .v"))
ROUNDS = 30
PHASE_WAIT_S = 20.0
# how far back a resumed run starts: its checkpoint may be older than what it published
RESUME_BACK = (0, 1, 2, 3, 6, 9)


def unreadable(sync: Path, version: int) -> str | None:
    """Why a worker could not serve ``version`` (None: it could): a version of its chain
    missing or partial, a file failing its size or checksum, a base gone."""
    try:
        for p in WeightSubscriber(sync).chain(version):
            if not version_complete(p.path, p.manifest):
                return f"version {p.version} is partial"
            verify_files(p)
    except (WeightSyncError, OSError) as e:
        return str(e)
    return None


def _pointer(sync: Path, name: str) -> int | None:
    try:
        return int((sync / name).read_text())
    except (FileNotFoundError, ValueError):
        return None


class Reader(threading.Thread):
    """A worker's view: every 10 ms, each pointer and the version it names. A version that
    cannot be read counts when the pointer still names it afterwards (else the publisher
    moved on and removed an old version, as it may)."""

    def __init__(self, sync: Path):
        super().__init__(daemon=True)
        self.sync, self.stop = sync, threading.Event()
        self.reads = 0
        self.bad: list[tuple[str, int, str]] = []

    def run(self) -> None:
        while not self.stop.wait(POLL_S):
            for name in POINTERS:
                v = _pointer(self.sync, name)
                if v is None:
                    continue
                self.reads += 1
                why = unreadable(self.sync, v)
                if why is not None and _pointer(self.sync, name) == v:
                    self.bad.append((name, v, why))


def _lines(path: Path, start: int) -> list[str]:
    try:
        return path.read_text().splitlines()[start:]
    except FileNotFoundError:
        return []


def _phase(line: str) -> str:
    """The kind of a phase line: ``replace .v00000012-<tag>.staging`` -> ``replace
    .vN.staging``."""
    words = line.split(" ")[:2]
    return re.sub(r"\d+", "N", re.sub(r"-[0-9a-f]{32}", "", " ".join(words)))


def test_kill9_while_publishing_never_leaves_a_pointer_to_an_unreadable_version(tmp_path):
    sync, log = tmp_path / "weights", tmp_path / "phases.log"
    sync.mkdir()
    rng = random.Random(41)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HELPER.parents[1]), os.environ.get("PYTHONPATH", "")])}
    reader = Reader(sync)
    reader.start()
    killed_at: collections.Counter[str] = collections.Counter()
    after_kill: list[tuple[int, str, int, str]] = []  # (round, pointer, version, why)
    first, seen, published = 0, 0, 0
    try:
        for r in range(ROUNDS + 1):
            target = TARGETS[r % len(TARGETS)]
            err = tmp_path / f"publisher-{r}.err"
            with open(err, "wb") as f:
                proc = subprocess.Popen([sys.executable, str(HELPER), str(sync), str(first),
                                         str(log)], env=env, stderr=f)
            try:
                deadline = time.monotonic() + PHASE_WAIT_S
                # a few versions first, so that deltas, retention and resumes far back
                # all happen; the last round: a resumed publisher goes on publishing
                skip = rng.randint(0, 5) if r < ROUNDS else 3
                hit = None
                while hit is None and time.monotonic() < deadline and proc.poll() is None:
                    for line in _lines(log, seen):
                        seen += 1
                        if line.startswith("published"):
                            published += 1
                            skip -= 1
                        elif skip <= 0 and r < ROUNDS and line.startswith(target):
                            hit = line
                            break
                    if skip <= 0 and r == ROUNDS:
                        hit = "published"
                    time.sleep(0.0005)
                assert proc.poll() is None, (f"round {r}: the publisher (from version {first}) "
                                             f"exited {proc.returncode}: "
                                             f"{err.read_text()[-1500:]}")
                assert hit is not None, f"round {r}: no {target!r} in {PHASE_WAIT_S}s"
                time.sleep(rng.uniform(0.0, 0.004))  # before, inside or after it
            finally:
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
            killed_at[_phase(_lines(log, 0)[-1])] += 1  # the phase the kill cut
            for name in POINTERS:
                v = _pointer(sync, name)
                why = None if v is None else unreadable(sync, v)
                if why is not None:
                    after_kill.append((r, name, v, why))
            latest = _pointer(sync, "LATEST")
            first = max(0, (latest if latest is not None else -1) + 1 - rng.choice(RESUME_BACK))
            seen = len(_lines(log, 0))
    finally:
        reader.stop.set()
        reader.join()
    print(f"kills by phase: {dict(sorted(killed_at.items()))}; {published} versions "
          f"published; reader: {reader.reads} pointer reads, {len(reader.bad)} unreadable; "
          f"after a kill: {len(after_kill)} unreadable; left: {published_versions(sync)}")
    assert not after_kill, after_kill[:5]
    assert not reader.bad, reader.bad[:5]
    assert reader.reads > 100
    assert published > ROUNDS
