"""Starting and stopping the run's helper processes (queue server, rollout workers).

Children are real processes (``python -m satjax ...``). A :class:`ProcessGroup`
stops them in reverse order on exit: SIGTERM first, so a worker puts the group it is
finishing and the queue server flushes its log, then SIGKILL after a grace period.

Children die with the trainer however it dies (``kill -9``, the OOM killer): each one
asks the kernel for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``) and
watches a lifeline, the read end of a pipe whose only write end the parent holds: the
kernel closes it when the parent dies, the child reads EOF and stops as on SIGTERM
(:func:`follow_parent`, called by ``python -m satjax`` at start). Either alone would do
on Linux; the lifeline also covers a parent that died before the child set its signal,
and platforms without ``prctl``.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from satjax.utils import die_with_parent

log = logging.getLogger(__name__)

LIFELINE_ENV = "SATJAX_LIFELINE_FD"  # the inherited read end of the parent's lifeline pipe
# After its parent died a child stops as on SIGTERM; past this it exits at once.
ORPHAN_EXIT_S = 20.0


def new_token() -> str:
    """A random bearer token for a queue server this run starts."""
    return secrets.token_urlsafe(24)


def follow_parent() -> None:
    """In a child started by :class:`ProcessGroup`: die with the parent (see the module
    docstring). Without the lifeline variable (a process started by hand) it does nothing."""
    fd = os.environ.pop(LIFELINE_ENV, None)  # not for our own children: they get their own
    if fd is None:
        return
    die_with_parent(signal.SIGTERM)

    def watch() -> None:
        while os.read(int(fd), 1):  # nothing is ever written: returns b"" at EOF only
            pass
        log.warning("parent process died: shutting down")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(ORPHAN_EXIT_S)
        log.error("still running %.0fs after the parent died: exiting", ORPHAN_EXIT_S)
        os._exit(1)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def log_tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a child's log (what a person needs to see why it died)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return f"(no log at {path})"
    return f"--- last {min(lines, len(text))} lines of {path}:\n" + "\n".join(text[-lines:])


class ChildExitedError(RuntimeError):
    """A child process exited while the run needed it."""

    def __init__(self, name: str, returncode: int, log_file: Path):
        tail = log_tail(log_file)
        super().__init__(f"{name} exited with code {returncode}\n{tail}")
        self.name, self.returncode = name, returncode
        # what a child that stops on purpose writes last: why (e.g. a reward that timed out)
        self.last_line = next((line for line in reversed(tail.splitlines()[1:])
                               if line.strip()), "")


class ProcessGroup:
    """Owns child processes; ``close()`` (or leaving the ``with``) stops them all.

    Start children from the thread that lives as long as the group (the main thread):
    the kernel's parent-death signal follows the thread that started a child.
    """

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []
        self._lifeline_r, self._lifeline_w = os.pipe()  # not inheritable: only _r is passed

    def start(
        self, name: str, args: Sequence[str], *, log_file: str | os.PathLike[str],
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen:
        """Runs ``python -m satjax *args``; output is appended to ``log_file``."""
        log_file = Path(log_file)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, **(env or {}), LIFELINE_ENV: str(self._lifeline_r)}
        # Children must not inherit the emulated multi-device flag meant for the trainer.
        full_env.pop("XLA_FLAGS", None)
        with open(log_file, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "satjax", *args],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env,
                pass_fds=(self._lifeline_r,),
                start_new_session=True,  # Ctrl-C goes to the trainer, which stops us in order
            )
        self.procs.append((name, proc, log_file))
        log.info("started %s (pid %d)", name, proc.pid)
        return proc

    def start_until_ready(
        self, name: str, args: Sequence[str], *, log_file: str | os.PathLike[str],
        ready: Callable[[], bool], timeout: float, retry_codes: tuple[int, ...] = (),
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen:
        """Starts ``name`` and polls ``ready()`` until it is true. A child that exits first
        is reported at once (:class:`ChildExitedError`, with its log's last lines), unless
        its exit code is in ``retry_codes``: then it is started again until ``timeout``
        (a queue server whose data directory a dying orphan still holds, for instance)."""
        deadline = time.monotonic() + timeout
        proc = self.start(name, args, log_file=log_file, env=env)
        while not ready():
            rc = proc.poll()
            if rc is not None:
                if rc not in retry_codes or time.monotonic() > deadline:
                    raise ChildExitedError(name, rc, Path(log_file))
                log.warning("%s exited with code %d at start; retrying", name, rc)
                self.procs.remove((name, proc, Path(log_file)))
                time.sleep(0.5)
                proc = self.start(name, args, log_file=log_file, env=env)
            elif time.monotonic() > deadline:
                raise TimeoutError(f"{name}: not ready after {timeout:.0f}s\n"
                                   f"{log_tail(Path(log_file))}")
        return proc

    def check_alive(self) -> None:
        """Raises :class:`ChildExitedError` if a child died: a crashed worker must not
        look like a slow one."""
        for name, proc, log_file in self.procs:
            rc = proc.poll()
            if rc is not None:
                raise ChildExitedError(name, rc, log_file)

    def close(self, grace: float = 20.0) -> None:
        for name, proc, _ in reversed(self.procs):
            _terminate(name, proc, grace)
        self.procs.clear()
        for fd in (self._lifeline_r, self._lifeline_w):
            if fd >= 0:
                os.close(fd)
        self._lifeline_r = self._lifeline_w = -1

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
