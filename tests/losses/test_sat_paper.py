"""SAT's defaults against an independent reference written from the authors' equations.

The reference below is numpy in float64, written from the project page's Eq. 3.1-3.6 (and
its "GSPO scope" paragraph) without calling satjax: d = lp - mu; q = inf{x : F(x) >= 0.9}
over the active tokens, found by scanning the sorted values with exact fractions;
c+- = 1 / (1 + (u+-/q)^2) if q > 0 and |d| > q, else 1; radii eps * c; J = min(r A,
clip(r, 1 - eps_lo c-, 1 + eps_hi c+) A). Tolerances: float32 against float64, rtol 1e-5
on values, 1e-4 on gradients (the losses compute in float32).
"""

import fractions

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from satjax import losses as L
from satjax import objectives

EPS = {"eps_low": 0.2, "eps_high": 0.2}


# ----------------------------------------------------------------- the reference


def ref_gate(abs_d: np.ndarray, level: float = 0.9) -> float:
    """q = inf{x >= 0 : F(x) >= level}, F the empirical CDF of ``abs_d`` (Eq. 3.3)."""
    vals = np.sort(abs_d.astype(np.float64))
    n, want = len(vals), fractions.Fraction(repr(level))
    for v in vals:
        if fractions.Fraction(int(np.sum(vals <= v)), n) >= want:
            return float(v)
    return float(vals[-1])


def ref_factors(d: np.ndarray, q: float) -> tuple[np.ndarray, np.ndarray]:
    """(c+, c-) of Eq. 3.2/3.4 elementwise."""
    def psi(u):
        return 1.0 / (1.0 + (u / q) ** 2) if q > 0 else np.ones_like(u)
    gate = (q > 0) & (np.abs(d) > q)
    c_plus = np.where(gate, psi(np.maximum(d, 0.0)), 1.0)
    c_minus = np.where(gate, psi(np.maximum(-d, 0.0)), 1.0)
    return c_plus, c_minus


def ref_surrogate(r, a, c_plus, c_minus, eps_low=0.2, eps_high=0.2):
    """Eq. 3.5-3.6: min(r A, clip(r, 1 - eps_lo c-, 1 + eps_hi c+) A)."""
    return np.minimum(r * a, np.clip(r, 1 - eps_low * c_minus, 1 + eps_high * c_plus) * a)


def ref_sat_token(lp, mu, adv, mask, reduction):
    """SAT-PPO ("token": token mean) / SAT-GRPO ("sequence": per-sequence mean, then mean)."""
    d = (lp - mu).astype(np.float64)  # the proxy as the trainer holds it (float32 inputs)
    lp, mu = lp.astype(np.float64), mu.astype(np.float64)
    q = ref_gate(np.abs(d[mask]))
    c_plus, c_minus = ref_factors(d, q)
    j = ref_surrogate(np.exp(lp - mu), adv[:, None], c_plus, c_minus) * mask
    if reduction == "token":
        return -j.sum() / mask.sum(), q
    rows = mask.sum(1) > 0
    return -np.mean(j.sum(1)[rows] / mask.sum(1)[rows]), q


def ref_sat_gspo(lp, mu, adv, mask):
    """SAT-GSPO: the sequence log-ratio broadcast to each active token before the quantile."""
    lp, mu = lp.astype(np.float64), mu.astype(np.float64)
    lengths = mask.sum(1)
    rows = lengths > 0
    d_seq = np.where(rows, ((lp - mu) * mask).sum(1) / np.maximum(lengths, 1), 0.0)
    q = ref_gate(np.abs(np.broadcast_to(d_seq[:, None], mask.shape)[mask]))
    c_plus, c_minus = ref_factors(d_seq, q)
    j = ref_surrogate(np.exp(d_seq), adv, c_plus, c_minus)
    return -np.mean(j[rows]), q, c_plus, c_minus


