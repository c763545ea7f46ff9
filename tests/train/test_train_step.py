"""The jitted sharded train step: mesh parity, grad accumulation, replay, objectives.

Compiled steps are cached per (mesh, options) and reused with fresh states, to keep the
number of XLA compilations (the cost of this file) small.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from satjax import objectives
from satjax.config import ObjectiveConfig, load_config
from satjax.model import token_logprobs
from satjax.train.state import lr_schedule, make_optimizer
from satjax.train.step import StepOptions, batch_advantages, make_train_step, staleness_metrics

RTOL = 1e-5
ATOL = 1e-6


def assert_trees_close(a, b, rtol=RTOL, atol=ATOL):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def forward(make_state):
    """Initial model's token_logprobs (no replay), outside the train step (an independent
    path): batch -> (log-probs [B, T], ModelOutput)."""
    graphdef, state = nnx.split(make_state(0).model)

    @jax.jit
    def fwd(batch):
        return token_logprobs(nnx.merge(graphdef, state), batch.tokens, batch.attention_mask)

    return fwd


@pytest.fixture(scope="module")
def batches(synthetic_batch):
    return [synthetic_batch(i, routed=True) for i in range(2)]


@pytest.fixture(scope="module")
def reference(run_steps, batches):
    """Single-device run, replay on, foreign (random) engine routes."""
    return run_steps(batches)


@pytest.fixture(scope="module")
def reference_objective(forward):
    def ref(name, batch):
        lp, _ = forward(batch)
        obj_batch = {
            "behavior_logprobs": batch.behavior_logprobs,
            "advantages": batch_advantages(batch),
            "mask": batch.loss_mask,
        }
        return objectives.make(name)(lp, obj_batch)

    return ref


@pytest.mark.parametrize("shape", [(8, 1, 1, 1), (2, 1, 4, 1), (1, 2, 2, 2)])
@pytest.mark.slow
def test_sharded_step_matches_single_device(reference, shape, run_steps, cached_step, batches):
    ref_state, ref_metrics = reference
    state, metrics = run_steps(batches, shape)
    for m, r in zip(metrics, ref_metrics, strict=True):
        np.testing.assert_allclose(m["loss"], r["loss"], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(m["grad_norm"], r["grad_norm"], rtol=RTOL)
    assert_trees_close(state["model"], ref_state["model"])
    assert_trees_close(state["optimizer"], ref_state["optimizer"])
    assert int(state["step"]) == 2 and int(state["policy_version"]) == 2
    assert cached_step(shape).num_compilations == 1


@pytest.mark.slow
def test_step_updates_params_and_reports_metrics(reference, make_state, host, batches):
    ref_state, ref_metrics = reference
    init = host(nnx.state(make_state(0)))
    for a, b in zip(
        jax.tree.leaves(init["model"]), jax.tree.leaves(ref_state["model"]), strict=True
    ):
        assert not np.allclose(a, b)
    m = ref_metrics[0]
    for key in ("loss", "grad_norm", "tokens", "router_mismatch", "sat_tail_frac"):
        assert key in m and np.isfinite(m[key]), key
    assert m["tokens"] == float(np.sum(batches[0].loss_mask))
    assert m["router_mismatch_applied"] == 0.0  # replay on: experts used == engine routes
    assert 0.5 < m["router_mismatch"] <= 1.0  # random engine routes differ from the router
    np.testing.assert_allclose([x["learning_rate"] for x in ref_metrics], [0.1, 0.05])


def test_a_batch_without_valid_rows_logs_finite_staleness(run_steps, batches):
    """Every row masked (all groups dropped): lag_mean and lag_max are 0, not -inf."""
    batch = batches[0]
    masked = batch.replace(loss_mask=np.zeros_like(batch.loss_mask))
    _, m = run_steps([batch, masked])
    assert m[0]["lag_max"] >= 0 and np.isfinite(m[0]["lag_max"])
    assert (m[1]["lag_max"], m[1]["lag_mean"], m[1]["sequences"]) == (0.0, 0.0, 0.0)


@pytest.mark.slow
def test_grad_accumulation_equals_full_batch(reference, run_steps, batches):
    """With SAT's gate over the whole batch (scope "batch"), grad_accum=2 is the batch."""
    ref_state, ref_metrics = reference
    # objective_hp as (key, value) pairs: hashable for the step cache, read by dict()
    acc, acc_metrics = run_steps(batches, grad_accum=2, objective_hp=(("scope", "batch"),))
    for a, b in zip(acc_metrics, ref_metrics, strict=True):
        for key in ("loss", "grad_norm", "router_mismatch", "sat_tail_frac"):
            np.testing.assert_allclose(a[key], b[key], rtol=RTOL, atol=ATOL, err_msg=key)
    assert_trees_close(acc["model"], ref_state["model"])


