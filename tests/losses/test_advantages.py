"""satjax.losses.advantages: GRPO group advantages match numpy; argument errors."""

import jax.numpy as jnp
import numpy as np
import pytest

from satjax import losses as L


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


def test_group_size_must_divide_the_batch():
    with pytest.raises(ValueError, match="group_size"):
        L.group_advantages(jnp.ones(6), 4)
    with pytest.raises(ValueError, match="group_size"):
        L.group_advantages(jnp.ones(6), 0)
