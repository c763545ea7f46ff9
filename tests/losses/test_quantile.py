"""satjax.losses.quantile: the masked quantile matches numpy; the masked mean."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from satjax import losses as L

FAST = settings(max_examples=5, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

_QUANTILE = {m: jax.jit(lambda x, q, mask, m=m: L.masked_quantile(x, q, mask, algorithm=m))
             for m in ("sort", "bisect", "radix", "select")}


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
    got = {method: float(fn(jnp.asarray(x), q, jnp.asarray(m)))
           for method, fn in _QUANTILE.items()}
    assert got["sort"] == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert got["bisect"] == got["sort"] and got["radix"] == got["sort"]  # bit for bit
    assert got["select"] == got["sort"]


def test_masked_quantile_empty_mask_is_zero():
    for method in _QUANTILE:
        assert float(L.masked_quantile(jnp.ones(4), 0.9, jnp.zeros(4, bool),
                                       algorithm=method)) == 0.0


def test_masked_quantile_rejects_an_unknown_method():
    with pytest.raises(ValueError, match="method"):
        L.masked_quantile(jnp.ones(4), 0.5, method="median")


def test_masked_mean_ignores_invalid_entries_and_is_zero_when_empty():
    x = jnp.asarray([1.0, 2.0, jnp.inf])
    assert float(L.masked_mean(jnp.where(jnp.isfinite(x), x, 0.0),
                               jnp.asarray([True, True, False]))) == 1.5
    assert float(L.masked_mean(jnp.ones(3), jnp.zeros(3, bool))) == 0.0


@pytest.mark.parametrize("q", [0.0, 0.5, 0.9, 0.999, 1.0])
def test_radix_is_bit_for_bit_the_sort_on_a_large_heavy_tailed_batch(q):
    """262k entries (the benchmark's size), negative values, ties, +-0 and a mask."""
    rng = np.random.default_rng(1)
    x = (rng.standard_t(3, (256, 1024)) * 0.05).astype(np.float32)
    x[:, :64] = np.round(x[:, :64], 2)  # many ties
    x[0, :8] = [0.0, -0.0, 1e-38, -1e-38, 1e30, -1e30, 0.0, 5e-45]
    m = rng.random(x.shape) < 0.7
    got = {method: np.asarray(fn(jnp.asarray(x), q, jnp.asarray(m)))
           for method, fn in _QUANTILE.items()}
    assert got["radix"].tobytes() == got["sort"].tobytes() == got["bisect"].tobytes()
    assert got["select"].tobytes() == got["sort"].tobytes()
    # float32 position q (n - 1) ~ 1.8e5 has ulp 1/64: the interpolation weight, not the
    # order statistics, limits agreement with float64 numpy to ~1e-4 relative.
    np.testing.assert_allclose(got["radix"], np.quantile(x[m].astype(np.float64), q),
                               rtol=1e-4, atol=1e-12)


_BATCHES = {  # 2^17 entries each: the sample is every 8th
    # smooth: the sample's bracket holds both order statistics in single-entry bins
    "smooth": lambda r, n: r.standard_t(3, n) * 0.05,
    # a few distinct values: crowded bins, so the radix fallback answers
    "ties": lambda r, n: np.round(r.normal(size=n), 1),
    "constant": lambda r, n: np.zeros(n),
    # periodic with the sample's stride: the sample sees only one value and misses rank k
    "strided": lambda r, n: np.where(np.arange(n) % 8 == 0, 1.0, r.normal(size=n)),
    # keys spread over many octaves, and infinities
    "wide": lambda r, n: np.where(r.random(n) < 0.1, np.inf, np.exp(r.normal(size=n) * 20)),
}


@pytest.mark.parametrize("kind", sorted(_BATCHES))
def test_select_is_the_sort_at_every_rank_on_each_path(kind):
    """`select` answers from its one-pass histogram or falls back to radix; both exact."""
    rng = np.random.default_rng(3)
    n = 1 << 17
    x = _BATCHES[kind](rng, n).astype(np.float32)
    m = rng.random(n) < 0.8
    for q in (0.0, 1e-4, 0.1, 0.5, 0.9, 0.9999, 1.0):
        got = np.asarray(_QUANTILE["select"](jnp.asarray(x), q, jnp.asarray(m)))
        ref = np.asarray(_QUANTILE["sort"](jnp.asarray(x), q, jnp.asarray(m)))
        assert got.tobytes() == ref.tobytes(), (kind, q)


@pytest.mark.parametrize("n_valid", [0, 1, 2, 3, 17, 1000])
@pytest.mark.parametrize("values", ["heavy", "equal"])
def test_select_with_few_valid_entries_in_a_large_batch_is_the_sort(n_valid, values):
    """2^16 entries (over auto's select threshold), few or none of them valid: the sample
    sees mostly invalid (+inf) keys, so the bracket misses and the fallback answers."""
    rng = np.random.default_rng(n_valid)
    n = 1 << 16
    x = (rng.standard_t(1, n) if values == "heavy" else np.full(n, 0.25)).astype(np.float32)
    m = np.zeros(n, bool)
    m[rng.permutation(n)[:n_valid]] = True
    for q in (0.0, 0.5, 0.9, 1.0):
        got = np.asarray(_QUANTILE["select"](jnp.asarray(x), q, jnp.asarray(m)))
        ref = np.asarray(_QUANTILE["sort"](jnp.asarray(x), q, jnp.asarray(m)))
        assert got.tobytes() == ref.tobytes(), (n_valid, values, q)
        want = np.quantile(x[m].astype(np.float64), q) if n_valid else 0.0
        np.testing.assert_allclose(got, want, rtol=1e-5)


def _lower_quantile_reference(values: np.ndarray, level: float) -> float:
    """inf{x : F(x) >= level} straight from the definition (the SAT authors' Eq. 3.3): the
    smallest entry whose empirical CDF reaches the level, compared as exact fractions."""
    import bisect
    import fractions

    vals = sorted(float(v) for v in values)
    n, want = len(vals), fractions.Fraction(repr(level))
    for v in vals:  # F(v) = #{x <= v} / n, counted on the sorted list
        if fractions.Fraction(bisect.bisect_right(vals, v), n) >= want:
            return v
    return vals[-1]


_LOWER = {a: jax.jit(lambda x, mask, a=a: L.masked_quantile(x, 0.9, mask, method="inverted_cdf",
                                                            algorithm=a))
          for a in ("sort", "bisect", "radix", "select")}


@pytest.mark.parametrize("n_valid", [1, 2, 9, 10, 11, 19, 20, 30, 100, 257])
@pytest.mark.parametrize("ties", [False, True])
def test_lower_quantile_is_the_definition_and_numpys_inverted_cdf(n_valid, ties):
    """At n = 10, 20, 30, 100 the level hits a rank exactly (0.9 n is an integer): the 9th
    of 10 entries, not the 10th, where a float-rounded 0.9 * n would be one rank off."""
    rng = np.random.default_rng(n_valid)
    x = np.abs(rng.standard_t(2, 300)).astype(np.float32)
    if ties:
        x = np.round(x, 1)
    m = np.zeros(300, bool)
    m[rng.permutation(300)[:n_valid]] = True
    ref = _lower_quantile_reference(x[m], 0.9)
    assert ref == np.quantile(x[m], 0.9, method="inverted_cdf")
    for algorithm, fn in _LOWER.items():
        assert float(fn(jnp.asarray(x), jnp.asarray(m))) == ref, algorithm


@pytest.mark.parametrize("level", [0.5, 0.9, 0.95, 0.99, 0.1])
def test_lower_quantile_rank_is_exact_at_many_sizes(level):
    """Entries 1..n: the lower quantile is ceil(level n) exactly, for every n to 2000 (the
    first n of one 2000-entry array active, so one compile serves every n; a few sizes
    also unmasked)."""
    fn = jax.jit(lambda x, m: L.masked_quantile(x, level, m, method="inverted_cdf",
                                                algorithm="sort"))
    x = jnp.arange(1, 2001, dtype=jnp.float32)
    for n in range(1, 2001, 7):
        want = _lower_quantile_reference(np.arange(1, n + 1), level)
        assert float(fn(x, jnp.arange(2000) < n)) == want, n
        if n in (1, 8, 99, 1996):
            got = L.masked_quantile(x[:n], level, method="inverted_cdf", algorithm="sort")
            assert float(got) == want, n


def test_lower_quantile_on_a_large_batch_is_the_same_for_every_algorithm():
    rng = np.random.default_rng(7)
    x = np.abs(rng.standard_t(3, (256, 1024)) * 0.05).astype(np.float32)
    x[:, :64] = np.round(x[:, :64], 2)
    m = rng.random(x.shape) < 0.7
    got = {a: np.asarray(fn(jnp.asarray(x), jnp.asarray(m))) for a, fn in _LOWER.items()}
    assert len({v.tobytes() for v in got.values()}) == 1
    assert float(got["sort"]) == np.quantile(x[m], 0.9, method="inverted_cdf")
