"""Every user error of the CLI: exit code 2 and one line naming what is wrong, no traceback,
before anything slow starts (each case runs a real ``python -m satjax`` in seconds)."""

import errno
import os
import socket
import subprocess
import sys
import time

import pytest

from satjax.app.commands import edited_keys, next_step
from satjax.app.run import queue_limit_flags, write_run_config
from satjax.config import dump_config, load_config
from satjax.run_dir import RunDirs, RunLock

TINY = "configs/tiny.yaml"

CASES = [
    # (command line, exit code, the start of the last stderr line)
    (["bogus"], 2, "satjax: error: unknown command 'bogus'; one of train, sft, serve-queue"),
    (["train", "--set", "train.stepz=3"], 2, "satjax train: error: unknown config key "
     "'train.stepz'"),
    (["train", "--set", "objective.name=sat_gpso"], 2,
     "satjax train: error: config key 'objective.name': must be one of sat_gspo,"),
    (["train", "--set", "objective.hparams.lamda=0.5"], 2,
     "satjax train: error: config key 'objective.hparams.lamda': must be a hyperparameter"),
    (["train", "--set", "objective.hparams.lam=-1"], 2,
     "satjax train: error: config key 'objective.hparams.lam': must be >= 0"),
    (["train", "--set", "model.preset=huge"], 2,
     "satjax train: error: config key 'model.preset': must be one of 'tiny', '', got 'huge'"),
    (["train", "--set", "model.param_dtype=fp8"], 2,
     "satjax train: error: config key 'model.param_dtype': must be one of"),
    (["train", "--set", "train.mesh.expert=4"], 2,
     "satjax train: error: config key 'train.mesh': must be at most the 1 device(s)"),
    (["train", "--set", "checkpoint.keep=0"], 2,
     "satjax train: error: config key 'checkpoint.keep': must be >= 1, got 0"),
    (["train", "--set", "train.buckets=[64,32]"], 2,
     "satjax train: error: config key 'train.buckets': must be a non-empty, increasing"),
    (["train", "--set", "train.steps=[1"], 2,
     "satjax train: error: config key 'train.steps': must be valid YAML"),
    (["train", "--config", "missing.yaml"], 2,
     "satjax train: error: config file 'missing.yaml': cannot be read"),
    (["train", "--set", "model.path=/nonexistent/model"], 2,
     "satjax train: error: config key 'model.path': must be a Hugging Face checkpoint"),
    (["train", "--set", "task.name=jsonl", "--set", "task.jsonl_path=/nonexistent.jsonl"], 2,
     "satjax train: error: config key 'task.jsonl_path': must be an existing file"),
    (["train", "--set", "rollout.engine=vllm", "--set", "rollout.vllm_python=/nonexistent"], 2,
     "satjax train: error: config key 'rollout.vllm_python': '/nonexistent' is not a python"),
    (["train", "--set", "run_dir=/nonexistent/run", "--resume"], 2,
     "satjax train: error: run_dir '/nonexistent/run': no run to resume"),
    (["train", "--log-every", "0"], 2, "satjax train: error: --log-every: must be >= 1"),
    (["eval", "--model", "/nonexistent/model"], 2,
     "satjax eval: error: --model: must be a Hugging Face checkpoint directory"),
    (["eval", "--set", "run_dir=/nonexistent/run"], 2,
     "satjax eval: error: run_dir '/nonexistent/run': has no published weights"),
    (["eval", "--k", "0", "--model", "/x"], 2, "satjax eval: error: --k: must be >= 1"),
    (["sft", "--set", "sft.batch_size=0"], 2,
     "satjax sft: error: config key 'sft.batch_size': must be >= 1, got 0"),
    (["lag-sweep", "--variants", "gspo,nope"], 2, "satjax lag-sweep: error: --variants:"),
    (["lag-sweep", "--set", "gspo:objective.hparams.lam=0.5"], 2,
     "satjax lag-sweep: error: gspo: config key 'objective.hparams.lam'"),
    (["rollout", "--weights", "/nonexistent/run/weights", "--queue", "localhost:1"], 2,
     "satjax rollout: error: set SATJAX_QUEUE_TOKEN"),
    (["train", "--set", "model.overrides={bogus: 1}"], 2,
     "satjax train: error: config key 'model.overrides.bogus': must be a field of the model "
     "config (vocab_size, "),
    # every architecture field's range, named by its key (was: a traceback after 14 s)
    (["train", "--set", "model.overrides={hidden_size: -1}"], 2,
     "satjax train: error: config key 'model.overrides.hidden_size': must be an int >= 1, "
     "got -1"),
    (["train", "--set", "model.overrides={num_experts: -1}"], 2,
     "satjax train: error: config key 'model.overrides.num_experts': must be an int >= 0 "),
    (["train", "--set", "model.overrides={num_experts: 4, num_experts_per_tok: 5}"], 2,
     "satjax train: error: config key 'model.overrides.num_experts_per_tok': must be an int "
     "in [1, num_experts] "),
    (["train", "--set", "model.overrides={num_attention_heads: 4, num_key_value_heads: 3}"],
     2, "satjax train: error: config key 'model.overrides.num_key_value_heads': must be an "
     "int >= 1 that divides num_attention_heads"),
    (["train", "--set", "model.overrides={head_dim: 31}"], 2,
     "satjax train: error: config key 'model.overrides.head_dim': must be an even int >= 2"),
    (["train", "--set", "model.overrides={num_hidden_layers: 0}"], 2,
     "satjax train: error: config key 'model.overrides.num_hidden_layers': must be an int "
     ">= 1, got 0"),
    (["train", "--set", "model.overrides={vocab_size: 8}"], 2,
     "satjax train: error: config key 'model.overrides.vocab_size': must be >= 55 (the "
     "built-in character tokenizer's vocabulary), got 8"),
    (["train", "--set", "model.overrides={moe_intermediate_size: 0}"], 2,
     "satjax train: error: config key 'model.overrides.moe_intermediate_size': must be an "
     "int >= 1"),
    (["train", "--set", "model.overrides={mlp_only_layers: [4]}"], 2,
     "satjax train: error: config key 'model.overrides.mlp_only_layers': must be a list of "
     "layer indices in [0, num_hidden_layers)"),
    (["train", "--set", "model.overrides={hidden_size: 64.5}"], 2,
     "satjax train: error: config key 'model.overrides.hidden_size': must be an int >= 1, "
     "got 64.5"),
    # a dense model (no MoE layer) has no routes: the run must not record or replay any
    (["train", "--set", "model.overrides={num_experts: 0}"], 2,
     "satjax train: error: config key 'train.replay': must be false for a dense model "
     "(model.overrides {'num_experts': 0} give no MoE layer, "),
    (["train", "--set", "model.preset=''", "--set", "model.overrides={vocab_size: 0}"], 2,
     "satjax train: error: config key 'model.overrides.vocab_size': must be an int >= 1"),
    (["train", "--set", "queue.token=abcdefghijklm"], 2,
     "satjax train: error: config key 'queue.token': must be at least 16 characters (the "
     "queue server's rule;"),
    (["train", "--set", "queue.ready_timeout_s=0"], 2,
     "satjax train: error: config key 'queue.ready_timeout_s': must be > 0 seconds, got 0"),
    # /sys is read-only even for root
    (["train", "--set", "run_dir=/sys/satjax-run"], 2,
     "satjax train: error: run_dir '/sys/satjax-run': must be a writable directory, got "),
]


