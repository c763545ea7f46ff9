"""Every user error of the CLI: exit code 2 and one line naming what is wrong, no traceback,
before anything slow starts (each case runs a real ``python -m satjax`` in seconds)."""

import subprocess
import sys

import pytest

from satjax.config import dump_config, load_config

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
