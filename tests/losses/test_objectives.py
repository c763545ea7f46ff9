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
    """The SAT paper's recipe: radii (0.2, 0.2) for every clip objective, the paper's
    kernel at the 0.9 quantile per micro-batch, SAT-GSPO's broadcast sequence proxy."""
    for name in ("sat_gspo", "gspo", "gspo_token", "grpo", "ppo_clip", "sat_ppo", "sat_grpo"):
        assert objectives.DEFAULTS[name]["eps_low"] == 0.2
        assert objectives.DEFAULTS[name]["eps_high"] == 0.2
    for name in ("sat_gspo", "sat_ppo", "sat_grpo"):
        hp = objectives.DEFAULTS[name]
        assert (hp["kernel"], hp["quantile"], hp["scope"]) == ("paper", 0.9, "microbatch")
    assert objectives.DEFAULTS["sat_gspo"]["proxy"] == "broadcast"
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
def test_mis_wiring(old):
    lp, batch = _batch(3, old=old)
    trainer = batch["old_logprobs"] if old else lp
    mu, adv, mask = batch["behavior_logprobs"], batch["advantages"], batch["mask"]
    loss, aux = objectives.sat_gspo(is_correction="mis", is_threshold=1.05,
                                    is_level="sequence")(lp, batch)
    m = losses.mis_mask(trainer, mu, threshold=1.05, mask=mask, level="sequence")
    ref, _ = losses.sat_gspo_loss(lp, mu, adv, mask, token_weights=m, eps_low=0.2,
                                  eps_high=0.2, old_logprobs=batch.get("old_logprobs"))
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-6)
    assert 0.0 <= float(aux["is_kept_frac"]) <= 1.0


def test_tis_wiring_with_old_logprobs():
    lp, batch = _batch(3, old=True)
    mu, adv, mask = batch["behavior_logprobs"], batch["advantages"], batch["mask"]
    loss, aux = objectives.ppo_clip(is_correction="tis", is_threshold=1.1)(lp, batch)
    w = losses.tis_weights(batch["old_logprobs"], mu, threshold=1.1, mask=mask)
    ref, _ = losses.ppo_clip_loss(lp, mu, adv, mask, token_weights=w, eps_low=0.2,
                                  eps_high=0.2, old_logprobs=batch["old_logprobs"])
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-6)
    assert float(aux["is_weight_mean"]) <= 1.1


@pytest.mark.parametrize("name", objectives.NAMES)
def test_tis_without_old_logprobs_is_refused(name):
    lp, batch = _batch(4)
    with pytest.raises(ValueError, match="old_logprobs"):
        objectives.make(name, is_correction="tis")(lp, batch)


def _ppo_token_grad_ref(lp, old, mu, adv, mask, *, eps_low, eps_high, w):
    """numpy d(ppo_clip loss)/d lp: -w A r / N where the clip does not bind, else 0."""
    r = np.exp(lp - old)
    a = adv[:, None]
    free = np.where(a >= 0, r <= 1 + eps_high, r >= 1 - eps_low)
    return np.where(mask & free, -w * a * r, 0.0) / mask.sum()


def test_decoupled_tis_per_token_gradient_is_the_capped_proximal_weight():
    """pi/mu = 0.6 at pi = pi_prox: the gradient weight is pi_prox/mu = 0.6 (not 0.36, the
    double count), and a ratio pi_prox/mu = 3 above the cap C = 2 is weighted by 2."""
    rho_prox = np.array([[0.6, 1.5, 3.0, 0.9, 1.0, 0.6]])  # pi_prox / mu per token
    mu = np.log(np.full((1, 6), 0.2))
    old = mu + np.log(rho_prox)
    lp = old + np.array([[0.0, 0.0, 0.0, 0.1, -0.1, 0.5]])  # last token: clip binds (A > 0)
    mask = np.array([[True] * 6])
    adv = np.array([1.5])
    batch = {"behavior_logprobs": jnp.asarray(mu, jnp.float32), "advantages":
             jnp.asarray(adv, jnp.float32), "mask": jnp.asarray(mask),
             "old_logprobs": jnp.asarray(old, jnp.float32)}
    obj = objectives.ppo_clip(is_correction="tis", is_threshold=2.0)
    g = np.asarray(jax.grad(lambda x: obj(x, batch)[0])(jnp.asarray(lp, jnp.float32)))
    w = np.minimum(rho_prox, 2.0)
    ref = _ppo_token_grad_ref(lp, old, mu, adv, mask, eps_low=0.2, eps_high=0.2, w=w)
    np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-7)
    # Token 0: pi/mu = 0.6 -> weight 0.6, gradient -0.6 * A / N.
    np.testing.assert_allclose(g[0, 0], -0.6 * 1.5 / 6, rtol=1e-5)
    np.testing.assert_allclose(g[0, 2], -2.0 * 1.5 / 6, rtol=1e-5)  # capped at C
    assert g[0, 5] == 0.0


def test_mis_without_old_logprobs_takes_both_bounds():
    """MIS band [0.5, 5] on pi/mu (current policy, detached): loss and gradient vs numpy."""
    rng = np.random.default_rng(7)
    mu = rng.normal(-2.0, 0.3, (B, T))
    lp = mu + rng.normal(0.0, 1.2, (B, T))  # wide: ratios on both sides of the band
    mask = rng.random((B, T)) < 0.85
    mask[:, 0] = True
    adv = rng.normal(size=B)
    batch = {"behavior_logprobs": jnp.asarray(mu, jnp.float32),
             "advantages": jnp.asarray(adv, jnp.float32), "mask": jnp.asarray(mask)}
    obj = objectives.ppo_clip(is_correction="mis", is_threshold=5.0, is_threshold_low=0.5)
    x = jnp.asarray(lp, jnp.float32)
    (loss, aux), g = jax.value_and_grad(lambda y: obj(y, batch), has_aux=True)(x)
    r = np.exp(lp - mu)
    keep = mask & (r >= 0.5) & (r <= 5.0)
    assert 0 < keep.sum() < mask.sum()  # the band drops something on each side
    assert ((r < 0.5) & mask).any() and ((r > 5.0) & mask).any()
    a = adv[:, None]
    surr = np.where(a >= 0, np.minimum(r, 1.2), np.maximum(r, 0.8)) * a
    ref_loss = -np.sum(np.where(keep, surr, 0.0)) / mask.sum()
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    ref_g = _ppo_token_grad_ref(lp, mu, mu, adv, mask, eps_low=0.2, eps_high=0.2,
                                w=keep.astype(float))
    np.testing.assert_allclose(np.asarray(g), ref_g, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(float(aux["is_kept_frac"]), keep.sum() / mask.sum(),
                               rtol=1e-6)


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
