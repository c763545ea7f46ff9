"""Every benchmark and script runs from the repo root as the docs write it,
``python benchmarks/bench_memory.py ...``, without ``PYTHONPATH=.``: Python then puts the
script's own directory first on ``sys.path``, not the repo root, so a script that imports
``benchmarks.*`` must make the repo importable itself."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for d in ("benchmarks", "scripts") for p in (REPO / d).glob("*.py")
                 if "benchmarks." in p.read_text())


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_script_that_imports_benchmarks_makes_them_importable(path):
    # what `python <path>` does to sys.path, then the module body (not its main), then the
    # import its main would make
    code = (f"import runpy, sys; sys.path[0] = {str(path.parent)!r}; "
            f"runpy.run_path({str(path)!r}, run_name='not_main'); import benchmarks.machine")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
