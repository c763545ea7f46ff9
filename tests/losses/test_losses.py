"""Properties of satjax.losses: SAT containment/pessimism/identity, gradients, validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from satjax import losses as L

B, T = 6, 8
SEQ_EPS = {"eps_low": 3e-2, "eps_high": 4e-2}
TOK_EPS = {"eps_low": 0.2, "eps_high": 0.28}
FAST = settings(max_examples=5, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

ALL_LOSSES = {
    "gspo": (L.gspo_loss, SEQ_EPS),
    "sat_gspo": (L.sat_gspo_loss, SEQ_EPS),
    "gspo_token": (L.gspo_token_loss, SEQ_EPS),
    "ppo_clip": (L.ppo_clip_loss, TOK_EPS),
    "grpo": (L.grpo_loss, TOK_EPS),
    "sat_ppo": (L.sat_ppo_loss, TOK_EPS),
}


def make_batch(seed, *, scale=0.05, adv="random", masked_row=True, dtype=np.float32,
               tail=3.0):
    """Random batch; ``scale`` sets the size of lp - mu, ``tail`` its heavy-tailedness."""
    rng = np.random.default_rng(seed)
    mu = rng.normal(-1.5, 0.5, (B, T))
    lp = mu + scale * rng.standard_t(tail, (B, T))
    mask = rng.random((B, T)) < 0.8
    mask[:, 0] = True
    if masked_row:
        mask[1] = False
        lp[1, :] = np.nan  # padding garbage must never leak
    a = rng.normal(size=B)
    if adv == "negative":
        a = -np.abs(a) - 0.1
    return (jnp.asarray(lp, dtype), jnp.asarray(mu, dtype), jnp.asarray(a, dtype),
            jnp.asarray(mask))


def sat_variants():
    out = []
    for kernel in ("hill", "gauss"):
        out.append((L.sat_gspo_loss, L.gspo_loss, SEQ_EPS, {"kernel": kernel}))
        out.append((L.sat_gspo_loss, L.gspo_loss, SEQ_EPS,
                    {"kernel": kernel, "proxy": "token"}))
        out.append((L.sat_ppo_loss, L.ppo_clip_loss, TOK_EPS, {"kernel": kernel}))
    return out


# ----------------------------------------------------------------- containment, pessimism


@FAST
@given(seed=st.integers(0, 10_000), log_scale=st.floats(-4, 1.5),
       kernel=st.sampled_from(["hill", "gauss"]), two_d=st.booleans(),
       lam=st.floats(0, 1), c=st.floats(0, 3))
def test_interval_containment_and_sign(seed, log_scale, kernel, two_d, lam, c):
    rng = np.random.default_rng(seed)
    shape = (B, T) if two_d else (B,)
    d = jnp.asarray(10**log_scale * rng.standard_t(2, shape), jnp.float32)
    mask = jnp.asarray(rng.random(shape) < 0.7)
    lo, hi = L.sat_interval(d, mask=mask, kernel=kernel, lam=lam, c=c, **SEQ_EPS)
    lo, hi, d = map(np.asarray, (lo, hi, d))
    assert np.all(lo >= np.float32(1 - SEQ_EPS["eps_low"])) and np.all(lo <= 1)
    assert np.all(hi <= np.float32(1 + SEQ_EPS["eps_high"])) and np.all(hi >= 1)
    # Sign selection: d > 0 never touches lo, d < 0 never touches hi.
    assert np.all(lo[d >= 0] == np.float32(1 - SEQ_EPS["eps_low"]))
    assert np.all(hi[d <= 0] == np.float32(1 + SEQ_EPS["eps_high"]))
    # Invalid entries keep the PPO interval.
    m = np.asarray(mask)
    assert np.all(lo[~m] == np.float32(1 - SEQ_EPS["eps_low"]))
    assert np.all(hi[~m] == np.float32(1 + SEQ_EPS["eps_high"]))


def test_sign_selection_contracts_the_tail_end():
    ordinary = np.linspace(-0.03, 0.03, 20)
    d = jnp.asarray(np.concatenate([[5.0, -5.0], ordinary]), jnp.float32)
    for kernel in ("hill", "gauss"):
        lo, hi = L.sat_interval(d, eps_low=0.2, eps_high=0.3, kernel=kernel)
        assert hi[0] < 1.3 and lo[0] == pytest.approx(0.8)
        assert lo[1] > 0.8 and hi[1] == pytest.approx(1.3)
        # ordinary entries untouched
        np.testing.assert_array_equal(np.asarray(hi[2:]), np.float32(1.3))


def _check_pessimism(sat_fn, base_fn, eps, kw, lp, mu, a, mask):
    sat_loss, _ = sat_fn(lp, mu, a, mask, **eps, **kw)
    base_loss, _ = base_fn(lp, mu, a, mask, **eps)
    assert np.isfinite(float(sat_loss))
    assert float(sat_loss) >= float(base_loss) - 1e-6 * max(1.0, abs(float(base_loss)))
    # Row by row: advantages zero except row i isolate J_i (bounds do not depend on A).
    for i in range(B):
        ai = jnp.zeros_like(a).at[i].set(a[i])
        s_i = float(sat_fn(lp, mu, ai, mask, **eps, **kw)[0])
        b_i = float(base_fn(lp, mu, ai, mask, **eps)[0])
        assert s_i >= b_i - 1e-7 * max(1.0, abs(b_i))


@FAST
@given(seed=st.integers(0, 10_000), log_scale=st.floats(-3, 1.3),
       adv=st.sampled_from(["random", "negative"]), variant=st.integers(0, 5))
def test_sat_pointwise_pessimism(seed, log_scale, adv, variant):
    """Per-sequence (per-row) SAT objective <= the PPO/GSPO one, and so the loss >=."""
    lp, mu, a, mask = make_batch(seed, scale=10**log_scale, adv=adv)
    _check_pessimism(*sat_variants()[variant], lp, mu, a, mask)


@pytest.mark.parametrize("variant", [0, 1, 2])
def test_sat_pessimism_bf16_inputs(variant):
    lp, mu, a, mask = make_batch(variant, scale=0.5, dtype=jnp.bfloat16)
    _check_pessimism(*sat_variants()[variant], lp, mu, a, mask)


def test_clipped_surrogate_pessimism_with_sat_bounds():
    rng = np.random.default_rng(0)
    d = jnp.asarray(rng.standard_t(2, 400) * 0.5, jnp.float32)
    ratio = jnp.exp(d + jnp.asarray(rng.normal(0, 0.1, 400), jnp.float32))
    a = jnp.asarray(rng.normal(size=400), jnp.float32)
    for kernel in ("hill", "gauss"):
        lo, hi = L.sat_interval(d, kernel=kernel, **TOK_EPS)
        j_sat = L.clipped_surrogate(ratio, a, lo, hi)
        j_ppo = L.clipped_surrogate(ratio, a, 0.8, 1.28)
        assert np.all(np.asarray(j_sat) <= np.asarray(j_ppo))
        assert np.any(np.asarray(j_sat) < np.asarray(j_ppo))  # SAT actually bites


def test_huge_proxy_is_finite_and_floors_at_c_min():
    lp, mu, a, mask = make_batch(3, scale=0.01)
    lp = lp.at[0, :2].add(30.0)  # two absurdly stale tokens (< 10% of the valid ones)
    # Token proxy: the 0.9-quantile comes from ordinary tokens, so row 0 hits the floor.
    loss, aux = L.sat_gspo_loss(lp, mu, a, mask, **SEQ_EPS, c_min=0.1, proxy="token")
    assert np.isfinite(float(loss))
    assert float(aux["sat_min_factor"]) == pytest.approx(0.1)
    assert 0 < float(aux["sat_tail_frac"]) <= 1


# ----------------------------------------------------------------- identities


def _value_and_grad(fn, lp, mu, a, mask, **kw):
    return jax.value_and_grad(lambda x: fn(x, mu, a, mask, **kw)[0])(lp)


def test_gauss_without_tail_equals_gspo_exactly():
    rng = np.random.default_rng(1)
    mu = jnp.asarray(rng.normal(-1, 0.3, (B, T)), jnp.float32)
    signs = jnp.asarray([1, -1, 1, -1, -1, 1], jnp.float32)[:, None]
    lp = mu + 0.02 * signs  # every |d_i| equal: |d_i| / sigma <= 1 = c, so no tail
    a = jnp.asarray(rng.normal(size=B), jnp.float32)
    mask = jnp.asarray(rng.random((B, T)) < 0.8).at[:, 0].set(True)
    v0, g0 = _value_and_grad(L.gspo_loss, lp, mu, a, mask, **SEQ_EPS)
    v1, g1 = _value_and_grad(L.sat_gspo_loss, lp, mu, a, mask, kernel="gauss", **SEQ_EPS)
    _, aux = L.sat_gspo_loss(lp, mu, a, mask, kernel="gauss", **SEQ_EPS)
    assert float(aux["sat_tail_frac"]) == 0.0
    assert float(v0) == float(v1)
    np.testing.assert_array_equal(np.asarray(g0), np.asarray(g1))


@FAST
@given(seed=st.integers(0, 10_000))
def test_gauss_large_c_is_gspo_on_random_data(seed):
    # max |d_i| / rms(d) <= sqrt(n) so c = sqrt(B) + 1 guarantees an empty tail.
    lp, mu, a, mask = make_batch(seed)
    kw = {"kernel": "gauss", "c": np.sqrt(B) + 1.0}
    v0, g0 = _value_and_grad(L.gspo_loss, lp, mu, a, mask, **SEQ_EPS)
    v1, g1 = _value_and_grad(L.sat_gspo_loss, lp, mu, a, mask, **kw, **SEQ_EPS)
    assert float(v0) == float(v1)
    np.testing.assert_array_equal(np.asarray(g0), np.asarray(g1))


@FAST
@given(seed=st.integers(0, 10_000), log_scale=st.floats(-3, 1), variant=st.integers(0, 5))
def test_lam_zero_is_identity(seed, log_scale, variant):
    sat_fn, base_fn, eps, kw = sat_variants()[variant]
    lp, mu, a, mask = make_batch(seed, scale=10**log_scale)
    v0, g0 = _value_and_grad(base_fn, lp, mu, a, mask, **eps)
    v1, g1 = _value_and_grad(sat_fn, lp, mu, a, mask, lam=0.0, **eps, **kw)
    assert float(v0) == float(v1)
    np.testing.assert_array_equal(np.asarray(g0), np.asarray(g1))


def test_gspo_token_matches_gspo_value_and_gradient():
    lp, mu, a, mask = make_batch(5, scale=0.05)
    v0, g0 = _value_and_grad(L.gspo_loss, lp, mu, a, mask, **SEQ_EPS)
    v1, g1 = _value_and_grad(L.gspo_token_loss, lp, mu, a, mask, **SEQ_EPS)
    np.testing.assert_allclose(float(v0), float(v1), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g0), np.asarray(g1), rtol=1e-5, atol=1e-8)


def test_grpo_vs_ppo_normalisation():
    """Equal-length rows: GRPO's per-sequence mean equals PPO's token mean."""
    lp, mu, a, _ = make_batch(2, scale=0.3, masked_row=False)
    full = jnp.ones((B, T), bool)
    g, _ = L.grpo_loss(lp, mu, a, full, **TOK_EPS)
    p, _ = L.ppo_clip_loss(lp, mu, a, full, **TOK_EPS)
    np.testing.assert_allclose(float(g), float(p), rtol=1e-6)
    ragged = full.at[0, 2:].set(False)
    g, _ = L.grpo_loss(lp, mu, a, ragged, **TOK_EPS)
    p, _ = L.ppo_clip_loss(lp, mu, a, ragged, **TOK_EPS)
    assert abs(float(g) - float(p)) > 1e-6


# ----------------------------------------------------------------- gradients (float64)


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _fd_check(f, x, grad, n_dirs=4, h=1e-6, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n_dirs):
        v = jnp.asarray(rng.normal(size=x.shape))
        fd = (f(x + h * v) - f(x - h * v)) / (2 * h)
        np.testing.assert_allclose(float(jnp.vdot(grad, v)), float(fd), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "ppo_clip", "grpo"])
def test_gradients_match_finite_differences(x64, name):
    fn, eps = ALL_LOSSES[name]
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


@pytest.mark.parametrize("seq_kernel,tok_kernel", [("hill", "gauss")])
def test_sat_gradients_match_fd_with_frozen_bounds(x64, seq_kernel, tok_kernel):
    """SAT's gradient is that of the clipped surrogate with the (detached) bounds frozen."""
    lp, mu, a, mask = make_batch(12, scale=0.2, dtype=np.float64)
    lp = jnp.where(mask, lp, 0.0)
    m = np.asarray(mask, np.float64)
    n = m.sum(1)
    rows = n > 0
    # sequence proxy
    d_seq = jnp.asarray((np.asarray(lp - mu) * m).sum(1) / np.maximum(n, 1))
    kernel = seq_kernel
    lo, hi = L.sat_interval(d_seq, mask=jnp.asarray(rows), kernel=kernel, **SEQ_EPS)

    def f_seq(x):
        s = jnp.exp(jnp.sum((x - mu) * m, 1) / np.maximum(n, 1))
        return -jnp.sum(L.clipped_surrogate(s, a, lo, hi) * rows) / rows.sum()

    g = jax.grad(lambda x: L.sat_gspo_loss(x, mu, a, mask, kernel=kernel, **SEQ_EPS)[0])(lp)
    _fd_check(f_seq, lp, g)
    # token-level SAT
    kernel = tok_kernel
    lo_t, hi_t = L.sat_interval(lp - mu, mask=mask, kernel=kernel, **TOK_EPS)

    def f_tok(x):
        j = L.clipped_surrogate(jnp.exp(x - mu), a[:, None], lo_t, hi_t)
        return -jnp.sum(j * m) / m.sum()

    g = jax.grad(lambda x: L.sat_ppo_loss(x, mu, a, mask, kernel=kernel, **TOK_EPS)[0])(lp)
    _fd_check(f_tok, lp, g)


