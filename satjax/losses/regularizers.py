"""Regularisers added to a policy-gradient loss: KL to a reference policy.

The trainer adds ``kl_coef * reference_kl(...)`` and ``-entropy_coef * masked_mean(entropy)``
to the objective's loss (``satjax.train.step``); the objectives themselves
(:mod:`satjax.objectives`) stay unchanged for direct callers. The token entropy comes from
:func:`satjax.model.logprobs.chunked_logprobs_entropy` (it needs the whole vocabulary
distribution, the log-probs here only the sampled token's).
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp

from satjax.losses._checks import check_choice, check_shape
from satjax.losses.quantile import masked_mean

Array = jax.Array

KlEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KlEstimator)
# token: the estimator per token, mean over the valid tokens; sequence: the estimator of
# each row's length-normalised log-ratio, mean over the rows with a valid token
KlLevel = Literal["token", "sequence"]
KL_LEVELS: tuple[str, ...] = get_args(KlLevel)

# verl's low_var_kl clamps: the log-ratio before exp (so exp cannot overflow and its
# gradient stays finite), then the estimate itself
_LOW_VAR_LOG_RATIO_CLAMP = 20.0
_LOW_VAR_KL_CLAMP = 10.0


def _estimate(x: Array, estimator: str) -> Array:
    """The estimator of ``KL(pi || pi_ref)`` at ``x = log pi_ref / pi``, elementwise."""
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * jnp.square(x)
    if estimator == "k3":
        return jnp.expm1(x) - x
    xc = jnp.clip(x, -_LOW_VAR_LOG_RATIO_CLAMP, _LOW_VAR_LOG_RATIO_CLAMP)
    return jnp.clip(jnp.expm1(xc) - xc, -_LOW_VAR_KL_CLAMP, _LOW_VAR_KL_CLAMP)


def _log_ratio(logprobs: Array, ref_logprobs: Array, mask: Array,
               estimator: str) -> tuple[Array, Array]:
    """``(x, valid)``: ``x = sg(ref_logprobs) - logprobs`` (float32 or wider, 0 where
    invalid) and the bool mask, after the argument checks."""
    check_choice("estimator", estimator, KL_ESTIMATORS)
    check_shape("ref_logprobs", ref_logprobs, jnp.shape(logprobs), "logprobs.shape")
    check_shape("mask", mask, jnp.shape(logprobs), "logprobs.shape")
    valid = jnp.asarray(mask) > 0
    lp = jnp.asarray(logprobs).astype(jnp.float32)
    ref = jax.lax.stop_gradient(jnp.asarray(ref_logprobs).astype(jnp.float32))
    return jnp.where(valid, ref - lp, 0.0), valid


def kl_penalty(logprobs: Array, ref_logprobs: Array, mask: Array, estimator: str) -> Array:
    """Per-token estimate of ``KL(pi || pi_ref)`` from the sampled tokens, float [B, T].

    With ``x = ref_logprobs - logprobs`` (``log pi_ref / pi`` of the sampled token):

    * ``k1 = -x`` (unbiased when the tokens come from ``pi``, can be negative);
    * ``k2 = x**2 / 2`` (biased, low variance, always >= 0);
    * ``k3 = exp(x) - 1 - x`` (unbiased when the tokens come from ``pi``, always >= 0;
      GRPO's penalty);
    * ``low_var_kl = clip(exp(x') - 1 - x', -10, 10)`` with ``x' = clip(x, -20, 20)``:
      verl's name for k3 with its clamps (the SAT paper's setting). It equals k3 while
      k3 <= 10 (``x`` in about [-11, 2.5]); beyond, the value is 10 and the gradient 0.

    The gradient flows through ``logprobs`` only (``ref_logprobs`` is detached). Invalid
    entries (``mask`` 0) are 0; reduce with :func:`satjax.losses.masked_mean`, or use
    :func:`reference_kl`.

    References:
      Schulman 2020, "Approximating KL Divergence" (joschu.net/blog/kl-approx.html);
      GRPO: Shao et al. 2024, arXiv:2402.03300 (the k3 penalty to a reference policy);
      verl, ``verl/trainer/ppo/core_algos.py``, ``kl_penalty`` "low_var_kl"
      (github.com/volcengine/verl).

    Example:
      >>> import jax.numpy as jnp
      >>> from satjax.losses import kl_penalty
      >>> lp, ref = jnp.log(jnp.array([[0.5, 0.25]])), jnp.log(jnp.array([[0.25, 0.25]]))
      >>> [round(float(v), 4) for v in kl_penalty(lp, ref, jnp.ones((1, 2)), "k3")[0]]
      [0.1931, 0.0]
      >>> x = jnp.array([[3.0, -1.0]])  # log pi_ref / pi; k3 = 16.09 is clamped to 10
      >>> kl = kl_penalty(jnp.zeros((1, 2)), x, jnp.ones((1, 2)), "low_var_kl")
      >>> [round(float(v), 4) for v in kl[0]]
      [10.0, 0.3679]
    """
    x, valid = _log_ratio(logprobs, ref_logprobs, mask, estimator)
    return jnp.where(valid, _estimate(x, estimator), 0.0)


def sequence_kl_penalty(logprobs: Array, ref_logprobs: Array, mask: Array,
                        estimator: str) -> Array:
    """Per-row estimate of ``KL(pi || pi_ref)`` at the sequence level, float [B].

    The estimator of :func:`kl_penalty` applied to each row's length-normalised log-ratio
    to the reference, as GSPO's sequence ratio is length-normalised:

    ``x_i = (1 / |y_i|) sum_t (ref_logprobs_{i,t} - logprobs_{i,t})`` over row i's valid
    tokens, ``kl_i = k(x_i)``. A row without valid tokens gets 0. Gradient through
    ``logprobs`` only.

    References:
      GSPO: Zheng et al. 2025, arXiv:2507.18071 (the length-normalised sequence ratio);
      Schulman 2020, "Approximating KL Divergence".

    Example:
      >>> import jax.numpy as jnp
      >>> from satjax.losses import sequence_kl_penalty
      >>> lp = jnp.array([[-1.0, -2.0], [-1.0, 0.0]])
      >>> ref = jnp.array([[-1.5, -1.5], [-2.0, 0.0]])  # x = 0 and -1
      >>> mask = jnp.array([[1, 1], [1, 0]])
      >>> [round(float(v), 4) for v in sequence_kl_penalty(lp, ref, mask, "k3")]
      [0.0, 0.3679]
    """
    x, valid = _log_ratio(logprobs, ref_logprobs, mask, estimator)
    lengths = jnp.sum(valid.astype(x.dtype), axis=-1)
    x_seq = jnp.sum(x, axis=-1) / jnp.maximum(lengths, 1.0)
    return jnp.where(lengths > 0, _estimate(x_seq, estimator), 0.0)


def reference_kl(logprobs: Array, ref_logprobs: Array, mask: Array, *, estimator: str,
                 level: str) -> Array:
    """The KL-to-reference term the trainer adds (times ``kl_coef``), a scalar.

    * ``level="token"``: the mean of :func:`kl_penalty` over the valid tokens;
    * ``level="sequence"``: the mean of :func:`sequence_kl_penalty` over the rows with at
      least one valid token.

    0 when nothing is valid. ``estimator``: one of :data:`KL_ESTIMATORS`; ``level``: one
    of :data:`KL_LEVELS`.

    Example:
      >>> import jax.numpy as jnp
      >>> from satjax.losses import reference_kl
      >>> lp, ref = jnp.array([[-1.0, -2.0]]), jnp.array([[-2.0, -1.0]])  # x = -1, +1
      >>> float(reference_kl(lp, ref, jnp.ones((1, 2)), estimator="k2", level="token"))
      0.5
      >>> float(reference_kl(lp, ref, jnp.ones((1, 2)), estimator="k2", level="sequence"))
      0.0
    """
    check_choice("level", level, KL_LEVELS)
    if level == "token":
        return masked_mean(kl_penalty(logprobs, ref_logprobs, mask, estimator),
                           jnp.asarray(mask) > 0)
    rows = jnp.any(jnp.asarray(mask) > 0, axis=-1)
    return masked_mean(sequence_kl_penalty(logprobs, ref_logprobs, mask, estimator), rows)