@pytest.mark.parametrize("argv, code, line", CASES, ids=[" ".join(c[0]) for c in CASES])
@pytest.mark.slow
def test_user_error_is_one_line_with_exit_code(satjax_cli, argv, code, line):
    r = satjax_cli(*argv)
    assert r.returncode == code, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(line), r.stderr[-2000:]


def _saved_run(tmp_path, *overrides):
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(TINY, [f"run_dir={run}", *overrides])
    (run / "config.yaml").write_text(dump_config(cfg))
    return run


@pytest.mark.slow
def test_resume_refuses_changing_what_the_run_is(satjax_cli, tmp_path):
    run = _saved_run(tmp_path, "task.max_digits=2")
    r = satjax_cli("train", "--set", f"run_dir={run}", "--resume", "--set",
                   "objective.name=gspo", "--set", "train.steps=5")
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    # the saved run has 2-digit addition: the defaults (1 digit) must not leak in, and only
    # the unsafe key is named (train.steps may change)
    assert last.startswith("satjax train: error: config key(s) 'objective.name'"), last
    assert "task.max_digits" not in last and "train.steps'" not in last
    # the keys it may change, each as a key or a section's keys (was "eval., ...*")
    assert last.endswith("; --resume may change only train.steps, checkpoint.every, "
                         "checkpoint.keep, eval.*, rollout.num_workers, rollout.vllm_python, "
                         "rollout.queue_retry_s, queue.address, task.reward_timeout_s, "
                         "queue.token, queue.fsync, queue.ready_timeout_s"), last
    # the same through --config: a file that disagrees with the run is refused too
    r = satjax_cli("train", "--config", TINY, "--set", f"run_dir={run}", "--resume")
    assert r.returncode == 2 and "'task.max_digits'" in r.stderr.splitlines()[-1]


