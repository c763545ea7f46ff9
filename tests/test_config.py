import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from satjax.app.commands import check_resources
from satjax.app.factory import DTYPES
from satjax.config import (
    Config,
    ConfigError,
    MeshConfig,
    QueueConfig,
    TrainConfig,
    config_digest,
    dump_config,
    load_config,
    max_sequence_tokens,
    train_buckets,
)

REPO = str(Path(__file__).resolve().parents[1])


def test_one_default_the_schema_is_configs_tiny_yaml():
    # Running without --config must be running configs/tiny.yaml: one set of defaults.
    # Build both from scratch (load_config fills in hparams types) and compare everything.
    assert load_config(None) == load_config(Path(REPO) / "configs/tiny.yaml")
    assert dump_config(load_config(None)) == dump_config(Config())
    assert load_config(None).task.max_digits == 1 and load_config(None).train.steps == 200


def test_defaults_and_yaml_roundtrip(tmp_path):
    cfg = load_config()
    assert cfg.objective.name == "sat_gspo" and cfg.rollout.engine == "builtin"
    p = tmp_path / "c.yaml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg


def test_overrides_typed(tmp_path):
    cfg = load_config(overrides=["objective.hparams.quantile=0.5", "train.steps=7",
                                 "train.replay=false", "train.learning_rate=1",
                                 "train.mesh.expert=4",
                                 "train.weight_decay=1e-3"])
    assert cfg.train.weight_decay == 1e-3
    assert cfg.objective.hparams == {"eps_low": 0.05, "eps_high": 0.07, "quantile": 0.5}
    assert cfg.train.steps == 7 and cfg.train.replay == "off"
    assert cfg.train.learning_rate == 1.0 and isinstance(cfg.train.learning_rate, float)
    assert cfg.train.mesh.expert == 4


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.stepz=3", "train.stepz"),
        ("train.steps=many", "train.steps"),
        ("train.replay=3", "train.replay"),
        ("rollout.engine=sglang", "rollout.engine"),
        ("rollout.group_size=1", "rollout.group_size"),
        ("train.buckets=5", "train.buckets"),
        ("train.mesh=4", "train.mesh"),
        ("nonsense=1", "nonsense"),
    ],
)
def test_bad_keys_are_named(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("[", r"\[")):
        load_config(overrides=[override])


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.buckets=[64,32]", "config key 'train.buckets': must be a non-empty, increasing"),
        ("train.buckets=[]", "config key 'train.buckets': must be a non-empty, increasing"),
        ("checkpoint.keep=0", "config key 'checkpoint.keep': must be >= 1, got 0"),
        ("eval.k=0", "config key 'eval.k': must be >= 1, got 0"),
        ("task.max_digits=0", "config key 'task.max_digits': must be >= task.min_digits"),
        ("train.steps=[1", "config key 'train.steps': must be valid YAML, got "),
        ("rollout.queue_retry_s=-1", "config key 'rollout.queue_retry_s': must be a finite "
                                     "number of seconds >= 0"),
        ("rollout.queue_retry_s=.inf", "config key 'rollout.queue_retry_s': must be a finite "
                                       "number of seconds >= 0"),
        ("train.adam_b2=1", "config key 'train.adam_b2': must be >= 0 and < 1, got 1.0"),
        ("task.reward_timeout_s=0", "config key 'task.reward_timeout_s': must be > 0 "
                                    "seconds, got 0"),
        ("task.reward_timeout_s=.nan", "config key 'task.reward_timeout_s': must be > 0 "
                                       "seconds, got nan"),
        ("train.adam_b1=-0.1", "config key 'train.adam_b1': must be >= 0 and < 1, got -0.1"),
    ],
)
def test_more_range_errors(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert str(e.value).startswith(message), str(e.value)


def test_config_file_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: [1\n")
    with pytest.raises(ConfigError, match=r"must be valid YAML, got .* at line \d+") as e:
        load_config(bad)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path / "missing.yaml")


def test_yaml_unknown_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match="train.lr"):
        load_config(p)


@pytest.mark.parametrize(
    "override, key, allowed",
    [
        ("rollout.engine=sglang", "rollout.engine", "'builtin', 'vllm'"),
        ("task.name=gsm8k", "task.name", "'arithmetic', 'sort', 'reverse', 'jsonl'"),
        ("queue.fsync=sometimes", "queue.fsync", "'always', 'batch', 'never'"),
        ("rollout.sample_dtype=float16", "rollout.sample_dtype", "'float32', 'bfloat16'"),
        ("model.param_dtype=int8", "model.param_dtype", "'float32', 'bfloat16'"),
        ("task.ops=['+','/']", r"task.ops[1]", "'+', '-', '*'"),
        ("rollout.engine=true", "rollout.engine", "'builtin', 'vllm'"),  # YAML bool, not str
    ],
)
def test_literal_choices_name_the_key_and_the_allowed_values(override, key, allowed):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert f"config key {key!r}: must be one of {allowed}, got " in str(e.value)


