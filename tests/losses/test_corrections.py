"""satjax.losses.corrections: TIS weights and MIS masks, and their use as token weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from satjax import losses as L


def test_tis_weights_truncate_and_detach(make_batch):
    lp, mu, _, mask = make_batch(4, scale=1.0)
    w = L.tis_weights(lp, mu, threshold=2.0, mask=mask)
    ref = np.minimum(np.exp(np.asarray(lp - mu, np.float64)), 2.0) * np.asarray(mask)
    np.testing.assert_allclose(np.nan_to_num(np.asarray(w)), np.nan_to_num(ref), rtol=1e-5)
    assert np.all(np.asarray(w)[~np.asarray(mask)] == 0)
    g = jax.grad(lambda x: jnp.sum(L.tis_weights(x, mu, threshold=2.0, mask=mask)))(lp)
    assert np.all(np.asarray(g) == 0)


def test_mis_mask_token_and_sequence(make_batch):
    lp, mu, _, mask = make_batch(4, scale=1.0)
    ratio = np.exp(np.asarray(lp - mu, np.float64))
    mm = np.asarray(L.mis_mask(lp, mu, threshold=2.0, mask=mask))
    np.testing.assert_array_equal(mm, (np.asarray(mask) & (ratio <= 2.0)).astype(np.float32))
    ms = np.asarray(L.mis_mask(lp, mu, threshold=1.2, mask=mask, level="sequence"))
    m = np.asarray(mask)
    lr = np.where(m, np.log(np.where(m, ratio, 1.0)), 0.0)
    geo = np.exp(lr.sum(1) / np.maximum(m.sum(1), 1))
    np.testing.assert_array_equal(ms, (m & (geo <= 1.2)[:, None]).astype(np.float32))


def test_ppo_token_weights_match_manual(make_batch, tok_eps):
    lp, mu, a, mask = make_batch(9, scale=0.3)
    w = L.tis_weights(lp, mu, threshold=1.1, mask=mask)
    loss, _ = L.ppo_clip_loss(lp, mu, a, mask, **tok_eps, token_weights=w)
    m = np.asarray(mask)
    r = np.exp(np.where(m, np.asarray(lp - mu, np.float64), 0.0))
    an = np.asarray(a, np.float64)[:, None]
    j = np.minimum(r * an, np.clip(r, 0.8, 1.28) * an)
    ref = -(j * np.asarray(w) * m).sum() / m.sum()
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5)


def test_threshold_and_level_are_validated(make_batch):
    lp, mu, _, _ = make_batch(0)
    with pytest.raises(ValueError, match="threshold"):
        L.tis_weights(lp, mu, threshold=0.0)
    with pytest.raises(ValueError, match="low_threshold"):
        L.mis_mask(lp, mu, threshold=2.0, low_threshold=-1.0)
    with pytest.raises(ValueError, match="level"):
        L.mis_mask(lp, mu, threshold=2.0, level="row")
