"""What the run side of ``satjax train`` promises when things go wrong (docs/reliability.md):
children die with the trainer, a child that dies is reported at once, acks cover every
batch a checkpoint holds, no secret in the run directory. Real processes, loopback only."""

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from satjax.app.launch import ORPHAN_EXIT_S, ChildExitedError, ProcessGroup
from satjax.app.run import PendingAcks, public_config
from satjax.config import dump_config, load_config
from satjax.queue.client import QueueClient
from satjax.queue.server import QueueServer
from satjax.trajectory import Trajectory

REPO = Path(__file__).resolve().parents[2]
TOKEN = "reliability-test-token-0123456789"


def _traj(group: str, i: int, size: int = 4) -> Trajectory:
    rng = np.random.default_rng(i)
    return Trajectory(
        trajectory_id=f"{group}-{i}", group_id=group, prompt_id=f"p-{group}",
        prompt_tokens=rng.integers(3, 40, 5, dtype=np.int32),
        response_tokens=rng.integers(3, 40, 4, dtype=np.int32),
        behavior_logprobs=-rng.random(4, dtype=np.float32), policy_version=0,
        reward=float(i % 2), group_size=size)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by init) counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def _wait_gone(pids, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def test_acks_cover_every_batch_after_out_of_order_groups(tmp_path):
    """Group A completes after B and C were put: the first batch (A) carries a larger
    cursor than the second (B). Acking after the checkpoint must consume both, so nothing
    the checkpoint holds is delivered again after a restart."""
    server = QueueServer(tmp_path / "q", TOKEN)
    port = server.start(0)
    client = QueueClient(f"127.0.0.1:{port}", token=TOKEN)
    client.put([_traj("A", i) for i in range(3)] + [_traj("B", i) for i in range(4)]
               + [_traj("C", i) for i in range(4)], strict=True)
    client.put([_traj("A", 3)], strict=True)
    acks = PendingAcks()
    trained = []
    for _ in range(2):  # two steps, then a checkpoint
        got = client.get_batch(4, trainer_version=0, max_lag=5, timeout=5.0)
        trained.append(got.trajectories[0].group_id)
        acks.add(got.cursor)
    assert trained == ["A", "B"]
    acks.ack(client)
    assert acks.cursors == []
    client.close()
    server.stop(1.0)

    server = QueueServer(tmp_path / "q", TOKEN)  # the restart after a crash
    port = server.start(0)
    client = QueueClient(f"127.0.0.1:{port}", token=TOKEN)
    left = []
    for first in (True, False, False):
        got = client.get_batch(4, trainer_version=0, max_lag=5, timeout=1.0,
                               redeliver_unacked=first)
        left += sorted({t.group_id for t in got.trajectories})
    assert left == ["C"]  # only what no checkpoint holds
    client.close()
    server.stop(1.0)


def test_child_that_dies_at_start_is_reported_at_once_with_its_log(tmp_path):
    with ProcessGroup() as procs:
        t0 = time.monotonic()
        with pytest.raises(ChildExitedError) as e:
            # no --data-dir: serve-queue exits 2 at once
            procs.start_until_ready("queue", ["serve-queue", "--port", "0"],
                                    log_file=tmp_path / "queue.log", ready=lambda: False,
                                    timeout=60, retry_codes=(1,))
        assert time.monotonic() - t0 < 30  # not after the 60 s readiness timeout
    assert e.value.returncode == 2
    assert "queue exited with code 2" in str(e.value) and "--data-dir" in str(e.value)


def test_children_die_with_a_parent_killed_9(tmp_path):
    """The parent holds a ProcessGroup with a queue server and a plain child; ``kill -9``
    of the parent (no cleanup code runs) stops both within seconds."""
    parent = tmp_path / "parent.py"
    parent.write_text(textwrap.dedent(f"""
        import sys, time
        from satjax.app.launch import ProcessGroup
        procs = ProcessGroup()
        q = procs.start("queue", ["serve-queue", "--port", "0", "--data-dir",
                                  {str(tmp_path / "q")!r}, "--token", {TOKEN!r}],
                        log_file={str(tmp_path / "queue.log")!r})
        print(q.pid, flush=True)
        time.sleep(600)
    """))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(parent)], stdout=subprocess.PIPE, text=True,
                            env=env, cwd=REPO)
    try:
        child = int(proc.stdout.readline())
        deadline = time.monotonic() + 60
        while "listening" not in (tmp_path / "queue.log").read_text():
            assert time.monotonic() < deadline, (tmp_path / "queue.log").read_text()
            assert _alive(child), (tmp_path / "queue.log").read_text()
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # its graceful stop may take a while on a loaded machine; an orphan exits hard
        # ORPHAN_EXIT_S after the signal whatever it is doing, so wait that plus a margin
        assert _wait_gone([child], timeout=ORPHAN_EXIT_S + 10) == [], \
            "the queue server outlived its parent"
    finally:
        proc.kill()
    # it stopped as on SIGTERM (the graceful path), not by a kill
    assert "shutting down" in (tmp_path / "queue.log").read_text()


