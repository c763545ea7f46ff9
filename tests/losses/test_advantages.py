"""satjax.losses.advantages: GRPO group advantages match numpy; argument errors."""

import jax.numpy as jnp
import numpy as np
import pytest

from satjax import losses as L


@pytest.mark.parametrize("ddof", [0, 1])
def test_group_advantages_match_numpy(ddof):
    r = np.random.default_rng(0).normal(size=12)
    kw = {} if ddof == 1 else {"ddof": 0}  # ddof=1 (sample std) is the default
    got = np.asarray(L.group_advantages(jnp.asarray(r), 4, **kw))
    g = r.reshape(3, 4)
    ref = ((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=ddof, keepdims=True) + 1e-6))
    np.testing.assert_allclose(got, ref.reshape(-1), rtol=1e-5)
    got = np.asarray(L.group_advantages(jnp.asarray(r), 3, normalize_std=False))
    g = r.reshape(4, 3)
    np.testing.assert_allclose(got, (g - g.mean(1, keepdims=True)).reshape(-1), rtol=1e-5,
                               atol=1e-7)
    assert np.all(np.asarray(L.group_advantages(jnp.ones(4), 2)) == 0)


def test_group_size_must_divide_the_batch():
    with pytest.raises(ValueError, match="group_size"):
        L.group_advantages(jnp.ones(6), 4)
    with pytest.raises(ValueError, match="group_size"):
        L.group_advantages(jnp.ones(6), 0)


def test_sample_std_is_the_default_like_verl_trl_slime():
    # G=2, rewards (1, 0): sample std 0.7071 -> A = +-0.7071; population std 0.5 -> +-1.
    r = jnp.asarray([1.0, 0.0])
    np.testing.assert_allclose(np.asarray(L.group_advantages(r, 2)), [0.70710, -0.70710],
                               rtol=1e-4)
    np.testing.assert_allclose(np.asarray(L.group_advantages(r, 2, ddof=0)), [1.0, -1.0],
                               rtol=1e-4)
    assert L.GroupAdvantageHParams().ddof == 1


def test_group_of_one_has_zero_advantage_for_every_ddof():
    for ddof in (0, 1):
        got = np.asarray(L.group_advantages(jnp.asarray([3.0, -1.0]), 1, ddof=ddof))
        np.testing.assert_array_equal(got, [0.0, 0.0])


def test_bad_ddof_and_flag_are_named():
    with pytest.raises(ValueError, match=r"^ddof: must be >= 0.0, got -1$"):
        L.group_advantages(jnp.ones(4), 2, ddof=-1)
    with pytest.raises(ValueError, match="ddof: must be an int"):
        L.group_advantages(jnp.ones(4), 2, ddof=0.5)
    with pytest.raises(ValueError, match="normalize_std: must be a bool"):
        L.group_advantages(jnp.ones(4), 2, normalize_std="yes")
