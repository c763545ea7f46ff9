"""satjax.losses.sat: SAT interval containment, sign selection, pessimism, no gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from satjax import losses as L

FAST = settings(max_examples=5, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(seed=st.integers(0, 10_000), log_scale=st.floats(-4, 1.5),
       kernel=st.sampled_from(["paper", "smooth", "gauss"]), two_d=st.booleans(),
       lam=st.floats(0, 1), c=st.floats(0, 3))
def test_interval_containment_and_sign(seq_eps, seed, log_scale, kernel, two_d, lam, c):
    rng = np.random.default_rng(seed)
    shape = (6, 8) if two_d else (6,)
    d = jnp.asarray(10**log_scale * rng.standard_t(2, shape), jnp.float32)
    mask = jnp.asarray(rng.random(shape) < 0.7)
    kw = {"paper": {}, "smooth": {"lam": lam}, "gauss": {"lam": lam, "c": c}}[kernel]
    lo, hi = L.sat_interval(d, mask=mask, kernel=kernel, **kw, **seq_eps)
    lo, hi, d = map(np.asarray, (lo, hi, d))
    assert np.all(lo >= np.float32(1 - seq_eps["eps_low"])) and np.all(lo <= 1)
    assert np.all(hi <= np.float32(1 + seq_eps["eps_high"])) and np.all(hi >= 1)
    # Sign selection: d > 0 never touches lo, d < 0 never touches hi.
    assert np.all(lo[d >= 0] == np.float32(1 - seq_eps["eps_low"]))
    assert np.all(hi[d <= 0] == np.float32(1 + seq_eps["eps_high"]))
    # Invalid entries keep the PPO interval.
    m = np.asarray(mask)
    assert np.all(lo[~m] == np.float32(1 - seq_eps["eps_low"]))
    assert np.all(hi[~m] == np.float32(1 + seq_eps["eps_high"]))


def test_sign_selection_contracts_the_tail_end():
    ordinary = np.linspace(-0.03, 0.03, 20)
    d = jnp.asarray(np.concatenate([[5.0, -5.0], ordinary]), jnp.float32)
    for kernel in ("paper", "smooth", "gauss"):
        lo, hi = L.sat_interval(d, eps_low=0.2, eps_high=0.3, kernel=kernel)
        assert hi[0] < 1.3 and lo[0] == pytest.approx(0.8)
        assert lo[1] > 0.8 and hi[1] == pytest.approx(1.3)
        # ordinary entries untouched
        np.testing.assert_array_equal(np.asarray(hi[2:]), np.float32(1.3))


def test_clipped_surrogate_pessimism_with_sat_bounds(tok_eps):
    rng = np.random.default_rng(0)
    d = jnp.asarray(rng.standard_t(2, 400) * 0.5, jnp.float32)
    ratio = jnp.exp(d + jnp.asarray(rng.normal(0, 0.1, 400), jnp.float32))
    a = jnp.asarray(rng.normal(size=400), jnp.float32)
    for kernel in ("paper", "smooth", "gauss"):
        lo, hi = L.sat_interval(d, kernel=kernel, **tok_eps)
        j_sat = L.clipped_surrogate(ratio, a, lo, hi)
        j_ppo = L.clipped_surrogate(ratio, a, 0.8, 1.28)
        assert np.all(np.asarray(j_sat) <= np.asarray(j_ppo))
        assert np.any(np.asarray(j_sat) < np.asarray(j_ppo))  # SAT actually bites


@pytest.mark.parametrize("kernel", ["paper", "smooth", "gauss"])
@pytest.mark.parametrize("two_d", [False, True])
def test_proxy_carries_no_gradient(tok_eps, kernel, two_d):
    rng = np.random.default_rng(0)
    d = jnp.asarray(rng.standard_t(2, (6, 8) if two_d else (6,)), jnp.float32)
    g = jax.grad(lambda x: sum(jnp.sum(b) for b in L.sat_interval(
        x, kernel=kernel, **tok_eps)))(d)
    assert np.all(np.asarray(g) == 0)


def test_sat_interval_rejects_an_unknown_kernel():
    with pytest.raises(ValueError, match="kernel"):
        L.sat_interval(jnp.ones(3), eps_low=0.1, eps_high=0.1, kernel="x")