@pytest.mark.parametrize("kernel", ["hill", "gauss"])
@pytest.mark.parametrize("two_d", [False, True])
def test_proxy_carries_no_gradient(kernel, two_d):
    rng = np.random.default_rng(0)
    d = jnp.asarray(rng.standard_t(2, (B, T) if two_d else (B,)), jnp.float32)
    g = jax.grad(lambda x: sum(jnp.sum(b) for b in L.sat_interval(
        x, kernel=kernel, **TOK_EPS)))(d)
    assert np.all(np.asarray(g) == 0)


# ----------------------------------------------------------------- quantile


@FAST
@given(seed=st.integers(0, 10_000), n_valid=st.integers(1, 300), q=st.floats(0, 1),
       ties=st.booleans())
def test_masked_quantile_matches_numpy(seed, n_valid, q, ties):
    rng = np.random.default_rng(seed)
    x = rng.standard_t(2, 300).astype(np.float32)
    if ties:
        x = np.round(x)
    m = np.zeros(300, bool)
    m[rng.permutation(300)[:n_valid]] = True
    ref = np.quantile(x[m].astype(np.float64), q)
    for method in ("sort", "bisect"):
        got = float(_QUANTILE[method](jnp.asarray(x), q, jnp.asarray(m)))
        assert got == pytest.approx(ref, rel=1e-5, abs=1e-6)