def test_queue_token_is_not_written_to_config_yaml():
    cfg = load_config(None, [f"queue.token={TOKEN}"])
    assert cfg.queue.token == TOKEN
    text = dump_config(public_config(cfg))
    assert TOKEN not in text
    assert public_config(cfg).queue == type(cfg.queue)(**{**vars(cfg.queue), "token": ""})


def test_latest_never_names_a_removed_version_when_a_resumed_run_republishes(tmp_path,
                                                                            monkeypatch):
    """A run published v0..v3, crashed (kill -9) and resumed from its checkpoint at step 1:
    its next publish (version 1 again) first discards v1..v3. Every time a version
    directory is removed, LATEST and TARGET must name a version that is still there."""
    import jax
    from flax import nnx

    from satjax import parallel
    from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from satjax.run_dir import version_dir
    from satjax.train.publish import ShardedPublisher
    from satjax.weight_sync import WeightPublisher, WeightSubscriber, published_versions

    model = Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny(num_hidden_layers=2), rngs=nnx.Rngs(0))
    mesh = parallel.make_mesh(parallel.MeshConfig(data=jax.device_count()))
    tokens = [1, 5, 9, 2]
    crashed = ShardedPublisher(WeightPublisher(tmp_path, keep=10), mesh, tokens)
    for v in range(4):
        crashed.publish(model, v, target_version=max(0, v - 1))
        crashed.wait()
    sub = WeightSubscriber(tmp_path)
    assert (sub.latest_version(), sub.wanted_version()) == (3, 2)

    removed = []
    real_rmtree = shutil.rmtree

    def watching_rmtree(path, *args, **kwargs):
        for pointer in ("LATEST", "TARGET"):
            named = (tmp_path / pointer).read_text().strip() \
                if (tmp_path / pointer).exists() else None
            if named is not None:
                assert version_dir(tmp_path, int(named)).is_dir(), (pointer, named)
                assert version_dir(tmp_path, int(named)) != path, (pointer, named, path)
        removed.append(path)
        return real_rmtree(path, *args, **kwargs)

    resumed = ShardedPublisher(WeightPublisher(tmp_path, keep=10), mesh, tokens)
    monkeypatch.setattr(shutil, "rmtree", watching_rmtree)
    resumed.publish(model, 1, target_version=0)
    resumed.wait()
    # each is renamed away (to .vNNNNNNNN-<uuid>.removed) before its files go
    assert {version_dir(tmp_path, v).name for v in (1, 2, 3)} <= {
        Path(p).name[1:].split("-")[0] for p in removed}
    assert published_versions(tmp_path) == [0, 1]
    assert (sub.latest_version(), sub.wanted_version()) == (1, 0)


def _start_train(tmp_path, *extra, pythonpath=()):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *map(str, pythonpath)]),
           "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    # as a terminal's foreground command: SIGINT not ignored (a shell's background job,
    # which may run these tests, ignores it, and an ignored signal is inherited; a handled
    # one is reset to the default by exec)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "satjax", "train", "--no-progress", "--set",
             f"run_dir={tmp_path / 'run'}", "--set", "train.steps=3",
             "--set", "rollout.group_size=4", "--set", "rollout.prompts_per_step=2", *extra],
            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize("phase, sft_steps", [
    ("satjax: sft warm-up: compiling the first step", 30),  # inside XLA's compile
    ("satjax: starting 1 rollout worker(s)", 0),  # the queue and the workers are up
])
@pytest.mark.slow
def test_ctrl_c_during_start_up_exits_130_at_once(tmp_path, phase, sft_steps):
    """Before: 7 of 10 such starts ended in a segfault (scripts/interrupt_startup.py)."""
    proc = _start_train(tmp_path, "--set", f"sft.steps={sft_steps}")
    lines = []
    try:
        while not any(line.startswith(phase) for line in lines):
            line = proc.stderr.readline()
            assert line, "".join(lines)[-3000:]  # it ended before reaching the phase
            lines.append(line)
        children = [int(x) for x in subprocess.run(["pgrep", "-P", str(proc.pid)],
                                                   capture_output=True, text=True).stdout.split()]
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert took < 10, took  # not after the compile or the queue's readiness wait
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(
        "satjax train: interrupted outside the RL steps (starting or stopping); no checkpoint "
        "yet; nothing to resume yet: run the same command again"), err[-3000:]
    assert _wait_gone(children, timeout=30) == []  # the queue and the worker followed


@pytest.fixture
def read_only_checkpoints(tmp_path, mount_tmpfs):
    """``<run>/checkpoints`` a read-only tmpfs (root ignores file modes, not a read-only
    mount; mounting needs root or a user namespace)."""
    ckpt = tmp_path / "run" / "checkpoints"
    ckpt.mkdir(parents=True)
    return mount_tmpfs(ckpt, "size=1m,ro")


@pytest.mark.slow
def test_a_failed_checkpoint_save_ends_the_process_and_its_children(tmp_path,
                                                                    read_only_checkpoints):
    """Before: the failure line was printed, then Orbax's async-save threads kept the
    trainer alive until it was killed."""
    proc = _start_train(tmp_path, "--set", "sft.mode=never", "--set", "checkpoint.every=1")
    lines: list[str] = []
    try:
        children: list[int] = []
        while not any(line.startswith("satjax train: failed") for line in lines):
            line = proc.stderr.readline()
            assert line, "".join(lines)[-3000:]  # it ended before failing
            lines.append(line)
            if line.startswith("satjax: starting 1 rollout worker(s)"):
                children = [int(x) for x in subprocess.run(
                    ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
                ).stdout.split()]
        t0 = time.monotonic()
        proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 1, "".join(lines)[-3000:]
    assert took < 10, took
    assert "Read-only file system" in lines[-1], lines[-1]
    assert len(children) == 2 and _wait_gone(children, timeout=10) == []


@pytest.mark.slow
def test_a_reward_that_never_returns_stops_the_run_naming_the_example(tmp_path):
    """Before: the worker hung in the reward and the trainer waited for its rollouts,
    silent, for ever."""
    # it answers the start's check (the reference answer) and hangs on what a worker samples
    (tmp_path / "hang_reward.py").write_text("import time\n"
                                             "def score(response, example):\n"
                                             "    if response != example.answer:\n"
                                             "        time.sleep(1e6)\n"
                                             "    return 1.0\n")
    proc = _start_train(tmp_path, "--set", "sft.mode=never", "--set",
                        "task.reward=hang_reward:score", "--set", "task.reward_timeout_s=2",
                        pythonpath=[tmp_path])
    try:
        _, err = proc.communicate(timeout=400)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert re.fullmatch(
        r"satjax train: failed: worker0 exited with code 1: task.reward 'hang_reward:score' "
        r"did not return within 2s on example train-\d+: stopping \(a reward call "
        r"cannot be interrupted; task.reward_timeout_s allows it longer\); no checkpoint yet; "
        r"fix the error above and start the run again \(there is nothing to resume\)",
        err.strip().splitlines()[-1]), err[-3000:]