def _batch(seed, b=8, t=12, scale=0.3, ties=False):
    rng = np.random.default_rng(seed)
    mu = rng.normal(-1.5, 0.5, (b, t))
    d = rng.standard_t(2, (b, t)) * scale
    if ties:
        d = np.round(d, 1)
    mask = rng.random((b, t)) < 0.8
    mask[:, 0] = True
    adv = rng.normal(size=b)
    return (np.asarray(mu + d, np.float32), np.asarray(mu, np.float32),
            np.asarray(adv, np.float32), mask)


def _sat(fn, lp, mu, adv, mask, **kw):
    return fn(jnp.asarray(lp), jnp.asarray(mu), jnp.asarray(adv), jnp.asarray(mask), **EPS, **kw)


# ----------------------------------------------------------------- values, random and adversarial


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ties", [False, True])
def test_defaults_are_the_equations_on_random_batches(seed, ties):
    lp, mu, adv, mask = _batch(seed, ties=ties)
    for fn, reduction in ((L.sat_ppo_loss, "token"), (L.sat_grpo_loss, "sequence")):
        loss, aux = _sat(fn, lp, mu, adv, mask)
        ref, q = ref_sat_token(lp, mu, adv, mask, reduction)
        np.testing.assert_allclose(float(loss), ref, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(float(aux["sat_q"]), q, rtol=1e-6)
    loss, aux = _sat(L.sat_gspo_loss, lp, mu, adv, mask)
    ref, q, _, _ = ref_sat_gspo(lp, mu, adv, mask)
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(aux["sat_q"]), q, rtol=1e-6)


def test_ties_at_q_are_not_gated():
    """Eq. 3.4's gate is strict: |d| == q keeps the radius, so with ties at q the realised
    gate rate falls below 10% (here 1 of 20 tokens, where a non-strict gate takes 4)."""
    d = np.array([[0.0] * 10 + [0.1] * 6 + [-0.3] * 3 + [0.5]], np.float32)  # q = 0.3 (ties)
    mask = np.ones_like(d, bool)
    lp = np.full_like(d, -1.0)
    _, aux = _sat(L.sat_ppo_loss, lp, lp - d, np.ones(1, np.float32), mask)
    assert ref_gate(np.abs(d[mask])) == pytest.approx(0.3)
    assert float(aux["sat_q"]) == pytest.approx(0.3)
    assert float(aux["sat_tail_frac"]) == pytest.approx(1 / 20)  # only the 0.5 token
    lo, hi = L.sat_interval(jnp.asarray(d[0]), **EPS)
    np.testing.assert_array_equal(np.asarray(lo)[16:19], np.float32(0.8))  # ties: untouched
    np.testing.assert_allclose(float(hi[19]), 1 + 0.2 / (1 + (0.5 / 0.3) ** 2), rtol=1e-6)


def test_the_factor_jumps_to_one_half_at_the_gate_with_no_floor():
    """Just past q the factor is ~1/2 (psi(q) = 1/2); far past it, it goes to 0 (no c_min)."""
    # 20 entries: q is the 18th smallest, 1.0
    d = jnp.concatenate([jnp.zeros((1, 8)), jnp.full((1, 10), 1.0), jnp.asarray([[1.001, 1e3]])], 1)
    lo, hi = L.sat_interval(d, **EPS)
    assert float(hi[0, 17]) == pytest.approx(1.2)  # at q exactly: not gated
    assert float(hi[0, 18]) == pytest.approx(1 + 0.2 * 0.5, rel=1e-3)  # just past: ~1/2
    assert 0.0 < float(hi[0, 19]) - 1.0 < 1e-6  # 0.2 / (1 + 1e6): no floor


def _value_and_grad(fn, args):
    """The loss value and its gradient in the trainer log-probs (args[0])."""
    rest = args[1:]
    return jax.value_and_grad(lambda x: fn(x, *rest, **EPS)[0])(args[0])


