"""Starting and stopping the run's helper processes (queue server, rollout workers).

Children are real processes (``python -m satjax ...``). A :class:`ProcessGroup`
stops them in reverse order on exit: SIGTERM first, so a worker puts the group it is
finishing and the queue server flushes its log, then SIGKILL after a grace period.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)


def new_token() -> str:
    """A random bearer token for a queue server this run starts."""
    return secrets.token_urlsafe(24)


class ProcessGroup:
    """Owns child processes; ``close()`` (or leaving the ``with``) stops them all."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []

    def start(
        self, name: str, args: Sequence[str], *, log_file: str | os.PathLike[str],
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen:
        """Runs ``python -m satjax *args``; output is appended to ``log_file``."""
        log_file = Path(log_file)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, **(env or {})}
        # Children must not inherit the emulated multi-device flag meant for the trainer.
        full_env.pop("XLA_FLAGS", None)
        out = open(log_file, "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(
            [sys.executable, "-m", "satjax", *args],
            stdout=out, stderr=subprocess.STDOUT, env=full_env,
            start_new_session=True,  # Ctrl-C goes to the trainer, which stops us in order
        )
        out.close()
        self.procs.append((name, proc, log_file))
        log.info("started %s (pid %d)", name, proc.pid)
        return proc

    def check_alive(self) -> None:
        """Raises if a child died: a crashed worker must not look like a slow one."""
        for name, proc, log_file in self.procs:
            rc = proc.poll()
            if rc is not None:
                tail = log_file.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with code {rc}; last log lines:\n{tail}")

    def close(self, grace: float = 20.0) -> None:
        for name, proc, _ in reversed(self.procs):
            _terminate(name, proc, grace)
        self.procs.clear()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _terminate(name: str, proc: subprocess.Popen, grace: float) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.poll() is None:
        log.warning("%s did not stop within %.0fs; killing", name, grace)
        proc.kill()
        proc.wait()
