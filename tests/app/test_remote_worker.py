"""Remote rollout workers: a standalone ``satjax serve-queue``, a trainer that starts no
queue and no workers (``queue.address`` set, ``rollout.num_workers=0``) and a worker
started on its own with only ``--queue`` and ``--weights``, all real processes on
127.0.0.1 (the localhost variant of the multi-host recipes in docs/parallel.md). Also
checks that the deploy/ recipes run real satjax commands with flags that exist."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from satjax.app.cli import COMMANDS
from satjax.config import load_config
from satjax.queue.client import QueueClient

REPO = Path(__file__).resolve().parents[2]
TOKEN = "remote-worker-test-token"
GROUP = 4
# what `satjax train` passes its own queue for this model (tiny preset, group size 4):
# a standalone server is given the same (docs/parallel.md)
LIMITS = ["--vocab-size", "55", "--num-experts", "8", "--moe-layers", "4", "--top-k", "2",
          "--max-seq-len", "4096", "--group-size", str(GROUP)]


def _start(args, env, log):
    return subprocess.Popen([sys.executable, "-m", "satjax", *args], env=env, cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _puts(log: Path) -> int:
    """Groups the worker's log says the queue stored (one line per put)."""
    return len(re.findall(rf"put group \w+: {GROUP} of {GROUP} stored", log.read_text()))


@pytest.mark.slow
def test_separate_worker_feeds_trainer_and_a_killed_worker_loses_no_put_group(
        tmp_path, satjax_env):
    env = {**satjax_env, "SATJAX_QUEUE_TOKEN": TOKEN}
    procs = []
    try:
        qlog = open(tmp_path / "queue.log", "w+")
        queue = subprocess.Popen(
            [sys.executable, "-m", "satjax", "serve-queue", "--port", "0", "--data-dir",
             str(tmp_path / "queue"), *LIMITS], env=env, cwd=REPO, stdout=subprocess.PIPE,
            stderr=qlog, text=True)
        procs.append(queue)
        line = queue.stdout.readline()
        assert "listening on 127.0.0.1:" in line, (tmp_path / "queue.log").read_text()
        address = line.split()[-1]
        run = tmp_path / "run"
        # max_lag high: the worker never pauses for staleness, so it is still putting when
        # it is killed below, after the trainer is done
        trainer = _start(["train", "--config", str(REPO / "configs/tiny.yaml"), "--no-progress",
                          "--set", f"run_dir={run}", "--set", "sft.steps=5",
                          "--set", "train.steps=2", "--set", "checkpoint.every=2",
                          "--set", "rollout.prompts_per_step=2",
                          "--set", f"rollout.group_size={GROUP}", "--set", "train.max_lag=1000",
                          "--set", f"queue.address={address}", "--set", "rollout.num_workers=0"],
                         env, open(tmp_path / "train.log", "w"))
        procs.append(trainer)
        # started at once: it waits for the trainer's run_config.yaml in the weights dir
        wlog = tmp_path / "worker.log"
        worker = _start(["rollout", "--queue", address, "--weights", str(run / "weights"),
                         "--worker-id", "5"], env, open(wlog, "w"))
        procs.append(worker)
        deadline = time.monotonic() + 240
        while trainer.poll() is None and time.monotonic() < deadline:
            assert worker.poll() is None, wlog.read_text()[-3000:]
            time.sleep(0.2)
        assert trainer.poll() == 0, (tmp_path / "train.log").read_text()[-3000:]
        assert (run / "weights" / "run_config.yaml").is_file()
        rows = [json.loads(x) for x in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2] and all(r["sequences"] == 8 for r in rows)
        assert "no local workers" in (tmp_path / "train.log").read_text()
        client = QueueClient(address, token=TOKEN)
        stats = client.stats()
        # the trainer trained (and acknowledged after its checkpoint) 2 x 8 trajectories,
        # all from the one worker, the queue's only producer
        assert stats["acked_total"] == 16 and stats["accepted_total"] >= 16

        # kill -9 while it is putting: every group it was told is stored is on the queue,
        # whole; at most the one group in flight went further than its log shows
        before = _puts(wlog)
        deadline = time.monotonic() + 60
        while _puts(wlog) < before + 3 and time.monotonic() < deadline:
            assert worker.poll() is None, wlog.read_text()[-3000:]
            time.sleep(0.05)
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        stored = _puts(wlog)
        assert stored >= before + 3
        stats = client.stats()
        assert stats["incomplete_groups"] == 0  # no group arrived in part
        assert GROUP * stored <= stats["accepted_total"] <= GROUP * (stored + 1), stats
        assert stats["rejected_total"] == 0
        client.close()
    finally:
        for proc in reversed(procs):
            _stop(proc)


# -- the deploy/ recipes ------------------------------------------------------------------

DEPLOY = REPO / "deploy"


def _satjax_argvs_in_shell(path: Path) -> list[list[str]]:
    """The argv of every ``satjax <command> ...`` in a script (continuation lines joined,
    quotes dropped, shell variables left as they are)."""
    text = path.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        words = [w.strip("'\"") for w in line.split()]
        for i, w in enumerate(words[:-1]):
            if w == "satjax" and words[i + 1] in COMMANDS:
                out.append(words[i:])
    return out


def _check_satjax_argv(argv: list[str], satjax_cli) -> None:
    """``satjax CMD --flag ...``: CMD is a command, every flag is in ``CMD -h`` and every
    ``--set KEY=VALUE`` names a config key."""
    assert argv[0] == "satjax", argv
    cmd = argv[1]
    help_ = satjax_cli(cmd, "-h")
    assert help_.returncode == 0, (argv, help_.stderr[-500:])
    flags = [a.split("=", 1)[0] for a in argv[2:] if a.startswith("--")]
    assert flags, argv
    for flag in flags:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_.stdout), (cmd, flag)
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    # shell variables stand in for site values; the keys must all exist
    load_config(None, [re.sub(r"=.*", "=1", s) if "$" in s else s for s in sets
                       if not s.startswith(("queue.address", "run_dir", "model.path"))]
                + ["queue.address=h:1"])


@pytest.mark.parametrize("script", ["slurm/train.sbatch", "tpu/launch.sh"])
def test_shell_recipes_parse_and_run_real_satjax_commands(script, satjax_cli):
    path = DEPLOY / script
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    argvs = _satjax_argvs_in_shell(path)
    assert {a[1] for a in argvs} >= {"serve-queue", "train", "rollout"}, argvs
    for argv in argvs:
        _check_satjax_argv(argv, satjax_cli)
