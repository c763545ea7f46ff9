"""SAT (Staleness-Adaptive Trust Region): contraction kernels and the SAT clip interval.

SAT shrinks the PPO/GSPO clip radius of samples whose staleness proxy ``d = sg(lp - mu)``
is in the tail of the batch, on the side the proxy points to (sign selection). The
``paper`` kernel is the authors' rule (their project page, Eq. 3.1-3.6); ``smooth`` and
``gauss`` are this project's earlier variants, kept as named options (docs/objectives.md
shows all three). The SAT losses themselves live in :mod:`satjax.losses.policy_gradient`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from satjax.losses._checks import check_shape, compute_dtype
from satjax.losses.hparams import SAT_DEFAULTS, Kernel, SatKernelHParams, Scale, check_hparams
from satjax.losses.quantile import masked_mean, masked_quantile

Array = jax.Array

_TINY = 1e-12  # keeps the gauss batch scale positive when every proxy is zero
_MAD_TO_STD = 1.4826  # median |x| of a zero-mean normal times this is its std


class TailKernel(NamedTuple):
    """A contraction kernel bound to its batch statistic.

    ``phi(x)`` maps ``x = |d| >= 0`` elementwise to the factor in (0, 1] that multiplies
    the radius on ``d``'s side (1: keep the PPO/GSPO radius); it is non-increasing in ``x``
    with ``phi(0) = 1``. ``scale`` is the batch statistic (the gate ``q`` of the paper and
    smooth kernels, ``sigma`` of the gauss kernel), one per row's micro-batch: shape [B]
    for ``d`` of shape [B] or [B, T].
    """

    phi: Callable[[Array], Array]
    scale: Array


def _per_row(stat: Array, x: Array) -> Array:
    """A per-row statistic [B] broadcast against ``x`` [B] or [B, T] (or a scalar ``x``)."""
    if x.ndim == 0:
        return stat
    return stat.reshape(stat.shape + (1,) * (x.ndim - 1))


def _grouped(statistic: Callable[[Array, Array], Array], a: Array, valid: Array,
             microbatches: int) -> Array:
    """``statistic(a_m, valid_m)`` of each micro-batch ``m`` as a per-row array [B].

    Rows i, i + M, i + 2M, ... form micro-batch i (M = ``microbatches``): the strided split
    of the train step's gradient accumulation, so a row's statistic is that of the rows
    it is differentiated with.
    """
    b = a.shape[0]
    if microbatches == 1:
        return jnp.broadcast_to(statistic(a, valid), (b,))
    if b % microbatches:
        raise ValueError(f"microbatches: must divide the batch's {b} rows, got {microbatches}")

    def split(x: Array) -> Array:  # [B, ...] -> [M, B/M, ...], micro-batch m = rows m::M
        return jnp.swapaxes(x.reshape(b // microbatches, microbatches, *x.shape[1:]), 0, 1)

    per_group = jax.vmap(statistic)(split(a), split(valid))  # [M]
    return jnp.tile(per_group, b // microbatches)  # row r -> group r % M


def paper_kernel(a: Array, valid: Array, hp: SatKernelHParams,
                 microbatches: int = 1) -> TailKernel:
    """The authors' kernel: ``phi(x) = 1 / (1 + (x / q)^2)`` if ``q > 0`` and ``x > q``,
    else 1.

    ``q`` is the lower empirical ``hp.quantile`` of ``a = |d|`` over the valid entries
    (``inf{x : F(x) >= level}``, no interpolation; Eq. 3.3); the gate is strict, so the
    factor jumps from 1 to 1/2 at ``q`` and falls towards 0 beyond it (no floor).
    """
    dt = a.dtype
    q = _grouped(lambda x, v: masked_quantile(x, hp.quantile, v, method="inverted_cdf"),
                 a, valid, microbatches)
    inv_q = 1.0 / jnp.where(q > 0, q, jnp.ones((), dt))  # scalar-per-row reciprocal

    def phi(x: Array) -> Array:
        qx, u = _per_row(q, x), x * _per_row(inv_q, x)
        return jnp.where((qx > 0) & (x > qx), 1.0 / (1.0 + u * u), jnp.ones((), dt))

    return TailKernel(phi, q)


def smooth_kernel(a: Array, valid: Array, hp: SatKernelHParams,
                  microbatches: int = 1) -> TailKernel:
    """This project's continuous Hill variant: ``phi(x) = 1 - lam (1 - cf)`` with
    ``cf = max(c_min, 2 / (1 + (x / q)^2))`` for ``x > q`` and 1 otherwise.

    ``q`` = numpy's linearly interpolated ``hp.quantile`` of ``a = |d|`` over the valid
    entries; ``cf`` is 1 at the gate (continuous there), half the paper's contraction
    beyond it (``x = 2q`` gives 0.4, the paper 0.2), floored at ``c_min``.
    """
    dt = a.dtype
    q = _grouped(lambda x, v: masked_quantile(x, hp.quantile, v), a, valid, microbatches)
    inv_q = 1.0 / jnp.where(q > 0, q, jnp.ones((), dt))

    def phi(x: Array) -> Array:
        qx, u = _per_row(q, x), x * _per_row(inv_q, x)
        cf = jnp.maximum(jnp.asarray(hp.c_min, dt), 2.0 / (1.0 + u * u))
        cf = jnp.where((qx > 0) & (x > qx), cf, jnp.ones((), dt))
        return 1.0 - jnp.asarray(hp.lam, dt) * (1.0 - cf)

    return TailKernel(phi, q)


def gauss_kernel(a: Array, valid: Array, hp: SatKernelHParams,
                 microbatches: int = 1) -> TailKernel:
    """This project's Gauss kernel: ``phi(x) = 1 - lam k(x)``,
    ``k(x) = 1 - exp(-max(0, x / sigma - c)^2 / (2 w^2))`` (``lam``, ``c``, ``w``: ``hp``'s).

    ``sigma`` is the batch scale of ``a = |d|`` over the valid entries: ``sqrt(mean a^2)``
    (``hp.scale="rms"``) or ``1.4826 * median a`` (``"mad"``), plus 1e-12.
    """
    dt = a.dtype

    def scale(x: Array, v: Array) -> Array:
        if hp.scale == "rms":
            return jnp.sqrt(masked_mean(x * x, v)) + _TINY
        return _MAD_TO_STD * masked_quantile(x, 0.5, v) + _TINY

    sigma = _grouped(scale, a, valid, microbatches)

    def phi(x: Array) -> Array:
        excess = jnp.maximum(x / _per_row(sigma, x) - jnp.asarray(hp.c, dt), 0.0)
        k = 1.0 - jnp.exp(-(excess * excess) / (2.0 * jnp.asarray(hp.w, dt) ** 2))
        return 1.0 - jnp.asarray(hp.lam, dt) * k

    return TailKernel(phi, sigma)


_KERNELS = {"paper": paper_kernel, "smooth": smooth_kernel, "gauss": gauss_kernel}


def tail_kernel(d: Array, valid: Array, hp: SatKernelHParams,
                microbatches: int = 1) -> TailKernel:
    """The contraction kernel ``hp.kernel`` with its batch statistic taken from the
    (detached) proxy ``d`` [B] or [B, T] over its valid entries, per micro-batch.

    ``microbatches`` (M): the rows form M strided micro-batches (rows m, m + M, ...) and
    each has its own statistic when ``hp.scope`` is "microbatch"; with scope "batch" (or
    M = 1) one statistic covers the whole batch. ``phi(|d_i|)`` is entry i's factor (1 =
    keep the PPO/GSPO radius); ``phi`` is non-increasing with ``phi(0) = 1``.
    """
    d = jax.lax.stop_gradient(d)
    a = jnp.where(valid, jnp.abs(d), jnp.zeros((), d.dtype))
    groups = microbatches if hp.scope == "microbatch" else 1
    return _KERNELS[hp.kernel](a, valid, hp, groups)


def sign_selected_bounds(d: Array, f_lo: Array, f_hi: Array, eps_low: Any,
                         eps_high: Any) -> tuple[Array, Array]:
    """Sign-selected contraction: d<0 shrinks the low radius, d>0 the high radius.

    This is the paper's ``c- = psi(u-)``, ``c+ = psi(u+)`` with ``u+- = [+-d]+``: the
    factor of the side ``d`` does not point to is ``psi(0) = 1``.
    """
    one = jnp.ones((), d.dtype)
    lo = 1.0 - jnp.asarray(eps_low, d.dtype) * jnp.where(d < 0, f_lo, one)
    hi = 1.0 + jnp.asarray(eps_high, d.dtype) * jnp.where(d > 0, f_hi, one)
    return lo, hi


def sat_interval(d: Array, *, eps_low: float, eps_high: float, mask: Array | None = None,
                 kernel: Kernel = SAT_DEFAULTS.kernel, quantile: float = SAT_DEFAULTS.quantile,
                 lam: float = SAT_DEFAULTS.lam, c_min: float = SAT_DEFAULTS.c_min,
                 c: float = SAT_DEFAULTS.c, w: float = SAT_DEFAULTS.w,
                 scale: Scale = SAT_DEFAULTS.scale) -> tuple[Array, Array]:
    """SAT clip bounds ``(1 - eps_low c-_i, 1 + eps_high c+_i)`` from the proxy ``d``.

    The default (``kernel="paper"``) is the authors' rule, with ``|d|`` over the valid
    entries of ``d`` as the current micro-batch:

    * ``q = inf{x >= 0 : F(x) >= quantile}``, ``F`` the empirical CDF of ``|d|`` (the
      lower empirical quantile, no interpolation);
    * ``psi(u) = 1 / (1 + (u / q)^2)``, ``u+ = [d]+``, ``u- = [-d]+``;
    * ``c+- = psi(u+-)`` if ``q > 0`` and ``|d| > q`` (strict), else 1;
    * ``lo = 1 - eps_low c-``, ``hi = 1 + eps_high c+``.

    Args:
      d: proxy, float [B] (one entry per sequence) or [B, T] (per token). Detached inside.
      eps_low, eps_high: the PPO/GSPO radii (>= 0).
      mask: 0/1 or bool of ``d``'s shape; the statistics use valid entries only, invalid
        entries get the uncontracted bounds.
      kernel: "paper" (the rule above), or this project's "smooth" (factor
        ``1 - lam (1 - max(c_min, 2 / (1 + (|d|/q)^2)))`` beyond the gate, ``q`` the
        linearly interpolated quantile: continuous at the gate) or "gauss" (factor
        ``1 - lam (1 - exp(-max(0, |d|/sigma - c)^2 / (2 w^2)))``, ``sigma`` the batch
        "rms" or "mad" ``scale`` of ``|d|``).
      quantile: the gate's level (paper, smooth).
      lam, c_min: smooth's strength and floor (lam also gauss's); c, w, scale: gauss's.
        Each is an error unless the kernel reads it or it keeps its default.

    Returns:
      ``(lo, hi)`` of ``d``'s shape: d > 0 contracts only ``hi``, d < 0 only ``lo``.
      ``1 - eps_low <= lo <= 1 <= hi <= 1 + eps_high`` always (containment).

    References:
      SAT, the Staleness-Adaptive Trust Region: the authors' project page
      (jyyang26.github.io/stable_async_analysis, Eq. 3.1-3.6); docs/objectives.md.

    Example:
      >>> import jax.numpy as jnp
      >>> from satjax.losses import sat_interval
      >>> d = jnp.array([0.01, -0.01, 0.02, -0.02, 0.01, 0.01, 0.02, 0.0, -0.01, 0.04])
      >>> lo, hi = sat_interval(d, eps_low=0.2, eps_high=0.2)  # q = 0.02: 0.04 is gated
      >>> [round(float(x), 3) for x in hi]  # c+ = 1 / (1 + 2^2) = 0.2 on its high side
      [1.2, 1.2, 1.2, 1.2, 1.2, 1.2, 1.2, 1.2, 1.2, 1.04]
      >>> [round(float(x), 3) for x in lo]
      [0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8]
    """
    check_hparams(eps_low=eps_low, eps_high=eps_high)
    hp = SatKernelHParams(kernel=kernel, quantile=quantile, lam=lam, c_min=c_min, c=c, w=w,
                          scale=scale)  # validates them
    d = jnp.asarray(d)
    if d.ndim not in (1, 2):
        raise ValueError(f"d: must have shape [B] or [B, T], got {d.shape}")
    if mask is not None:
        check_shape("mask", mask, d.shape, "d.shape")
    d = jax.lax.stop_gradient(d.astype(compute_dtype(d)))
    valid = jnp.ones(d.shape, bool) if mask is None else jnp.asarray(mask).astype(bool)
    f = jnp.where(valid, tail_kernel(d, valid, hp).phi(jnp.abs(d)), jnp.ones((), d.dtype))
    return sign_selected_bounds(d, f, f, eps_low, eps_high)
