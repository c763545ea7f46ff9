"""Named objectives with defaults: ``fn(logprobs, batch) -> (loss, aux)``.

Usage with Optax (three lines)::

    obj = satjax.objectives.sat_gspo()
    (loss, aux), g = jax.value_and_grad(
        lambda p: obj(logprob_fn(p), batch), has_aux=True)(params)
    updates, opt_state = tx.update(g, opt_state, params)

``batch`` is a mapping with ``"behavior_logprobs"`` [B, T], ``"advantages"`` [B],
``"mask"`` [B, T] and optionally ``"old_logprobs"`` [B, T]. Every objective accepts
``is_correction`` (None | "tis" | "mis"), ``is_threshold``, ``is_threshold_low`` (MIS only)
and ``is_level`` ("token" | "sequence") to correct the rollout/trainer mismatch:

* "tis" is for decoupled objectives only: the clipped ratio is taken against the proximal
  policy ``batch["old_logprobs"]`` and each term is weighted by
  ``min(pi_prox / mu, is_threshold)``. Without ``old_logprobs`` the clipped ratio is
  already ``pi / mu``, and a TIS weight would count the mismatch twice, so the objective
  raises ValueError.
* "mis" keeps a term only where ``is_threshold_low <= pi_prox / mu <= is_threshold``
  (``pi_prox`` = ``old_logprobs``, else the detached current log-probs). Without
  ``old_logprobs`` this is a hard trust region on the very ratio the surrogate clips: a 0/1
  mask rescales nothing, so nothing is counted twice; it only drops the terms whose ratio
  left the band, including those on the side the clip does not bind.

``aux`` holds :data:`satjax.losses.AUX_KEYS` plus ``is_weight_mean`` and ``is_kept_frac``
(1.0 without correction).

Hyperparameters, their defaults and ranges are the dataclasses of
:mod:`satjax.losses.hparams`; :func:`hparams` validates a name and a mapping up front::

    >>> from satjax import objectives
    >>> hp = objectives.hparams("gspo", {"eps_high": 0.28})
    >>> type(hp).__name__, hp.eps_low, hp.eps_high
    ('GspoHParams', 0.2, 0.28)
    >>> objectives.hparams("gspo", {"eps_high": -1.0})
    Traceback (most recent call last):
    ...
    ValueError: eps_high: must be >= 0.0, got -1.0
    >>> objectives.hparams("gspo", {"lam": 0.5})
    Traceback (most recent call last):
    ...
    ValueError: gspo hyperparameters: must be among [...], got unknown ['lam']
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from satjax import losses
from satjax.losses import hparams as hp_lib

Objective = Callable[[jax.Array, Mapping[str, Any]], tuple[jax.Array, dict[str, jax.Array]]]

# every objective registers itself next to its loss (satjax.losses.registry)
NAMES: tuple[str, ...] = tuple(losses.OBJECTIVES)
IS_CORRECTIONS = hp_lib.IS_CORRECTIONS

# Every objective's defaults as a plain dict (derived from the dataclasses, for display).
DEFAULTS: dict[str, dict[str, Any]] = {
    name: dataclasses.asdict(spec.hparams()) for name, spec in losses.OBJECTIVES.items()
}

_IS_FIELDS = tuple(f.name for f in dataclasses.fields(hp_lib.HParams)
                   if f.name.startswith("is_"))
_REQUIRED_KEYS = ("behavior_logprobs", "advantages", "mask")


def _check_name(name: str) -> None:
    if name not in losses.OBJECTIVES:
        raise ValueError(f"objective: must be one of {NAMES}, got {name!r}")


def hparams(name: str, values: Mapping[str, Any] | None = None) -> hp_lib.HParams:
    """The validated hyperparameters of objective ``name``: its defaults updated by ``values``.

    Raises:
      ValueError: ``name`` is not one of :data:`NAMES`; a key of ``values`` is not a
        hyperparameter of that objective (the message names it and lists the allowed
        ones); or a value is out of range (the dataclass's own message).
    """
    _check_name(name)
    cls = losses.OBJECTIVES[name].hparams
    values = dict(values or {})
    allowed = sorted(f.name for f in dataclasses.fields(cls))
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ValueError(f"{name} hyperparameters: must be among {allowed}, "
                         f"got unknown {unknown}")
    return cls(**values)


def _batch_get(batch: Mapping[str, Any], key: str) -> Any:
    if key not in batch:
        raise ValueError(f"batch: must have key {key!r} (required: {_REQUIRED_KEYS}), "
                         f"got keys {sorted(batch)}")
    return batch[key]


def make(name: str, hp: hp_lib.HParams | Mapping[str, Any] | None = None, /, *,
         microbatches: int = 1, **overrides: Any) -> Objective:
    """Objective ``name`` with its defaults overridden by ``hp`` and then ``overrides``.

    ``hp`` is a mapping or an instance of the objective's own dataclass (e.g.
    ``make("gspo", GspoHParams(eps_high=1e-3))``). ``microbatches``: how many strided
    gradient-accumulation micro-batches a batch given to the objective holds (rows m,
    m + M, ...); SAT objectives with ``scope="microbatch"`` take their gate per
    micro-batch (the others have no batch statistic and ignore it). Raises ValueError
    naming an unknown objective or hyperparameter, or an out-of-range value (see
    :func:`hparams`).
    """
    _check_name(name)
    spec = losses.OBJECTIVES[name]
    cls, loss_fn = spec.hparams, spec.loss
    if isinstance(hp, hp_lib.HParams):
        if type(hp) is not cls:
            raise ValueError(f"hp: must be a {cls.__name__} for objective {name!r}, "
                             f"got {type(hp).__name__}")
        hp = dataclasses.asdict(hp)
    cfg = hparams(name, {**dict(hp or {}), **overrides})
    loss_kw = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _IS_FIELDS}
    if "microbatches" in inspect.signature(loss_fn).parameters:
        loss_kw["microbatches"] = microbatches
    correction = cfg.is_correction

    def objective(logprobs: jax.Array, batch: Mapping[str, Any]):
        mu = _batch_get(batch, "behavior_logprobs")
        adv = _batch_get(batch, "advantages")
        mask = _batch_get(batch, "mask")
        old = batch.get("old_logprobs")
        weights = None
        if correction == "tis":
            if old is None:
                raise ValueError(
                    "batch: must have 'old_logprobs' (the proximal policy) with "
                    "is_correction='tis', got keys "
                    f"{sorted(batch)}; without it the clipped ratio is already pi/mu and "
                    "a TIS weight would count the mismatch twice (use 'mis' or None)")
            weights = losses.tis_weights(old, mu, threshold=cfg.is_threshold, mask=mask,
                                         level=cfg.is_level)
        elif correction == "mis":
            prox = old if old is not None else jax.lax.stop_gradient(logprobs)
            weights = losses.mis_mask(prox, mu, threshold=cfg.is_threshold, mask=mask,
                                      level=cfg.is_level,
                                      low_threshold=cfg.is_threshold_low)
        loss, aux = loss_fn(logprobs, mu, adv, mask, old_logprobs=old,
                            token_weights=weights, **loss_kw)
        one = jnp.ones((), loss.dtype)
        if weights is None:
            aux["is_weight_mean"] = one
            aux["is_kept_frac"] = one
        else:
            valid = jnp.asarray(mask).astype(bool)
            aux["is_weight_mean"] = losses.masked_mean(weights.astype(loss.dtype), valid)
            aux["is_kept_frac"] = losses.masked_mean((weights > 0).astype(loss.dtype), valid)
        return loss, aux

    objective.__name__ = name
    objective.__doc__ = f"{name} objective with hyperparameters {cfg!r}."
    return objective


def sat_gspo(**hp: Any) -> Objective:
    """SAT-GSPO (the project's default objective); see :func:`satjax.losses.sat_gspo_loss`.

    >>> from satjax import objectives
    >>> objectives.sat_gspo(eps_low=1e-3).__name__
    'sat_gspo'
    """
    return make("sat_gspo", **hp)


def gspo(**hp: Any) -> Objective:
    """GSPO; see :func:`satjax.losses.gspo_loss`."""
    return make("gspo", **hp)


def gspo_token(**hp: Any) -> Objective:
    """GSPO-token; see :func:`satjax.losses.gspo_token_loss`."""
    return make("gspo_token", **hp)


def grpo(**hp: Any) -> Objective:
    """GRPO (token clip, per-sequence length normalisation); see
    :func:`satjax.losses.grpo_loss`."""
    return make("grpo", **hp)


def ppo_clip(**hp: Any) -> Objective:
    """PPO-clip (token-mean over the batch); see :func:`satjax.losses.ppo_clip_loss`."""
    return make("ppo_clip", **hp)


def sat_ppo(**hp: Any) -> Objective:
    """Token-level SAT; see :func:`satjax.losses.sat_ppo_loss`."""
    return make("sat_ppo", **hp)


def sat_grpo(**hp: Any) -> Objective:
    """SAT-GRPO (token-level SAT, GRPO's reduction); see :func:`satjax.losses.sat_grpo_loss`."""
    return make("sat_grpo", **hp)


def dppo_tv(**hp: Any) -> Objective:
    """DPPO-Binary-TV; see :func:`satjax.losses.dppo_tv_loss`."""
    return make("dppo_tv", **hp)


def dppo_tv_clip(**hp: Any) -> Objective:
    """DPPO-Binary-TV as the SAT page's grid runs it (GRPO's clip times the TV mask); see
    :func:`satjax.losses.dppo_tv_clip_loss`."""
    return make("dppo_tv_clip", **hp)


def dppo_kl(**hp: Any) -> Objective:
    """DPPO-Binary-KL; see :func:`satjax.losses.dppo_kl_loss`."""
    return make("dppo_kl", **hp)