def test_q_zero_gates_nothing_and_is_the_base_objective_bit_for_bit():
    """Most |d| zero (q = 0): no factor is evaluated (the explicit q > 0 branch), and every
    SAT objective is its base, value and gradient, bit for bit."""
    lp, mu, adv, mask = _batch(3)
    mu = lp.copy()
    mu[0, 0] -= 0.5  # one off-policy token (and sequence) of ~70: q = 0
    mask[0, 1:] = False
    for sat_fn, base_fn in ((L.sat_gspo_loss, L.gspo_loss), (L.sat_ppo_loss, L.ppo_clip_loss),
                            (L.sat_grpo_loss, L.grpo_loss)):
        args = [jnp.asarray(x) for x in (lp, mu, adv, mask)]
        (v0, g0), (v1, g1) = (_value_and_grad(f, args) for f in (base_fn, sat_fn))
        assert np.asarray(v0).tobytes() == np.asarray(v1).tobytes()
        assert np.asarray(g0).tobytes() == np.asarray(g1).tobytes()
        aux = sat_fn(*args, **EPS)[1]
        assert float(aux["sat_q"]) == 0.0 and float(aux["sat_tail_frac"]) == 0.0


def test_sat_off_the_gate_is_the_base_objective_bit_for_bit():
    """A batch where nothing is past q (every |d| equal): the base objective, bit for bit."""
    lp, mu, adv, mask = _batch(4)
    lp = np.round(lp * 64) / 64  # multiples of 2^-6: lp - mu below is exact
    mu = lp - np.float32(0.0625)  # every token (and sequence) has d = 1/16: all tie at q
    for sat_fn, base_fn in ((L.sat_gspo_loss, L.gspo_loss), (L.sat_ppo_loss, L.ppo_clip_loss),
                            (L.sat_grpo_loss, L.grpo_loss)):
        args = [jnp.asarray(x) for x in (lp, mu, adv, mask)]
        (v0, g0), (v1, g1) = (_value_and_grad(f, args) for f in (base_fn, sat_fn))
        assert np.asarray(v0).tobytes() == np.asarray(v1).tobytes()
        assert np.asarray(g0).tobytes() == np.asarray(g1).tobytes()


def test_one_long_sequence_moves_the_token_weighted_gate():
    """SAT-GSPO's q is over tokens: a 100-token row with d = 0.2 outweighs nine 1-token
    rows, so q = 0.2 and the seven rows with |d| > 0.2 are gated; counted once per sequence
    (our "sequence" proxy) the same batch has q = 0.55 and gates one row."""
    b, t = 10, 100
    mask = np.zeros((b, t), bool)
    mask[0] = True
    mask[1:, 0] = True
    d_rows = np.array([0.2, 0.5, 0.45, 0.4, 0.35, 0.3, 0.6, 0.55, 0.01, 0.02], np.float32)
    lp = np.full((b, t), -1.0, np.float32)
    mu = lp - d_rows[:, None]
    adv = np.ones(b, np.float32)
    _, aux = _sat(L.sat_gspo_loss, lp, mu, adv, mask)
    ref, q, c_plus, _ = ref_sat_gspo(lp, mu, adv, mask)
    assert q == pytest.approx(0.2) and float(aux["sat_q"]) == pytest.approx(0.2)
    gated_tokens = np.sum(mask.sum(1) * (c_plus < 1))
    np.testing.assert_allclose(float(aux["sat_tail_frac"]), gated_tokens / mask.sum(), rtol=1e-6)
    np.testing.assert_allclose(float(aux["sat_c_plus_mean"]), np.mean(c_plus[c_plus < 1]),
                               rtol=1e-5)
    _, aux_seq = _sat(L.sat_gspo_loss, lp, mu, adv, mask, proxy="sequence")
    assert float(aux_seq["sat_q"]) == pytest.approx(ref_gate(np.abs(d_rows)))
    assert float(aux_seq["sat_tail_frac"]) == pytest.approx(0.1)  # only 0.6 is past 0.55


