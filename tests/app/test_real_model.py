"""A user's own model and data end to end: a Hugging Face Qwen3-MoE checkpoint with a BPE
tokenizer and chat template (scripts/make_small_model.py), GSM8K-format rows with their own
field names, a reward module, a held-out file; ``satjax train`` (built-in engine; vLLM-CPU
when ``SATJAX_VLLM_PYTHON`` is set), ``satjax eval``, ``satjax export``; the start-up
errors; a dense Qwen3 checkpoint."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import make_small_model  # noqa: E402

sys.path.pop(0)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("small")
    assert make_small_model.main([str(out)]) == 0
    return out


def _user_settings(small, run_dir, *extra):
    return ["--set", f"run_dir={run_dir}", "--set", f"model.path={small / 'model'}",
            "--set", "task.name=jsonl", "--set", f"task.jsonl_path={small / 'data/train.jsonl'}",
            "--set", f"task.eval_path={small / 'data/test.jsonl'}",
            "--set", "task.question_field=problem", "--set", "task.answer_field=solution",
            "--set", "task.prompt_template=chat",
            "--set", "task.system_prompt=Answer with a number.",
            "--set", "task.reward=my_reward:score", "--set", "task.max_prompt_tokens=96",
            "--set", "rollout.max_new_tokens=8", "--set", "rollout.group_size=2",
            "--set", "rollout.prompts_per_step=2", "--set", "train.buckets=[64]", *extra]


def _satjax(small, *args, timeout=600):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{small}", "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user's laptop
    return subprocess.run([sys.executable, "-m", "satjax", *args], env=env, cwd=small,
                          capture_output=True, text=True, timeout=timeout)


def _hf_generates(path):
    """AutoModelForCausalLM + AutoTokenizer load ``path`` and generate from a chat prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = tok.apply_chat_template([{"role": "user", "content": "Tom has 2 pens"}],
                                  add_generation_prompt=True, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4) or tok.eos_token_id in out[0, ids.shape[1]:]
    return tok, model


