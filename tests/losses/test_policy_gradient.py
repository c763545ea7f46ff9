"""satjax.losses.policy_gradient: SAT pessimism/identity, gradients, weights, aux, validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from satjax import losses as L
from satjax import objectives

FAST = settings(max_examples=5, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


def _check_pessimism(sat_fn, base_fn, eps, kw, lp, mu, a, mask):
    sat_loss, _ = sat_fn(lp, mu, a, mask, **eps, **kw)
    base_loss, _ = base_fn(lp, mu, a, mask, **eps)
    assert np.isfinite(float(sat_loss))
    assert float(sat_loss) >= float(base_loss) - 1e-6 * max(1.0, abs(float(base_loss)))
    # Row by row: advantages zero except row i isolate J_i (bounds do not depend on A).
    for i in range(a.shape[0]):
        ai = jnp.zeros_like(a).at[i].set(a[i])
        s_i = float(sat_fn(lp, mu, ai, mask, **eps, **kw)[0])
        b_i = float(base_fn(lp, mu, ai, mask, **eps)[0])
        assert s_i >= b_i - 1e-7 * max(1.0, abs(b_i))


def _value_and_grad(fn, lp, mu, a, mask, **kw):
    return jax.value_and_grad(lambda x: fn(x, mu, a, mask, **kw)[0])(lp)


def _fd_check(f, x, grad, n_dirs=4, h=1e-6, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n_dirs):
        v = jnp.asarray(rng.normal(size=x.shape))
        fd = (f(x + h * v) - f(x - h * v)) / (2 * h)
        np.testing.assert_allclose(float(jnp.vdot(grad, v)), float(fd), rtol=1e-5, atol=1e-9)


# ----------------------------------------------------------------- SAT pessimism


@FAST
@given(seed=st.integers(0, 10_000), log_scale=st.floats(-3, 1.3),
       adv=st.sampled_from(["random", "negative"]), variant=st.integers(0, 14))
def test_sat_pointwise_pessimism(make_batch, sat_variants, seed, log_scale, adv, variant):
    """Per-sequence (per-row) SAT objective <= the PPO/GSPO one, and so the loss >=."""
    lp, mu, a, mask = make_batch(seed, scale=10**log_scale, adv=adv)
    _check_pessimism(*sat_variants[variant], lp, mu, a, mask)


@pytest.mark.parametrize("variant", [0, 1, 2, 3, 4])
def test_sat_pessimism_bf16_inputs(make_batch, sat_variants, variant):
    lp, mu, a, mask = make_batch(variant, scale=0.5, dtype=jnp.bfloat16)
    _check_pessimism(*sat_variants[variant], lp, mu, a, mask)


def test_huge_proxy_is_finite_and_floors_at_c_min(make_batch, seq_eps):
    lp, mu, a, mask = make_batch(3, scale=0.01)
    lp = lp.at[0, :2].add(30.0)  # two absurdly stale tokens (< 10% of the valid ones)
    # Token proxy: the 0.9-quantile comes from ordinary tokens, so row 0 hits the floor.
    loss, aux = L.sat_gspo_loss(lp, mu, a, mask, **seq_eps, kernel="smooth", c_min=0.1,
                                proxy="token")
    assert np.isfinite(float(loss))
    assert float(aux["sat_min_factor"]) == pytest.approx(0.1)
    assert 0 < float(aux["sat_tail_frac"]) <= 1


# ----------------------------------------------------------------- identities


def test_gauss_without_tail_equals_gspo_exactly(seq_eps):
    b, t = 6, 8
    rng = np.random.default_rng(1)
    mu = jnp.asarray(rng.normal(-1, 0.3, (b, t)), jnp.float32)
    signs = jnp.asarray([1, -1, 1, -1, -1, 1], jnp.float32)[:, None]
    lp = mu + 0.02 * signs  # every |d_i| equal: |d_i| / sigma <= 1 = c, so no tail
    a = jnp.asarray(rng.normal(size=b), jnp.float32)
    mask = jnp.asarray(rng.random((b, t)) < 0.8).at[:, 0].set(True)
    v0, g0 = _value_and_grad(L.gspo_loss, lp, mu, a, mask, **seq_eps)
    v1, g1 = _value_and_grad(L.sat_gspo_loss, lp, mu, a, mask, kernel="gauss", **seq_eps)
    _, aux = L.sat_gspo_loss(lp, mu, a, mask, kernel="gauss", **seq_eps)
    assert float(aux["sat_tail_frac"]) == 0.0
    assert float(v0) == float(v1)
    np.testing.assert_array_equal(np.asarray(g0), np.asarray(g1))


@FAST
@given(seed=st.integers(0, 10_000))
def test_gauss_large_c_is_gspo_on_random_data(make_batch, seq_eps, seed):
    lp, mu, a, mask = make_batch(seed)
    # max |d_i| / rms(d) <= sqrt(n) so c = sqrt(B) + 1 guarantees an empty tail.
    kw = {"kernel": "gauss", "c": np.sqrt(a.shape[0]) + 1.0}
    v0, g0 = _value_and_grad(L.gspo_loss, lp, mu, a, mask, **seq_eps)
    v1, g1 = _value_and_grad(L.sat_gspo_loss, lp, mu, a, mask, **kw, **seq_eps)
    assert float(v0) == float(v1)
    np.testing.assert_array_equal(np.asarray(g0), np.asarray(g1))


@FAST
@given(seed=st.integers(0, 10_000), log_scale=st.floats(-3, 1), variant=st.integers(0, 14))
def test_lam_zero_is_identity(make_batch, sat_variants, seed, log_scale, variant):
    """Our kernels' strength 0 is the base objective bit for bit (the paper's kernel has no
    strength: tests/losses/test_sat_paper.py checks its identity off the gate)."""
    sat_fn, base_fn, eps, kw = sat_variants[variant]
    assume(kw["kernel"] != "paper")
    lp, mu, a, mask = make_batch(seed, scale=10**log_scale)
    v0, g0 = _value_and_grad(base_fn, lp, mu, a, mask, **eps)
    v1, g1 = _value_and_grad(sat_fn, lp, mu, a, mask, lam=0.0, **eps, **kw)
    assert float(v0) == float(v1)
    np.testing.assert_array_equal(np.asarray(g0), np.asarray(g1))


def test_gspo_token_matches_gspo_value_and_gradient(make_batch, seq_eps):
    lp, mu, a, mask = make_batch(5, scale=0.05)
    v0, g0 = _value_and_grad(L.gspo_loss, lp, mu, a, mask, **seq_eps)
    v1, g1 = _value_and_grad(L.gspo_token_loss, lp, mu, a, mask, **seq_eps)
    np.testing.assert_allclose(float(v0), float(v1), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g0), np.asarray(g1), rtol=1e-5, atol=1e-8)


def test_grpo_vs_ppo_normalisation(make_batch, tok_eps):
    """Equal-length rows: GRPO's per-sequence mean equals PPO's token mean."""
    lp, mu, a, _ = make_batch(2, scale=0.3, masked_row=False)
    full = jnp.ones(lp.shape, bool)
    g, _ = L.grpo_loss(lp, mu, a, full, **tok_eps)
    p, _ = L.ppo_clip_loss(lp, mu, a, full, **tok_eps)
    np.testing.assert_allclose(float(g), float(p), rtol=1e-6)
    ragged = full.at[0, 2:].set(False)
    g, _ = L.grpo_loss(lp, mu, a, ragged, **tok_eps)
    p, _ = L.ppo_clip_loss(lp, mu, a, ragged, **tok_eps)
    assert abs(float(g) - float(p)) > 1e-6


# ----------------------------------------------------------------- gradients (float64)


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "ppo_clip", "grpo"])
def test_gradients_match_finite_differences(x64, make_batch, all_losses, name):
    fn, eps = all_losses[name]
    lp, mu, a, mask = make_batch(11, scale=0.2, dtype=np.float64)
    old = mu + 0.01
    kw = {**eps, "old_logprobs": old}
    for masked_kw in ({}, {"token_weights": jnp.asarray(mask, jnp.float64) * 0.7}):
        def f(x, kw=kw, masked_kw=masked_kw):
            return fn(x, mu, a, mask, **kw, **masked_kw)[0]
        g = jax.grad(f)(lp)
        assert g.dtype == jnp.float64
        assert np.all(np.asarray(g)[~np.asarray(mask)] == 0)
        _fd_check(f, jnp.where(mask, lp, 0.0), g)


@pytest.mark.parametrize("seq_kernel,tok_kernel", [("smooth", "gauss")])
def test_sat_gradients_match_fd_with_frozen_bounds(x64, make_batch, seq_eps, tok_eps,
                                                   seq_kernel, tok_kernel):
    """SAT's gradient is that of the clipped surrogate with the (detached) bounds frozen."""
    lp, mu, a, mask = make_batch(12, scale=0.2, dtype=np.float64)
    lp = jnp.where(mask, lp, 0.0)
    m = np.asarray(mask, np.float64)
    n = m.sum(1)
    rows = n > 0
    # sequence proxy
    d_seq = jnp.asarray((np.asarray(lp - mu) * m).sum(1) / np.maximum(n, 1))
    kernel = seq_kernel
    lo, hi = L.sat_interval(d_seq, mask=jnp.asarray(rows), kernel=kernel, **seq_eps)

    def f_seq(x):
        s = jnp.exp(jnp.sum((x - mu) * m, 1) / np.maximum(n, 1))
        return -jnp.sum(L.clipped_surrogate(s, a, lo, hi) * rows) / rows.sum()

    g = jax.grad(lambda x: L.sat_gspo_loss(x, mu, a, mask, kernel=kernel, **seq_eps)[0])(lp)
    _fd_check(f_seq, lp, g)
    # token-level SAT
    kernel = tok_kernel
    lo_t, hi_t = L.sat_interval(lp - mu, mask=mask, kernel=kernel, **tok_eps)

    def f_tok(x):
        j = L.clipped_surrogate(jnp.exp(x - mu), a[:, None], lo_t, hi_t)
        return -jnp.sum(j * m) / m.sum()

    g = jax.grad(lambda x: L.sat_ppo_loss(x, mu, a, mask, kernel=kernel, **tok_eps)[0])(lp)
    _fd_check(f_tok, lp, g)


# ----------------------------------------------------------------- token weights


@pytest.mark.parametrize("name", objectives.NAMES)
def test_token_weights_compose(make_batch, all_losses, name):
    fn, eps = all_losses[name]
    lp, mu, a, mask = make_batch(8, scale=0.3)
    ones_w = jnp.ones(lp.shape)
    base, _ = fn(lp, mu, a, mask, **eps)
    ones, _ = fn(lp, mu, a, mask, **eps, token_weights=ones_w)
    assert float(base) == float(ones)
    half, _ = fn(lp, mu, a, mask, **eps, token_weights=0.5 * ones_w)
    np.testing.assert_allclose(float(half), 0.5 * float(base), rtol=1e-6)
    # Dropping a sequence with MIS (sequence level) removes exactly its contribution.
    w = ones_w.at[0].set(0.0)
    dropped, _ = fn(lp, mu, a, mask, **eps, token_weights=w)
    only0, _ = fn(lp, mu, a * (jnp.arange(a.shape[0]) == 0), mask, **eps)
    np.testing.assert_allclose(float(dropped), float(base) - float(only0), rtol=1e-5,
                               atol=1e-7)


# ----------------------------------------------------------------- aux, jit, dtypes


@pytest.mark.parametrize("name", objectives.NAMES)
def test_aux_keys_vmap_and_bf16(make_batch, all_losses, name):
    fn, eps = all_losses[name]
    lp, mu, a, mask = make_batch(6, scale=0.2)
    loss, aux = fn(lp, mu, a, mask, **eps)
    assert set(aux) == set(L.AUX_KEYS)
    assert all(jnp.shape(v) == () and np.isfinite(float(v)) for v in aux.values())
    if name in ("sat_gspo", "ppo_clip"):
        stacked = [jnp.stack([x, x]) for x in (lp, mu, a, mask)]
        vl, _ = jax.vmap(lambda *x: fn(*x, **eps))(*stacked)
        np.testing.assert_allclose(np.asarray(vl), float(loss), rtol=1e-6)
    bl, _ = fn(lp.astype(jnp.bfloat16), mu.astype(jnp.bfloat16), a, mask, **eps)
    assert bl.dtype == jnp.float32 and np.isfinite(float(bl))
    if name in ("sat_gspo", "grpo"):
        g = jax.grad(lambda x: fn(x, mu, a, mask, **eps)[0])(lp.astype(jnp.bfloat16))
        assert g.dtype == jnp.bfloat16


def test_non_sat_losses_report_neutral_sat_metrics(make_batch, seq_eps):
    lp, mu, a, mask = make_batch(6, scale=2.0)
    _, aux = L.gspo_loss(lp, mu, a, mask, **seq_eps)
    assert float(aux["sat_tail_frac"]) == 0 and float(aux["sat_min_factor"]) == 1
    assert float(aux["sat_mean_hi_radius"]) == pytest.approx(seq_eps["eps_high"])
    assert float(aux["kl_k3"]) >= 0


# ----------------------------------------------------------------- validation


def test_value_errors_name_the_argument(make_batch, seq_eps):
    lp, mu, a, mask = make_batch(0)
    b = lp.shape[0]
    cases = [
        (dict(behavior_logprobs=mu[:, :-1]), "behavior_logprobs"),
        (dict(mask=mask[:-1]), "mask"),
        (dict(advantages=a[:-1]), "advantages"),
        (dict(old_logprobs=mu[:, :3]), "old_logprobs"),
        (dict(token_weights=jnp.ones((b, 1))), "token_weights"),
        (dict(mask=jnp.zeros_like(mask)), "mask"),
        (dict(logprobs=lp.at[0, 0].set(jnp.inf)), "logprobs"),
        (dict(behavior_logprobs=mu.at[0, 0].set(jnp.nan)), "behavior_logprobs"),
        (dict(logprobs=lp[0]), "logprobs"),
        (dict(eps_low=-0.1), "eps_low"),
        (dict(eps_high=-1.0), "eps_high"),
        (dict(lam=1.5), "lam"),
        (dict(lam=-0.1), "lam"),
        (dict(kernel="cauchy"), "kernel"),
        (dict(proxy="row"), "proxy"),
        (dict(scale="std"), "scale"),
        (dict(w=0.0), "w"),
        (dict(quantile=1.2), "quantile"),
    ]
    base = dict(logprobs=lp, behavior_logprobs=mu, advantages=a, mask=mask, **seq_eps)
    for override, name in cases:
        kw = {**base, **override}
        with pytest.raises(ValueError, match=name):
            L.sat_gspo_loss(kw.pop("logprobs"), kw.pop("behavior_logprobs"),
                            kw.pop("advantages"), kw.pop("mask"), **kw)


