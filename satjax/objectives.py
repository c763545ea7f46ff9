"""Named objectives with defaults: ``fn(logprobs, batch) -> (loss, aux)``.

Usage with Optax (three lines)::

    obj = satjax.objectives.sat_gspo()
    (loss, aux), g = jax.value_and_grad(
        lambda p: obj(logprob_fn(p), batch), has_aux=True)(params)
    updates, opt_state = tx.update(g, opt_state, params)

``batch`` is a mapping with ``"behavior_logprobs"`` [B, T], ``"advantages"`` [B],
``"mask"`` [B, T] and optionally ``"old_logprobs"`` [B, T]. Every objective accepts
``is_correction`` (None | "tis" | "mis"), ``is_threshold`` and ``is_level``
("token" | "sequence") to correct the rollout/trainer mismatch: the IS ratio is
``batch["old_logprobs"]`` (when present, else the detached current log-probs) over the
behaviour log-probs. ``aux`` holds :data:`satjax.losses.AUX_KEYS` plus ``is_weight_mean``
and ``is_kept_frac`` (1.0 without correction).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from satjax import losses

Objective = Callable[[jax.Array, Mapping[str, Any]], tuple[jax.Array, dict[str, jax.Array]]]

_IS = {"is_correction": None, "is_threshold": 2.0, "is_level": "token"}
_SAT = {"c": 1.0, "w": 1.0, "lam": 1.0, "kernel": "hill", "quantile": 0.9, "c_min": 0.1,
        "scale": "rms"}
_SEQ_EPS = {"eps_low": 3e-4, "eps_high": 4e-4}
_TOK_EPS = {"eps_low": 0.2, "eps_high": 0.28}

DEFAULTS: dict[str, dict[str, Any]] = {
    "sat_gspo": {**_SEQ_EPS, **_SAT, "proxy": "sequence", **_IS},
    "gspo": {**_SEQ_EPS, **_IS},
    "gspo_token": {**_SEQ_EPS, **_IS},
    "grpo": {**_TOK_EPS, **_IS},
    "ppo_clip": {**_TOK_EPS, **_IS},
    "sat_ppo": {**_TOK_EPS, **_SAT, **_IS},
}

_LOSSES: dict[str, Callable[..., tuple[jax.Array, dict[str, jax.Array]]]] = {
    "sat_gspo": losses.sat_gspo_loss,
    "gspo": losses.gspo_loss,
    "gspo_token": losses.gspo_token_loss,
    "grpo": losses.grpo_loss,
    "ppo_clip": losses.ppo_clip_loss,
    "sat_ppo": losses.sat_ppo_loss,
}

_REQUIRED_KEYS = ("behavior_logprobs", "advantages", "mask")
IS_CORRECTIONS = (None, "tis", "mis")


def _batch_get(batch: Mapping[str, Any], key: str) -> Any:
    if key not in batch:
        raise ValueError(f"batch is missing key {key!r}; required: {_REQUIRED_KEYS}")
    return batch[key]


def make(name: str, **hp: Any) -> Objective:
    """Objective ``name`` with :data:`DEFAULTS` overridden by ``hp``.

    Raises ValueError naming an unknown objective or hyperparameter.
    """
    if name not in DEFAULTS:
        raise ValueError(f"unknown objective {name!r}; expected one of {tuple(DEFAULTS)}")
    unknown = sorted(set(hp) - set(DEFAULTS[name]))
    if unknown:
        raise ValueError(f"unknown hyperparameter(s) {unknown} for objective {name!r}; "
                         f"accepted: {sorted(DEFAULTS[name])}")
    cfg = {**DEFAULTS[name], **hp}
    correction = cfg.pop("is_correction")
    threshold = cfg.pop("is_threshold")
    level = cfg.pop("is_level")
    if correction not in IS_CORRECTIONS:
        raise ValueError(f"unknown is_correction {correction!r}; expected one of "
                         f"{IS_CORRECTIONS}")
    if correction is not None:
        losses._check_hparam("is_threshold", threshold, low=0.0, low_open=True)
        losses._check_choice("is_level", level, losses.IS_LEVELS)
    loss_fn = _LOSSES[name]

    def objective(logprobs: jax.Array, batch: Mapping[str, Any]):
        mu = _batch_get(batch, "behavior_logprobs")
        adv = _batch_get(batch, "advantages")
        mask = _batch_get(batch, "mask")
        old = batch.get("old_logprobs")
        weights = None
        if correction is not None:
            trainer_lp = old if old is not None else jax.lax.stop_gradient(logprobs)
            is_fn = losses.tis_weights if correction == "tis" else losses.mis_mask
            weights = is_fn(trainer_lp, mu, threshold=threshold, mask=mask, level=level)
        loss, aux = loss_fn(logprobs, mu, adv, mask, old_logprobs=old,
                            token_weights=weights, **cfg)
        one = jnp.ones((), loss.dtype)
        if weights is None:
            aux["is_weight_mean"] = one
            aux["is_kept_frac"] = one
        else:
            valid = jnp.asarray(mask).astype(bool)
            aux["is_weight_mean"] = losses._masked_mean(weights.astype(loss.dtype), valid)
            aux["is_kept_frac"] = losses._masked_mean((weights > 0).astype(loss.dtype), valid)
        return loss, aux

    objective.__name__ = name
    objective.__doc__ = f"{name} objective with hyperparameters {cfg!r}."
    return objective


def sat_gspo(**hp: Any) -> Objective:
    """SAT-GSPO (the project's default objective); see :func:`satjax.losses.sat_gspo_loss`."""
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
