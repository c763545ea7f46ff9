"""Test session setup: every test runs on an emulated 8-device CPU mesh."""

import argparse
import importlib
import os
import shutil
import tempfile

import pytest

# Must happen before jax is imported anywhere in the test session.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The processes the tests start (satjax commands, rollout workers) share one persistent
# compile cache for the session: they compile the same tiny programs again and again, and
# a 4-step `satjax train` measured 102 s -> 30 s (60 -> 19 s of CPU) with the cache warm.
# Set after importing jax, which reads these variables when it is imported, so that this
# process itself keeps no cache (see _no_process_wide_compile_cache). A pytest-xdist
# worker inherits the variable from the controller: it takes the controller's directory
# (one cache for all workers) and unsets it until jax is imported.
_INHERITED_CACHE = os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
import jax  # noqa: E402

_COMPILE_CACHE = _INHERITED_CACHE or tempfile.mkdtemp(prefix="satjax-tests-compile-cache-")
os.environ.update(JAX_COMPILATION_CACHE_DIR=_COMPILE_CACHE,
                  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
assert jax.config.jax_compilation_cache_dir is None


def pytest_sessionfinish(session, exitstatus):
    if _INHERITED_CACHE is None:  # the process that made it removes it
        shutil.rmtree(_COMPILE_CACHE, ignore_errors=True)


class _Parsed(Exception):
    """Raised instead of parsing: carries the command's own parser and its argv."""


@pytest.fixture
def command_parser(monkeypatch):
    """``command_parser("train")`` -> the ArgumentParser ``satjax train`` builds, without
    running the command (its ``parse_args`` call hands the parser back instead)."""
    from satjax.app.cli import COMMANDS

    def get(name: str) -> argparse.ArgumentParser:
        def capture(self, args=None, namespace=None):
            raise _Parsed(self)

        module, func, _ = COMMANDS[name]
        with monkeypatch.context() as m:
            m.setattr(argparse.ArgumentParser, "parse_args", capture)
            with pytest.raises(_Parsed) as e:
                getattr(importlib.import_module(module), func)([])
        return e.value.args[0]

    return get


@pytest.fixture(autouse=True)
def _no_process_wide_compile_cache():
    """A test that points JAX's persistent compile cache somewhere leaves it set for every
    later test in this process (one such leak crashed CI writing a later test's executable
    there): fail the test that does it instead."""
    yield
    import sys

    if "jax" in sys.modules:
        import jax

        assert jax.config.jax_compilation_cache_dir is None, (
            "this test left JAX's compilation cache dir set; run such code in a subprocess")


@pytest.fixture
def mount_tmpfs():
    """``mount_tmpfs(path, "size=3m")`` mounts a tmpfs on the existing directory ``path``
    (mount options as ``mount -o`` takes them), unmounted after the test; skips the test
    where mounting needs rights it lacks (root or a user namespace)."""
    import subprocess

    mounted = []

    def mount(path, options: str):
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs ({options}; needs root): {r.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=False)
