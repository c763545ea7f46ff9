"""Small operating-system helpers shared across stages: durable file writes, free ports,
children that die with their parent."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
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
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)


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