def test_fresh_start_into_an_existing_run_is_refused(satjax_cli, tmp_path):
    run = _saved_run(tmp_path)  # 1-digit; the new start asks for 2
    (run / "checkpoints" / "3").mkdir(parents=True)
    r = satjax_cli("train", "--set", f"run_dir={run}", "--set", "task.max_digits=2")
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"satjax train: error: run_dir '{run}': already has checkpoints")
    assert "--resume" in last and "Traceback" not in r.stderr
    assert load_config(run / "config.yaml").task.max_digits == 1  # left as it was


def test_version_and_help(satjax_cli):
    r = satjax_cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("satjax 0.")
    r = satjax_cli("-h")
    assert r.returncode == 0
    for command in ("train", "sft", "serve-queue", "rollout", "eval", "lag-sweep"):
        assert f"  {command} " in r.stdout


def test_help_into_a_closed_pipe_is_quiet(satjax_env):
    # `satjax -h | head -0`: the reader is gone before satjax writes
    proc = subprocess.Popen([sys.executable, "-m", "satjax", "-h"], env=satjax_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0
    assert "BrokenPipe" not in err and "Traceback" not in err, err


def test_token_from_the_environment_is_checked_too(satjax_cli, satjax_env):
    satjax_env["SATJAX_QUEUE_TOKEN"] = "short"
    r = satjax_cli("train")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "satjax train: error: environment variable SATJAX_QUEUE_TOKEN: must be at least 16 "
        "characters"), r.stderr[-2000:]


def test_config_file_that_is_not_utf8_is_one_line(satjax_cli, tmp_path):
    path = tmp_path / "latin1.yaml"
    raw = "seed: 3\n# r\u00e9glages\n".encode("latin-1")
    path.write_bytes(raw)
    r = satjax_cli("train", "--config", str(path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"satjax train: error: config file '{path}': must be UTF-8 text, got byte 0xe9 at "
        f"offset {raw.index(0xE9)}"), r.stderr[-2000:]


BAD_ROWS = [  # (the second row, extra --set, the end of the error line)
    ({"question": "2+2", "answer": None}, [],
     "row 1: its 'answer' (task.answer_field) is null; give every row one, or leave the row "
     "out"),
    ({"question": "2+2", "answer": "4"}, ["--set", "task.prompt_template='{hint}{prompt}'"],
     "row 1 has no field 'hint' (fields: prompt, question, answer)"),
    ({"question": "2+2 \u00e9", "answer": "4"}, [],
     "row 1's prompt: text contains character '\u00e9' outside the tokenizer alphabet"),
]


@pytest.mark.parametrize("row, extra, end", BAD_ROWS, ids=["null", "template", "alphabet"])
@pytest.mark.slow
def test_a_bad_row_is_one_line_naming_it(satjax_cli, tmp_path, row, extra, end):
    """What README and docs/real-models.md promise of bad data: one line, exit code 2 (was a
    traceback, exit 1; a null answer trained as the text "None")."""
    import json

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in
                            [{"question": "1+1", "answer": "2", "hint": "h"}, row]))
    r = satjax_cli("train", "--set", "task.name=jsonl", "--set", f"task.jsonl_path={data}",
                   "--set", "task.reward=exact", "--set", f"run_dir={tmp_path / 'run'}", *extra)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("satjax train: error: config key 'task.") and f"{data}: " in last
    assert last.endswith(end), last
    assert not (tmp_path / "run").exists()  # every row is read before the run directory


