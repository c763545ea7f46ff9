"""2 processes x 4 CPU devices (jax.distributed, gloo) against 1 process x 8 devices.

Real processes, real collectives: the Trainer of each process runs the same jitted step on
one global 8-device mesh, with the batch only process 0 "read" broadcast to the other.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from satjax.utils import free_port

CHILD = Path(__file__).with_name("multiprocess_child.py")
REPO = Path(__file__).resolve().parents[2]


def start(pid: int, nproc: int, port: int, out: Path, mesh: str, mode: str,
          log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={8 // nproc}"}
    return subprocess.Popen([sys.executable, str(CHILD), str(pid), str(nproc), str(port),
                             str(out), mesh, mode], env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)


def run(nproc: int, out: Path, mesh: str, mode: str) -> None:
    port = free_port()
    procs = [start(i, nproc, port, out, mesh, mode, out / f"{mode}-{nproc}-{i}.log")
             for i in range(nproc)]
    try:
        for i, p in enumerate(procs):
            assert p.wait(timeout=300) == 0, (out / f"{mode}-{nproc}-{i}.log").read_text()[-3000:]
    finally:
        for p in procs:
            p.kill()


def load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def hf_tensors(version: Path) -> dict[str, bytes]:
    """Every tensor of a published version (its raw bytes), from the files its index names."""
    from safetensors.numpy import load_file

    index = json.loads((version / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for fname in sorted(set(index.values())):
        for name, value in load_file(version / fname).items():
            assert index[name] == fname
            out[name] = value.tobytes()
    assert out.keys() == index.keys()
    return out


def rebuilt_by_a_worker(weights: Path, version: int) -> None:
    """A built-in engine that follows the chain to ``version`` passes its canary."""
    from satjax.rollout.builtin_engine import BuiltinEngine
    from satjax.weight_sync import WeightSubscriber, check_canary

    sub = WeightSubscriber(weights)
    steps = sub.sync_plan(version, None)
    assert [s.is_delta for s in steps] == [False] + [True] * version
    assert all(len(s.manifest["files"]) > 1 for s in steps)
    engine = BuiltinEngine("float32")
    engine.load(steps[0].path, steps[0].version)
    engine.apply_deltas([s.path for s in steps[1:]], version)
    manifest = sub.manifest(version)
    check_canary(manifest, engine.canary_logprobs(manifest["canary"]["tokens"]),
                 atol=engine.canary_atol)


def files_written(out: Path, tag: str, nproc: int) -> list[list[str]]:
    return [json.loads((out / f"files-{tag}-{i}.json").read_text()) for i in range(nproc)]


@pytest.mark.slow
def test_two_processes_train_and_publish_like_one_and_their_checkpoint_restores_elsewhere(
        tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    run(2, two, "2,2,2,1", "train")  # data axis across the two processes
    run(1, one, "2,2,2,1", "train")
    # version 0 (the shared initial weights): the same tensors, byte for byte, whether one
    # process or two wrote it; with the data axis across processes each holds a replica
    # and writes about half the files, none twice
    ref = hf_tensors(one / "v0-1-2221")
    assert hf_tensors(two / "v0-2-2221") == ref
    mine = files_written(two, "2-2221", 2)
    index = json.loads((two / "v0-2-2221" / "model.safetensors.index.json").read_text())
    assert all(mine) and not set(mine[0]) & set(mine[1])
    assert set(mine[0]) | set(mine[1]) == set(index["weight_map"].values())
    # fsdp over the two processes: no process holds a whole tensor, so expert weights are
    # resharded to whole experts per process (each receives only its own) and the rest is
    # replicated before the write; still the same bytes
    fsdp = tmp_path / "fsdp"
    fsdp.mkdir()
    run(2, fsdp, "1,2,4,1", "publish")
    assert hf_tensors(fsdp / "v0-2-1241") == ref
    mine = files_written(fsdp, "2-1241", 2)
    assert all(mine) and not set(mine[0]) & set(mine[1])
    a, b = load(one / "params-train-1.npz"), load(two / "params-train-2.npz")
    init = load(two / "params-init-2.npz")
    assert a.keys() == b.keys() == init.keys() and len(a) > 10
    for k in a:  # fp32 reductions in another order: about one ulp apart
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert max(float(np.abs(b[k] - init[k]).max()) for k in b) > 1e-4  # it trained
    weights = two / "run" / "weights"
    # versions 1-3 are deltas of the version before, each process writing its own
    # tensors' deltas; the keyframe 0 stays while they need it
    assert sorted(p.name for p in weights.glob("v*")) == [f"v{v:08d}" for v in range(4)]
    assert (weights / "LATEST").read_text() == "3"
    rebuilt_by_a_worker(weights, 3)
    # the 2-process checkpoint, restored by one process on another mesh, is the same state
    run(1, two, "1,4,1,2", "restore")
    c = load(two / "params-restore-1.npz")
    for k in b:
        np.testing.assert_array_equal(c[k], b[k], err_msg=k)


@pytest.mark.parametrize("victim", [1, 0])
@pytest.mark.slow
def test_killing_one_process_stops_the_other(tmp_path, victim):
    port = free_port()
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    procs = [start(i, 2, port, tmp_path, "2,2,2,1", "wait", logs[i]) for i in range(2)]
    try:
        deadline = time.monotonic() + 120
        while not all("waiting" in f.read_text() for f in logs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [f.read_text()[-2000:] for f in logs]
            time.sleep(0.5)
        os.kill(procs[victim].pid, signal.SIGKILL)
        t0 = time.monotonic()
        survivor = procs[1 - victim]
        rc = survivor.wait(timeout=30)
        assert rc != 0
        print(f"survivor exited {rc} {time.monotonic() - t0:.1f} s after kill -9 of its peer")
    finally:
        for p in procs:
            p.kill()
