"""satjax.losses.hparams and objectives.hparams: validation, and each default written once."""

import dataclasses
import inspect

import jax.numpy as jnp
import pytest

from satjax import losses as L
from satjax import objectives
from satjax.losses import hparams as H

_SAT_FIELDS = {f.name for f in dataclasses.fields(H.SatKernelHParams)}


@pytest.mark.parametrize("field,value", [
    ("eps_low", -0.1), ("eps_high", float("nan")), ("lam", 1.5), ("lam", -0.1), ("c", -1.0),
    ("w", 0.0), ("quantile", 1.2), ("c_min", 2.0), ("kernel", "cauchy"), ("scale", "std"),
    ("proxy", "row"), ("scope", "step"), ("is_correction", "clip"), ("is_threshold", 0.0),
    ("is_level", "row"),
])
def test_dataclass_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}: must be .*, got {value!r}$"):
        H.SatGspoHParams(**{field: value})


@pytest.mark.parametrize("kernel,field,value", [
    ("paper", "lam", 0.5), ("paper", "c_min", 0.2), ("paper", "c", 2.0), ("paper", "w", 2.0),
    ("paper", "scale", "mad"), ("smooth", "c", 2.0), ("smooth", "scale", "mad"),
    ("gauss", "quantile", 0.8), ("gauss", "c_min", 0.2),
])
def test_a_parameter_the_kernel_does_not_read_is_refused(kernel, field, value):
    """A sweep over lam under the paper's kernel would vary nothing: it is an error, from
    the dataclass, from the loss functions and from sat_interval alike."""
    match = rf"^{field}: applies to kernel .*, not {kernel!r}; got {value!r}$"
    with pytest.raises(ValueError, match=match):
        H.SatGspoHParams(kernel=kernel, **{field: value})
    with pytest.raises(ValueError, match=match):
        L.sat_interval(jnp.ones(4), eps_low=0.2, eps_high=0.2, kernel=kernel,
                       **{field: value})
    lp = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match=match):
        L.sat_ppo_loss(lp, lp, jnp.ones(2), jnp.ones((2, 3)), eps_low=0.2, eps_high=0.2,
                       kernel=kernel, **{field: value})


def test_dataclasses_are_frozen_and_valid_by_default():
    for name in objectives.NAMES:
        hp = objectives.hparams(name)
        with pytest.raises(dataclasses.FrozenInstanceError):
            hp.eps_low = 1.0  # type: ignore[misc]
    assert H.SatGspoHParams(lam=0.0, kernel="gauss").kernel == "gauss"
    assert H.SatGspoHParams().kernel == "paper" and H.SatGspoHParams().proxy == "broadcast"


def test_hparams_unknown_objective_lists_the_names():
    with pytest.raises(ValueError, match="sat_gpso") as err:
        objectives.hparams("sat_gpso")
    assert all(name in str(err.value) for name in objectives.NAMES)


def test_hparams_unknown_key_names_it_and_lists_the_allowed():
    with pytest.raises(ValueError, match="epsilon") as err:
        objectives.hparams("gspo", {"epsilon": 0.1})
    assert "eps_low" in str(err.value) and "is_threshold" in str(err.value)
    with pytest.raises(ValueError, match="proxy"):  # a SAT-only knob on a non-SAT objective
        objectives.hparams("gspo", {"proxy": "token"})


def test_hparams_bad_value_is_the_dataclass_message():
    with pytest.raises(ValueError, match=r"^lam: must be <= 1.0, got 2.0$"):
        objectives.hparams("sat_ppo", {"kernel": "smooth", "lam": 2.0})


def test_hparams_returns_the_objective_dataclass_with_overrides():
    hp = objectives.hparams("sat_gspo", {"kernel": "smooth", "lam": 0.5, "proxy": "token"})
    assert isinstance(hp, H.SatGspoHParams)
    assert (hp.lam, hp.proxy, hp.eps_low) == (0.5, "token", H.SatGspoHParams().eps_low)
    assert objectives.hparams("gspo", None) == H.GspoHParams()


