"""Pure-jnp policy-gradient losses: PPO-clip, GRPO, GSPO, GSPO-token, SAT-PPO, SAT-GRPO,
SAT-GSPO, DPPO (Binary-TV and Binary-KL).

Every function here is pure (no hidden state, no randomness) and safe under ``jax.jit``,
``jax.vmap`` and ``jax.grad``. Conventions shared by all losses:

* ``logprobs`` float [B, T]: current policy log-probs of the sampled response tokens
  (the only input gradients flow into).
* ``behavior_logprobs`` float [B, T]: log-probs reported by the rollout engine (mu).
* ``advantages`` float [B]: one advantage per sequence.
* ``mask`` 0/1 float or bool [B, T]: 1 marks a valid response token. Invalid entries may
  hold anything (even nan/inf); they never reach the loss. Rows without any valid token
  are ignored.
* ``old_logprobs`` optional float [B, T]: an explicit old/proximal policy. When given the
  importance ratio is taken against it (``ref`` below; else ``ref = mu``); the SAT
  staleness proxy is always taken against ``behavior_logprobs`` (docs/objectives.md).
* ``token_weights`` optional float [B, T]: detached multiplicative weights (e.g.
  :func:`~satjax.losses.tis_weights` or :func:`~satjax.losses.mis_mask`). Token-level
  losses multiply each token's surrogate; sequence-level losses multiply each sequence's
  surrogate by the mean weight of its valid tokens. Normalisers are not changed by the
  weights.

* ``microbatches`` (SAT losses; static int, default 1): the batch's rows form this many
  strided micro-batches (rows m, m + M, ...: the train step's gradient-accumulation split)
  and, with ``scope="microbatch"``, SAT's gate is taken per micro-batch, as the authors
  take it over "the current microbatch"; the loss's reduction stays over the whole batch.

Every loss returns ``(loss, aux)`` where ``loss`` is a scalar to *minimise* and ``aux`` is
a dict with exactly the keys in :data:`AUX_KEYS` (scalars, detached), so a trainer can log
a fixed key set whatever the objective. Hyperparameter defaults and ranges come from
:mod:`satjax.losses.hparams`.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from satjax.losses._checks import check_finite_where_valid, check_shape, compute_dtype, is_concrete
from satjax.losses.hparams import (
    CHOICES,
    RANGES,
    SAT_DEFAULTS,
    STATIC_NUMBERS,
    DppoHParams,
    DppoKlHParams,
    DppoTvClipHParams,
    DppoTvHParams,
    GrpoHParams,
    GspoHParams,
    GspoTokenHParams,
    Kernel,
    PpoClipHParams,
    SatGrpoHParams,
    SatGspoHParams,
    SatKernelHParams,
    SatPpoHParams,
    Scale,
    Scope,
    TokenClipHParams,
    check_hparams,
    check_kernel_params,
)
from satjax.losses.quantile import masked_mean
from satjax.losses.registry import register
from satjax.losses.sat import sign_selected_bounds, tail_kernel

Array = jax.Array

# every kernel's parameters, each once (their defaults and checks: SatKernelHParams)
KERNEL_PARAM_NAMES = tuple(dict.fromkeys(
    name for names in SatKernelHParams.KERNEL_PARAMS.values() for name in names))

AUX_KEYS = (
    "clip_frac_low",
    "clip_frac_high",
    "sat_q",
    "sat_tail_frac",
    "sat_c_plus_mean",
    "sat_c_minus_mean",
    "sat_min_factor",
    "sat_newly_clipped_frac",
    "sat_mean_lo_radius",
    "sat_mean_hi_radius",
    "proxy_abs_mean",
    "proxy_abs_max",
    "mismatch_abs_mean",
    "kl_k1",
    "kl_k3",
    "ratio_min",
    "ratio_mean",
    "ratio_max",
)
"""The metrics every loss returns. SAT's (neutral for the other losses: q 0, factors 1):

* ``sat_q``: the gate ``q`` (gauss: the scale ``sigma``), averaged over micro-batches;
* ``sat_tail_frac``: the realised gate rate, the share of SAT's units (tokens, or
  sequences for the per-sequence proxy) whose factor is below 1;
* ``sat_c_plus_mean`` / ``sat_c_minus_mean``: the mean ``c+`` / ``c-`` over those gated
  units (a gated unit with ``d < 0`` has ``c+ = 1``, and vice versa);
* ``sat_min_factor``: the smallest factor, ``min c``;
* ``sat_newly_clipped_frac``: units whose clip binds under SAT's bounds but not PPO's;
* ``sat_mean_lo_radius`` / ``sat_mean_hi_radius``: the mean contracted radii.