@pytest.mark.parametrize("seed", range(4))
def test_gradients_are_the_equations_with_the_bounds_held(seed):
    """The SAT bounds carry no gradient (sg): the gradient is that of Eq. 3.6 with the
    reference's bounds as constants."""
    lp, mu, adv, mask = _batch(seed, scale=0.2)
    d = lp.astype(np.float64) - mu
    c_plus, c_minus = ref_factors(d, ref_gate(np.abs(d[mask])))
    lo, hi = jnp.asarray(1 - 0.2 * c_minus, jnp.float32), jnp.asarray(1 + 0.2 * c_plus, jnp.float32)
    m, a = jnp.asarray(mask, jnp.float32), jnp.asarray(adv)[:, None]

    def ref(x):  # token-mean of min(rA, clip(r, lo, hi) A), r = exp(x - mu)
        r = jnp.exp(x - jnp.asarray(mu))
        j = jnp.minimum(r * a, jnp.clip(r, lo, hi) * a)
        return -jnp.sum(j * m) / jnp.sum(m)

    g_ref = jax.grad(ref)(jnp.asarray(lp))
    g = jax.grad(lambda x: _sat(L.sat_ppo_loss, x, mu, adv, mask)[0])(jnp.asarray(lp))
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-8)


def test_containment_and_pessimism_on_adversarial_batches():
    """Huge, tiny, one-sided and all-equal proxies: the SAT interval stays inside PPO's and
    the SAT surrogate never exceeds PPO's, token by token."""
    rng = np.random.default_rng(0)
    cases = [rng.standard_t(1, 200) * 50, rng.normal(0, 1e-6, 200),
             np.abs(rng.normal(0, 1, 200)), -np.abs(rng.normal(0, 1, 200)), np.full(200, 0.3),
             np.r_[np.zeros(190), 5 * np.ones(10)]]
    a = jnp.asarray(rng.normal(size=200), jnp.float32)
    for d in cases:
        d = jnp.asarray(d, jnp.float32)
        lo, hi = L.sat_interval(d, **EPS)
        assert bool(jnp.all((lo >= np.float32(0.8)) & (lo <= 1) & (hi >= 1)
                            & (hi <= np.float32(1.2))))
        r = jnp.exp(jnp.clip(d, -20, 20))
        assert bool(jnp.all(L.clipped_surrogate(r, a, lo, hi)
                            <= L.clipped_surrogate(r, a, 0.8, 1.2)))


def test_an_empty_active_set_gives_no_gradient_under_jit():
    """No active token: nothing is gated or differentiated (loss 0, gradient 0, factors 1);
    the train step skips such a step (tests/train). Eagerly, the loss refuses the batch."""
    lp, mu, adv, _ = _batch(1)
    empty = jnp.zeros(lp.shape, bool)
    for fn in (L.sat_gspo_loss, L.sat_ppo_loss, L.sat_grpo_loss):
        (loss, aux), g = jax.jit(jax.value_and_grad(
            lambda x, m, fn=fn: fn(x, jnp.asarray(mu), jnp.asarray(adv), m, **EPS),
            has_aux=True))(jnp.asarray(lp), empty)
        assert float(loss) == 0.0 and not np.any(np.asarray(g))
        assert float(aux["sat_min_factor"]) == 1.0 and float(aux["sat_tail_frac"]) == 0.0
        with pytest.raises(ValueError, match="at least one valid token"):
            fn(jnp.asarray(lp), jnp.asarray(mu), jnp.asarray(adv), empty, **EPS)


# ----------------------------------------------------------------- scope and diagnostics


