"""Fixtures for the app tests: the ``satjax`` command as a real subprocess."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def satjax_env():
    """The environment a user's shell gives ``satjax``: this checkout, one CPU device."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user's laptop
    env.pop("SATJAX_VLLM_PYTHON", None)
    return env


@pytest.fixture
def satjax_cli(satjax_env):
    """Runs ``python -m satjax *args`` in the repository root and returns the
    CompletedProcess with text stdout/stderr."""

    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "satjax", *args], env=satjax_env,
                              cwd=REPO, capture_output=True, text=True, timeout=timeout)

    return run