_QUANTILE = {m: jax.jit(lambda x, q, mask, m=m: L.masked_quantile(x, q, mask, method=m))
             for m in ("sort", "bisect")}


def test_masked_quantile_empty_mask_is_zero():
    for method in ("sort", "bisect"):
        assert float(L.masked_quantile(jnp.ones(4), 0.9, jnp.zeros(4, bool),
                                       method=method)) == 0.0


# ----------------------------------------------------------------- IS corrections


def test_tis_weights_truncate_and_detach():
    lp, mu, _, mask = make_batch(4, scale=1.0)
    w = L.tis_weights(lp, mu, threshold=2.0, mask=mask)
    ref = np.minimum(np.exp(np.asarray(lp - mu, np.float64)), 2.0) * np.asarray(mask)
    np.testing.assert_allclose(np.nan_to_num(np.asarray(w)), np.nan_to_num(ref), rtol=1e-5)
    assert np.all(np.asarray(w)[~np.asarray(mask)] == 0)
    g = jax.grad(lambda x: jnp.sum(L.tis_weights(x, mu, threshold=2.0, mask=mask)))(lp)
    assert np.all(np.asarray(g) == 0)


def test_mis_mask_token_and_sequence():
    lp, mu, _, mask = make_batch(4, scale=1.0)
    ratio = np.exp(np.asarray(lp - mu, np.float64))
    mm = np.asarray(L.mis_mask(lp, mu, threshold=2.0, mask=mask))
    np.testing.assert_array_equal(mm, (np.asarray(mask) & (ratio <= 2.0)).astype(np.float32))
    ms = np.asarray(L.mis_mask(lp, mu, threshold=1.2, mask=mask, level="sequence"))
    m = np.asarray(mask)
    lr = np.where(m, np.log(np.where(m, ratio, 1.0)), 0.0)
    geo = np.exp(lr.sum(1) / np.maximum(m.sum(1), 1))
    np.testing.assert_array_equal(ms, (m & (geo <= 1.2)[:, None]).astype(np.float32))