def _np_gate_per_micro(lp, batch, num):
    """numpy: SAT-GSPO's default gate per strided micro-batch (rows m, m + num, ...): the
    lower empirical 0.9 quantile of |d_i| (d_i the row's mean of lp - mu over its valid
    tokens) counted once per valid token (the broadcast proxy), as a per-row array."""
    valid = np.asarray(batch.loss_mask) > 0
    d = np.where(valid, np.asarray(lp, np.float64) - batch.behavior_logprobs, 0.0)
    n = valid.sum(1)
    d_seq = d.sum(1) / np.maximum(n, 1)
    q = np.zeros(len(n))
    for m in range(num):
        rows = np.arange(m, len(n), num)
        x = np.sort(np.repeat(np.abs(d_seq[rows]), n[rows]))
        q[rows] = x[int(np.ceil(0.9 * len(x))) - 1]
    return q, n > 0


@pytest.mark.slow
def test_sat_gate_per_grad_accum_micro_batch(run_steps, batches, forward):
    """grad_accum=2: the step's sat_q is the mean over the valid rows of the gate of the
    row's micro-batch (rows m, m + 2, ...: the step's micro-batches), from numpy."""
    batch = batches[0]
    _, m = run_steps([batch], grad_accum=2, replay=False)
    lp, _ = forward(batch)
    q2, rows = _np_gate_per_micro(lp, batch, 2)
    q1, _ = _np_gate_per_micro(lp, batch, 1)
    assert abs(q2[rows].mean() - q1[rows].mean()) > 1e-4  # the test can tell
    np.testing.assert_allclose(m[0]["sat_q"], q2[rows].mean(), rtol=1e-5)


@pytest.mark.slow
def test_replay_with_own_routes_equals_no_replay(forward, run_steps, batches):
    batch = batches[0]
    _, out = forward(batch)
    own = np.asarray(out.router_topk) * np.asarray(batch.route_mask())[..., None, None]
    own_batch = batch.replace(routed_experts=own.astype(np.int32))
    on, m_on = run_steps([own_batch])  # same compiled step as the reference
    off, m_off = run_steps([own_batch], replay=False)
    np.testing.assert_allclose(m_on[0]["loss"], m_off[0]["loss"], rtol=RTOL, atol=ATOL)
    assert m_on[0]["router_mismatch"] == 0.0 and m_off[0]["router_mismatch"] == 0.0
    assert_trees_close(on["model"], off["model"])


@pytest.mark.slow
def test_replay_matters_for_foreign_routes(reference, run_steps, batches, reference_objective):
    _, m_on = reference
    _, m_off = run_steps(batches[:1], replay=False)
    assert m_off[0]["router_mismatch_applied"] > 0.5
    assert m_on[0]["router_mismatch_applied"] == 0.0
    # the step's loss == the objective on independently computed log-probs (no replay)
    ref_loss, ref_aux = reference_objective("sat_gspo", batches[0])
    np.testing.assert_allclose(m_off[0]["loss"], ref_loss, rtol=RTOL, atol=ATOL)
    assert set(ref_aux) <= set(m_off[0])
    assert not np.isclose(m_on[0]["loss"], m_off[0]["loss"], rtol=1e-6, atol=0)


