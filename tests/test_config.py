import pytest

from satjax.config import ConfigError, dump_config, load_config


def test_defaults_and_yaml_roundtrip(tmp_path):
    cfg = load_config()
    assert cfg.objective.name == "sat_gspo" and cfg.rollout.engine == "builtin"
    p = tmp_path / "c.yaml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg


def test_overrides_typed(tmp_path):
    cfg = load_config(overrides=["objective.hparams.lam=0.5", "train.steps=7", "train.replay=false",
                                 "train.learning_rate=1", "train.mesh.expert=4",
                                 "train.weight_decay=1e-3"])
    assert cfg.train.weight_decay == 1e-3
    assert cfg.objective.hparams == {"lam": 0.5}
    assert cfg.train.steps == 7 and cfg.train.replay is False
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


def test_yaml_unknown_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match="train.lr"):
        load_config(p)