BAD_REWARDS = [  # (the reward's body, the end of the error line)
    ("return 1 / 0", "failed on example train-0: ZeroDivisionError: division by zero (called "
     "at start with the example's reference answer)"),
    ("return float('nan')", "returned nan on example train-0; must be finite (called at start "
     "with the example's reference answer)"),
    ("return '1.0'", "returned '1.0' (str) on example train-0; must be a number (called at "
     "start with the example's reference answer)"),
]


@pytest.mark.parametrize("body, end", [*BAD_REWARDS, (None, "")],
                         ids=["raises", "nan", "text", "signature"])
def test_a_reward_that_fails_on_the_first_example_stops_the_start(satjax_cli, satjax_env,
                                                                  tmp_path, body, end):
    """A user's reward is called once at start on the first example (its reference answer
    as the response): one line, exit 2, before the warm-up. Before: a worker found it after
    its first rollouts, 33-120 s in, inside two tracebacks (~52 lines); a reward returning
    the text "1.0" was taken as 1.0."""
    signature = "def score(response):" if body is None else "def score(response, example):"
    (tmp_path / "bad_reward.py").write_text(f"{signature}\n    {body or 'return 1.0'}\n")
    satjax_env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    t0 = time.monotonic()
    r = satjax_cli("train", "--set", "task.reward=bad_reward:score", "--set",
                   f"run_dir={tmp_path / 'run'}", "--no-progress")
    elapsed = time.monotonic() - t0
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "sft warm-up" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("satjax train: error: config key 'task.reward': 'bad_reward:score' "
                           ), last
    assert last.endswith(end or "failed on example train-0: TypeError: score() takes 1 "
                         "positional argument but 2 were given (called at start with the "
                         "example's reference answer)"), last
    assert not (tmp_path / "run").exists()  # nothing written for a start that cannot run
    assert elapsed < 60, elapsed  # imports and the config's checks: no model, no processes


def test_serve_queue_on_a_port_in_use_is_one_line(satjax_cli, satjax_env, tmp_path):
    satjax_env["SATJAX_QUEUE_TOKEN"] = "a-queue-token-of-24-chars"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = satjax_cli("serve-queue", "--port", str(port), "--data-dir", str(tmp_path / "q"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"serve-queue: could not bind 127.0.0.1:{port}: the port is in use (another server?) "
        "or the host is not an address of this machine; --port 0 picks a free port")


def _written_run(tmp_path, *overrides):
    """A run directory as ``satjax train`` writes it before its first checkpoint."""
    run = tmp_path / "run"
    write_run_config(RunDirs(run), load_config(TINY, [f"run_dir={run}", *overrides]))
    return run


def test_a_running_run_refuses_a_second_start_and_a_resume(satjax_cli, tmp_path):
    run = _written_run(tmp_path, "task.max_digits=2")
    dirs = RunDirs(run)
    dirs.logs.mkdir()
    dirs.metrics.write_text("".join(f'{{"step": {i}}}\n' for i in range(1, 41)))
    files = {p: p.read_bytes() for p in (dirs.config, dirs.weights_config, dirs.metrics)}
    with RunLock(run):  # the running trainer (this process) holds the run
        # a fresh start that would write its own config over the run's, and a resume
        for extra in (["--set", "task.max_digits=1"], ["--resume"]):
            r = satjax_cli("train", "--set", f"run_dir={run}", *extra)
            assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
            assert r.stderr.strip().splitlines()[-1] == (
                f"satjax train: error: run_dir '{run}': in use by a running satjax train "
                f"(pid {os.getpid()}, which holds LOCK); stop it first, or choose another "
                "run_dir")
    # nothing of the running run was touched: its config, its workers' copy, its metrics
    assert {p: p.read_bytes() for p in files} == files


def test_hand_edited_config_is_refused_on_resume_naming_the_keys(satjax_cli, tmp_path):
    run = _written_run(tmp_path)
    dirs = RunDirs(run)
    text = dirs.config.read_text()
    dirs.config.write_text(text.replace("overrides: {}", "overrides: {num_experts: 4}")
                           .replace("max_digits: 1", "max_digits: 2"))
    r = satjax_cli("train", "--set", f"run_dir={run}", "--resume")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"satjax train: error: {dirs.config}: edited since the run wrote "
                           "it: config key(s) 'model.overrides.num_experts', "
                           "'task.max_digits' changed"), last


