"""A trainer's publisher, alone, for the kill -9 test (``tests/test_weight_kill9.py``):
``python tests/weight_publisher_proc.py SYNC_DIR FIRST_VERSION PHASES_LOG``.

Publishes versions FIRST_VERSION, FIRST_VERSION + 1, ... until it is killed, as
``satjax.train.publish`` does after a (re)start: ``discard_from(version)`` before each
publish, the first version full, then deltas up to every ``KEYFRAME_EVERY``-th, each with
``TARGET`` at ``version - LAG`` (exact-lag mode). Each step of a publish that a kill may
cut (the staged files written chunk by chunk, the rename, each pointer, each removal) is
appended to PHASES_LOG before it happens, and is drawn out a little on both sides, so
that kills land just before, inside and just after each of them.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from satjax.weight_sync import WeightPublisher, delta_file_name

KEYFRAME_EVERY = 4
LAG = 2
KEEP = LAG + 2  # the trainer's max(3, exact_lag + 2)
FILES = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
CHUNK, CHUNKS = 16 << 10, 4
STEP_S = 0.002  # how much longer each phase lasts


def main() -> None:
    sync_dir, first, log_path = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def phase(what: str) -> None:
        os.write(log_fd, f"{what}\n".encode())
        time.sleep(STEP_S)

    def slowed(name: str, fn):
        def wrapper(*args, **kwargs):
            phase(f"{name} {Path(args[0]).name}")
            try:
                return fn(*args, **kwargs)
            finally:  # so that a kill also lands just after it
                time.sleep(STEP_S)
        return wrapper

    # the publisher's own calls, each logged: os.replace renames the version and every
    # pointer's temp file (atomic_write), rmtree removes versions and staging
    os.replace = slowed("replace", os.replace)
    shutil.rmtree = slowed("rmtree", shutil.rmtree)

    publisher = WeightPublisher(sync_dir, keep=KEEP)
    prev: int | None = None
    deltas = 0
    version = first
    while True:
        base = prev if prev is not None and deltas + 1 < KEYFRAME_EVERY else None

        def write(d: Path, version: int = version, base: int | None = base) -> None:
            for name in FILES:
                name = name if base is None else delta_file_name(name)
                with open(d / name, "wb") as f:
                    for i in range(CHUNKS):
                        phase(f"write v{version} {name} {i}")
                        f.write(os.urandom(CHUNK))
                        f.flush()

        phase(f"discard_from v{version}")
        publisher.discard_from(version)
        phase(f"publish v{version} {'full' if base is None else f'delta of v{base}'}")
        publisher.publish(version, write, base=base, target_version=max(0, version - LAG),
                          canary={"tokens": [1], "logprobs": [-1.0]})
        phase(f"published v{version}")
        deltas = 0 if base is None else deltas + 1
        prev, version = version, version + 1


if __name__ == "__main__":
    main()