def test_literal_choices_accept_every_allowed_value():
    cfg = load_config(overrides=["queue.fsync=never", "rollout.engine=vllm",
                                 "model.param_dtype=bfloat16", "task.ops=['*','-']"])
    assert (cfg.queue.fsync, cfg.rollout.engine, cfg.model.param_dtype, cfg.task.ops) == (
        "never", "vllm", "bfloat16", ("*", "-"))


def test_mesh_is_the_mesh_config():
    cfg = load_config(overrides=["train.mesh.data=2", "train.mesh.expert=4"])
    assert isinstance(cfg.train.mesh, MeshConfig)
    assert cfg.train.mesh.shape == (2, 1, 4, 1) and cfg.train.mesh.size == 8
    cfg.train.mesh.validate(8)
    with pytest.raises(ValueError, match="must equal the device count"):
        cfg.train.mesh.validate(4)
    with pytest.raises(ConfigError, match=r"'train\.mesh'.*MeshConfig\.fsdp: must be a positive"):
        load_config(overrides=["train.mesh.fsdp=0"])
    with pytest.raises(ValueError, match="MeshConfig.tensor: must be a positive int, got -1"):
        MeshConfig(tensor=-1)


def test_truncated_sampling_is_refused_during_rl():
    # the trainer's log-probs are those of the untruncated, temperature-scaled distribution
    with pytest.raises(ConfigError, match=r"'rollout\.top_p': must be 1\.0 during RL .*got 0\.9"):
        load_config(overrides=["rollout.top_p=0.9"])
    with pytest.raises(ConfigError, match=r"'rollout\.top_k': must be 0 during RL .*got 20"):
        load_config(overrides=["rollout.top_k=20"])
    assert load_config(overrides=["rollout.top_p=1", "rollout.top_k=0"]).rollout.top_p == 1.0


def test_digit_string_task_config():
    from satjax.app.factory import build_task
    from satjax.model.tokenizer import CharTokenizer

    cfg = load_config(overrides=["task.name=reverse", "task.min_digits=6", "task.max_digits=6",
                                 "task.scoring=per_position"])
    task = build_task(cfg, CharTokenizer())
    ex = task.example(0)
    assert ex.prompt.startswith("reverse:") and len(ex.answer) == 6
    assert task.reward(ex.answer[:5] + "x", ex) == pytest.approx(5 / 6)
    with pytest.raises(ConfigError, match=r"'task\.scoring': must be 'exact' unless"):
        load_config(overrides=["task.scoring=per_position"])  # arithmetic has exact only


def test_range_errors_say_what_and_got():
    with pytest.raises(ConfigError, match=r"'rollout\.group_size': must be >= 2 .*, got 1"):
        load_config(overrides=["rollout.group_size=1"])
    with pytest.raises(ConfigError, match=r"'train\.exact_lag': must be <= train\.max_lag"):
        load_config(overrides=["train.max_lag=1", "train.exact_lag=2"])
    # paths are checked with the files they name, where a command starts
    with pytest.raises(ConfigError, match=r"'task\.jsonl_path': must be an existing file "
                                          r"\(JSONL or Parquet\) or datasets directory, got ''"):
        check_resources(load_config(overrides=["task.name=jsonl"]))


def test_broadcast_interval_is_one_lag_schedule_within_max_lag():
    cfg = load_config(overrides=["train.max_lag=8", "train.broadcast_every=8"])
    assert (cfg.train.broadcast_every, cfg.train.exact_lag) == (8, -1)
    with pytest.raises(ConfigError, match=r"'train\.broadcast_every': must be 0 when "
                                          r"train\.exact_lag >= 0 .*, got 8$"):
        load_config(overrides=["train.max_lag=8", "train.broadcast_every=8",
                               "train.exact_lag=8"])
    with pytest.raises(ConfigError, match=r"'train\.broadcast_every': must be <= "
                                          r"train\.max_lag .*, got 8$"):
        load_config(overrides=["train.broadcast_every=8"])  # max_lag 2 would drop lags 3..8
    with pytest.raises(ConfigError, match=r"'train\.broadcast_every': must be >= 0"):
        load_config(overrides=["train.broadcast_every=-1"])
    # the measured mismatch may bound the broadcast's lag (lag_schedule.served_version)
    load_config(overrides=["train.max_lag=4", "train.broadcast_every=4",
                           "train.mismatch_target=0.1"])
    with pytest.raises(ConfigError, match=r"'train\.broadcast_every': must be 0 with "
                                          r"rollout\.partial"):
        load_config(overrides=["train.max_lag=4", "train.broadcast_every=4",
                               "rollout.partial=true"])