@pytest.mark.parametrize("proxy", ["broadcast", "sequence", "token"])
def test_microbatch_scope_takes_the_gate_of_each_strided_micro_batch(proxy):
    """With M micro-batches (rows m, m + M, ...), each row's radii are those its own
    micro-batch gives it alone; scope="batch" is one gate over the whole batch."""
    lp, mu, adv, mask = _batch(9, b=8, scale=0.5)
    m = 4
    _, aux = _sat(L.sat_gspo_loss, lp, mu, adv, mask, proxy=proxy, microbatches=m)
    qs = [float(_sat(L.sat_gspo_loss, lp[g::m], mu[g::m], adv[g::m], mask[g::m],
                     proxy=proxy)[1]["sat_q"]) for g in range(m)]
    np.testing.assert_allclose(float(aux["sat_q"]), np.mean(qs), rtol=1e-6)
    whole = _sat(L.sat_gspo_loss, lp, mu, adv, mask, proxy=proxy)[1]
    batch_scope = _sat(L.sat_gspo_loss, lp, mu, adv, mask, proxy=proxy, microbatches=m,
                       scope="batch")[1]
    assert float(batch_scope["sat_q"]) == float(whole["sat_q"])
    # the loss: each row's bounds are its micro-batch's, so the micro-batch losses add up
    loss = _sat(L.sat_ppo_loss, lp, mu, adv, mask, microbatches=m)[0]
    parts = [(_sat(L.sat_ppo_loss, lp[g::m], mu[g::m], adv[g::m], mask[g::m])[0], mask[g::m].sum())
             for g in range(m)]
    np.testing.assert_allclose(float(loss), sum(float(v) * n for v, n in parts) / mask.sum(),
                               rtol=1e-5)


def test_microbatches_must_divide_the_rows():
    lp, mu, adv, mask = _batch(1, b=6)
    with pytest.raises(ValueError, match="microbatches: must divide"):
        _sat(L.sat_ppo_loss, lp, mu, adv, mask, microbatches=4)
    with pytest.raises(ValueError, match="microbatches: must be an int >= 1"):
        _sat(L.sat_ppo_loss, lp, mu, adv, mask, microbatches=0)


def test_the_papers_diagnostics():
    lp, mu, adv, mask = _batch(2, scale=0.5)
    _, aux = _sat(L.sat_ppo_loss, lp, mu, adv, mask)
    d = (lp.astype(np.float64) - mu)[mask]
    q = ref_gate(np.abs(d))
    c_plus, c_minus = ref_factors(d, q)
    gated = np.abs(d) > q
    np.testing.assert_allclose(float(aux["sat_q"]), q, rtol=1e-6)
    np.testing.assert_allclose(float(aux["sat_tail_frac"]), gated.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(aux["sat_c_plus_mean"]), c_plus[gated].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(aux["sat_c_minus_mean"]), c_minus[gated].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(aux["sat_min_factor"]),
                               np.minimum(c_plus, c_minus).min(), rtol=1e-5)
    np.testing.assert_allclose(float(aux["mismatch_abs_mean"]), np.abs(d).mean(), rtol=1e-5)
    np.testing.assert_allclose(float(aux["kl_k1"]), -d.mean(), rtol=1e-4, atol=1e-7)
    assert 0.0 < gated.mean() <= 0.1


def test_the_objective_factory_passes_the_micro_batch_count():
    lp, mu, adv, mask = _batch(5, b=8, scale=0.5)
    batch = {"behavior_logprobs": jnp.asarray(mu), "advantages": jnp.asarray(adv),
             "mask": jnp.asarray(mask)}
    got = objectives.make("sat_grpo", microbatches=4)(jnp.asarray(lp), batch)[1]["sat_q"]
    want = _sat(L.sat_grpo_loss, lp, mu, adv, mask, microbatches=4)[1]["sat_q"]
    assert float(got) == float(want)
    assert float(objectives.make("grpo", microbatches=4)(jnp.asarray(lp), batch)[0]) == float(
        objectives.make("grpo")(jnp.asarray(lp), batch)[0])  # no gate: nothing to split
