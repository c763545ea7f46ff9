"""satjax.objectives: factory, defaults, IS correction wiring, and an Optax step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from satjax import losses, objectives

B, T, V, D = 4, 6, 11, 5


def _batch(seed=0, *, old=False):
    rng = np.random.default_rng(seed)
    mu = rng.normal(-2.0, 0.3, (B, T)).astype(np.float32)
    mask = rng.random((B, T)) < 0.8
    mask[:, 0] = True
    batch = {
        "behavior_logprobs": jnp.asarray(mu),
        "advantages": jnp.asarray(rng.normal(size=B), jnp.float32),
        "mask": jnp.asarray(mask),
    }
    if old:
        batch["old_logprobs"] = jnp.asarray(mu + rng.normal(0, 0.05, (B, T)), jnp.float32)
    lp = jnp.asarray(mu + rng.normal(0, 0.3, (B, T)), jnp.float32)
    return lp, batch


def test_defaults_match_the_design():
    for name in ("sat_gspo", "gspo", "gspo_token"):
        assert objectives.DEFAULTS[name]["eps_low"] == 3e-4
        assert objectives.DEFAULTS[name]["eps_high"] == 4e-4
    for name in ("grpo", "ppo_clip", "sat_ppo"):
        assert objectives.DEFAULTS[name]["eps_low"] == 0.2
        assert objectives.DEFAULTS[name]["eps_high"] == 0.28
    for name in ("sat_gspo", "sat_ppo"):
        hp = objectives.DEFAULTS[name]
        assert (hp["c"], hp["w"], hp["lam"], hp["kernel"]) == (1.0, 1.0, 1.0, "hill")
    assert all(hp["is_correction"] is None for hp in objectives.DEFAULTS.values())


@pytest.mark.parametrize("name", objectives.NAMES)
def test_make_matches_the_loss_function(name):
    lp, batch = _batch(1, old=True)
    fn = objectives.make(name)
    assert getattr(objectives, name)().__name__ == name
    loss, aux = fn(lp, batch)
    hp = {k: v for k, v in objectives.DEFAULTS[name].items() if not k.startswith("is_")}
    ref, ref_aux = getattr(losses, f"{name}_loss")(
        lp, batch["behavior_logprobs"], batch["advantages"], batch["mask"],
        old_logprobs=batch["old_logprobs"], **hp)
    assert float(loss) == float(ref)
    assert set(aux) == set(losses.AUX_KEYS) | {"is_weight_mean", "is_kept_frac"}
    assert float(aux["is_weight_mean"]) == 1.0


def test_hyperparameter_override_reaches_the_loss():
    lp, batch = _batch(2)
    a, _ = objectives.ppo_clip(eps_low=0.01, eps_high=0.01)(lp, batch)
    b, _ = losses.ppo_clip_loss(lp, batch["behavior_logprobs"], batch["advantages"],
                                batch["mask"], eps_low=0.01, eps_high=0.01)
    assert float(a) == float(b)


def test_errors_name_the_culprit():
    with pytest.raises(ValueError, match="sat_gpso"):
        objectives.make("sat_gpso")
    with pytest.raises(ValueError, match="epsilon"):
        objectives.sat_gspo(epsilon=0.1)
    with pytest.raises(ValueError, match="proxy"):
        objectives.gspo(proxy="token")  # SAT-only knob on a non-SAT objective
    with pytest.raises(ValueError, match="is_correction"):
        objectives.gspo(is_correction="clip")
    with pytest.raises(ValueError, match="is_threshold"):
        objectives.gspo(is_correction="tis", is_threshold=-1.0)
    lp, batch = _batch()
    del batch["mask"]
    with pytest.raises(ValueError, match="mask"):
        objectives.gspo()(lp, batch)


@pytest.mark.parametrize("old", [False, True])
def test_tis_and_mis_wiring(old):
    lp, batch = _batch(3, old=old)
    trainer = batch["old_logprobs"] if old else lp
    mu, adv, mask = batch["behavior_logprobs"], batch["advantages"], batch["mask"]
    kw = {"eps_low": 0.2, "eps_high": 0.28}
    old_kw = {"old_logprobs": batch.get("old_logprobs")}

    loss, aux = objectives.ppo_clip(is_correction="tis", is_threshold=1.1)(lp, batch)
    w = losses.tis_weights(trainer, mu, threshold=1.1, mask=mask)
    ref, _ = losses.ppo_clip_loss(lp, mu, adv, mask, token_weights=w, **kw, **old_kw)
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-6)
    assert float(aux["is_weight_mean"]) <= 1.1

    loss, aux = objectives.sat_gspo(is_correction="mis", is_threshold=1.05,
                                    is_level="sequence")(lp, batch)
    m = losses.mis_mask(trainer, mu, threshold=1.05, mask=mask, level="sequence")
    ref, _ = losses.sat_gspo_loss(lp, mu, adv, mask, token_weights=m, eps_low=3e-4,
                                  eps_high=4e-4, **old_kw)
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-6)
    assert 0.0 <= float(aux["is_kept_frac"]) <= 1.0
    if old:
        return
    # Without old_logprobs, the IS weights must not carry gradient (current lp detached).
    g_tis = jax.grad(lambda x: objectives.ppo_clip(is_correction="tis", is_threshold=1e9)(
        x, batch)[0])(lp)
    g_ref = jax.grad(lambda x: losses.ppo_clip_loss(
        x, mu, adv, mask, token_weights=losses.tis_weights(
            trainer, mu, threshold=1e9, mask=mask), **kw, **old_kw)[0])(lp)
    np.testing.assert_allclose(np.asarray(g_tis), np.asarray(g_ref), rtol=1e-5, atol=1e-8)


def test_optax_step_on_a_tiny_linear_policy():
    """The three-line usage: objective + value_and_grad(has_aux) + optax.adam."""
    rng = np.random.default_rng(0)
    feats = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, V, (B, T)))
    params = {"w": jnp.asarray(rng.normal(0, 0.1, (D, V)), jnp.float32),
              "b": jnp.zeros((V,), jnp.float32)}

    def logprob_fn(p):
        logits = feats @ p["w"] + p["b"]
        return jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1)[..., 0]

    mu = jax.lax.stop_gradient(logprob_fn(params))
    batch = {"behavior_logprobs": mu, "advantages": jnp.asarray([1.0, -1.0, 0.5, -0.5]),
             "mask": jnp.ones((B, T), bool)}
    obj = objectives.sat_gspo(eps_low=0.02, eps_high=0.02)
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        (loss, aux), g = jax.value_and_grad(lambda p: obj(logprob_fn(p), batch),
                                            has_aux=True)(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, aux

    p, s = params, opt_state
    first, _ = obj(logprob_fn(params), batch)
    for _ in range(3):
        p, s, loss, aux = step(p, s)
    final, _ = obj(logprob_fn(p), batch)
    assert float(final) < float(first)
    assert not np.allclose(np.asarray(p["w"]), np.asarray(params["w"]))
    assert np.isfinite(float(aux["kl_k3"]))