def test_config_module_is_jax_free():
    # the queue server imports the config for its flag defaults; it must stay light
    code = "import sys, satjax.config; sys.exit('jax' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, "importing satjax.config imported jax"


def test_one_set_of_defaults():
    # the values the queue server's flags and the library read from the schema
    assert QueueConfig().fsync == "batch"
    assert TrainConfig().max_lag == 2
    assert DTYPES == {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@pytest.mark.parametrize(
    "override, message",
    [
        ("objective.name=sat_gpso", "config key 'objective.name': must be one of sat_gspo,"),
        ("objective.hparams.lamda=0.5",
         "config key 'objective.hparams.lamda': must be a hyperparameter of sat_gspo"),
        ("objective.hparams.lam=-1", "config key 'objective.hparams.lam': must be >= 0"),
        ("objective.hparams.kernel=box", "config key 'objective.hparams.kernel': must be one of"),
    ],
)
def test_objective_name_and_hyperparameters_are_checked_at_load(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(Path(REPO) / "configs/tiny.yaml", [override])
    assert str(e.value).startswith(message), str(e.value)


def test_objective_hyperparameters_of_another_objective_are_refused():
    # sat_gspo's `lam` is not a GSPO hyperparameter: switching the objective must not keep it.
    with pytest.raises(ConfigError, match="objective.hparams.lam"):
        load_config(None, ["objective.name=gspo", "objective.hparams.lam=0.5"])
    cfg = load_config(None, ["objective.name=gspo", "objective.hparams.eps_high=1e-3"])
    assert cfg.objective.hparams == {"eps_low": 0.05, "eps_high": 1e-3}


def test_model_compute_options_are_config_keys():
    cfg = load_config(overrides=["model.dtype=bfloat16", "model.moe_impl=ragged",
                                 "model.scan_layers=true", "train.remat=full"])
    assert (cfg.model.dtype, cfg.model.param_dtype) == ("bfloat16", "float32")
    assert (cfg.model.moe_impl, cfg.model.scan_layers, cfg.train.remat) == ("ragged", True,
                                                                            "full")
    for override, key in (("train.remat=some", "train.remat"),
                          ("model.moe_impl=megablox", "model.moe_impl")):
        with pytest.raises(ConfigError, match=f"config key '{key}': must be one of"):
            load_config(overrides=[override])


def test_the_papers_config_names_its_model_and_checks_the_checkpoint(tmp_path):
    from satjax.app.factory import model_config
    from satjax.model import Qwen3MoeConfig

    paper = Path(REPO) / "configs/qwen3-30b-a3b.yaml"
    cfg = load_config(paper)
    # the Setup box of the SAT-GSPO+R3 row: lag 8 as a broadcast interval, 32k responses
    # in a bucket that holds prompt + response, 4,096 rows as 64 micro-steps over 64 devices
    assert (cfg.objective.name, cfg.objective.hparams, cfg.train.replay) == (
        "sat_gspo", {}, "experts")
    assert (cfg.train.broadcast_every, cfg.train.exact_lag) == (8, -1)
    assert (cfg.train.adam_b1, cfg.train.adam_b2, cfg.train.learning_rate) == (0.9, 0.98, 1e-6)
    assert (cfg.objective.kl_coef, cfg.objective.kl_estimator, cfg.objective.kl_level) == (
        1e-3, "low_var_kl", "sequence")
    assert max(cfg.train.buckets) == max_sequence_tokens(cfg) == 512 + 32768
    rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    assert rows == 4096 and rows // cfg.train.grad_accum == cfg.train.mesh.size == 64
    eight_k = load_config(paper, ["rollout.max_new_tokens=7680"])
    assert min(b for b in train_buckets(eight_k) if b >= max_sequence_tokens(eight_k)) == 8192
    shape = model_config(cfg)  # the architecture, without weights or a tokenizer
    assert (shape.num_hidden_layers, shape.num_experts, shape.num_experts_per_tok,
            shape.vocab_size) == (48, 128, 8, 151936)
    with pytest.raises(ConfigError, match="'model.path': must be a local checkpoint"):
        check_resources(cfg)
    # a checkpoint of another architecture is refused, naming what differs
    other = tmp_path / "ckpt"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(
        Qwen3MoeConfig(**{**cfg.model.overrides, "num_hidden_layers": 24}).to_hf_dict()))
    with pytest.raises(ConfigError, match="num_hidden_layers: config.json has 24, the config "
                                          "says 48"):
        check_resources(load_config(paper, [f"model.path={other}", "task.name=arithmetic"]))
    (other / "config.json").write_text(json.dumps(
        Qwen3MoeConfig(**cfg.model.overrides).to_hf_dict()))
    # a 151936-token model needs its tokenizer: the character tokenizer does not fit it
    with pytest.raises(ConfigError, match="'task.tokenizer_path': must be set: model.path "
                                          "has no tokenizer files"):
        check_resources(load_config(paper, [f"model.path={other}", "task.name=arithmetic",
                                            "train.mesh={data: 8}", "rollout.engine=builtin"]))
    (other / "tokenizer.json").write_text("{}")  # found (not read) by the check
    # the config's prompt_template: chat needs a chat template
    with pytest.raises(ConfigError, match="'task.prompt_template': must be 'chat' only with "
                                          "a Hugging Face tokenizer that has a chat template"):
        check_resources(load_config(paper, [f"model.path={other}", "task.name=arithmetic",
                                            "train.mesh={data: 8}", "rollout.engine=builtin"]))
    (other / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    check_resources(load_config(paper, [f"model.path={other}", "task.name=arithmetic",
                                        "train.mesh={data: 8}", "rollout.engine=builtin"]))


def test_config_digest_is_of_the_values_the_run_is(tmp_path):
    cfg = load_config(None, ["task.max_digits=2", "objective.hparams.eps_low=1e-3"])
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(cfg))
    digest = config_digest(cfg)
    assert len(digest) == 64 and config_digest(load_config(path)) == digest  # round trip
    path.write_text("# notes\n" + dump_config(cfg).replace(": ", ":   "))
    assert config_digest(load_config(path)) == digest  # formatting and comments: same run
    assert config_digest(dataclasses.replace(cfg, run_dir="elsewhere")) == digest  # moved
    for change in ("task.max_digits=3", "objective.hparams.eps_low=2e-3", "seed=1",
                   "model.overrides={num_experts: 4}"):
        assert config_digest(load_config(path, [change])) != digest, change


def test_replay_modes_and_their_boolean_spellings():
    """train.replay: off | experts | gates; true keeps meaning experts, false (and YAML's
    bare off) off; anything else names the key."""
    for value, mode in (("true", "experts"), ("false", "off"), ("off", "off"),
                        ("experts", "experts"), ("gates", "gates")):
        assert load_config(overrides=[f"train.replay={value}"]).train.replay == mode
    assert load_config().train.replay == "experts"
    with pytest.raises(ConfigError, match="'train.replay': must be one of 'off', 'experts', "
                                          "'gates'"):
        load_config(overrides=["train.replay=logits"])


def test_router_record_options_need_what_they_use():
    with pytest.raises(ConfigError, match="'train.replay': must be 'off' or 'experts' unless "
                                          "rollout.record_routes"):
        load_config(overrides=["train.replay=gates", "rollout.record_routes=false"])
    with pytest.raises(ConfigError, match="'rollout.record_router_logits': must be off unless "
                                          "rollout.record_routes"):
        load_config(overrides=["train.replay=off", "rollout.record_routes=false",
                               "rollout.record_router_logits=true"])
    # both engines record gates and (on request) logits and continue across updates
    for engine in ("builtin", "vllm"):
        cfg = load_config(overrides=["train.replay=gates", "rollout.record_router_logits=true",
                                     "rollout.partial=true", f"rollout.engine={engine}"])
        assert (cfg.train.replay, cfg.rollout.record_router_logits, cfg.rollout.partial) == \
            ("gates", True, True)


def test_each_section_checks_its_own_ranges_and_only_cross_rules_stay_global():
    """A section's rules run on the section alone (a RolloutConfig needs no Config), name
    the full key, and every section of the schema has them; a rule across sections (gate
    replay needs recorded routes) is refused only where both sections meet."""
    from satjax import config as C

    with pytest.raises(C.ConfigError, match=r"'rollout\.group_size': must be >= 2"):
        C.RolloutConfig(group_size=1).check()
    with pytest.raises(C.ConfigError, match=r"'train\.exact_lag': must be <= train\.max_lag"):
        C.TrainConfig(max_lag=1, exact_lag=2).check()
    sections = [f.name for f in dataclasses.fields(C.Config) if f.name not in ("run_dir",
                                                                                "seed")]
    for name in sections:
        section = getattr(C.Config(), name)
        assert section.SECTION == name
        section.check()  # the defaults pass
    C.TrainConfig(replay="gates").check()
    C.RolloutConfig(record_routes=False).check()
    with pytest.raises(C.ConfigError, match=r"'train\.replay'"):
        C.load_config(None, ["train.replay=gates", "rollout.record_routes=false"])
