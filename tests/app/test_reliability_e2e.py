"""``satjax train`` killed with ``kill -9`` (its children must follow), resumed (nothing
lost, one metrics record per step), then preempted with SIGTERM (a checkpoint of the step
it reached); stopped with the next batch prefetched, then resumed: the same batches in
the same order as a run that never stopped. Real processes, loopback only; takes minutes."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from satjax.app.factory import build_tokenizer, model_config
from satjax.config import load_config
from satjax.queue.client import QueueClient
from satjax.queue.server import QueueServer
from satjax.trajectory import Trajectory

REPO = Path(__file__).resolve().parents[2]
TOKEN = "e2e-secret-token-do-not-store-0123"


def _train(run_dir, *extra):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "satjax", "train", "--config", str(REPO / "configs/tiny.yaml"),
           "--no-progress", "--set", f"run_dir={run_dir}", "--set", "sft.steps=5",
           "--set", "checkpoint.every=2", "--set", "rollout.prompts_per_step=2",
           "--set", "rollout.group_size=4", "--set", f"queue.token={TOKEN}",
           "--set", "train.steps=500", *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)


def _steps(run_dir):
    path = Path(run_dir) / "logs" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.endswith("}")]


def _wait_steps(proc, run_dir, n, timeout=600):
    deadline = time.monotonic() + timeout
    while len(_steps(run_dir)) < n:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.5)


def _checkpoints(run_dir):
    return sorted(int(p.name) for p in (Path(run_dir) / "checkpoints").iterdir()
                  if p.name.isdigit())


def _children(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid):
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_kill9_then_resume_then_sigterm(tmp_path):
    run_dir = tmp_path / "run"
    proc = _train(run_dir)
    _wait_steps(proc, run_dir, 3)
    children = _children(proc.pid)
    assert len(children) == 2  # queue server and one worker
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    deadline = time.monotonic() + 30
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(c) for c in children), "a child outlived the trainer's kill -9"
    restored = _checkpoints(run_dir)[-1]
    assert restored >= 2

    # --resume: a fresh queue server on the same data directory; the re-run steps replace
    # their old metrics lines
    proc = _train(run_dir, "--resume")
    _wait_steps(proc, run_dir, restored + 3)
    children = _children(proc.pid)
    proc.send_signal(signal.SIGTERM)  # a preemption: checkpoint, then exit
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]  # interrupted, after the clean checkpoint
    assert out.strip().splitlines()[-1].endswith("--resume")  # says how to continue
    steps = _steps(run_dir)
    assert steps == list(range(1, len(steps) + 1)), steps  # one record per step
    assert _checkpoints(run_dir)[-1] == steps[-1]  # the step it reached is checkpointed
    assert not any(_alive(c) for c in children)
    queue_log = (run_dir / "logs" / "queue.log").read_text()
    assert "does not follow" not in queue_log and "Traceback" not in queue_log, queue_log[-3000:]

    # the secret is nowhere in clear in the run directory's text files
    for path in [run_dir / "config.yaml", *(run_dir / "logs").glob("*.log")]:
        assert TOKEN not in path.read_text(errors="replace"), path


def _metrics(run_dir):
    path = Path(run_dir) / "logs" / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


GROUP, PROMPTS = 4, 2  # the _train settings: a batch is 2 groups of 4


def _batches(steps):
    """Batch v (trained at version v) sampled by version v, rewards v + 0.25 i; before it
    (from v = 1) a decoy of the same size sampled by version v - 1, which is stale under
    max_lag 0 for the step that trains batch v, but fresh at version v - 1: a batch fetched
    for the wrong version would be the decoy."""
    mc = model_config(load_config(REPO / "configs/tiny.yaml"), build_tokenizer(
        load_config(REPO / "configs/tiny.yaml")))
    layers, k = len(mc.moe_layer_indices), mc.num_experts_per_tok
    rng = np.random.default_rng(0)

    def group(name, version, rewards):
        return [Trajectory(
            trajectory_id=f"{name}-{i}", group_id=name, prompt_id=f"p-{name}",
            prompt_tokens=rng.integers(3, mc.vocab_size, 6, dtype=np.int32),
            response_tokens=rng.integers(3, mc.vocab_size, 3, dtype=np.int32),
            behavior_logprobs=-rng.random(3, dtype=np.float32) - 1.0, policy_version=version,
            reward=float(r), group_size=GROUP,
            routed_experts=rng.integers(0, mc.num_experts, (8, layers, k), dtype=np.int32))
            for i, r in enumerate(rewards)]

    out, means = [], []
    for v in range(steps + 1):
        if v:
            out += [t for g in range(PROMPTS) for t in group(f"decoy{v}-{g}", v - 1, [0.0] * GROUP)]
        rewards = [v + 0.25 * i for i in range(GROUP)]
        out += [t for g in range(PROMPTS) for t in group(f"batch{v}-{g}", v, rewards)]
        means.append(float(np.mean(np.asarray(rewards, np.float32))))
    return out, means


@pytest.mark.slow
def test_stop_with_the_next_batch_prefetched_then_resume_trains_the_same_batches(tmp_path):
    steps = 30
    data, reward_means = _batches(steps)
    runs = {}
    for name in ("straight", "stopped"):
        server = QueueServer(tmp_path / f"q-{name}", TOKEN)
        port = server.start(0)
        client = QueueClient(f"127.0.0.1:{port}", token=TOKEN)
        client.put(data, strict=True)
        run_dir = tmp_path / name
        extra = ("--set", f"queue.address=127.0.0.1:{port}", "--set", "rollout.num_workers=0",
                 "--set", "train.max_lag=0", "--set", "sft.steps=0",
                 "--set", f"train.steps={steps}")
        proc = _train(run_dir, *extra)
        if name == "stopped":
            _wait_steps(proc, run_dir, 2)
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=600)
        stats = client.stats()
        if name == "stopped":
            assert proc.returncode == 130, err[-3000:]
            stopped_at = _steps(run_dir)[-1]
            assert 2 <= stopped_at < steps and _checkpoints(run_dir)[-1] == stopped_at
            # the checkpoint's batches are acknowledged; the next one was fetched while the
            # last step ran, and is not
            assert stats["acked_total"] == 8 * stopped_at and stats["delivered_unacked"] == 8
            proc = _train(run_dir, "--resume", *extra)
            out, err = proc.communicate(timeout=600)
            stats = client.stats()
        assert proc.returncode == 0, err[-3000:]
        # nothing fetched beyond the last step
        assert stats["acked_total"] == 8 * steps and stats["delivered_unacked"] == 0, stats
        runs[name] = _metrics(run_dir)
        client.close()
        server.stop(1.0)
    for name, rows in runs.items():
        assert [r["step"] for r in rows] == list(range(1, steps + 1)), name
        # batch v at step v + 1, each at the version that sampled it: never a decoy
        np.testing.assert_allclose([r["reward_mean"] for r in rows], reward_means[:steps],
                                   rtol=1e-6, err_msg=name)
        assert all(r["lag_max"] == 0 for r in rows), name
        assert all(r["time/wait_data_s"] >= 0 and r["time/step_s"] > 0 for r in rows)
    # the straight run dropped each decoy while fetching the batch after it
    assert [r["queue/dropped_stale"] for r in runs["straight"]] == [0] + [8] * (steps - 1)
    # same batches, same order, from the same start: the same updates (a resume restores the
    # state bit for bit; 1e-6: the two processes' XLA CPU reductions)
    np.testing.assert_allclose([r["loss"] for r in runs["stopped"]],
                               [r["loss"] for r in runs["straight"]], rtol=1e-6, atol=1e-7)


def _recipe(doc: Path, heading: str) -> str:
    """The first ```bash block after ``heading`` in ``doc``."""
    text = doc.read_text()
    return text[text.index(heading):].split("```bash\n", 1)[1].split("```", 1)[0]


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # gone meanwhile
        return ""


@pytest.mark.slow
def test_the_localhost_recipe_runs_end_to_end(tmp_path):
    """docs/parallel.md's localhost recipe, as written but for the port, the directory and
    the run's length: it exits 0, no process logs a traceback, the terminal shows only the
    trainer's lines and the workers' output is in their files."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    block = _recipe(REPO / "docs/parallel.md", "### Localhost (run here)")
    assert "--set rollout.num_workers=0\n" in block
    script = (block.replace("50051", str(port)).replace("runs/remote", str(tmp_path / "remote"))
              .replace("--set rollout.num_workers=0\n", "--set rollout.num_workers=0 "
                       "--set train.steps=2 --set sft.steps=2 --no-progress\n"))
    # `satjax` as installed: this checkout's, an executable on PATH (a shell function that
    # exec'd would replace the script's shell at `satjax train`, and the recipe's last
    # lines, which stop the workers and the queue, would never run)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "satjax").write_text(f'#!/bin/sh\nexec {sys.executable} -m satjax "$@"\n')
    (bin_dir / "satjax").chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("XLA_FLAGS", None)
    env.pop("SATJAX_QUEUE_TOKEN", None)
    r = subprocess.run(["bash", "-c", script], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=900)
    # the recipe stopped what it started: no process of it is left
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit()
            and str(tmp_path) in _cmdline(p)]
    for p in left:  # never leave them running, even when the assertion below fails
        os.kill(int(p.name), signal.SIGKILL)
    assert not left, [_cmdline(p) for p in left]
    logs = tmp_path / "remote" / "logs"
    texts = {p.name: p.read_text(errors="replace") for p in logs.glob("*.log")}
    assert r.returncode == 0, (r.stderr[-3000:], {k: v[-2000:] for k, v in texts.items()})
    assert "finished step 2 of 2" in r.stdout
    for name, text in texts.items():
        assert "Traceback" not in text, (name, text[-3000:])
    assert "Traceback" not in r.stderr
    assert {"queue.log", "worker0.log", "worker1.log"} <= set(texts)
    assert all("put group" in texts[f"worker{i}.log"] for i in (0, 1))
    terminal = (r.stdout + r.stderr).splitlines()
    assert not [x for x in terminal if "put group" in x or "satjax.rollout" in x], terminal
    assert len(terminal) < 30, terminal


@pytest.mark.slow
def test_a_moved_run_given_by_a_relative_path_resumes(tmp_path):
    """A run started with a relative run_dir, then moved, resumes from its new place (given
    by another relative path): run_dir is where the run is, not what it is."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)

    def train(run_dir, *extra):
        return subprocess.run(
            [sys.executable, "-m", "satjax", "train", "--no-progress", "--set",
             f"run_dir={run_dir}", *extra], env=env, cwd=tmp_path, capture_output=True,
            text=True, timeout=600)

    r = train("first", "--set", "train.steps=2", "--set", "sft.steps=2", "--set",
              "checkpoint.every=2", "--set", "rollout.prompts_per_step=2", "--set",
              "rollout.group_size=4")
    assert r.returncode == 0, r.stderr[-3000:]
    (tmp_path / "moved").mkdir()
    (tmp_path / "first").rename(tmp_path / "moved" / "run")
    r = train("moved/run", "--resume", "--set", "train.steps=3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from the checkpoint at step 2" in r.stderr
    assert _steps(tmp_path / "moved" / "run") == [1, 2, 3]
    assert load_config(tmp_path / "moved" / "run" / "config.yaml").run_dir == "moved/run"