@pytest.mark.parametrize("name", list(ALL_LOSSES))
def test_token_weights_compose(name):
    fn, eps = ALL_LOSSES[name]
    lp, mu, a, mask = make_batch(8, scale=0.3)
    base, _ = fn(lp, mu, a, mask, **eps)
    ones, _ = fn(lp, mu, a, mask, **eps, token_weights=jnp.ones((B, T)))
    assert float(base) == float(ones)
    half, _ = fn(lp, mu, a, mask, **eps, token_weights=0.5 * jnp.ones((B, T)))
    np.testing.assert_allclose(float(half), 0.5 * float(base), rtol=1e-6)
    # Dropping a sequence with MIS (sequence level) removes exactly its contribution.
    w = jnp.ones((B, T)).at[0].set(0.0)
    dropped, _ = fn(lp, mu, a, mask, **eps, token_weights=w)
    only0, _ = fn(lp, mu, a * (jnp.arange(B) == 0), mask, **eps)
    np.testing.assert_allclose(float(dropped), float(base) - float(only0), rtol=1e-5,
                               atol=1e-7)


def test_ppo_token_weights_match_manual():
    lp, mu, a, mask = make_batch(9, scale=0.3)
    w = L.tis_weights(lp, mu, threshold=1.1, mask=mask)
    loss, _ = L.ppo_clip_loss(lp, mu, a, mask, **TOK_EPS, token_weights=w)
    m = np.asarray(mask)
    r = np.exp(np.where(m, np.asarray(lp - mu, np.float64), 0.0))
    an = np.asarray(a, np.float64)[:, None]
    j = np.minimum(r * an, np.clip(r, 0.8, 1.28) * an)
    ref = -(j * np.asarray(w) * m).sum() / m.sum()
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5)


