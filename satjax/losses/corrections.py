"""Importance-sampling corrections for the rollout/trainer mismatch: TIS weights, MIS mask.

Both compare the trainer's log-probs of the sampled tokens with the rollout engine's
(``mu``) and return detached [B, T] weights to pass as a loss's ``token_weights``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from satjax.losses._checks import check_finite_where_valid, check_shape, compute_dtype
from satjax.losses.hparams import HParams, check_hparams

Array = jax.Array


def _is_log_ratio(logprobs: Array, behavior_logprobs: Array, mask: Array | None,
                  level: str) -> tuple[Array, Array]:
    lp = jnp.asarray(logprobs)
    if lp.ndim != 2:
        raise ValueError(f"logprobs: must have shape [B, T], got {lp.shape}")
    check_shape("behavior_logprobs", behavior_logprobs, lp.shape, "logprobs.shape")
    if mask is not None:
        check_shape("mask", mask, lp.shape, "logprobs.shape")
    check_hparams(level=level)
    valid = jnp.ones(lp.shape, bool) if mask is None else jnp.asarray(mask).astype(bool)
    check_finite_where_valid("logprobs", lp, valid)
    check_finite_where_valid("behavior_logprobs", behavior_logprobs, valid)
    dt = compute_dtype(lp)
    zero = jnp.zeros((), dt)
    lr = jnp.where(valid, lp.astype(dt) - jnp.asarray(behavior_logprobs).astype(dt), zero)
    lr = jax.lax.stop_gradient(lr)
    if level == "sequence":  # length-normalised (geometric-mean) ratio, as GSPO's s_i
        n = jnp.maximum(jnp.sum(valid, axis=1, keepdims=True), 1).astype(dt)
        lr = jnp.broadcast_to(jnp.sum(lr, axis=1, keepdims=True) / n, lr.shape)
    return lr, valid


def tis_weights(logprobs: Array, behavior_logprobs: Array, *, threshold: float,
                mask: Array | None = None, level: str = HParams.is_level) -> Array:
    """Truncated IS weights ``min(pi_trainer / mu, threshold)``, detached, float [B, T].

    ``w_{i,t} = min(exp(lp_{i,t} - mu_{i,t}), threshold)`` (``level="token"``) or
    ``min(exp(mean_t (lp_i - mu_i)), threshold)`` for every token of row i
    (``level="sequence"``, the per-row geometric-mean ratio). Invalid entries get 0.

    Args:
      logprobs: the trainer's old (or detached current) log-probs, float [B, T].
      behavior_logprobs: the rollout engine's log-probs mu, float [B, T].
      threshold: truncation level (> 0).
      mask: 0/1 or bool [B, T]; ``None`` means every entry is valid.
      level: "token" or "sequence".

    References:
      TIS: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
      training" (truncated importance sampling against the rollout engine's log-probs).

    Example:
      >>> import jax.numpy as jnp
      >>> from satjax.losses import tis_weights
      >>> lp = jnp.log(jnp.array([[0.5, 0.9]]))
      >>> mu = jnp.log(jnp.array([[0.25, 0.9]]))
      >>> print(tis_weights(lp, mu, threshold=1.5))  # ratios 2 and 1
      [[1.5 1. ]]
    """
    check_hparams(threshold=threshold)
    lr, valid = _is_log_ratio(logprobs, behavior_logprobs, mask, level)
    wts = jnp.minimum(jnp.exp(lr), jnp.asarray(threshold, lr.dtype))
    return jax.lax.stop_gradient(jnp.where(valid, wts, jnp.zeros((), lr.dtype)))


def mis_mask(logprobs: Array, behavior_logprobs: Array, *, threshold: float,
             mask: Array | None = None, level: str = HParams.is_level,
             low_threshold: float | None = None) -> Array:
    """Masked IS: float 0/1 [B, T], 0 where the IS ratio ``pi_trainer / mu`` exceeds
    ``threshold`` (or falls below ``low_threshold`` when given) and at invalid entries.

    ``m_{i,t} = 1[low_threshold <= r_{i,t} <= threshold]`` with ``r`` the token ratio
    ``exp(lp - mu)`` (``level="token"``) or, ``level="sequence"``, the row's
    geometric-mean ratio (dropping whole rows). Arguments as :func:`tis_weights`.

    References:
      MIS: masked importance sampling, IcePop-style: instead of truncating the ratio
      (TIS), tokens whose train/rollout ratio leaves the band are dropped from the
      gradient. TIS: Yao et al. 2025, "Your efficient RL framework secretly brings you
      off-policy RL training".

    Example:
      >>> import jax.numpy as jnp
      >>> from satjax.losses import mis_mask
      >>> lp = jnp.log(jnp.array([[0.5, 0.9]]))
      >>> mu = jnp.log(jnp.array([[0.25, 0.9]]))
      >>> mis_mask(lp, mu, threshold=1.5).tolist()  # ratio 2 is dropped
      [[0.0, 1.0]]
    """
    check_hparams(threshold=threshold)
    if low_threshold is not None:
        check_hparams(low_threshold=low_threshold)
    lr, valid = _is_log_ratio(logprobs, behavior_logprobs, mask, level)
    ratio = jnp.exp(lr)
    keep = valid & (ratio <= jnp.asarray(threshold, lr.dtype))
    if low_threshold is not None:
        keep = keep & (ratio >= jnp.asarray(low_threshold, lr.dtype))
    return jax.lax.stop_gradient(keep.astype(lr.dtype))