def _run_and_check(small, run_dir, *extra):
    r = _satjax(small, "train", "--no-progress",
                *_user_settings(small, run_dir, "--set", "train.steps=2", "--set", "eval.every=2",
                                "--set", "eval.k=2", "--set", "rollout.overlong=penalty",
                                "--set", "model.param_dtype=bfloat16", *extra))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "no warm-up: sft.mode auto" in r.stderr and not (run_dir / "sft").exists()
    rows = [json.loads(x) for x in (run_dir / "logs/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2]
    for m in rows:  # bf16 master weights: the step's metrics are logged all the same
        assert isinstance(m["grad_norm"], float) and m["truncated_frac"] >= 0
    # the held-out file whole (8 rows), k = 2, at step 2
    assert rows[1]["eval/num_prompts"] == 8.0 and "eval/pass@2" in rows[1]
    assert "eval/avg@2" not in rows[0]
    return rows


@pytest.mark.slow
def test_user_checkpoint_trains_evaluates_and_exports(small, tmp_path):
    run_dir = tmp_path / "run"
    _run_and_check(small, run_dir)
    # a full version is a complete HF model; its tokenizer applies the same chat template
    tok, _ = _hf_generates(run_dir / "weights/v00000000")
    assert tok.chat_template == (small / "model/chat_template.jinja").read_text()

    r = _satjax(small, "eval", "--set", f"run_dir={run_dir}", "--k", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.splitlines()[-1])
    assert result["num_prompts"] == 8.0 and 0.0 <= result["pass@2"] <= 1.0

    # the latest version is a delta: export rebuilds it (canary-checked) as an HF model
    assert not (run_dir / "weights/v00000002/config.json").exists()
    r = _satjax(small, "export", "--set", f"run_dir={run_dir}", "--out", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr[-3000:]
    _, hf_model = _hf_generates(tmp_path / "hf")
    from satjax.model import from_pretrained

    # the exported weights are the published v2's: the canary the trainer computed
    manifest = json.loads((run_dir / "weights/v00000002/manifest.json").read_text())
    tokens = manifest["canary"]["tokens"]
    import torch

    with torch.no_grad():
        logits = hf_model(torch.tensor([tokens])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    np.testing.assert_allclose(lp.numpy(), manifest["canary"]["logprobs"], atol=1e-4)
    assert from_pretrained(tmp_path / "hf").config.num_experts == 8


@pytest.mark.skipif(not os.environ.get("SATJAX_VLLM_PYTHON"),
                    reason="SATJAX_VLLM_PYTHON is unset (the vLLM test group)")
@pytest.mark.slow
def test_user_checkpoint_trains_with_vllm(small, tmp_path):
    """With the whole router record through vLLM's plug-in: gate replay, router logits,
    partial rollouts."""
    rows = _run_and_check(small, tmp_path / "run", "--set", "rollout.engine=vllm",
                          "--set", f"rollout.vllm_python={os.environ['SATJAX_VLLM_PYTHON']}",
                          "--set", "train.replay=gates", "--set", "rollout.partial=true",
                          "--set", "rollout.record_router_logits=true")
    for m in rows:  # the trainer's forward applies vLLM's experts and gates exactly
        assert m["router_gate_diff_applied"] == 0.0 and m["router_mismatch_applied"] == 0.0, m
        assert m["router_kl"] >= 0 and m["router_gate_diff"] >= 0, m


def _error(capsys, command, argv):
    from satjax.app import commands

    with pytest.raises(SystemExit) as e:
        getattr(commands, command)(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    return err


@pytest.mark.slow
def test_user_mistakes_are_one_line_exit_2(small, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(small)  # where the user keeps my_reward.py
    monkeypatch.syspath_prepend(str(small))
    base = _user_settings(small, tmp_path / "run")
    err = _error(capsys, "train", [*base, "--set", "task.question_field=question"])
    assert "'task.question_field': must be a field of" in err and "(problem, solution)" in err
    err = _error(capsys, "train", [*base, "--set", "task.prompt_template='Q: {question}'"])
    assert "'task.prompt_template': must name only fields" in err
    err = _error(capsys, "train", [*base, "--set", "task.reward=my_reward:nope"])
    assert "module 'my_reward' has no function 'nope'" in err
    err = _error(capsys, "sft", base)
    assert "no warm-up to run for model.path" in err and "sft.mode=always" in err

    # a checkpoint without its tokenizer files, and one of another model type
    bare = tmp_path / "bare"
    shutil.copytree(small / "model", bare, ignore=shutil.ignore_patterns("tokenizer*", "chat*"))
    err = _error(capsys, "train", [*base, "--set", f"model.path={bare}",
                                   "--set", "task.prompt_template=raw"])
    assert "'task.tokenizer_path': must be set: model.path has no tokenizer files" in err
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    err = _error(capsys, "train", [*base, "--set", f"model.path={bare}"])
    assert "Qwen3-MoE or dense Qwen3 checkpoint" in err and "'llama'" in err

    # a missing extra is named with its install command
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "math_verify" else real(name, *a))
    err = _error(capsys, "train", [*base, "--set", "task.reward=math_verify"])
    assert "pip install 'satjax[math]'" in err


@pytest.mark.slow
def test_dense_qwen3_loads_and_trains(tmp_path, capsys):
    """A dense checkpoint (model_type qwen3) trains; replay options refuse it cleanly."""
    import jax
    from flax import nnx

    from satjax.app.commands import check_resources
    from satjax.app.factory import build_model, build_task, build_tokenizer, worker_config
    from satjax.config import ConfigError, load_config
    from satjax.data.pipeline import prompt_dataset
    from satjax.rollout.builtin_engine import BuiltinEngine
    from satjax.rollout.worker import GroupSampler
    from satjax.train.trainer import Trainer

    assert make_small_model.main([str(tmp_path), "--dense"]) == 0
    assert json.loads((tmp_path / "model/config.json").read_text())["model_type"] == "qwen3"
    overrides = [f"run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}",
                 "task.name=jsonl", f"task.jsonl_path={tmp_path / 'data/train.jsonl'}",
                 "task.question_field=problem", "task.answer_field=solution",
                 "task.reward=exact", "rollout.group_size=2", "rollout.prompts_per_step=2",
                 "rollout.max_new_tokens=4", "train.buckets=[64]", "train.mesh={data: 1}"]
    with pytest.raises(ConfigError, match=r"'train.replay': must be false for a dense model"):
        check_resources(load_config(None, overrides))
    cfg = load_config(None, [*overrides, "train.replay=false", "rollout.record_routes=false"])
    check_resources(cfg)
    tok = build_tokenizer(cfg)
    task = build_task(cfg, tok)
    model = build_model(cfg, tok)
    assert model.config.moe_layer_indices == ()
    trainer = Trainer(cfg, model, tok)
    engine = BuiltinEngine("float32", pad_id=tok.pad_id)
    engine.set_model(trainer.train_state().model, 0)
    sampler = GroupSampler(engine, task, tok, iter(prompt_dataset(task)),
                           worker_config(cfg, tok, seed=0, worker_id="dense"))
    trajectories = sampler.sample()
    for i, t in enumerate(trajectories):  # a reward signal, so the step moves the weights
        t.reward = float(i % 2)
    before = jax.tree.map(np.asarray, nnx.state(trainer.train_state().model, nnx.Param))
    metrics = trainer.train_on(trajectories)
    after = jax.tree.map(np.asarray, nnx.state(trainer.train_state().model, nnx.Param))
    trainer.close()
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before),
                                                         jax.tree.leaves(after), strict=True))


def test_stop_ids_come_from_tokenizer_generation_config_and_config(small, tmp_path):
    from satjax.app.factory import build_tokenizer, stop_token_ids, worker_config
    from satjax.config import load_config

    model = tmp_path / "model"
    shutil.copytree(small / "model", model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 7]}))
    cfg = load_config(overrides=[f"model.path={model}",
                                 'rollout.stop=["<|im_start|>", "The end"]'])
    tok = build_tokenizer(cfg)
    # EOS, the checkpoint's end-of-turn ids, then one-token stop strings as ids
    assert stop_token_ids(cfg, tok) == (tok.eos_id, 7, tok.token_id("<|im_start|>"))
    # a stop string of several tokens is cut by the worker
    assert worker_config(cfg, tok, seed=0, worker_id="w").stop_strings == ("The end",)


def test_a_failure_before_any_checkpoint_does_not_suggest_resume(small, tmp_path, capsys):
    from satjax.app import commands

    broken = tmp_path / "broken"
    shutil.copytree(small / "model", broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    code = commands.train(["--no-progress", *_user_settings(small, tmp_path / "run"),
                           "--set", f"model.path={broken}", "--set", "task.reward=exact"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.splitlines()[-1] == ("satjax train: failed; no checkpoint yet; fix the error "
                                    "above and start the run again (there is nothing to resume)")
