"""Small operating-system helpers shared across stages: durable file writes, free ports,
children that die with their parent."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Makes a rename or create inside ``path`` durable (POSIX needs the directory synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """``os.write`` until every byte is written (it may write fewer than asked)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def writev_all(fd: int, buffers: Sequence[bytes | memoryview]) -> None:
    """Writes ``buffers`` back to back with as few ``os.writev`` calls as the kernel allows
    (at most ``IOV_MAX`` buffers a call; a call may write fewer bytes than asked)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    iov_max = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
    i = 0
    while i < len(views):
        n = os.writev(fd, views[i:i + iov_max])
        while n:  # skip what was written; the rest of a partly written buffer goes next
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i], n = views[i][n:], 0


def name_file(error: OSError, path: str | os.PathLike[str]) -> None:
    """Makes ``error`` name ``path`` if it names no file (``os.write`` on a descriptor, say),
    so that a full disk's error says which disk."""
    if error.filename is None:
        error.filename = os.fspath(path)


def atomic_write(path: str | os.PathLike[str], data: bytes | str, *, fsync: bool = True,
                 mode: int = 0o644) -> None:
    """Replaces ``path`` by ``data`` so that a crash leaves either the old or the new file.

    Temp file + fsync + rename + directory fsync; without ``fsync`` the replacement is
    still atomic for a process crash (kill -9) but not for a power cut.
    """
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        write_all(fd, data)
        if fsync:
            os.fsync(fd)
    except OSError as e:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written file behind
        name_file(e, path)
        raise
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)


class LockHeldError(RuntimeError):
    """The lock file is held by another process (``holder``: the pid it wrote, or "?")."""

    def __init__(self, path: Path, holder: str):
        super().__init__(f"{path}: held by pid {holder}")
        self.path, self.holder = path, holder


class PidLock:
    """Exclusive ``flock`` on ``path`` (created), which then holds the owner's pid.

    The kernel drops the lock with the process (``kill -9`` included), so a lock file left
    behind never blocks a successor; the pid only names the holder in the refusal
    (:class:`LockHeldError`). The descriptor is not inherited by children (Python's
    default), so an orphaned child does not hold what its parent held.
    """

    def __init__(self, path: str | os.PathLike[str], mode: int = 0o644) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, mode)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise LockHeldError(self.path, holder) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = -1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the caller binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Asks the kernel to send ``sig`` to this process when the thread that started it
    exits, however it dies (``kill -9`` included). Linux only (``prctl(PR_SET_PDEATHSIG)``);
    elsewhere a no-op, and a lifeline pipe (``satjax/app/launch.py``) covers it."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")


# Run by the child's own interpreter, so nothing runs between fork and exec in the parent's
# image: a ``preexec_fn`` would make Python fork (not vfork) and run the parent's at-fork
# hooks in the child, and gRPC's (a rollout worker talks to its queue over gRPC) aborted a
# vLLM server at start (SIGABRT, "epoll_wait error: Bad file descriptor" in its log). It
# imports this module (standard library only) from the checkout it is given.
_TIED_EXEC = (
    "import os, sys\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "from satjax.utils import die_with_parent\n"
    "die_with_parent(int(sys.argv[2]))\n"
    "if os.getppid() != int(sys.argv[3]):\n"
    "    sys.exit(128 + int(sys.argv[2]))  # the parent died before the tie took hold\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[4:]])\n"
)


def tied_to_this_process(python_argv: Sequence[str], sig: int = signal.SIGTERM) -> list[str]:
    """The command line that runs ``python_argv`` (``[python, *args]``) with
    :func:`die_with_parent` ``(sig)`` in force, set by the child itself before it execs.

    Use it instead of ``Popen(..., preexec_fn=die_with_parent)`` in a process that runs
    threads with at-fork hooks (gRPC's): the interpreter ``python_argv[0]`` sets
    ``PR_SET_PDEATHSIG`` and then replaces itself with ``python_argv``.

    >>> cmd = tied_to_this_process([sys.executable, "-c", "print('hi')"])
    >>> import subprocess; subprocess.run(cmd, capture_output=True, text=True).stdout
    'hi\\n'
    """
    python, *args = python_argv
    package_root = str(Path(__file__).resolve().parents[1])
    return [python, "-c", _TIED_EXEC, package_root, str(int(sig)), str(os.getpid()), *args]


def retain_freed_memory(pad_bytes: int = 64 << 20, mmap_bytes: int = 32 << 20) -> bool:
    """Lets glibc's malloc reuse freed memory for large buffers: allocations below
    ``mmap_bytes`` come from the heap instead of a fresh ``mmap`` each (``M_MMAP_THRESHOLD``),
    and up to ``pad_bytes`` of freed memory stays mapped at the top of each arena instead of
    going back to the kernel at once (``M_TOP_PAD``).

    For processes that allocate and free buffers of megabytes many times a second (queue
    server, trainer, rollout workers): each fresh allocation would otherwise fault in and
    zero new pages, which costs more than the copy into them (measured on the 2-core dev
    VM: a 7.8 MB GetBatch reply 17 -> 8 ms on the server; decoding 16 trajectories with
    int32 routes, 2 MB each, median 57 -> 7 ms on the client). Process-wide, so only the
    ``satjax`` entry point calls it. Returns False (and does nothing) off glibc.
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    m_top_pad, m_mmap_threshold = -2, -3  # <malloc.h>
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(m_mmap_threshold, int(mmap_bytes))
                and libc.mallopt(m_top_pad, int(pad_bytes)))


def code_commit() -> str | None:
    """The commit of the satjax checkout this code runs from (``+dirty`` with uncommitted
    changes to tracked files); None for an installed wheel or without git. Asked of the
    package's own directory, not the working directory: a sweep run from elsewhere still
    records the code it ran."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, timeout=10, cwd=here).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, cwd=here
                               ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def versions_line(packages: tuple[str, ...]) -> str:
    """``versions: python 3.11.9, jax 0.10.2, ...; 2 CPUs, Linux x86_64``: what a figure
    ran on (``packages`` not installed are left out)."""
    import importlib.metadata

    found = {"python": platform.python_version()}
    for name in packages:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    pkgs = ", ".join(f"{k} {v}" for k, v in found.items())
    return f"versions: {pkgs}; {os.cpu_count()} CPUs, {platform.system()} {platform.machine()}"