And for every loss: ``mismatch_abs_mean``, the authors' ``d-bar`` = mean ``|lp - mu|``
over valid tokens; ``kl_k1`` = mean ``mu - lp`` and ``kl_k3`` (the k1 and k3 estimates of
KL(mu || pi) on the behaviour's samples); ``proxy_abs_*`` are over the loss's own units.
"""


# --------------------------------------------------------------------------- helpers


def _masked_min(x: Array, valid: Array, neutral: float) -> Array:
    return jnp.min(jnp.where(valid, x, jnp.asarray(jnp.inf, x.dtype)), initial=neutral)


def _masked_max(x: Array, valid: Array, neutral: float) -> Array:
    return jnp.max(jnp.where(valid, x, jnp.asarray(-jnp.inf, x.dtype)), initial=neutral)


def clipped_surrogate(ratio: Array, advantages: Array, lo: Array | float,
                      hi: Array | float) -> Array:
    """Elementwise PPO surrogate ``min(r*A, clip(r, lo, hi)*A)`` (to maximise).

    All arguments broadcast together; returns their broadcast shape.

    References:
      PPO: Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
      arXiv:1707.06347.

    Example:
      >>> import jax.numpy as jnp
      >>> from satjax.losses import clipped_surrogate
      >>> print(clipped_surrogate(jnp.array([0.5, 1.5, 1.5]), jnp.array([1.0, 1.0, -1.0]),
      ...                         0.8, 1.2))
      [ 0.5  1.2 -1.5]
    """
    # Same value and gradient as the min form, but A = 0 with r = inf gives 0, not nan.
    return jnp.where(advantages >= 0, jnp.minimum(ratio, hi), jnp.maximum(ratio, lo)) * advantages


def _ratio(log_ratio: Array) -> Array:
    """exp of a log-ratio capped at half the dtype's overflow point (44 in float32).

    The cap only bites on degenerate inputs (ratios above ~1e19), where it keeps the loss
    and its gradient finite instead of inf/nan; there the gradient of the ratio is 0.
    """
    cap = 0.5 * float(np.log(jnp.finfo(log_ratio.dtype).max))
    return jnp.exp(jnp.minimum(log_ratio, cap))


# --------------------------------------------------------------------------- batch prep


def _validate_batch(logprobs: Array, behavior_logprobs: Array, advantages: Array,
                    mask: Array, old_logprobs: Array | None,
                    token_weights: Array | None) -> None:
    """Shape checks always; value checks (empty mask, nan/inf) only on concrete inputs."""
    lp = logprobs
    if jnp.ndim(lp) != 2:
        raise ValueError(f"logprobs: must have shape [B, T], got {jnp.shape(lp)}")
    b, t = jnp.shape(lp)
    check_shape("behavior_logprobs", behavior_logprobs, (b, t), "logprobs.shape")
    check_shape("mask", mask, (b, t), "logprobs.shape")
    check_shape("advantages", advantages, (b,), "[B]")
    if old_logprobs is not None:
        check_shape("old_logprobs", old_logprobs, (b, t), "logprobs.shape")
    if token_weights is not None:
        check_shape("token_weights", token_weights, (b, t), "logprobs.shape")
    valid = jnp.asarray(mask).astype(bool)
    if is_concrete(valid) and not bool(np.any(np.asarray(valid))):
        raise ValueError("mask: must have at least one valid token, got all entries 0")
    check_finite_where_valid("logprobs", lp, valid)
    check_finite_where_valid("behavior_logprobs", behavior_logprobs, valid)
    if old_logprobs is not None:
        check_finite_where_valid("old_logprobs", old_logprobs, valid)
    check_finite_where_valid("advantages", advantages, jnp.ones((b,), bool))
    if token_weights is not None:
        check_finite_where_valid("token_weights", token_weights, valid)


class Prepared(NamedTuple):
    """A batch as every loss reads it (from :func:`_prepare`): promoted to the compute
    dtype (at least float32), masked entries zeroed so nan/inf padding never leaks,
    everything but ``lp`` detached. A pytree (a NamedTuple), so it crosses jit/vmap."""

    lp: Array         # [B, T] current log-probs (the only input gradients flow into)
    mu: Array         # [B, T] behaviour log-probs
    ref: Array        # [B, T] the ratio's reference: old_logprobs when given, else mu
    valid: Array      # [B, T] bool mask
    vf: Array         # [B, T] the mask as 0/1 floats
    lengths: Array    # [B] valid tokens per row
    row_valid: Array  # [B] rows with at least one valid token
    adv: Array        # [B] advantages
    w: Array          # [B, T] token weights (the mask when none are given)
    log_ratio: Array  # [B, T] lp - ref
    d_tok: Array      # [B, T] the staleness proxy sg(lp - mu)


def _prepare(logprobs: Array, behavior_logprobs: Array, advantages: Array, mask: Array,
             old_logprobs: Array | None, token_weights: Array | None) -> Prepared:
    """Masked, promoted arrays shared by every loss (see module docstring)."""
    _validate_batch(logprobs, behavior_logprobs, advantages, mask, old_logprobs,
                    token_weights)
    lp = jnp.asarray(logprobs)
    valid = jnp.asarray(mask).astype(bool)
    dt = compute_dtype(lp)
    zero = jnp.zeros((), dt)

    def clean(x: Array) -> Array:  # masked entries -> 0 so nan/inf padding never leaks
        return jnp.where(valid, jnp.asarray(x).astype(dt), zero)

    lp_c = clean(lp)
    mu = jax.lax.stop_gradient(clean(behavior_logprobs))
    ref = mu if old_logprobs is None else jax.lax.stop_gradient(clean(old_logprobs))
    vf = valid.astype(dt)
    lengths = jnp.sum(vf, axis=1)
    return Prepared(
        lp=lp_c, mu=mu, ref=ref, valid=valid, vf=vf, lengths=lengths,
        row_valid=lengths > 0,
        adv=jax.lax.stop_gradient(jnp.asarray(advantages).astype(dt)),
        w=vf if token_weights is None else jax.lax.stop_gradient(clean(token_weights)),
        # token log-ratio against the ratio reference, and the staleness proxy vs behaviour
        log_ratio=lp_c - ref,
        d_tok=jax.lax.stop_gradient(lp_c - mu))
def _seq_mean(x: Array, p: Prepared) -> Array:
    """Per-row mean over valid tokens, [B, T] -> [B] (0 for empty rows)."""
    return jnp.sum(x * p.vf, axis=1) / jnp.maximum(p.lengths, 1.0)


def _kl_k3(p: Prepared) -> Array:
    """k3 estimate of KL(behaviour || current) on behaviour samples, masked token mean."""
    r = p.d_tok
    return masked_mean(_ratio(r) - 1.0 - r, p.valid)


class SatFactors(NamedTuple):
    """SAT's contraction of each of its units (tokens or sequences), for the metrics:
    ``c_plus`` / ``c_minus`` (the factors of the high / low radius), ``weight`` (what a
    unit counts for: 1 per valid token or sequence, 0 elsewhere; a sequence's valid-token
    count for the broadcast proxy) and ``q`` (the gate per row, [B])."""

    c_plus: Array
    c_minus: Array
    weight: Array
    q: Array


def _aux(p: Prepared, *, ratio: Array, units_valid: Array, proxy: Array,
         lo: Array | float, hi: Array | float, eps_low: Any, eps_high: Any,
         sat: SatFactors | None, binds: tuple[Array, Array] | None = None) -> dict[str, Array]:
    """Scalar metrics over valid units (rows for sequence losses, tokens otherwise).

    Clip fractions count where the clip *binds* for the advantage's sign (verl's
    ``pg_clipfrac``): ``A > 0`` and ``r > hi`` (high) or ``A < 0`` and ``r < lo`` (low); a
    ratio outside the interval on the other side keeps its gradient and is not counted.
    An objective without a ratio interval (DPPO) passes its own ``binds`` (low, high): the
    units whose gradient it drops. For sequence-level losses each row counts once per valid
    token (token-weighted, as verl's GSPO); the other metrics are plain means over units.
    """
    dt = ratio.dtype
    one = jnp.ones((), dt)
    lo_ppo = 1.0 - jnp.asarray(eps_low, dt)
    hi_ppo = 1.0 + jnp.asarray(eps_high, dt)
    if ratio.ndim == 1:  # sequence level: weight each row by its valid-token count
        adv, clip_w = p.adv, p.lengths
    else:
        adv, clip_w = p.adv[:, None], p.vf
    n_clip = jnp.maximum(jnp.sum(clip_w), 1.0)

    def clip_mean(x: Array) -> Array:
        return jnp.sum(x.astype(dt) * clip_w) / n_clip

    binds_low, binds_high = binds or ((adv < 0) & (ratio < lo), (adv > 0) & (ratio > hi))
    aux = {
        "clip_frac_low": clip_mean(binds_low),
        "clip_frac_high": clip_mean(binds_high),
        "proxy_abs_mean": masked_mean(jnp.abs(proxy), units_valid),
        "proxy_abs_max": _masked_max(jnp.abs(proxy), units_valid, 0.0),
        "mismatch_abs_mean": masked_mean(jnp.abs(p.d_tok), p.valid),
        "kl_k1": -masked_mean(p.d_tok, p.valid),
        "kl_k3": _kl_k3(p),
        "ratio_min": _masked_min(ratio, units_valid, 1.0),
        "ratio_mean": masked_mean(ratio, units_valid),
        "ratio_max": _masked_max(ratio, units_valid, 1.0),
    }
    if sat is None:  # neutral SAT metrics for non-SAT losses
        aux.update(sat_q=jnp.zeros((), dt), sat_tail_frac=jnp.zeros((), dt),
                   sat_c_plus_mean=one, sat_c_minus_mean=one,
                   sat_newly_clipped_frac=jnp.zeros((), dt),
                   sat_min_factor=one, sat_mean_lo_radius=jnp.asarray(eps_low, dt) * one,
                   sat_mean_hi_radius=jnp.asarray(eps_high, dt) * one)
    else:
        # Binds under the SAT bounds but would not under the PPO/GSPO ones.
        newly = (binds_low & (ratio >= lo_ppo)) | (binds_high & (ratio <= hi_ppo))
        uw = sat.weight.astype(dt)
        factor = jnp.minimum(sat.c_plus, sat.c_minus)
        gated = (factor < 1.0).astype(dt) * uw
        # The SAT sums as one reduction of a stacked array: on XLA:CPU each separate
        # reduction of a computed [B, T] array is its own pass plus a write (262k tokens:
        # 0.6-0.8 ms for four, 0.3-0.45 ms stacked).
        n_gated, c_plus_sum, c_minus_sum, n_newly, lo_sum, hi_sum = jnp.sum(jnp.stack([
            gated, sat.c_plus * gated, sat.c_minus * gated, newly.astype(dt) * clip_w,
            jnp.broadcast_to(1.0 - lo, ratio.shape) * uw,
            jnp.broadcast_to(hi - 1.0, ratio.shape) * uw]), axis=tuple(range(1, ratio.ndim + 1)))
        n_units = jnp.maximum(jnp.sum(uw), 1.0)

        def gated_mean(total: Array) -> Array:  # 1 (no contraction) when nothing is gated
            return jnp.where(n_gated > 0, total / jnp.maximum(n_gated, 1.0), one)

        aux.update(
            sat_q=masked_mean(sat.q, p.row_valid),
            sat_tail_frac=n_gated / n_units,
            sat_c_plus_mean=gated_mean(c_plus_sum),
            sat_c_minus_mean=gated_mean(c_minus_sum),
            sat_min_factor=_masked_min(factor, uw > 0, 1.0),
            sat_newly_clipped_frac=n_newly / n_clip,
            sat_mean_lo_radius=lo_sum / n_units,
            sat_mean_hi_radius=hi_sum / n_units,
        )
    return {k: jax.lax.stop_gradient(aux[k]) for k in AUX_KEYS}


# --------------------------------------------------------------------------- jit wrapper


def _jit_loss(impl):
    """Validate eagerly (inputs and hyperparameters), then run ``impl`` under ``jax.jit``.

    String hyperparameters are static; numbers are traced, so sweeping them does not
    recompile. Inside an outer jit/grad the inner jit is simply inlined.
    """
    signature = inspect.signature(impl)
    static = tuple(k for k in (*CHOICES, *STATIC_NUMBERS, "microbatches")
                   if k in signature.parameters)
    jitted = jax.jit(impl, static_argnames=static)

    @functools.wraps(impl)
    def wrapper(*args: Any, **kwargs: Any) -> tuple[Array, dict[str, Array]]:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        check_hparams(**{k: v for k, v in given.items() if k in CHOICES or k in RANGES})
        if "kernel" in given:
            check_kernel_params(given["kernel"], {k: given[k] for k in KERNEL_PARAM_NAMES})
        microbatches = given.get("microbatches", 1)
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) \
                or microbatches < 1:
            raise ValueError(f"microbatches: must be an int >= 1, got {microbatches!r}")
        _validate_batch(*(given.get(k) for k in ("logprobs", "behavior_logprobs",
                                                 "advantages", "mask", "old_logprobs",
                                                 "token_weights")))
        return jitted(*args, **kwargs)

    return wrapper


# --------------------------------------------------------------------------- sequence level


def _sequence_objective(p: Prepared, lo: Array | float,
                        hi: Array | float) -> tuple[Array, Array]:
    """GSPO core: (loss, ratio [B]) with s_i = exp(mean_t log-ratio), bounds [B] or scalar."""
    s = _ratio(_seq_mean(p.log_ratio, p))
    seq_w = _seq_mean(p.w, p)
    j = clipped_surrogate(s, p.adv, lo, hi) * seq_w
    return -masked_mean(j, p.row_valid), s


def _ppo_bounds(p: Prepared, eps_low: Any, eps_high: Any) -> tuple[Array, Array]:
    dt = p.lp.dtype
    return 1.0 - jnp.asarray(eps_low, dt), 1.0 + jnp.asarray(eps_high, dt)


@register("sat_gspo", SatGspoHParams)
@_jit_loss
def sat_gspo_loss(logprobs: Array, behavior_logprobs: Array, advantages: Array, mask: Array,
                  *, eps_low: float, eps_high: float, kernel: Kernel = SAT_DEFAULTS.kernel,
                  quantile: float = SAT_DEFAULTS.quantile, lam: float = SAT_DEFAULTS.lam,
                  c_min: float = SAT_DEFAULTS.c_min, c: float = SAT_DEFAULTS.c,
                  w: float = SAT_DEFAULTS.w, scale: Scale = SAT_DEFAULTS.scale,
                  scope: Scope = SAT_DEFAULTS.scope, proxy: str = SatGspoHParams.proxy,
                  microbatches: int = 1, old_logprobs: Array | None = None,
                  token_weights: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """SAT-GSPO: GSPO with staleness-adaptive, sign-selected per-sequence clip bounds.

    ``J_i = min(s_i A_i, clip(s_i, 1 - eps_low c-_i, 1 + eps_high c+_i) A_i)`` with GSPO's
    ``s_i = exp(mean_t (lp - ref))`` and SAT's factors (:func:`~satjax.losses.sat_interval`)
    of the sequence's proxy; loss = ``-mean_i J_i`` over valid sequences (GSPO's reduction).

    ``proxy`` (the gate's statistics):

    * ``"broadcast"`` (default, the authors'): "the ratio scalar of its base objective",
      ``d_i = sg(mean_t (lp - mu))`` broadcast to each valid token of row i before the
      quantile, so ``q`` is token-weighted (a long sequence counts once per token) and
      the gate rate is a share of tokens;
    * ``"sequence"`` (ours): the same ``d_i``, each valid sequence counted once;
    * ``"token"`` (ours): ``d_{i,t} = sg(lp - mu)`` [B, T] over the valid tokens; row i's
      high radius shrinks by the smallest factor of its tokens with d > 0, its low radius
      by that of its tokens with d < 0.

    ``scope`` and ``microbatches``: the gate per micro-batch (module docstring). Other
    arguments: :func:`~satjax.losses.sat_interval` and :func:`gspo_loss`. With no sequence
    past the gate (``q = 0``, or no ``|d_i| > q``) the loss and its gradient are GSPO's bit
    for bit.

    Shapes: ``logprobs``, ``behavior_logprobs``, ``mask`` (and ``old_logprobs``,
    ``token_weights`` when given) [B, T]; ``advantages`` [B]; returns a scalar loss and
    ``aux`` of scalars keyed by :data:`AUX_KEYS` (conventions: module docstring).

    References:
      SAT, the Staleness-Adaptive Trust Region: the authors' project page
      (jyyang26.github.io/stable_async_analysis, Eq. 3.1-3.6 and "GSPO scope");
      GSPO: Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071.

    Example (the long rows set the token-weighted gate; the short stale one is past it):
      >>> import jax.numpy as jnp
      >>> from satjax import losses
      >>> lp = jnp.full((3, 5), -1.0)
      >>> d = jnp.array([0.1, 0.0, 0.5])  # each row's log-ratio, on every token
      >>> mask = jnp.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
      >>> adv = jnp.array([1.0, -1.0, 1.0])
      >>> _, aux = losses.sat_gspo_loss(lp, lp - d[:, None], adv, mask, eps_low=0.2,
      ...                               eps_high=0.2)  # 10 tokens: q = 9th smallest |d|
      >>> round(float(aux["sat_q"]), 4), round(float(aux["sat_tail_frac"]), 4)
      (0.1, 0.1)
      >>> round(float(aux["sat_c_plus_mean"]), 4)  # 1 / (1 + (0.5 / 0.1)^2)
      0.0385
      >>> _, aux = losses.sat_gspo_loss(lp, lp - d[:, None], adv, mask, eps_low=0.2,
      ...                               eps_high=0.2, proxy="sequence")  # 3 rows: q = 0.5
      >>> round(float(aux["sat_q"]), 4), round(float(aux["sat_tail_frac"]), 4)
      (0.5, 0.0)
    """
    p = _prepare(logprobs, behavior_logprobs, advantages, mask, old_logprobs, token_weights)
    hp = SatKernelHParams(kernel=kernel, quantile=quantile, lam=lam, c_min=c_min, c=c, w=w,
                          scale=scale, scope=scope)
    d_seq = _seq_mean(p.d_tok, p)
    one = jnp.ones((), d_seq.dtype)
    if proxy == "token":
        tk = tail_kernel(p.d_tok, p.valid, hp, microbatches)
        # Sign selection per token: tokens with d > 0 can only shrink the row's high
        # radius, tokens with d < 0 only its low radius, each by the row's minimum factor.
        # phi is non-increasing with phi(0) = 1, so that minimum is phi of the row's
        # largest |d| on that side (d is 0 at invalid tokens): two row reductions of d and
        # the kernel on [B], instead of the kernel on every token.
        zero = jnp.zeros((), p.d_tok.dtype)
        c_plus = tk.phi(jnp.maximum(jnp.max(p.d_tok, axis=1), zero))
        c_minus = tk.phi(jnp.maximum(-jnp.min(p.d_tok, axis=1), zero))
        weight = p.row_valid
    else:
        if proxy == "broadcast":
            tk = tail_kernel(d_seq[:, None] * p.vf, p.valid, hp, microbatches)
            weight = p.lengths
        else:
            tk = tail_kernel(d_seq, p.row_valid, hp, microbatches)
            weight = p.row_valid
        f = jnp.where(p.row_valid, tk.phi(jnp.abs(d_seq)), one)
        c_plus, c_minus = jnp.where(d_seq > 0, f, one), jnp.where(d_seq < 0, f, one)
    lo = 1.0 - jnp.asarray(eps_low, c_minus.dtype) * c_minus
    hi = 1.0 + jnp.asarray(eps_high, c_plus.dtype) * c_plus
    loss, s = _sequence_objective(p, lo, hi)
    aux = _aux(p, ratio=jax.lax.stop_gradient(s), units_valid=p.row_valid, proxy=d_seq,
               lo=lo, hi=hi, eps_low=eps_low, eps_high=eps_high,
               sat=SatFactors(c_plus, c_minus, weight, tk.scale))
    return loss, aux


@register("gspo", GspoHParams)
@_jit_loss
def gspo_loss(logprobs: Array, behavior_logprobs: Array, advantages: Array, mask: Array, *,
              eps_low: float, eps_high: float, old_logprobs: Array | None = None,
              token_weights: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """GSPO: sequence-level clipped surrogate on the length-normalised ratio.

    ``s_i = exp(mean_t (lp_{i,t} - ref_{i,t}))``,
    ``J_i = min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)``,
    loss = ``-mean_i J_i`` over valid sequences.

    Shapes: ``logprobs``, ``behavior_logprobs``, ``mask`` (and ``old_logprobs``,
    ``token_weights`` when given) [B, T]; ``advantages`` [B]; returns a scalar loss and
    ``aux`` of scalars keyed by :data:`AUX_KEYS` (conventions: module docstring).

    References:
      GSPO: Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071.

    Example:
      >>> import jax.numpy as jnp
      >>> from satjax import losses
      >>> lp = jnp.array([[-1.0, -2.0], [-0.5, -9.0]])  # row 1: one valid token
      >>> mu = jnp.array([[-1.5, -2.0], [-0.5, -9.0]])
      >>> adv, mask = jnp.array([1.0, -1.0]), jnp.array([[1, 1], [1, 0]])
      >>> loss, aux = losses.gspo_loss(lp, mu, adv, mask, eps_low=0.2, eps_high=0.2)
      >>> round(float(loss), 4), round(float(aux["clip_frac_high"]), 4)  # 2 of 3 tokens
      (-0.1, 0.6667)
    """
    p = _prepare(logprobs, behavior_logprobs, advantages, mask, old_logprobs, token_weights)
    lo, hi = _ppo_bounds(p, eps_low, eps_high)
    loss, s = _sequence_objective(p, lo, hi)
    proxy = _seq_mean(p.d_tok, p)
    aux = _aux(p, ratio=jax.lax.stop_gradient(s), units_valid=p.row_valid, proxy=proxy,
               lo=lo, hi=hi, eps_low=eps_low, eps_high=eps_high, sat=None)
    return loss, aux


@register("gspo_token", GspoTokenHParams)
@_jit_loss
def gspo_token_loss(logprobs: Array, behavior_logprobs: Array, advantages: Array,
                    mask: Array, *, eps_low: float, eps_high: float,
                    old_logprobs: Array | None = None,
                    token_weights: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """GSPO-token: ``s_{i,t} = sg(s_i) * pi_t / sg(pi_t)``, token surrogate, seq-mean.

    ``J_{i,t} = min(s_{i,t} A_i, clip(s_{i,t}, 1 - eps_low, 1 + eps_high) A_i)``,
    loss = ``-mean_i mean_t J_{i,t}``. Same value as :func:`gspo_loss` and, with one
    advantage per sequence and no token weights, the same gradient; token weights act per
    token (through the gradient).

    Shapes: ``logprobs``, ``behavior_logprobs``, ``mask`` (and ``old_logprobs``,
    ``token_weights`` when given) [B, T]; ``advantages`` [B]; returns a scalar loss and
    ``aux`` of scalars keyed by :data:`AUX_KEYS` (conventions: module docstring).

    References:
      GSPO: Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071
      (the GSPO-token variant).

    Example (the value equals GSPO's):
      >>> import jax.numpy as jnp
      >>> from satjax import losses
      >>> lp = jnp.array([[-1.0, -2.0], [-0.5, -9.0]])  # row 1: one valid token
      >>> mu = jnp.array([[-1.5, -2.0], [-0.5, -9.0]])
      >>> adv, mask = jnp.array([1.0, -1.0]), jnp.array([[1, 1], [1, 0]])
      >>> loss, _ = losses.gspo_token_loss(lp, mu, adv, mask, eps_low=0.2, eps_high=0.2)
      >>> round(float(loss), 4)
      -0.1
    """
    p = _prepare(logprobs, behavior_logprobs, advantages, mask, old_logprobs, token_weights)
    lo, hi = _ppo_bounds(p, eps_low, eps_high)
    s = _ratio(_seq_mean(p.log_ratio, p))
    s_tok = jax.lax.stop_gradient(s)[:, None] * jnp.exp(
    p.lp - jax.lax.stop_gradient(p.lp))
    j = clipped_surrogate(s_tok, p.adv[:, None], lo, hi) * p.w
    loss = -masked_mean(_seq_mean(j, p), p.row_valid)
    aux = _aux(p, ratio=jax.lax.stop_gradient(s), units_valid=p.row_valid,
               proxy=_seq_mean(p.d_tok, p), lo=lo, hi=hi, eps_low=eps_low,
               eps_high=eps_high, sat=None)
    return loss, aux


# --------------------------------------------------------------------------- token level


def _token_terms(p: Prepared, lo: Array | float, hi: Array | float,
                 clip_ratio_c: Any) -> tuple[Array, Array]:
    """Per-token weighted surrogate [B, T] (0 at invalid tokens) and the token ratio.

    With ``clip_ratio_c`` (dual clip), a token with ``A < 0`` has surrogate at least
    ``clip_ratio_c * A``, i.e. its loss is capped at ``clip_ratio_c * |A|`` (no gradient
    there), as verl's ``clip_ratio_c``.
    """
    r = _ratio(p.log_ratio)
    adv = p.adv[:, None]
    j = clipped_surrogate(r, adv, lo, hi)
    if clip_ratio_c is not None:
        j = jnp.where(adv < 0, jnp.maximum(j, jnp.asarray(clip_ratio_c, j.dtype) * adv), j)
    return j * p.w * p.vf, r


def _token_mean_loss(j: Array, p: Prepared) -> Array:
    """PPO's reduction of token surrogates [B, T]: minus their sum over valid tokens."""
    return -jnp.sum(j) / jnp.maximum(jnp.sum(p.vf), 1.0)


def _sequence_mean_loss(j: Array, p: Prepared) -> Array:
    """GRPO's reduction of token surrogates [B, T]: minus the mean over valid sequences of
    each sequence's mean over its valid tokens."""
    return -masked_mean(jnp.sum(j, axis=1) / jnp.maximum(p.lengths, 1.0), p.row_valid)


@register("grpo", GrpoHParams)
@_jit_loss
def grpo_loss(logprobs: Array, behavior_logprobs: Array, advantages: Array, mask: Array, *,
              eps_low: float, eps_high: float,
              clip_ratio_c: float | None = TokenClipHParams.clip_ratio_c,
              old_logprobs: Array | None = None,
              token_weights: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """GRPO: token-level clip, each sequence's token surrogates averaged over its length,
    then averaged over sequences (every sequence weighs the same; cf. :func:`ppo_clip_loss`).

    With ``J_{i,t}`` as in :func:`ppo_clip_loss`: loss = ``-mean_i (sum_t J_{i,t} / |o_i|)``
    over valid sequences, ``|o_i|`` the number of valid tokens of row i; ``clip_ratio_c``
    is the dual clip of :func:`ppo_clip_loss`. The
    KL-to-reference penalty of the GRPO paper is not included (add it in the trainer;
    ``aux["kl_k3"]`` is the k3 estimate against the behaviour policy).

    Shapes: ``logprobs``, ``behavior_logprobs``, ``mask`` (and ``old_logprobs``,
    ``token_weights`` when given) [B, T]; ``advantages`` [B]; returns a scalar loss and
    ``aux`` of scalars keyed by :data:`AUX_KEYS` (conventions: module docstring).

    References:
      GRPO: Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning
      in Open Language Models", arXiv:2402.03300.

    Example:
      >>> import jax.numpy as jnp
      >>> from satjax import losses
      >>> lp = jnp.array([[-1.0, -2.0], [-0.5, -9.0]])  # row 1: one valid token
      >>> mu = jnp.array([[-1.5, -2.0], [-0.5, -9.0]])
      >>> adv, mask = jnp.array([1.0, -1.0]), jnp.array([[1, 1], [1, 0]])
      >>> loss, _ = losses.grpo_loss(lp, mu, adv, mask, eps_low=0.2, eps_high=0.2)
      >>> round(float(loss), 4)
      -0.05
    """
    p = _prepare(logprobs, behavior_logprobs, advantages, mask, old_logprobs, token_weights)
    lo, hi = _ppo_bounds(p, eps_low, eps_high)
    j, r = _token_terms(p, lo, hi, clip_ratio_c)
    loss = _sequence_mean_loss(j, p)
    aux = _aux(p, ratio=jax.lax.stop_gradient(r), units_valid=p.valid, proxy=p.d_tok,
               lo=lo, hi=hi, eps_low=eps_low, eps_high=eps_high, sat=None)
    return loss, aux


@register("ppo_clip", PpoClipHParams)
@_jit_loss
def ppo_clip_loss(logprobs: Array, behavior_logprobs: Array, advantages: Array, mask: Array,
                  *, eps_low: float, eps_high: float,
                  clip_ratio_c: float | None = TokenClipHParams.clip_ratio_c,
                  old_logprobs: Array | None = None,
                  token_weights: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """Token-level PPO-clip; loss = -(sum of token surrogates) / (number of valid tokens).

    ``r_{i,t} = exp(lp_{i,t} - ref_{i,t})``,
    ``J_{i,t} = min(r_{i,t} A_i, clip(r_{i,t}, 1 - eps_low, 1 + eps_high) A_i)``,
    loss = ``-sum_{i,t} J_{i,t} / #valid tokens``. The token-mean over the whole batch
    weights long sequences more (DAPO-style), unlike :func:`grpo_loss`, which averages
    within each sequence first. ``clip_ratio_c`` (None = off, else > 1): dual clip, for
    ``A_i < 0`` ``J_{i,t} = max(J_{i,t}, clip_ratio_c * A_i)`` (verl's ``clip_ratio_c``;
    Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL", arXiv:1912.09729).

    Shapes: ``logprobs``, ``behavior_logprobs``, ``mask`` (and ``old_logprobs``,
    ``token_weights`` when given) [B, T]; ``advantages`` [B]; returns a scalar loss and
    ``aux`` of scalars keyed by :data:`AUX_KEYS` (conventions: module docstring).

    References:
      PPO: Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
      arXiv:1707.06347.

    Example:
      >>> import jax.numpy as jnp
      >>> from satjax import losses
      >>> lp = jnp.array([[-1.0, -2.0], [-0.5, -9.0]])  # row 1: one valid token
      >>> mu = jnp.array([[-1.5, -2.0], [-0.5, -9.0]])
      >>> adv, mask = jnp.array([1.0, -1.0]), jnp.array([[1, 1], [1, 0]])
      >>> loss, aux = losses.ppo_clip_loss(lp, mu, adv, mask, eps_low=0.2, eps_high=0.2)
      >>> round(float(loss), 4), round(float(aux["clip_frac_high"]), 4)
      (-0.4, 0.3333)
    """
    p = _prepare(logprobs, behavior_logprobs, advantages, mask, old_logprobs, token_weights)
    lo, hi = _ppo_bounds(p, eps_low, eps_high)
    j, r = _token_terms(p, lo, hi, clip_ratio_c)
    loss = _token_mean_loss(j, p)
    aux = _aux(p, ratio=jax.lax.stop_gradient(r), units_valid=p.valid, proxy=p.d_tok,
               lo=lo, hi=hi, eps_low=eps_low, eps_high=eps_high, sat=None)
    return loss, aux


def _sat_token_terms(p: Prepared, eps_low: Any, eps_high: Any, clip_ratio_c: Any,
                     hp: SatKernelHParams, microbatches: int
                     ) -> tuple[Array, Array, Array, Array, SatFactors]:
    """Token-level SAT (SAT-PPO, SAT-GRPO): the per-token surrogate and ratio of
    :func:`_token_terms` under SAT's bounds from ``d = sg(lp - mu)`` [B, T], the bounds,
    and the factors for the metrics."""
    tk = tail_kernel(p.d_tok, p.valid, hp, microbatches)
    f = tk.phi(jnp.abs(p.d_tok))  # d is 0 at invalid tokens, and phi(0) = 1
    lo, hi = sign_selected_bounds(p.d_tok, f, f, eps_low, eps_high)
    j, r = _token_terms(p, lo, hi, clip_ratio_c)
    one = jnp.ones((), f.dtype)
    sat = SatFactors(jnp.where(p.d_tok > 0, f, one), jnp.where(p.d_tok < 0, f, one), p.vf,
                     tk.scale)
    return j, r, lo, hi, sat


@register("sat_ppo", SatPpoHParams)
@_jit_loss
def sat_ppo_loss(logprobs: Array, behavior_logprobs: Array, advantages: Array, mask: Array,
                 *, eps_low: float, eps_high: float, kernel: Kernel = SAT_DEFAULTS.kernel,
                 quantile: float = SAT_DEFAULTS.quantile, lam: float = SAT_DEFAULTS.lam,
                 c_min: float = SAT_DEFAULTS.c_min, c: float = SAT_DEFAULTS.c,
                 w: float = SAT_DEFAULTS.w, scale: Scale = SAT_DEFAULTS.scale,
                 scope: Scope = SAT_DEFAULTS.scope,
                 clip_ratio_c: float | None = TokenClipHParams.clip_ratio_c,
                 microbatches: int = 1, old_logprobs: Array | None = None,
                 token_weights: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """Token-level SAT on PPO-clip (token-mean over the batch).

    ``J_{i,t} = min(r_{i,t} A_i, clip(r_{i,t}, 1 - eps_low c-_{i,t}, 1 + eps_high c+_{i,t})
    A_i)`` with SAT's factors (:func:`~satjax.losses.sat_interval`) of ``d = sg(lp - mu)``
    [B, T], the gate over the valid tokens (per micro-batch: module docstring); loss =
    ``-sum J / #valid tokens``; ``clip_ratio_c`` is the dual clip of :func:`ppo_clip_loss`.
    :func:`sat_grpo_loss` is the same clip with GRPO's reduction.

    Shapes: ``logprobs``, ``behavior_logprobs``, ``mask`` (and ``old_logprobs``,
    ``token_weights`` when given) [B, T]; ``advantages`` [B]; returns a scalar loss and
    ``aux`` of scalars keyed by :data:`AUX_KEYS` (conventions: module docstring).

    References:
      SAT, the Staleness-Adaptive Trust Region: the authors' project page
      (jyyang26.github.io/stable_async_analysis, Eq. 3.1-3.6); PPO: Schulman et al. 2017,
      "Proximal Policy Optimization Algorithms", arXiv:1707.06347.

    Example (10 tokens: the gate q is the 9th smallest |d|, 0.1; one token is past it):
      >>> import jax.numpy as jnp
      >>> from satjax import losses
      >>> d = jnp.array([[0.0, 0.1, -0.1, 0.05, 0.3], [0.1, -0.05, 0.0, 0.1, -0.1]])
      >>> lp = jnp.full((2, 5), -1.0)
      >>> adv, mask = jnp.array([1.0, -1.0]), jnp.ones((2, 5))
      >>> loss, aux = losses.sat_ppo_loss(lp, lp - d, adv, mask, eps_low=0.2, eps_high=0.2)
      >>> round(float(aux["sat_q"]), 4), round(float(aux["sat_tail_frac"]), 4)
      (0.1, 0.1)
      >>> round(float(aux["sat_c_plus_mean"]), 4)  # 1 / (1 + 3^2)
      0.1
    """
    p = _prepare(logprobs, behavior_logprobs, advantages, mask, old_logprobs, token_weights)
    hp = SatKernelHParams(kernel=kernel, quantile=quantile, lam=lam, c_min=c_min, c=c, w=w,
                          scale=scale, scope=scope)
    j, r, lo, hi, sat = _sat_token_terms(p, eps_low, eps_high, clip_ratio_c, hp,
                                         microbatches)
    loss = _token_mean_loss(j, p)
    aux = _aux(p, ratio=jax.lax.stop_gradient(r), units_valid=p.valid, proxy=p.d_tok,
               lo=lo, hi=hi, eps_low=eps_low, eps_high=eps_high, sat=sat)
    return loss, aux


@register("sat_grpo", SatGrpoHParams)
@_jit_loss
def sat_grpo_loss(logprobs: Array, behavior_logprobs: Array, advantages: Array, mask: Array,
                  *, eps_low: float, eps_high: float, kernel: Kernel = SAT_DEFAULTS.kernel,
                  quantile: float = SAT_DEFAULTS.quantile, lam: float = SAT_DEFAULTS.lam,
                  c_min: float = SAT_DEFAULTS.c_min, c: float = SAT_DEFAULTS.c,
                  w: float = SAT_DEFAULTS.w, scale: Scale = SAT_DEFAULTS.scale,
                  scope: Scope = SAT_DEFAULTS.scope,
                  clip_ratio_c: float | None = TokenClipHParams.clip_ratio_c,
                  microbatches: int = 1, old_logprobs: Array | None = None,
                  token_weights: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """SAT-GRPO: :func:`sat_ppo_loss`'s token clip with GRPO's reduction (each sequence's
    token surrogates averaged over its length, then over sequences; :func:`grpo_loss`).

    The authors' SAT-GRPO: the token ratio is "the ratio scalar of its base objective".
    With no token past the gate the loss and its gradient are :func:`grpo_loss`'s bit for
    bit.

    Shapes: ``logprobs``, ``behavior_logprobs``, ``mask`` (and ``old_logprobs``,
    ``token_weights`` when given) [B, T]; ``advantages`` [B]; returns a scalar loss and
    ``aux`` of scalars keyed by :data:`AUX_KEYS` (conventions: module docstring).

    References:
      SAT, the Staleness-Adaptive Trust Region: the authors' project page
      (jyyang26.github.io/stable_async_analysis, Eq. 3.1-3.6); GRPO: Shao et al. 2024,
      arXiv:2402.03300.

    Example (rows of equal length: the value is SAT-PPO's, up to float rounding):
      >>> import jax.numpy as jnp
      >>> from satjax import losses
      >>> d = jnp.array([[0.0, 0.1, -0.1, 0.05, 0.3], [0.1, -0.05, 0.0, 0.1, -0.1]])
      >>> lp, adv, mask = jnp.full((2, 5), -1.0), jnp.array([1.0, -1.0]), jnp.ones((2, 5))
      >>> a = losses.sat_grpo_loss(lp, lp - d, adv, mask, eps_low=0.2, eps_high=0.2)[0]
      >>> b = losses.sat_ppo_loss(lp, lp - d, adv, mask, eps_low=0.2, eps_high=0.2)[0]
      >>> round(float(a), 6), round(float(b), 6)
      (-0.001487, -0.001487)
    """
    p = _prepare(logprobs, behavior_logprobs, advantages, mask, old_logprobs, token_weights)
    hp = SatKernelHParams(kernel=kernel, quantile=quantile, lam=lam, c_min=c_min, c=c, w=w,
                          scale=scale, scope=scope)
    j, r, lo, hi, sat = _sat_token_terms(p, eps_low, eps_high, clip_ratio_c, hp,
                                         microbatches)
    loss = _sequence_mean_loss(j, p)
    aux = _aux(p, ratio=jax.lax.stop_gradient(r), units_valid=p.valid, proxy=p.d_tok,
               lo=lo, hi=hi, eps_low=eps_low, eps_high=eps_high, sat=sat)
    return loss, aux


# --------------------------------------------------------------------------- DPPO


def _dppo(p: Prepared, out_low: Array, out_high: Array,
          ratio_cap: Any) -> tuple[Array, dict[str, Array]]:
    """DPPO core: token-mean of ``A * sg(min(r, ratio_cap)) * lp`` over the tokens not
    dropped, a token being dropped when its divergence is out (``out_low`` for ``A < 0``,
    ``out_high`` for ``A > 0``); DPPO has no ratio interval, so its radius metrics are 0."""
    r = _ratio(p.log_ratio)
    adv = p.adv[:, None]
    drop_low, drop_high = (adv < 0) & out_low & p.valid, (adv > 0) & out_high & p.valid
    coef = jax.lax.stop_gradient(jnp.minimum(r, jnp.asarray(ratio_cap, r.dtype)))
    j = jnp.where(drop_low | drop_high, 0.0, adv * coef * p.lp) * p.w * p.vf
    loss = _token_mean_loss(j, p)
    aux = _aux(p, ratio=jax.lax.stop_gradient(r), units_valid=p.valid, proxy=p.d_tok,
               lo=1.0, hi=1.0, eps_low=0.0, eps_high=0.0, sat=None,
               binds=(drop_low, drop_high))
    return loss, aux


@register("dppo_tv", DppoTvHParams)
@_jit_loss
def dppo_tv_loss(logprobs: Array, behavior_logprobs: Array, advantages: Array, mask: Array,
                 *, delta_low: float = DppoTvHParams.delta_low,
                 delta_high: float = DppoTvHParams.delta_high,
                 ratio_cap: float = DppoHParams.ratio_cap, old_logprobs: Array | None = None,
                 token_weights: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """DPPO-Binary-TV: a policy gradient that drops a token when the probability of the
    sampled token moved too far, instead of clipping the ratio.

    With ``p = exp(lp_{i,t})``, ``q = exp(ref_{i,t})`` and ``r = p / q``: a token is kept
    unless ``A_i > 0`` and ``p - q > delta_high``, or ``A_i < 0`` and
    ``p - q < -delta_low``; loss = ``-sum_{kept} A_i sg(min(r, ratio_cap)) lp_{i,t} /
    #valid tokens``, whose gradient at a kept token is PPO's unclipped ``-A_i grad r``.
    ``clip_frac_low`` / ``clip_frac_high`` are the shares of valid tokens dropped with
    ``A < 0`` / ``A > 0`` (verl's ``pg_clipfrac`` is their sum).

    Shapes: ``logprobs``, ``behavior_logprobs``, ``mask`` (and ``old_logprobs``,
    ``token_weights`` when given) [B, T]; ``advantages`` [B]; returns a scalar loss and
    ``aux`` of scalars keyed by :data:`AUX_KEYS` (conventions: module docstring).

    References:
      DPPO: Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning",
      arXiv:2602.04879 (public recipes: verl ``dppo_tv``, sail-sg/Stable-RL).

    Example:
      >>> import jax.numpy as jnp
      >>> from satjax import losses
      >>> lp = jnp.array([[-1.0, -2.0], [-0.5, -9.0]])  # row 1: one valid token
      >>> mu = jnp.array([[-1.5, -2.0], [-0.5, -9.0]])
      >>> adv, mask = jnp.array([1.0, -1.0]), jnp.array([[1, 1], [1, 0]])
      >>> loss, aux = losses.dppo_tv_loss(lp, mu, adv, mask)  # p - q = 0.145: kept
      >>> round(float(loss), 4), float(aux["clip_frac_high"])
      (1.0496, 0.0)
      >>> loss, aux = losses.dppo_tv_loss(lp, mu, adv, mask, delta_high=0.1)  # dropped
      >>> round(float(loss), 4), round(float(aux["clip_frac_high"]), 4)
      (0.5, 0.3333)
    """
    p = _prepare(logprobs, behavior_logprobs, advantages, mask, old_logprobs, token_weights)
    dt = p.lp.dtype
    tv = jax.lax.stop_gradient(jnp.exp(p.lp) - jnp.exp(p.ref))  # p - q
    return _dppo(p, tv < -jnp.asarray(delta_low, dt), tv > jnp.asarray(delta_high, dt),
                 ratio_cap)


@register("dppo_tv_clip", DppoTvClipHParams)
@_jit_loss
def dppo_tv_clip_loss(logprobs: Array, behavior_logprobs: Array, advantages: Array,
                      mask: Array, *, eps_low: float, eps_high: float,
                      delta_low: float = DppoTvClipHParams.delta_low,
                      delta_high: float = DppoTvClipHParams.delta_high,
                      clip_ratio_c: float | None = TokenClipHParams.clip_ratio_c,
                      old_logprobs: Array | None = None,
                      token_weights: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """DPPO-Binary-TV as the SAT authors' grid runs it: GRPO's clipped surrogate times
    DPPO-TV's {0, 1} mask.

    ``J_{i,t}`` is :func:`grpo_loss`'s clipped token surrogate, set to 0 where
    :func:`dppo_tv_loss` drops the token (``A_i > 0`` and ``p - q > delta_high``, or
    ``A_i < 0`` and ``p - q < -delta_low``: the sampled token's probability moved outward
    too far); loss = ``-mean_i (sum_t J_{i,t} / |o_i|)``, GRPO's reduction. Unlike
    :func:`dppo_tv_loss` (the DPPO paper's, verl's and Stable-RL's: the mask instead of the
    clip, a token mean over the batch) both the clip and the mask act. ``clip_frac_low`` /
    ``clip_frac_high`` count the tokens whose gradient either removes.

    Shapes: ``logprobs``, ``behavior_logprobs``, ``mask`` (and ``old_logprobs``,
    ``token_weights`` when given) [B, T]; ``advantages`` [B]; returns a scalar loss and
    ``aux`` of scalars keyed by :data:`AUX_KEYS` (conventions: module docstring).

    References:
      The SAT authors' project page (jyyang26.github.io/stable_async_analysis, "Setup": the
      grid's DPPO row, "the GRPO clip times a {0,1} hard mask", delta 1e-3); DPPO: Qi et al.
      2026, arXiv:2602.04879.

    Example:
      >>> import jax.numpy as jnp
      >>> from satjax import losses
      >>> lp = jnp.array([[-1.0, -2.0], [-0.5, -9.0]])  # row 1: one valid token
      >>> mu = jnp.array([[-1.5, -2.0], [-0.5, -9.0]])
      >>> adv, mask = jnp.array([1.0, -1.0]), jnp.array([[1, 1], [1, 0]])
      >>> kw = dict(eps_low=0.2, eps_high=0.2)
      >>> # token (0, 0): r = 1.65, p - q = 0.145; under delta 0.2 it is kept and clipped
      >>> # at 1.2 (GRPO's loss); under the default 1e-3 the mask drops it
      >>> loss, aux = losses.dppo_tv_clip_loss(lp, mu, adv, mask, delta_high=0.2, **kw)
      >>> round(float(loss), 4), round(float(aux["clip_frac_high"]), 4)
      (-0.05, 0.3333)
      >>> loss, aux = losses.dppo_tv_clip_loss(lp, mu, adv, mask, **kw)
      >>> round(float(loss), 4), round(float(aux["clip_frac_high"]), 4)
      (0.25, 0.3333)
    """
    p = _prepare(logprobs, behavior_logprobs, advantages, mask, old_logprobs, token_weights)
    dt = p.lp.dtype
    lo, hi = _ppo_bounds(p, eps_low, eps_high)
    j, r = _token_terms(p, lo, hi, clip_ratio_c)
    tv = jax.lax.stop_gradient(jnp.exp(p.lp) - jnp.exp(p.ref))  # p - q
    adv = p.adv[:, None]
    drop_low = (adv < 0) & (tv < -jnp.asarray(delta_low, dt)) & p.valid
    drop_high = (adv > 0) & (tv > jnp.asarray(delta_high, dt)) & p.valid
    loss = _sequence_mean_loss(jnp.where(drop_low | drop_high, 0.0, j), p)
    ratio = jax.lax.stop_gradient(r)
    binds = (drop_low | ((adv < 0) & (ratio < lo)), drop_high | ((adv > 0) & (ratio > hi)))
    aux = _aux(p, ratio=ratio, units_valid=p.valid, proxy=p.d_tok, lo=lo, hi=hi,
               eps_low=eps_low, eps_high=eps_high, sat=None, binds=binds)
    return loss, aux


@register("dppo_kl", DppoKlHParams)
@_jit_loss
def dppo_kl_loss(logprobs: Array, behavior_logprobs: Array, advantages: Array, mask: Array,
                 *, delta_low: float = DppoKlHParams.delta_low,
                 delta_high: float = DppoKlHParams.delta_high,
                 ratio_cap: float = DppoHParams.ratio_cap, old_logprobs: Array | None = None,
                 token_weights: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """DPPO-Binary-KL: :func:`dppo_tv_loss` with the binary KL as the divergence, masked
    on the outward side only.

    ``D = q log(q / p) + (1 - q) log((1 - q) / (1 - p))`` (the KL between the Bernoulli
    distributions "the sampled token or not" under the reference and the current policy);
    a token is dropped if ``A_i > 0``, ``p > q`` and ``D > delta_high``, or ``A_i < 0``,
    ``p < q`` and ``D > delta_low``; the loss is that of :func:`dppo_tv_loss`. ``1 - p``
    is computed as ``-expm1(lp)``, exact for probabilities near 1.

    Shapes: ``logprobs``, ``behavior_logprobs``, ``mask`` (and ``old_logprobs``,
    ``token_weights`` when given) [B, T]; ``advantages`` [B]; returns a scalar loss and
    ``aux`` of scalars keyed by :data:`AUX_KEYS` (conventions: module docstring).

    References:
      DPPO: Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning",
      arXiv:2602.04879 (public recipes: verl ``dppo_kl``, sail-sg/Stable-RL).

    Example:
      >>> import jax.numpy as jnp
      >>> from satjax import losses
      >>> lp = jnp.array([[-1.0, -2.0], [-0.5, -9.0]])  # row 1: one valid token
      >>> mu = jnp.array([[-1.5, -2.0], [-0.5, -9.0]])
      >>> adv, mask = jnp.array([1.0, -1.0]), jnp.array([[1, 1], [1, 0]])
      >>> loss, aux = losses.dppo_kl_loss(lp, mu, adv, mask)  # D = 0.0486 <= 0.05: kept
      >>> round(float(loss), 4), float(aux["clip_frac_high"])
      (1.0496, 0.0)
      >>> loss, aux = losses.dppo_kl_loss(lp, mu, adv, mask, delta_high=0.04)  # dropped
      >>> round(float(loss), 4), round(float(aux["clip_frac_high"]), 4)
      (0.5, 0.3333)
    """
    p = _prepare(logprobs, behavior_logprobs, advantages, mask, old_logprobs, token_weights)
    dt = p.lp.dtype
    lp, ref = jax.lax.stop_gradient(p.lp), p.ref
    q, not_q, not_p = jnp.exp(ref), -jnp.expm1(ref), -jnp.expm1(lp)
    kl = (q * (ref - lp) + jax.scipy.special.xlogy(not_q, not_q)
          - jax.scipy.special.xlogy(not_q, not_p))
    return _dppo(p, (lp < ref) & (kl > jnp.asarray(delta_low, dt)),
                 (lp > ref) & (kl > jnp.asarray(delta_high, dt)), ratio_cap)