def test_edited_keys_ignore_formatting_and_name_each_change(tmp_path):
    run = _written_run(tmp_path)
    dirs = RunDirs(run)
    text = dirs.config.read_text()
    assert edited_keys(dirs, load_config(dirs.config)) == []
    dirs.config.write_text("# my notes\n" + text.replace("  steps: 200", "  steps:    200"))
    assert edited_keys(dirs, load_config(dirs.config)) == []  # same values
    dirs.config.write_text(text.replace("  steps: 200", "  steps: 300"))
    assert edited_keys(dirs, load_config(dirs.config)) == ["train.steps"]
    # a moved run: run_dir is where the run is, not what it is
    moved = tmp_path / "moved"
    run.rename(moved)
    dirs = RunDirs(moved)
    dirs.config.write_text(text)
    assert edited_keys(dirs, load_config(dirs.config)) == []
    # both copies edited: which keys changed is not known
    dirs.weights_config.write_text(text.replace("seed: 0", "seed: 5"))
    dirs.config.write_text(text.replace("seed: 0", "seed: 6"))
    assert edited_keys(dirs, load_config(dirs.config)) is None
    # a run recorded without a digest (an older satjax) is not checked
    dirs.config_digest.unlink()
    assert edited_keys(dirs, load_config(dirs.config)) == []


def test_resume_of_a_run_without_a_checkpoint_is_refused(satjax_cli, tmp_path):
    """Before: the start said there was nothing to resume, then ``--resume`` silently
    started the run afresh."""
    run = _written_run(tmp_path)
    config = RunDirs(run).config.read_bytes()
    r = satjax_cli("train", "--set", f"run_dir={run}", "--resume")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"satjax train: error: run_dir '{run}': has no checkpoint to resume from (the run "
        "stopped before its first); start it again without --resume")
    assert "sft warm-up" not in r.stderr
    assert RunDirs(run).config.read_bytes() == config


def test_a_run_written_before_a_key_was_added_resumes(tmp_path):
    """A key added to the config since a run was written (here ``task.reward_timeout_s``)
    is filled with its default when the run's config.yaml is read: that is no edit
    (before: the digest differed, and ``--resume`` was refused)."""
    import hashlib

    import yaml

    run = _written_run(tmp_path)
    dirs = RunDirs(run)
    for path in (dirs.config, dirs.weights_config):  # as the older satjax wrote them
        text = path.read_text()
        assert "  reward_timeout_s: 60.0\n" in text
        path.write_text(text.replace("  reward_timeout_s: 60.0\n", ""))
    data = yaml.safe_load(dirs.config.read_text())  # and its digest (config_digest then)
    data.pop("run_dir")
    data["queue"].pop("token")
    dirs.config_digest.write_text(
        hashlib.sha256(yaml.safe_dump(data, sort_keys=True).encode()).hexdigest() + "\n")
    assert edited_keys(dirs, load_config(dirs.config)) == []
    # a hand edit of such a run is still caught, and named
    dirs.config.write_text(dirs.config.read_text().replace("max_digits: 1", "max_digits: 2"))
    assert edited_keys(dirs, load_config(dirs.config)) == ["task.max_digits"]


def test_the_resume_hint_carries_the_rewards_pythonpath(tmp_path, monkeypatch):
    """A reward module found on ``PYTHONPATH`` is needed again by ``--resume``: the hint
    says so (before: the hint alone failed at start, the module not found)."""
    from satjax.data.rewards import import_reward

    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "hint_reward.py").write_text("def score(r, e):\n    return 1.0\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/elsewhere", str(tmp_path / "rewards")]))
    monkeypatch.syspath_prepend(str(tmp_path / "rewards"))
    import_reward("hint_reward:score")
    run = str(tmp_path / "run")
    (tmp_path / "run" / "checkpoints" / "4").mkdir(parents=True)
    assert next_step(run, None, "hint_reward:score") == (
        f"continue with: PYTHONPATH={tmp_path / 'rewards'} satjax train --set run_dir={run} "
        "--resume")
    assert next_step(run, None, "exact") == (
        f"continue with: satjax train --set run_dir={run} --resume")