@pytest.mark.slow
def test_tis_with_one_update_weighs_by_the_policy_before_it(run_steps, batches, forward):
    """One update per batch and is_correction="tis": the step supplies the proximal policy
    (the detached log-probs of its own forward), so the loss is the objective given
    old_logprobs = lp and the weight is min(exp(lp - mu), 2), checked in numpy."""
    tis = (("is_correction", "tis"), ("is_threshold", 2.0))
    _, m = run_steps(batches[:1], objective="grpo", objective_hp=tis, replay=False)
    b = batches[0]
    lp, _ = forward(b)
    mask = np.asarray(b.loss_mask)
    w = np.minimum(np.exp(np.asarray(lp) - np.asarray(b.behavior_logprobs)), 2.0)
    np.testing.assert_allclose(m[0]["is_weight_mean"], (w * mask).sum() / mask.sum(),
                               rtol=1e-5)
    assert m[0]["is_weight_mean"] != 1.0
    ref_loss, _ = objectives.make("grpo", is_correction="tis")(lp, {
        "behavior_logprobs": b.behavior_logprobs, "advantages": batch_advantages(b),
        "mask": b.loss_mask, "old_logprobs": lp})
    np.testing.assert_allclose(m[0]["loss"], ref_loss, rtol=RTOL, atol=ATOL)
    assert m[0]["clip_frac_low"] == m[0]["clip_frac_high"] == 0.0  # pi / pi_prox = 1


@pytest.mark.parametrize("name", sorted(objectives.DEFAULTS))
def test_every_objective_traces_in_the_step(name, make_state, mesh_of, batches):
    # Tracing + lowering checks the wiring of every objective without an XLA compile each
    # (sat_gspo and ppo_clip are also executed end to end in this file, and their loss
    # is checked against the objective applied to independently computed log-probs).
    graphdef, state = nnx.split(make_state(0))
    step = make_train_step(graphdef, state, mesh=mesh_of((1, 1, 1, 1)),
                           options=StepOptions(objective=name))
    lowered = step.lower(state, batches[0])
    assert "loss" in lowered.out_info[1]
    assert step.num_compilations == 1


@pytest.mark.slow
def test_precomputed_advantages_and_compile_counter(
    cached_step, run_steps, make_state, synthetic_batch, batches, reference_objective
):
    adv = np.linspace(-1, 1, 8).astype(np.float32)
    b0 = batches[0].replace(advantages=adv)
    step = cached_step((1, 1, 1, 1), objective="ppo_clip", replay=False)
    _, m = run_steps([b0, batches[1].replace(advantages=adv)], objective="ppo_clip", replay=False)
    np.testing.assert_allclose(m[0]["advantage_abs_mean"], np.mean(np.abs(adv)), rtol=1e-6)
    ref_loss, _ = reference_objective("ppo_clip", b0)
    np.testing.assert_allclose(m[0]["loss"], ref_loss, rtol=RTOL, atol=ATOL)
    assert step.num_compilations == 1  # same shape twice: one trace
    # a new bucket length traces again (lowering only: the trace is what is counted)
    b_long = synthetic_batch(5, T=32, routed=True).replace(advantages=adv)
    step.lower(nnx.split(make_state(0))[1], b_long)
    assert step.num_compilations == 2
    assert step.traced_shapes == [(8, 16), (8, 32)]