def test_names_cover_every_objective_constructor():
    assert set(objectives.NAMES) == set(objectives.DEFAULTS)
    for name in objectives.NAMES:
        assert getattr(objectives, name)().__name__ == name


# ----------------------------------------------------------------- each default written once


@pytest.mark.parametrize("name", objectives.NAMES)
def test_loss_keyword_defaults_are_the_dataclass_defaults(name):
    """Every keyword default of a loss equals its objective's dataclass default."""
    fn = getattr(L, f"{name}_loss")
    defaults = dataclasses.asdict(objectives.hparams(name))
    params = inspect.signature(fn).parameters
    with_defaults = {k: p.default for k, p in params.items()
                     if p.default is not inspect.Parameter.empty
                     and k not in ("old_logprobs", "token_weights", "microbatches")}
    assert with_defaults == {k: v for k, v in defaults.items()
                             if k in with_defaults}
    # every hyperparameter of the dataclass except the IS ones and the radii is a loss kwarg
    # with a default, so there is no second place it could be written.
    expected = {k for k in defaults if k not in ("eps_low", "eps_high")
                and not k.startswith("is_")}
    assert set(with_defaults) == expected


def test_sat_interval_and_correction_defaults_are_the_dataclass_defaults():
    params = inspect.signature(L.sat_interval).parameters
    sat = dataclasses.asdict(H.SatKernelHParams())
    del sat["scope"]  # sat_interval is given one micro-batch: it has no scope
    assert {k: params[k].default for k in _SAT_FIELDS - {"scope"}} == sat
    for fn in (L.tis_weights, L.mis_mask):
        assert inspect.signature(fn).parameters["level"].default == H.HParams.is_level
    params = inspect.signature(L.group_advantages).parameters
    assert {k: params[k].default for k in ("normalize_std", "ddof", "eps")} == \
        dataclasses.asdict(H.GroupAdvantageHParams())


@pytest.mark.parametrize("kw,match", [
    ({"clip_ratio_c": 1.0}, r"^clip_ratio_c: must be > 1.0, got 1.0$"),
    ({"is_threshold_low": 0.5}, "is_threshold_low: must be None unless"),
    ({"is_correction": "mis", "is_threshold_low": 3.0}, "is_threshold_low: must be <="),
])
def test_dual_clip_and_mis_low_bound_are_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        H.PpoClipHParams(**kw)


def test_dual_clip_is_token_level_and_off_by_default():
    for name in ("grpo", "ppo_clip", "sat_ppo"):
        assert objectives.hparams(name).clip_ratio_c is None
    with pytest.raises(ValueError, match="clip_ratio_c"):
        objectives.hparams("gspo", {"clip_ratio_c": 3.0})


@pytest.mark.parametrize("name", objectives.NAMES)
def test_constructor_and_make_defaults_are_the_dataclass_defaults(name):
    expected = dataclasses.asdict(objectives.hparams(name))
    assert objectives.DEFAULTS[name] == expected
    doc = getattr(objectives, name)().__doc__
    assert repr(objectives.hparams(name)) in doc
    assert repr(objectives.hparams(name)) in objectives.make(name).__doc__


def test_make_accepts_a_dataclass_instance():
    hp = H.GspoHParams(eps_high=1e-3)
    assert repr(hp) in objectives.make("gspo", hp).__doc__
    assert repr(H.GspoHParams(eps_high=1e-3, eps_low=1e-4)) in objectives.make(
        "gspo", hp, eps_low=1e-4).__doc__
    with pytest.raises(ValueError, match="GspoHParams"):
        objectives.make("sat_gspo", hp)


def test_the_radii_defaults_by_level():
    for name in ("sat_gspo", "gspo", "gspo_token"):
        assert isinstance(objectives.hparams(name), H.SequenceClipHParams)
    for name in ("grpo", "ppo_clip", "sat_ppo"):
        assert isinstance(objectives.hparams(name), H.TokenClipHParams)
