"""DPPO (Binary-TV, Binary-KL, and the SAT grid's TV with GRPO's clip) against float64
numpy references written from the definitions: which tokens are dropped, the loss, its
gradient and the drop fractions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from satjax import losses as L
from satjax import objectives


def _reference(lp, mu, adv, mask, divergence, delta_low, delta_high, ratio_cap):
    """(loss, d loss / d lp, dropped with A < 0, dropped with A > 0), in float64."""
    lp, mu, adv = (np.asarray(x, np.float64) for x in (lp, mu, adv))
    m = np.asarray(mask, bool)
    lp = np.where(m, lp, 0.0)
    p, q = np.exp(lp), np.exp(mu)
    a = np.broadcast_to(adv[:, None], lp.shape)
    if divergence == "tv":
        out_high, out_low = p - q > delta_high, p - q < -delta_low
    else:  # KL(Bern(q) || Bern(p)), masked on the outward side only
        with np.errstate(divide="ignore", invalid="ignore"):
            kl = q * np.log(q / p) + (1 - q) * np.log((1 - q) / (1 - p))
        out_high, out_low = (p > q) & (kl > delta_high), (p < q) & (kl > delta_low)
    drop_high, drop_low = m & (a > 0) & out_high, m & (a < 0) & out_low
    keep = m & ~drop_high & ~drop_low
    coef = np.minimum(p / q, ratio_cap)
    n = m.sum()
    loss = -np.sum(np.where(keep, a * coef * lp, 0.0)) / n
    grad = np.where(keep, -a * coef / n, 0.0)
    return loss, grad, drop_low.sum() / n, drop_high.sum() / n


@pytest.mark.parametrize("divergence,deltas", [("tv", (0.15, 0.15)), ("tv", (0.02, 0.05)),
                                               ("kl", (0.05, 0.05)), ("kl", (0.002, 0.01))])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dppo_matches_the_numpy_reference(make_batch, divergence, deltas, seed):
    fn = L.dppo_tv_loss if divergence == "tv" else L.dppo_kl_loss
    # |lp - mu| up to ~1: the narrow thresholds drop a real share of the tokens
    lp, mu, a, mask = make_batch(seed, scale=0.4)
    lo, hi = deltas
    loss, aux = fn(lp, mu, a, mask, delta_low=lo, delta_high=hi)
    grad = jax.grad(lambda x: fn(x, mu, a, mask, delta_low=lo, delta_high=hi)[0])(lp)
    ref_loss, ref_grad, ref_low, ref_high = _reference(lp, mu, a, mask, divergence, lo, hi,
                                                       L.DppoHParams.ratio_cap)
    # float32 against float64: loss and gradient to 1e-5 relative
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-7)
    assert float(aux["clip_frac_low"]) == pytest.approx(ref_low, abs=1e-7)
    assert float(aux["clip_frac_high"]) == pytest.approx(ref_high, abs=1e-7)
    if deltas[0] < 0.05:  # the narrow thresholds really drop tokens
        assert ref_low + ref_high > 0


def test_dppo_drops_only_the_side_the_advantage_pushes():
    # one token per row: q = 0.5; p = 0.8 (up) and p = 0.2 (down), each with A > 0 and A < 0
    q = np.log(0.5)
    lp = jnp.log(jnp.array([[0.8], [0.8], [0.2], [0.2]]))
    mu, mask = jnp.full((4, 1), q), jnp.ones((4, 1), bool)
    adv = jnp.array([1.0, -1.0, 1.0, -1.0])
    for fn in (L.dppo_tv_loss, L.dppo_kl_loss):
        g = jax.grad(lambda x, fn=fn: fn(x, mu, adv, mask)[0])(lp)
        # p rose and A > 0: out (dropped); p rose and A < 0: pushing back in, kept;
        # p fell and A > 0: kept; p fell and A < 0: dropped
        np.testing.assert_array_equal(np.asarray(g[:, 0]) != 0, [False, True, True, False])
        _, aux = fn(lp, mu, adv, mask)
        assert float(aux["clip_frac_high"]) == 0.25 and float(aux["clip_frac_low"]) == 0.25


def test_dppo_kl_is_finite_when_a_probability_reaches_one():
    lp = jnp.array([[0.0, -1e-9]])  # p = 1 (up to float32): 1 - p from -expm1(lp)
    mu = jnp.array([[-0.5, -1e-9]])
    loss, aux = L.dppo_kl_loss(lp, mu, jnp.array([1.0]), jnp.ones((1, 2), bool))
    assert np.isfinite(float(loss))
    assert float(aux["clip_frac_high"]) == 0.5  # p = 1 > q: the binary KL is inf, dropped


def test_dppo_ratio_cap_truncates_the_weight_not_the_token():
    lp, mu = jnp.array([[-0.1]]), jnp.array([[-3.0]])  # r = e^2.9 = 18.2
    adv, mask = jnp.array([-1.0]), jnp.ones((1, 1), bool)  # p > q with A < 0: kept
    g = jax.grad(lambda x: L.dppo_tv_loss(x, mu, adv, mask, ratio_cap=5.0)[0])(lp)
    assert float(g[0, 0]) == pytest.approx(5.0)  # -A * min(r, 5)


def test_dppo_objectives_have_their_own_hyperparameters():
    assert objectives.DEFAULTS["dppo_tv"]["delta_high"] == 0.15
    assert objectives.DEFAULTS["dppo_kl"]["delta_high"] == 0.05
    with pytest.raises(ValueError, match="eps_low"):
        objectives.hparams("dppo_tv", {"eps_low": 0.2})  # DPPO has no ratio clip
    with pytest.raises(ValueError, match="delta_low: must be >= 0.0"):
        objectives.dppo_kl(delta_low=-1.0)


def _reference_tv_clip(lp, mu, adv, mask, eps_low, eps_high, delta_low, delta_high):
    """The SAT page's DPPO row in float64: GRPO's clipped token surrogate, zeroed where the
    TV mask drops the token, each sequence's mean then the mean over sequences. Returns
    (loss, d loss / d lp, share of tokens without gradient with A < 0, with A > 0)."""
    lp, mu, adv = (np.asarray(x, np.float64) for x in (lp, mu, adv))
    m = np.asarray(mask, bool)
    lp = np.where(m, lp, 0.0)
    r, tv = np.exp(lp - mu), np.exp(lp) - np.exp(mu)
    a = np.broadcast_to(adv[:, None], lp.shape)
    clipped = np.clip(r, 1 - eps_low, 1 + eps_high)
    j = np.minimum(r * a, clipped * a)
    drop = m & (((a > 0) & (tv > delta_high)) | ((a < 0) & (tv < -delta_low)))
    unclipped = r * a <= clipped * a  # the min takes r A: the token's gradient is r A
    keep = m & ~drop
    n_tok, rows = m.sum(1), m.any(1)
    per_row = np.where(keep, j, 0.0).sum(1) / np.maximum(n_tok, 1)
    loss = -per_row[rows].mean()
    grad = -np.where(keep & unclipped, r * a, 0.0) / np.maximum(n_tok, 1)[:, None] / rows.sum()
    binds_low = m & (a < 0) & (drop | (r < 1 - eps_low))
    binds_high = m & (a > 0) & (drop | (r > 1 + eps_high))
    return loss, grad, binds_low.sum() / m.sum(), binds_high.sum() / m.sum()


@pytest.mark.parametrize("deltas", [(1e-3, 1e-3), (0.02, 0.05), (0.15, 0.15)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dppo_tv_clip_matches_the_numpy_reference(make_batch, tok_eps, deltas, seed):
    lp, mu, a, mask = make_batch(seed, scale=0.4)
    lo, hi = deltas
    kw = dict(delta_low=lo, delta_high=hi, **tok_eps)
    loss, aux = L.dppo_tv_clip_loss(lp, mu, a, mask, **kw)
    grad = jax.grad(lambda x: L.dppo_tv_clip_loss(x, mu, a, mask, **kw)[0])(lp)
    ref_loss, ref_grad, ref_low, ref_high = _reference_tv_clip(lp, mu, a, mask,
                                                               tok_eps["eps_low"],
                                                               tok_eps["eps_high"], lo, hi)
    # float32 against float64: loss and gradient to 1e-5 relative
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-7)
    assert float(aux["clip_frac_low"]) == pytest.approx(ref_low, abs=1e-7)
    assert float(aux["clip_frac_high"]) == pytest.approx(ref_high, abs=1e-7)


def test_dppo_tv_clip_is_grpo_when_the_mask_drops_nothing_and_masks_what_grpo_keeps(
        make_batch, tok_eps):
    lp, mu, a, mask = make_batch(4, scale=0.4)
    wide = L.dppo_tv_clip_loss(lp, mu, a, mask, delta_low=1.0, delta_high=1.0, **tok_eps)[0]
    assert float(wide) == float(L.grpo_loss(lp, mu, a, mask, **tok_eps)[0])
    # the grid's 1e-3 drops tokens inside GRPO's clip band: the gradients differ there
    g_grpo = jax.grad(lambda x: L.grpo_loss(x, mu, a, mask, **tok_eps)[0])(lp)
    g_dppo = jax.grad(lambda x: L.dppo_tv_clip_loss(x, mu, a, mask, **tok_eps)[0])(lp)
    r = np.exp(np.asarray(lp - mu))
    inside = np.asarray(mask) & (r > 1 - tok_eps["eps_low"]) & (r < 1 + tok_eps["eps_high"])
    differ = np.asarray(g_grpo != g_dppo)
    assert differ[inside].any() and not differ[~np.asarray(mask)].any()
