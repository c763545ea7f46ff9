"""scripts/device_check.sh, built and run on CPU (its accelerator run needs a lent GPU):
the real script in a real process, on the tiny config."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_device_check_trains_and_prints_the_estimate_beside_the_device_peak():
    env = {**os.environ, "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # one CPU device, as one GPU
    out = subprocess.run(
        ["bash", str(REPO / "scripts/device_check.sh"), "--config", "configs/tiny.yaml",
         "--seq-len", "256", "--steps", "2", "--set", "train.remat=full"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "model 2 of 4 layers; 256 tokens per device" in text
    losses = [float(x) for x in re.findall(r"^step \d: [0-9.]+ s \(loss ([-0-9.e]+)", text, re.M)]
    assert len(losses) == 2 and losses[0] != losses[1]  # two real optimizer steps
    assert "device peak: n/a (cpu reports no memory_stats)" in text
    estimate = re.search(r"^CPU estimate \(bench_memory.py, same step\): ([0-9.]+) GiB", text,
                         re.M)
    assert estimate and float(estimate.group(1)) > 0