def test_bad_arguments(make_state, mesh_of):
    graphdef, state = nnx.split(make_state(0))
    mesh = mesh_of((1, 1, 1, 1))
    with pytest.raises(ValueError, match="grad_accum"):
        StepOptions(grad_accum=0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        make_optimizer(0.1, max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="nope"):
        make_train_step(graphdef, state, mesh=mesh, options=StepOptions(objective="nope"))


def test_step_options_from_the_config():
    """The one place a run's config becomes the step's options."""
    cfg = load_config(overrides=[
        "train.grad_accum=2", "train.replay=false", "train.remat=full",
        "train.updates_per_batch=2", "train.mini_batches=4", "train.warmup_steps=10",
        "rollout.temperature=0", "objective.name=ppo_clip", "objective.kl_coef=0.5",
        "objective.kl_estimator=k2", "objective.kl_level=sequence",
        "objective.entropy_coef=0.1"])
    o = StepOptions.from_config(cfg)
    assert (o.objective, o.objective_hp, o.replay, o.grad_accum, o.remat) == (
        "ppo_clip", cfg.objective.hparams, "off", 2, "full")
    assert (o.updates_per_batch, o.mini_batches) == (2, 4)
    assert (o.kl_coef, o.kl_estimator, o.kl_level, o.entropy_coef) == (
        0.5, "k2", "sequence", 0.1)
    assert o.temperature == 1e-6  # a greedy rollout's log-probs: the step needs > 0
    assert (o.normalize_adv_std, o.donate) == (True, True)
    assert o.lr_schedule is not None
    for count in (0, 5, 20):
        assert o.lr_schedule(count) == lr_schedule(cfg.train)(count)
    # where the step and the config share a default it is the config's
    assert (StepOptions().kl_estimator, StepOptions().kl_level) == (
        ObjectiveConfig().kl_estimator, ObjectiveConfig().kl_level)


def test_optimizer_clips_by_global_norm():
    """The clip is the chain's first link: AdamW sees the clipped gradient (eps=1 makes
    Adam's update depend on the gradient's scale, so clipping is visible in it)."""
    params = {"w": np.zeros(2, np.float32)}
    grads = {"w": np.asarray([3.0, 4.0], np.float32)}  # global norm 5
    clipped = make_optimizer(1.0, max_grad_norm=0.5, eps=1.0)
    unclipped = make_optimizer(1.0, max_grad_norm=None, eps=1.0)
    reference = optax.adamw(1.0, eps=1.0)
    up_c, _ = clipped.update(grads, clipped.init(params), params)
    up_u, _ = unclipped.update(grads, unclipped.init(params), params)
    up_r, _ = reference.update({"w": grads["w"] * 0.1}, reference.init(params), params)
    np.testing.assert_allclose(up_c["w"], up_r["w"], rtol=1e-6)
    assert not np.allclose(up_c["w"], up_u["w"])


def _adam_moments(opt_state):
    """(mu, nu) of the one ScaleByAdamState in an optax state."""
    (adam,) = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(
        x, optax.ScaleByAdamState)) if isinstance(s, optax.ScaleByAdamState)]
    return np.asarray(adam.mu["w"]), np.asarray(adam.nu["w"])


@pytest.mark.parametrize("overrides, b1, b2", [([], 0.9, 0.999),
                                               (["train.adam_b1=0.8", "train.adam_b2=0.98"],
                                                0.8, 0.98)])
def test_run_optimizer_threads_adams_decays(overrides, b1, b2):
    """train.adam_b1 / adam_b2 reach Adam: after updates with g1, g2 (under the clip)
    mu = b1 (1 - b1) g1 + (1 - b1) g2 and nu = b2 (1 - b2) g1^2 + (1 - b2) g2^2."""
    from satjax.train.trainer import run_optimizer

    tx = run_optimizer(load_config(None, overrides))
    params = {"w": np.zeros(2, np.float32)}
    g1, g2 = np.asarray([0.3, -0.4], np.float32), np.asarray([0.1, 0.2], np.float32)
    state = tx.init(params)
    for g in (g1, g2):
        _, state = tx.update({"w": g}, state, params)
    mu, nu = _adam_moments(state)
    np.testing.assert_allclose(mu, b1 * (1 - b1) * g1 + (1 - b1) * g2, rtol=1e-5)
    np.testing.assert_allclose(nu, b2 * (1 - b2) * g1 ** 2 + (1 - b2) * g2 ** 2, rtol=1e-5)
    with pytest.raises(ValueError, match="b2: must be >= 0 and < 1, got 1.0"):
        make_optimizer(0.1, max_grad_norm=None, b2=1.0)