# ----------------------------------------------------------------- aux, jit, dtypes


@pytest.mark.parametrize("name", list(ALL_LOSSES))
def test_aux_keys_vmap_and_bf16(name):
    fn, eps = ALL_LOSSES[name]
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


def test_non_sat_losses_report_neutral_sat_metrics():
    lp, mu, a, mask = make_batch(6, scale=2.0)
    _, aux = L.gspo_loss(lp, mu, a, mask, **SEQ_EPS)
    assert float(aux["sat_tail_frac"]) == 0 and float(aux["sat_min_factor"]) == 1
    assert float(aux["sat_mean_hi_radius"]) == pytest.approx(SEQ_EPS["eps_high"])
    assert float(aux["kl_k3"]) >= 0


# ----------------------------------------------------------------- validation


def test_value_errors_name_the_argument():
    lp, mu, a, mask = make_batch(0)
    cases = [
        (dict(behavior_logprobs=mu[:, :-1]), "behavior_logprobs"),
        (dict(mask=mask[:-1]), "mask"),
        (dict(advantages=a[:-1]), "advantages"),
        (dict(old_logprobs=mu[:, :3]), "old_logprobs"),
        (dict(token_weights=jnp.ones((B, 1))), "token_weights"),
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
    base = dict(logprobs=lp, behavior_logprobs=mu, advantages=a, mask=mask, **SEQ_EPS)
    for override, name in cases:
        kw = {**base, **override}
        with pytest.raises(ValueError, match=name):
            L.sat_gspo_loss(kw.pop("logprobs"), kw.pop("behavior_logprobs"),
                            kw.pop("advantages"), kw.pop("mask"), **kw)
    with pytest.raises(ValueError, match="kernel"):
        L.sat_interval(jnp.ones(3), eps_low=0.1, eps_high=0.1, kernel="x")
    with pytest.raises(ValueError, match="threshold"):
        L.tis_weights(lp, mu, threshold=0.0)
    with pytest.raises(ValueError, match="group_size"):
        L.group_advantages(jnp.ones(6), 4)


def test_value_checks_skip_under_jit_and_padding_may_be_nan():
    lp, mu, a, mask = make_batch(0)  # row 1 of lp is nan padding
    loss, _ = jax.jit(lambda *x: L.sat_gspo_loss(*x, **SEQ_EPS))(lp, mu, a, mask)
    assert np.isfinite(float(loss))
    g = jax.grad(lambda x: L.gspo_loss(x, mu, a, mask, **SEQ_EPS)[0])(lp)
    assert np.all(np.isfinite(np.asarray(g)))


# ----------------------------------------------------------------- group advantages


def test_group_advantages_match_numpy():
    r = np.random.default_rng(0).normal(size=12)
    got = np.asarray(L.group_advantages(jnp.asarray(r), 4))
    g = r.reshape(3, 4)
    ref = ((g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + 1e-6)).reshape(-1)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    got = np.asarray(L.group_advantages(jnp.asarray(r), 3, normalize_std=False))
    g = r.reshape(4, 3)
    np.testing.assert_allclose(got, (g - g.mean(1, keepdims=True)).reshape(-1), rtol=1e-5,
                               atol=1e-7)
    assert np.all(np.asarray(L.group_advantages(jnp.ones(4), 2)) == 0)