@pytest.mark.slow
def test_unreachable_queue_address_waits_then_fails_in_one_line(satjax_env, tmp_path):
    """``queue.ready_timeout_s`` bounds the failure: the wait comes before the warm-up, so
    the run ends within the wait plus the imports. Before: after the warm-up and the
    trainer's build (measured on the loaded 2-core machine: 52 s for a 3 s wait; after:
    7.4 s, the wait starting at 4.4 s)."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    wait_s = 3
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "satjax", "train", "--set", f"run_dir={tmp_path / 'run'}",
         "--set", f"queue.address=127.0.0.1:{port}", "--set", "rollout.num_workers=0",
         "--set", f"queue.ready_timeout_s={wait_s}", "--no-progress"],
        env=satjax_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines, waiting_at = [], None
    try:
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if line.startswith("satjax: waiting for the queue"):
                waiting_at = time.monotonic()
        proc.wait(timeout=120)
    finally:
        proc.kill()
    end = time.monotonic()
    err = "\n".join(lines)
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0] == (f"satjax: waiting for the queue at 127.0.0.1:{port} (up to {wait_s}s: "
                        "queue.ready_timeout_s)"), err  # the first thing it does
    assert lines[-1] == (
        f"satjax train: error: queue.address '127.0.0.1:{port}': no queue answered within "
        f"{wait_s}s (is `satjax serve-queue` running there, and reachable from here? "
        "queue.ready_timeout_s waits longer); start the queue (or set queue.address to where "
        "it runs), then start the run again (there is nothing to resume)")
    assert len(lines) == 2, err  # no warm-up, no model, no other line
    assert waiting_at is not None and end - waiting_at <= wait_s + 2, end - waiting_at
    # the imports before the wait take seconds even on a loaded 2-core machine; the
    # warm-up and the trainer's build, which came first before, took 49 s there
    assert end - t0 <= wait_s + 30, end - t0
    assert not (tmp_path / "run").exists()  # nothing written for a run that cannot start


def test_resume_is_suggested_only_where_it_can_help(tmp_path):
    run = str(tmp_path / "run")
    cont = f"continue with: satjax train --set run_dir={run} --resume"
    full = OSError(errno.ENOSPC, "No space left on device", f"{run}/logs/metrics.jsonl")
    bug = ValueError("a bug")
    # nothing checkpointed: starting again is all there is
    assert next_step(run, bug) == "fix the error above and start the run again (there is " \
                                  "nothing to resume)"
    assert next_step(run, full).startswith("fix the cause (No space left on device: ")
    assert "--resume" not in next_step(run, full) + next_step(run, None)
    (tmp_path / "run" / "checkpoints" / "4").mkdir(parents=True)
    assert next_step(run, bug) == cont
    assert next_step(run, None) == cont
    # a cause outside the run: --resume helps only once it is fixed
    assert next_step(run, full) == (f"fix the cause (No space left on device: {run}/logs/"
                                    f"metrics.jsonl), then {cont}")


def test_the_runs_queue_refuses_what_its_trainer_could_not_batch():
    """``satjax train``'s queue requires the router record its workers make (experts and
    gates; logits on request) and bounds versions to the trainer's int32 ones."""
    from satjax.app.factory import build_tokenizer, model_config
    from satjax.trajectory import MAX_VERSION

    def flags(*overrides):
        cfg = load_config(overrides=list(overrides))
        out = queue_limit_flags(cfg, model_config(cfg, build_tokenizer(cfg)))
        return ([out[i + 1] for i, f in enumerate(out) if f == "--require-record"],
                out[out.index("--max-version") + 1],
                [out[i + 1] for i, f in enumerate(out) if f == "--refuse-record"])

    # what the run does not record is refused as what it does is required: a group with
    # router_logits in a run without them used to stop its trainer at every delivery
    assert flags() == (["routed_experts", "routed_gates"], str(MAX_VERSION),
                       ["router_logits"])
    assert flags("rollout.record_router_logits=true")[::2] == (
        ["routed_experts", "routed_gates", "router_logits"], [])
    assert flags("rollout.record_routes=false", "train.replay=off")[::2] == (
        [], ["routed_experts", "routed_gates", "router_logits"])
    # a dense model (no MoE layer): no routes to bound; the queue refused to start with
    # --num-experts 0 (a dense model.path, or model.overrides num_experts 0)
    cfg = load_config(overrides=["model.overrides={num_experts: 0}", "train.replay=off",
                                 "rollout.record_routes=false"])
    out = queue_limit_flags(cfg, model_config(cfg, build_tokenizer(cfg)))
    assert not {"--num-experts", "--moe-layers", "--top-k"} & set(out), out
