"""SAT (Staleness-Adaptive Trust Region): contraction kernels and the SAT clip interval.

SAT shrinks the PPO/GSPO clip radius of samples whose staleness proxy ``d = sg(lp - mu)``
is in the tail of the batch, on the side the proxy points to (sign selection). The Hill
kernel is the SAT paper's; the Gauss kernel is this project's formalisation (both are
described in docs/objectives.md). The SAT losses themselves live in
:mod:`satjax.losses.policy_gradient`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from satjax.losses._checks import check_shape, compute_dtype
from satjax.losses.hparams import SAT_DEFAULTS, Kernel, SatKernelHParams, Scale, check_hparams
from satjax.losses.quantile import masked_mean, masked_quantile

Array = jax.Array

_TINY = 1e-12  # keeps the gauss batch scale positive when every proxy is zero
_MAD_TO_STD = 1.4826  # median |x| of a zero-mean normal times this is its std


def hill_kernel(a: Array, valid: Array, hp: SatKernelHParams) -> Callable[[Array], Array]:
    """Hill kernel with its gate bound to the batch: ``phi(x) = 1 - lam (1 - cf)``.

    ``q`` = the ``hp.quantile`` of ``a = |d|`` (0 at invalid entries) over the valid
    entries, computed once here; ``phi`` then maps any ``x >= 0`` elementwise to
    ``cf = max(c_min, 2 / (1 + (x / q)^2))`` for ``x > q`` and 1 otherwise (1 everywhere
    when ``q == 0``); ``lam``, ``c_min``: ``hp``'s.
    """
    dt = a.dtype
    qv = masked_quantile(a, hp.quantile, valid)
    safe_q = jnp.where(qv > 0, qv, jnp.ones((), dt))

    # A scalar reciprocal, so phi has no elementwise division: XLA then fuses phi into
    # each consumer instead of writing u to memory first (one pass less per batch).
    inv_q = 1.0 / safe_q

    def phi(x: Array) -> Array:
        u = x * inv_q
        cf = jnp.maximum(jnp.asarray(hp.c_min, dt), 2.0 / (1.0 + u * u))
        cf = jnp.where((qv > 0) & (x > qv), cf, jnp.ones((), dt))
        return 1.0 - jnp.asarray(hp.lam, dt) * (1.0 - cf)

    return phi


def gauss_kernel(a: Array, valid: Array, hp: SatKernelHParams) -> Callable[[Array], Array]:
    """Gauss kernel with its scale bound to the batch: ``phi(x) = 1 - lam k(x)``,
    ``k(x) = 1 - exp(-max(0, x / sigma - c)^2 / (2 w^2))`` (``lam``, ``c``, ``w``: ``hp``'s).

    ``sigma`` is the batch scale of ``a = |d|`` over the valid entries: ``sqrt(mean a^2)``
    (``hp.scale="rms"``) or ``1.4826 * median a`` (``"mad"``), plus 1e-12.
    """
    dt = a.dtype
    if hp.scale == "rms":
        sigma = jnp.sqrt(masked_mean(a * a, valid))
    else:
        sigma = _MAD_TO_STD * masked_quantile(a, 0.5, valid)
    sigma = sigma + _TINY

    def phi(x: Array) -> Array:
        excess = jnp.maximum(x / sigma - jnp.asarray(hp.c, dt), 0.0)
        k = 1.0 - jnp.exp(-(excess * excess) / (2.0 * jnp.asarray(hp.w, dt) ** 2))
        return 1.0 - jnp.asarray(hp.lam, dt) * k

    return phi


def tail_kernel(d: Array, valid: Array, hp: SatKernelHParams) -> Callable[[Array], Array]:
    """The contraction kernel ``hp.kernel`` with its batch statistic taken from the
    (detached) ``d``.

    Returns ``phi``: ``phi(|d_i|)`` is entry i's factor in [0, 1] (1 = keep the PPO/GSPO
    radius), elementwise on any shape. The batch statistic (hill: the gate quantile; gauss:
    the scale) is computed once, here, over the valid entries of ``|d|``. ``phi`` is
    non-increasing with ``phi(0) = 1``, so the smallest factor over any set of entries is
    ``phi(max |d|)`` over that set: a reduction of ``|d|``, not a pass over the factors.
    """
    d = jax.lax.stop_gradient(d)
    a = jnp.where(valid, jnp.abs(d), jnp.zeros((), d.dtype))
    if hp.kernel == "gauss":
        return gauss_kernel(a, valid, hp)
    return hill_kernel(a, valid, hp)  # the paper's


def tail_factor(d: Array, valid: Array, hp: SatKernelHParams) -> Array:
    """Contraction factor in [0, 1] for each entry of the (detached) proxy ``d``.

    Factor 1 means "keep the PPO/GSPO radius"; invalid entries always get 1.
    """
    d = jax.lax.stop_gradient(d)
    phi = tail_kernel(d, valid, hp)
    return jnp.where(valid, phi(jnp.abs(d)), jnp.ones((), d.dtype))


def sign_selected_bounds(d: Array, f_lo: Array, f_hi: Array, eps_low: Any,
                         eps_high: Any) -> tuple[Array, Array]:
    """Sign-selected contraction: d<0 shrinks the low radius, d>0 the high radius."""
    one = jnp.ones((), d.dtype)
    lo = 1.0 - jnp.asarray(eps_low, d.dtype) * jnp.where(d < 0, f_lo, one)
    hi = 1.0 + jnp.asarray(eps_high, d.dtype) * jnp.where(d > 0, f_hi, one)
    return lo, hi


def sat_interval(d: Array, *, eps_low: float, eps_high: float, c: float = SAT_DEFAULTS.c,
                 w: float = SAT_DEFAULTS.w, lam: float = SAT_DEFAULTS.lam,
                 mask: Array | None = None, kernel: Kernel = SAT_DEFAULTS.kernel,
                 quantile: float = SAT_DEFAULTS.quantile, c_min: float = SAT_DEFAULTS.c_min,
                 scale: Scale = SAT_DEFAULTS.scale) -> tuple[Array, Array]:
    """SAT clip bounds ``(1 - eps_lo_i, 1 + eps_hi_i)`` from the staleness proxy ``d``.

    With ``f_i`` in [0, 1] the kernel's contraction factor of entry i:
    ``lo_i = 1 - eps_low * (f_i if d_i < 0 else 1)``,
    ``hi_i = 1 + eps_high * (f_i if d_i > 0 else 1)``.

    Args:
      d: proxy, float [B] (sequence proxy) or [B, T] (token proxy). Detached inside.
      eps_low, eps_high: the PPO/GSPO radii (>= 0).
      c, w, scale: gauss kernel gate (in units of the batch scale) and width; ``scale``
        "rms" (sqrt of the mean d^2) or "mad" (1.4826 * median |d|), over valid entries.
      lam: contraction strength in [0, 1]; 0 gives the PPO/GSPO interval exactly.
      mask: 0/1 or bool of ``d``'s shape; statistics use valid entries only, invalid
        entries get the uncontracted bounds.
      kernel: "hill" (default, the paper's: q = quantile of |d|, u = |d|/q,
        factor max(c_min, 2/(1+u^2)) for u > 1) or "gauss" (``1 - exp(-max(0,
        |d|/sigma - c)^2 / (2 w^2))``, this project's formalisation).
      quantile, c_min: hill kernel gate level and floor.

    Returns:
      ``(lo, hi)`` of ``d``'s shape: d > 0 contracts only ``hi``, d < 0 only ``lo``.
      ``1 - eps_low <= lo <= 1 <= hi <= 1 + eps_high`` always (containment).

    References:
      SAT, the Staleness-Adaptive Trust Region (the Hill kernel and sign selection);
      docs/objectives.md gives the math this implementation follows.

    Example:
      >>> import jax.numpy as jnp
      >>> from satjax.losses import sat_interval
      >>> d = jnp.array([0.0, 0.01, -0.01, 0.01, 5.0])  # one very stale sample
      >>> lo, hi = sat_interval(d, eps_low=0.2, eps_high=0.2)
      >>> [round(float(x), 3) for x in hi]  # only its high bound shrinks
      [1.2, 1.2, 1.2, 1.2, 1.106]
      >>> [round(float(x), 3) for x in lo]
      [0.8, 0.8, 0.8, 0.8, 0.8]
    """
    check_hparams(eps_low=eps_low, eps_high=eps_high)
    hp = SatKernelHParams(c=c, w=w, lam=lam, kernel=kernel, quantile=quantile, c_min=c_min,
                          scale=scale)  # validates them
    d = jnp.asarray(d)
    if d.ndim not in (1, 2):
        raise ValueError(f"d: must have shape [B] or [B, T], got {d.shape}")
    if mask is not None:
        check_shape("mask", mask, d.shape, "d.shape")
    d = jax.lax.stop_gradient(d.astype(compute_dtype(d)))
    valid = jnp.ones(d.shape, bool) if mask is None else jnp.asarray(mask).astype(bool)
    f = tail_factor(d, valid, hp)
    return sign_selected_bounds(d, f, f, eps_low, eps_high)