def _staleness_reference(lp, mu, mask):
    """numpy: token_gate_frac, token_extreme_frac and k3 KL as the docstrings define them."""
    lp, mu, valid = np.asarray(lp, np.float64), np.asarray(mu, np.float64), np.asarray(mask) > 0
    d = np.where(valid, lp - mu, 0.0)
    rows = valid.any(axis=1)
    d_seq = d.sum(axis=1)[rows] / valid.sum(axis=1)[rows]
    # token-weighted (each row's |d_i| once per valid token), lower empirical quantile
    gate = np.quantile(np.repeat(np.abs(d_seq), valid.sum(axis=1)[rows]), 0.9,
                       method="inverted_cdf")
    dv = d[valid]
    return (float(np.mean(np.abs(dv) > gate)) if gate > 0 else 0.0,
            float(np.mean(np.abs(dv) > np.log(2.0))),
            float(np.mean(np.exp(dv) - 1.0 - dv)))


def test_staleness_metrics_match_numpy_on_a_small_batch():
    r = np.random.default_rng(5)
    B, T = 6, 9
    mu = -r.random((B, T)).astype(np.float32) * 3
    lp = (mu + 0.6 * r.standard_normal((B, T))).astype(np.float32)
    mask = (r.random((B, T)) < 0.7).astype(np.float32)
    mask[2] = 0.0  # an empty row: no sequence proxy, no tokens
    lp[mask == 0] = np.nan  # padding may hold anything
    got = staleness_metrics(jnp.asarray(lp), jnp.asarray(mu), jnp.asarray(mask))
    gate_frac, extreme_frac, _ = _staleness_reference(lp, mu, mask)
    assert 0.0 < extreme_frac < 1.0 and 0.0 < gate_frac < 1.0  # the test can tell
    np.testing.assert_allclose(float(got["token_gate_frac"]), gate_frac, rtol=1e-6)
    np.testing.assert_allclose(float(got["token_extreme_frac"]), extreme_frac, rtol=1e-6)
    same = staleness_metrics(jnp.asarray(mu), jnp.asarray(mu), jnp.asarray(mask))
    assert float(same["token_gate_frac"]) == float(same["token_extreme_frac"]) == 0.0


@pytest.mark.slow
def test_step_logs_staleness_kl_and_grad_norm_of_its_batch(run_steps, batches, forward,
                                                           make_state):
    batch = batches[0]
    _, m = run_steps([batch], replay=False)
    lp, _ = forward(batch)  # the initial model's log-probs, outside the step
    gate_frac, extreme_frac, kl = _staleness_reference(lp, batch.behavior_logprobs,
                                                       batch.loss_mask)
    assert extreme_frac > 0.0
    np.testing.assert_allclose(m[0]["token_gate_frac"], gate_frac, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m[0]["token_extreme_frac"], extreme_frac, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m[0]["kl_k3"], kl, rtol=1e-4, atol=1e-6)
    # grad_norm: global norm of an independent gradient of the same objective
    graphdef, params, rest = nnx.split(make_state(0).model, nnx.Param, ...)
    obj = objectives.make("sat_gspo")
    obj_batch = {"behavior_logprobs": batch.behavior_logprobs,
                 "advantages": batch_advantages(batch), "mask": batch.loss_mask}

    def loss(p):
        lp, _ = token_logprobs(nnx.merge(graphdef, p, rest), batch.tokens, batch.attention_mask)
        return obj(lp, obj_batch)[0]

    grads = jax.grad(loss)(params)
    norm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))
    np.testing.assert_allclose(m[0]["grad_norm"], norm, rtol=1e-4)
