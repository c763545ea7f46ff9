"""satjax.utils: the I/O helpers the durable stores rely on."""

import os
import platform

import pytest

from satjax import utils


def test_writev_all_finishes_partial_writes_and_long_buffer_lists(tmp_path, monkeypatch):
    real_writev = os.writev
    calls = []

    def short_writev(fd, buffers):  # the kernel may write fewer bytes than asked
        calls.append(len(buffers))
        first = memoryview(buffers[0])[:7]
        return real_writev(fd, [first])

    monkeypatch.setattr(os, "writev", short_writev)
    monkeypatch.setattr(os, "sysconf", lambda name: 3)  # IOV_MAX of 3 buffers a call
    buffers = [bytes([i]) * (i * 5) for i in range(12)] + [memoryview(b"tail")]
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        utils.writev_all(fd, buffers)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(buffers)
    assert max(calls) <= 3 and len(calls) > len(buffers)


def test_retain_freed_memory_applies_on_glibc_only():
    assert utils.retain_freed_memory() == (platform.libc_ver()[0] == "glibc")


def test_code_commit_names_the_checkout_of_the_code_wherever_it_runs_from(tmp_path,
                                                                         monkeypatch):
    """A sweep's ``sessions.jsonl`` records the commit of the code it ran, read from the
    package's checkout even when the working directory is another repository."""
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    if not (repo / ".git").exists():
        pytest.skip("not a git checkout")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo,
                          capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    monkeypatch.chdir(tmp_path)  # a repository without a commit: git would fail here
    assert utils.code_commit() in (head, head + "+dirty")
