"""satjax.utils: the I/O helpers the durable stores rely on."""

import os
import platform
import signal

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


@pytest.mark.skipif(not platform.system() == "Linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_tied_child_gets_sigterm_when_its_parent_is_killed_9(tmp_path):
    """The parent runs a gRPC server (threads with at-fork hooks, as a rollout worker does)
    and starts a child through ``tied_to_this_process``; ``kill -9`` of the parent delivers
    SIGTERM to the child, which the child's handler records."""
    import subprocess
    import sys
    import textwrap
    import time

    marker = tmp_path / "child.txt"
    child_code = textwrap.dedent(f"""
        import pathlib, signal, sys, time
        def on_term(sig, frame):
            pathlib.Path({str(marker)!r}).write_text(f"signal {{sig}}")
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        pathlib.Path({str(marker)!r}).write_text("started")
        time.sleep(60)
    """)
    parent = tmp_path / "parent.py"
    parent.write_text(textwrap.dedent(f"""
        import subprocess, sys, time
        from concurrent import futures
        import grpc
        from satjax.utils import tied_to_this_process
        server = grpc.server(futures.ThreadPoolExecutor(2))
        server.add_insecure_port("127.0.0.1:0")
        server.start()
        child = subprocess.Popen(tied_to_this_process([sys.executable, "-c", {child_code!r}]),
                                 start_new_session=True)
        print(child.pid, flush=True)
        time.sleep(60)
    """))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, str(parent)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": repo})
    child = None
    try:
        child = int(proc.stdout.readline())
        deadline = time.monotonic() + 30
        while not marker.exists() or marker.read_text() != "started":
            assert time.monotonic() < deadline, "the tied child did not start"
            time.sleep(0.05)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 15
        while marker.read_text() == "started":
            assert time.monotonic() < deadline, "the tied child outlived its parent"
            time.sleep(0.05)
        assert marker.read_text() == f"signal {int(signal.SIGTERM)}"
    finally:
        proc.kill()
        if child is not None and os.path.exists(f"/proc/{child}"):
            os.kill(child, signal.SIGKILL)


def test_a_tied_child_exits_at_once_if_its_parent_is_already_gone():
    """The child checks its parent after ``prctl``: one already replaced (here: a pid that is
    not the parent) means the parent died before the tie took hold."""
    import subprocess
    import sys

    cmd = utils.tied_to_this_process([sys.executable, "-c", "print('ran')"])
    cmd[cmd.index(str(os.getpid()))] = "1"  # as if the parent had died and init adopted it
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 128 + signal.SIGTERM and "ran" not in out.stdout