def test_value_checks_skip_under_jit_and_padding_may_be_nan(make_batch, seq_eps):
    lp, mu, a, mask = make_batch(0)  # row 1 of lp is nan padding
    loss, _ = jax.jit(lambda *x: L.sat_gspo_loss(*x, **seq_eps))(lp, mu, a, mask)
    assert np.isfinite(float(loss))
    g = jax.grad(lambda x: L.gspo_loss(x, mu, a, mask, **seq_eps)[0])(lp)
    assert np.all(np.isfinite(np.asarray(g)))


# ----------------------------------------------------------------- clip fractions, dual clip


def _np_batch(make_batch, seed, scale):
    lp, mu, a, mask = make_batch(seed, scale=scale)
    lp_np = np.where(np.asarray(mask), np.asarray(lp, np.float64), 0.0)
    return lp, mu, a, mask, lp_np, np.asarray(mu, np.float64), np.asarray(a, np.float64), \
        np.asarray(mask)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_clip_fractions_count_where_the_clip_binds(make_batch, tok_eps, seed):
    """verl's pg_clipfrac: A > 0 and r > 1 + eps_high, or A < 0 and r < 1 - eps_low."""
    lp, mu, a, mask, lpn, mun, an, mn = _np_batch(make_batch, seed, 0.4)
    r = np.exp(lpn - mun)
    n = mn.sum()
    high = (mn & (an[:, None] > 0) & (r > 1 + tok_eps["eps_high"])).sum() / n
    low = (mn & (an[:, None] < 0) & (r < 1 - tok_eps["eps_low"])).sum() / n
    # The other side of the interval exists here and must not be counted.
    assert (mn & (an[:, None] < 0) & (r > 1 + tok_eps["eps_high"])).any()
    for fn in (L.ppo_clip_loss, L.grpo_loss):
        _, aux = fn(lp, mu, a, mask, **tok_eps)
        np.testing.assert_allclose(float(aux["clip_frac_high"]), high, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(float(aux["clip_frac_low"]), low, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_clip_fractions_are_token_weighted(make_batch, seq_eps, seed):
    lp, mu, a, mask, lpn, mun, an, mn = _np_batch(make_batch, seed, 0.3)
    lengths = mn.sum(1)
    s = np.exp(np.sum((lpn - mun) * mn, 1) / np.maximum(lengths, 1))
    high = np.sum(lengths * ((an > 0) & (s > 1 + seq_eps["eps_high"]))) / lengths.sum()
    low = np.sum(lengths * ((an < 0) & (s < 1 - seq_eps["eps_low"]))) / lengths.sum()
    assert high + low > 0
    for fn in (L.gspo_loss, L.gspo_token_loss):
        _, aux = fn(lp, mu, a, mask, **seq_eps)
        np.testing.assert_allclose(float(aux["clip_frac_high"]), high, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(float(aux["clip_frac_low"]), low, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("proxy", ["sequence", "token"])
def test_sat_newly_clipped_counts_where_only_the_sat_bound_binds(make_batch, seq_eps,
                                                                 tok_eps, proxy):
    """SAT-GSPO (token-weighted rows) and SAT-PPO (tokens), with bounds from sat_interval."""
    # Staleness of the size of the radii, so some ratios fall between SAT and PPO bounds.
    # (seed 5 holds such a token at scale 0.1 and such a row at 0.03)
    lp, mu, a, mask, lpn, mun, an, mn = _np_batch(make_batch, 5,
                                                  0.1 if proxy == "token" else 0.03)
    lengths = mn.sum(1)
    # sat_ppo: per-token bounds from sat_interval on d = lp - mu over the valid tokens.
    lo, hi = (np.asarray(x, np.float64) for x in L.sat_interval(
        jnp.asarray(lpn - mun, jnp.float32), mask=mask, **tok_eps))
    r, at = np.exp(lpn - mun), an[:, None]
    newly = mn & (((at > 0) & (r > hi) & (r <= 1 + tok_eps["eps_high"]))
                  | ((at < 0) & (r < lo) & (r >= 1 - tok_eps["eps_low"])))
    assert newly.any() or proxy == "sequence"
    _, aux = L.sat_ppo_loss(lp, mu, a, mask, **tok_eps)
    np.testing.assert_allclose(float(aux["sat_newly_clipped_frac"]), newly.sum() / mn.sum(),
                               rtol=1e-6)
    if proxy == "token":
        return
    d = np.sum((lpn - mun) * mn, 1) / np.maximum(lengths, 1)
    row = lengths > 0
    # (the smooth kernel: at this seed's 6 rows the paper's gate passes only the largest)
    lo, hi = (np.asarray(x, np.float64) for x in L.sat_interval(
        jnp.asarray(d, jnp.float32), mask=jnp.asarray(row), kernel="smooth", **seq_eps))
    s = np.exp(d)  # no old_logprobs: the ratio reference is mu, so log s = d
    newly = row & (((an > 0) & (s > hi) & (s <= 1 + seq_eps["eps_high"]))
                   | ((an < 0) & (s < lo) & (s >= 1 - seq_eps["eps_low"])))
    assert newly.any()
    _, aux = L.sat_gspo_loss(lp, mu, a, mask, **seq_eps, proxy="sequence", kernel="smooth")
    np.testing.assert_allclose(float(aux["sat_newly_clipped_frac"]),
                               np.sum(lengths * newly) / lengths.sum(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kernel", ["smooth", "gauss"])
def test_token_proxy_rows_take_each_sides_smallest_token_factor(make_batch, seq_eps,
                                                                tok_eps, kernel):
    """Reference: per-token factors from sat_interval (the kernel on every token), each
    row's minimum per side and GSPO with those row bounds, in float64 numpy."""
    lp, mu, a, mask = make_batch(7, scale=0.3)
    m = np.asarray(mask, bool)
    d = np.where(m, np.asarray(lp, np.float64) - np.asarray(mu, np.float64), 0.0)
    d32 = jnp.asarray(d, jnp.float32)

    def token_factors(eps):  # the factor each token applies on the side its d points to
        lo_t, hi_t = (np.asarray(x, np.float64) for x in L.sat_interval(
            d32, mask=mask, kernel=kernel, **eps))
        f_hi = np.where(m & (d > 0), (hi_t - 1) / eps["eps_high"], 1.0)
        f_lo = np.where(m & (d < 0), (1 - lo_t) / eps["eps_low"], 1.0)
        return f_lo, f_hi

    f_lo_t, f_hi_t = token_factors(seq_eps)
    f_lo, f_hi = f_lo_t.min(1), f_hi_t.min(1)
    assert np.any(np.minimum(f_lo, f_hi) < 0.99)  # the tail is populated
    lo, hi = 1 - seq_eps["eps_low"] * f_lo, 1 + seq_eps["eps_high"] * f_hi
    n = m.sum(1)
    rows = n > 0
    s = np.exp(d.sum(1) / np.maximum(n, 1))
    an = np.asarray(a, np.float64)
    j = np.where(an >= 0, np.minimum(s, hi), np.maximum(s, lo)) * an
    loss, aux = L.sat_gspo_loss(lp, mu, a, mask, kernel=kernel, proxy="token", **seq_eps)
    np.testing.assert_allclose(float(loss), -np.sum(j * rows) / rows.sum(), rtol=1e-5,
                               atol=1e-7)
    # Factors read back from float32 bounds carry ~ulp(1) / eps (2e-6 at eps_low = 0.03).
    np.testing.assert_allclose(float(aux["sat_min_factor"]),
                               np.minimum(f_lo, f_hi)[rows].min(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(aux["sat_mean_hi_radius"]), np.mean((hi - 1)[rows]),
                               rtol=1e-5)
    np.testing.assert_allclose(float(aux["sat_mean_lo_radius"]), np.mean((1 - lo)[rows]),
                               rtol=1e-5)
    # sat_ppo: the smallest factor over the valid tokens.
    f_lo_t, f_hi_t = token_factors(tok_eps)
    _, aux = L.sat_ppo_loss(lp, mu, a, mask, kernel=kernel, **tok_eps)
    np.testing.assert_allclose(float(aux["sat_min_factor"]),
                               np.minimum(f_lo_t, f_hi_t)[m].min(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["ppo_clip", "grpo", "sat_ppo"])
def test_dual_clip_caps_negative_advantage_tokens(make_batch, tok_eps, name):
    """verl clip_ratio_c: for A < 0 the token loss is min(PPO loss, c |A|); numpy reference
    of the loss (rtol 1e-5) and of the gradient (rtol 1e-4)."""
    lp, mu, a, mask, lpn, mun, an, mn = _np_batch(make_batch, 4, 1.0)
    c = 3.0
    fn = getattr(L, f"{name}_loss")
    # SAT off: PPO bounds
    kw = dict(tok_eps, kernel="smooth", lam=0.0) if name == "sat_ppo" else dict(tok_eps)
    (loss, _), g = jax.value_and_grad(
        lambda x: fn(x, mu, a, mask, clip_ratio_c=c, **kw), has_aux=True)(lp)
    r, at = np.exp(lpn - mun), an[:, None]
    ppo_loss = np.where(at >= 0, -at * np.minimum(r, 1 + tok_eps["eps_high"]),
                        -at * np.maximum(r, 1 - tok_eps["eps_low"]))
    capped = (at < 0) & (ppo_loss > c * -at)
    assert (capped & mn).any()
    tok_loss = np.where(capped, c * -at, ppo_loss)
    free = np.where(at >= 0, r <= 1 + tok_eps["eps_high"], r >= 1 - tok_eps["eps_low"])
    tok_g = np.where(free & ~capped, -at * r, 0.0)
    lengths = mn.sum(1)
    if name == "grpo":
        per = np.where(mn, 1.0, 0.0) / np.maximum(lengths, 1)[:, None] / (lengths > 0).sum()
    else:
        per = np.where(mn, 1.0, 0.0) / mn.sum()
    np.testing.assert_allclose(float(loss), np.sum(tok_loss * per), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g), tok_g * per, rtol=1e-4, atol=1e-7)
    base, _ = fn(lp, mu, a, mask, **kw)
    assert float(loss) < float(base)  # the cap only lowers the loss
    # objectives passes it through
    obj_loss, _ = objectives.make(name, clip_ratio_c=c, **kw)(
        lp, {"behavior_logprobs": mu, "advantages": a, "mask": mask})
    assert float(obj_loss) == float(loss)


@pytest.mark.parametrize("name", ["sat_ppo", "sat_gspo_token"])
def test_token_sat_on_a_large_batch_matches_a_sorted_gate(monkeypatch, tok_eps, seq_eps,
                                                          name):
    """64 x 1024 tokens, so the gate quantile takes the CPU selection path (the small test
    batches use bisection): loss, gradient and metrics equal those with the gate from a
    full sort, and the tail is the tokens with |d| above numpy's 0.9-quantile."""
    import satjax.losses.sat as sat_module

    rng = np.random.default_rng(7)
    b, t = 64, 1024
    mu = rng.normal(-1.0, 0.5, (b, t)).astype(np.float32)
    lp = (mu + 0.05 * rng.standard_t(3, (b, t))).astype(np.float32)
    mask = np.arange(t)[None, :] < rng.integers(t // 4, t + 1, b)[:, None]
    adv = rng.normal(size=b).astype(np.float32)
    fn, eps, kw = {"sat_ppo": (L.sat_ppo_loss, tok_eps, {}),
                   "sat_gspo_token": (L.sat_gspo_loss, seq_eps, {"proxy": "token"})}[name]
    args = tuple(jnp.asarray(x) for x in (lp, mu, adv, mask))

    def run():  # a fresh jit of the loss body, so each run traces the gate it is given
        body = fn.__wrapped__
        return jax.jit(jax.value_and_grad(lambda x: body(x, *args[1:], **eps, **kw),
                                          has_aux=True))(args[0])

    (loss, aux), g = run()
    real = sat_module.masked_quantile
    monkeypatch.setattr(sat_module, "masked_quantile",
                        lambda *a, **k: real(*a, **k, algorithm="sort"))
    (loss_s, aux_s), g_s = run()
    np.testing.assert_allclose(float(loss), float(loss_s), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_s), rtol=1e-6, atol=1e-12)
    for k in L.AUX_KEYS:
        np.testing.assert_allclose(float(aux[k]), float(aux_s[k]), rtol=1e-6, err_msg=k)
    if name == "sat_ppo":
        a = np.abs(lp - mu)[mask]
        tail = np.mean(a > np.quantile(a, 0.9, method="inverted_cdf"))
        np.testing.assert_allclose(float(aux["sat_tail_frac"]), tail, atol=1.5 / a.size)
