"""Shared fixtures of the losses tests: random batches, test radii, the loss table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from satjax import losses as L

B, T = 6, 8
# Radii used by the tests (wider than the GSPO defaults so clipping actually happens).
SEQ_EPS = {"eps_low": 3e-2, "eps_high": 4e-2}
TOK_EPS = {"eps_low": 0.2, "eps_high": 0.28}


def _make_batch(seed, *, scale=0.05, adv="random", masked_row=True, dtype=np.float32,
                tail=3.0):
    """Random [B, T] batch; ``scale`` sets the size of lp - mu, ``tail`` its heavy-tailedness."""
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


# Session scope: hypothesis tests may use these (they hold no state).
@pytest.fixture(scope="session")
def make_batch():
    return _make_batch


@pytest.fixture(scope="session")
def seq_eps():
    return dict(SEQ_EPS)


@pytest.fixture(scope="session")
def tok_eps():
    return dict(TOK_EPS)


@pytest.fixture(scope="session")
def all_losses():
    """Objective name -> (its loss function, the test radii for its level; DPPO has none)."""
    return {
        "gspo": (L.gspo_loss, SEQ_EPS),
        "sat_gspo": (L.sat_gspo_loss, SEQ_EPS),
        "gspo_token": (L.gspo_token_loss, SEQ_EPS),
        "ppo_clip": (L.ppo_clip_loss, TOK_EPS),
        "grpo": (L.grpo_loss, TOK_EPS),
        "sat_ppo": (L.sat_ppo_loss, TOK_EPS),
        "sat_grpo": (L.sat_grpo_loss, TOK_EPS),
        "dppo_tv": (L.dppo_tv_loss, {}),
        "dppo_tv_clip": (L.dppo_tv_clip_loss, TOK_EPS),
        "dppo_kl": (L.dppo_kl_loss, {}),
    }


@pytest.fixture(scope="session")
def sat_variants():
    """(SAT loss, base loss, radii, SAT kwargs): 15 variants over kernel, proxy, reduction."""
    out = []
    for kernel in ("paper", "smooth", "gauss"):
        for proxy in ("broadcast", "sequence", "token"):
            out.append((L.sat_gspo_loss, L.gspo_loss, SEQ_EPS, {"kernel": kernel,
                                                                  "proxy": proxy}))
        out.append((L.sat_ppo_loss, L.ppo_clip_loss, TOK_EPS, {"kernel": kernel}))
        out.append((L.sat_grpo_loss, L.grpo_loss, TOK_EPS, {"kernel": kernel}))
    return out


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield
