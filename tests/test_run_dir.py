"""The run directory layout: one module names every path; one trainer holds a run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from satjax.run_dir import RunDirError, RunDirs, RunLock, parse_version_dir, version_dir
from satjax.weight_sync import WeightPublisher, WeightSubscriber, published_versions

REPO = Path(__file__).resolve().parents[1]


def test_layout(tmp_path):
    d = RunDirs(str(tmp_path))
    assert d.root == tmp_path
    assert d.config == tmp_path / "config.yaml"
    assert d.checkpoints == tmp_path / "checkpoints"
    assert d.weights == tmp_path / "weights"
    assert d.lock == tmp_path / "LOCK"
    assert d.config_digest == tmp_path / "config.sha256"
    assert d.queue == tmp_path / "queue"
    assert d.sft == tmp_path / "sft"
    assert d.metrics == tmp_path / "logs" / "metrics.jsonl"
    assert d.process_log("worker0") == tmp_path / "logs" / "worker0.log"
    assert d.vllm_logs("1") == tmp_path / "logs" / "vllm-1"
    assert d.version(12) == tmp_path / "weights" / "v00000012"


def test_version_names_round_trip_and_reject_others():
    assert version_dir("w", 7).name == "v00000007"
    assert parse_version_dir("v00000007") == 7
    for other in ("LATEST", "v", "vx1", ".v00000007-abc", "TARGET"):
        assert parse_version_dir(other) is None


def test_weight_sync_publishes_where_run_dirs_points(tmp_path):
    d = RunDirs(tmp_path)

    def write(p):  # returns nothing: publish hashes the file it finds
        (p / "w").write_text("x")

    WeightPublisher(d.weights).publish(3, write)
    assert (d.version(3) / "manifest.json").exists()
    assert WeightSubscriber(d.weights).checkpoint_dir(3) == d.version(3)
    assert published_versions(d.weights) == [3]
    assert published_versions(tmp_path / "missing") == []


def test_run_lock_is_released_by_kill_9(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from satjax.run_dir import RunLock; RunLock(sys.argv[1]); "
        "print('held', flush=True); time.sleep(60)"), str(tmp_path)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError, match=f"pid {holder.pid}, which holds LOCK"):
            RunLock(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    RunLock(tmp_path).release()  # the kernel dropped the dead holder's lock
