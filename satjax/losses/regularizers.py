"""Per-token regularisers added to a policy-gradient loss: KL to a reference policy.

The trainer adds ``kl_coef * masked_mean(kl_penalty(...))`` and ``-entropy_coef *
masked_mean(entropy)`` to the objective's loss (``satjax.train.step``); the objectives
themselves (:mod:`satjax.objectives`) stay unchanged for direct callers. The token entropy
comes from :func:`satjax.model.logprobs.chunked_logprobs_entropy` (it needs the whole
vocabulary distribution, the log-probs here only the sampled token's).
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp

from satjax.losses._checks import check_choice, check_shape

Array = jax.Array

KlEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KlEstimator)


def kl_penalty(logprobs: Array, ref_logprobs: Array, mask: Array, estimator: str) -> Array:
    """Per-token estimate of ``KL(pi || pi_ref)`` from the sampled tokens, float [B, T].

    With ``x = ref_logprobs - logprobs`` (``log pi_ref / pi`` of the sampled token):

    * ``k1 = -x`` (unbiased when the tokens come from ``pi``, can be negative);
    * ``k2 = x**2 / 2`` (biased, low variance, always >= 0);
    * ``k3 = exp(x) - 1 - x`` (unbiased when the tokens come from ``pi``, always >= 0;
      GRPO's penalty).

    The gradient flows through ``logprobs`` only (``ref_logprobs`` is detached). Invalid
    entries (``mask`` 0) are 0; reduce with :func:`satjax.losses.masked_mean`.

    References:
      Schulman 2020, "Approximating KL Divergence" (joschu.net/blog/kl-approx.html);
      GRPO: Shao et al. 2024, arXiv:2402.03300 (the k3 penalty to a reference policy).

    Example:
      >>> import jax.numpy as jnp
      >>> from satjax.losses import kl_penalty
      >>> lp, ref = jnp.log(jnp.array([[0.5, 0.25]])), jnp.log(jnp.array([[0.25, 0.25]]))
      >>> [round(float(v), 4) for v in kl_penalty(lp, ref, jnp.ones((1, 2)), "k3")[0]]
      [0.1931, 0.0]
    """
    check_choice("estimator", estimator, KL_ESTIMATORS)
    check_shape("ref_logprobs", ref_logprobs, jnp.shape(logprobs), "logprobs.shape")
    check_shape("mask", mask, jnp.shape(logprobs), "logprobs.shape")
    valid = jnp.asarray(mask) > 0
    lp = jnp.asarray(logprobs).astype(jnp.float32)
    x = jnp.where(valid, jax.lax.stop_gradient(jnp.asarray(ref_logprobs).astype(jnp.float32))
                  - lp, 0.0)
    if estimator == "k1":
        k = -x
    elif estimator == "k2":
        k = 0.5 * jnp.square(x)
    else:
        k = jnp.expm1(x) - x
    return jnp.where(valid, k, 0.0)
