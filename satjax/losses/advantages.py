"""Advantage estimators: GRPO's group-relative advantages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from satjax.losses._checks import check_finite_where_valid, compute_dtype
from satjax.losses.hparams import GroupAdvantageHParams, check_hparams

Array = jax.Array


def group_advantages(rewards: Array, group_size: int, *,
                     normalize_std: bool = GroupAdvantageHParams.normalize_std,
                     ddof: int = GroupAdvantageHParams.ddof,
                     eps: float = GroupAdvantageHParams.eps) -> Array:
    """GRPO group-relative advantages, float [B] from rewards [B].

    Consecutive blocks of ``group_size`` rows are one prompt's group:
    ``A = r - mean_group(r)``, divided by ``std_group(r) + eps`` when ``normalize_std``,
    with ``std = sqrt(sum (r - mean)^2 / max(G - ddof, 1))``: ``ddof=1`` (default) is the
    sample std of verl, TRL and slime, ``ddof=0`` the population std. A group of one has
    advantage 0 whatever ``ddof`` (its std is taken as 0 rather than 0/0).

    References:
      GRPO: Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning
      in Open Language Models", arXiv:2402.03300.

    Example:
      >>> import jax.numpy as jnp
      >>> from satjax.losses import group_advantages
      >>> r = jnp.array([1.0, 0.0, 3.0, 3.0])  # two groups of two
      >>> group_advantages(r, 2, normalize_std=False).tolist()
      [0.5, -0.5, 0.0, 0.0]
    """
    r = jnp.asarray(rewards)
    if r.ndim != 1:
        raise ValueError(f"rewards: must have shape [B], got {r.shape}")
    if not isinstance(group_size, int | np.integer) or group_size < 1:
        raise ValueError(f"group_size: must be a positive int, got {group_size!r}")
    if r.shape[0] % group_size:
        raise ValueError(f"group_size: must divide the batch size {r.shape[0]}, "
                         f"got {group_size!r}")
    check_hparams(normalize_std=normalize_std, ddof=ddof, eps=eps)
    check_finite_where_valid("rewards", r, jnp.ones(r.shape, bool))
    r = r.astype(compute_dtype(r))
    g = r.reshape(-1, group_size)
    a = g - jnp.mean(g, axis=1, keepdims=True)
    if normalize_std:
        var = jnp.sum(a * a, axis=1, keepdims=True) / max(group_size - ddof, 1)
        a = a / (jnp.sqrt(var) + eps)
    return a.reshape(-1)
