"""The jitted sharded train step: mesh parity, grad accumulation, replay, objectives.

Compiled steps are cached per (mesh, options) and reused with fresh states, to keep the
number of XLA compilations (the cost of this file) small.
"""

import functools

import jax
import numpy as np
import pytest
from flax import nnx
from train_fixtures import (
    cached_step,
    host,
    make_state,
    run_steps,
    single_device_mesh,
    synthetic_batch,
)

from satjax import objectives
from satjax.train.logprobs import token_logprobs
from satjax.train.step import batch_advantages, make_train_step

RTOL = 1e-5
ATOL = 1e-6


def assert_trees_close(a, b, rtol=RTOL, atol=ATOL):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


@functools.cache
def jitted_forward(replay=False):
    """Initial model's token_logprobs, outside the train step (an independent path)."""
    graphdef, state = nnx.split(make_state(0).model)

    @jax.jit
    def fwd(batch):
        return token_logprobs(nnx.merge(graphdef, state), batch, replay=replay)

    return fwd


BATCHES = [synthetic_batch(i, routes=True) for i in range(2)]


@pytest.fixture(scope="module")
def reference():
    """Single-device run, replay on, foreign (random) engine routes."""
    return run_steps(BATCHES)


@pytest.mark.parametrize("shape", [(8, 1, 1, 1), (2, 1, 4, 1), (1, 2, 2, 2)])
def test_sharded_step_matches_single_device(reference, shape):
    ref_state, ref_metrics = reference
    state, metrics = run_steps(BATCHES, shape)
    for m, r in zip(metrics, ref_metrics, strict=True):
        np.testing.assert_allclose(m["loss"], r["loss"], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(m["grad_norm"], r["grad_norm"], rtol=RTOL)
    assert_trees_close(state["model"], ref_state["model"])
    assert_trees_close(state["optimizer"], ref_state["optimizer"])
    assert int(state["step"]) == 2 and int(state["policy_version"]) == 2
    assert cached_step(shape).num_compilations == 1


def test_step_updates_params_and_reports_metrics(reference):
    ref_state, ref_metrics = reference
    init = host(nnx.state(make_state(0)))
    for a, b in zip(
        jax.tree.leaves(init["model"]), jax.tree.leaves(ref_state["model"]), strict=True
    ):
        assert not np.allclose(a, b)
    assert not np.array_equal(init["rng"], ref_state["rng"])
    m = ref_metrics[0]
    for key in ("loss", "grad_norm", "tokens", "router_mismatch", "sat_tail_frac"):
        assert key in m and np.isfinite(m[key]), key
    assert m["tokens"] == float(np.sum(BATCHES[0].loss_mask))
    assert m["router_mismatch_applied"] == 0.0  # replay on: experts used == engine routes
    assert 0.5 < m["router_mismatch"] <= 1.0  # random engine routes differ from the router
    np.testing.assert_allclose([x["learning_rate"] for x in ref_metrics], [0.1, 0.05])


def test_grad_accumulation_equals_full_batch(reference):
    ref_state, ref_metrics = reference
    acc, acc_metrics = run_steps(BATCHES, grad_accum=2)
    for a, b in zip(acc_metrics, ref_metrics, strict=True):
        for key in ("loss", "grad_norm", "router_mismatch", "sat_tail_frac"):
            np.testing.assert_allclose(a[key], b[key], rtol=RTOL, atol=ATOL, err_msg=key)
    assert_trees_close(acc["model"], ref_state["model"])


def test_replay_with_own_routes_equals_no_replay():
    batch = BATCHES[0]
    _, aux = jitted_forward()(batch)
    own = np.asarray(aux["selected_experts"]) * np.asarray(batch.route_mask())[..., None, None]
    own_batch = batch.replace(routes=own.astype(np.int32))
    on, m_on = run_steps([own_batch])  # same compiled step as the reference
    off, m_off = run_steps([own_batch], replay=False)
    np.testing.assert_allclose(m_on[0]["loss"], m_off[0]["loss"], rtol=RTOL, atol=ATOL)
    assert m_on[0]["router_mismatch"] == 0.0 and m_off[0]["router_mismatch"] == 0.0
    assert_trees_close(on["model"], off["model"])


def test_replay_matters_for_foreign_routes(reference):
    _, m_on = reference
    _, m_off = run_steps(BATCHES[:1], replay=False)
    assert m_off[0]["router_mismatch_applied"] > 0.5
    assert m_on[0]["router_mismatch_applied"] == 0.0
    # the step's loss == the objective on independently computed log-probs (no replay)
    ref_loss, ref_aux = reference_objective("sat_gspo", BATCHES[0])
    np.testing.assert_allclose(m_off[0]["loss"], ref_loss, rtol=RTOL, atol=ATOL)
    assert set(ref_aux) <= set(m_off[0])
    assert not np.isclose(m_on[0]["loss"], m_off[0]["loss"], rtol=1e-6, atol=0)


def reference_objective(name, batch):
    lp, _ = jitted_forward()(batch)
    obj_batch = {
        "behavior_logprobs": batch.behavior_logprobs,
        "advantages": batch_advantages(batch),
        "mask": batch.loss_mask,
    }
    return objectives.make(name)(lp, obj_batch)


@pytest.mark.parametrize("name", sorted(objectives.DEFAULTS))
def test_every_objective_traces_in_the_step(name):
    # Tracing + lowering checks the wiring of every objective without an XLA compile each
    # (sat_gspo and ppo_clip are also executed end to end in this file, and their loss
    # is checked against the objective applied to independently computed log-probs).
    graphdef, state = nnx.split(make_state(0))
    step = make_train_step(graphdef, state, mesh=single_device_mesh(), objective=name)
    lowered = step.lower(state, BATCHES[0])
    assert "loss" in lowered.out_info[1]
    assert step.num_compilations == 1


def test_precomputed_advantages_and_compile_counter():
    adv = np.linspace(-1, 1, 8).astype(np.float32)
    b0 = BATCHES[0].replace(advantages=adv)
    step = cached_step((1, 1, 1, 1), objective="ppo_clip", replay=False)
    _, m = run_steps([b0, BATCHES[1].replace(advantages=adv)], objective="ppo_clip", replay=False)
    np.testing.assert_allclose(m[0]["advantage_abs_mean"], np.mean(np.abs(adv)), rtol=1e-6)
    ref_loss, _ = reference_objective("ppo_clip", b0)
    np.testing.assert_allclose(m[0]["loss"], ref_loss, rtol=RTOL, atol=ATOL)
    assert step.num_compilations == 1  # same shape twice: one trace
    # a new bucket length traces again (lowering only: the trace is what is counted)
    b_long = synthetic_batch(5, T=32, routes=True).replace(advantages=adv)
    step.lower(nnx.split(make_state(0))[1], b_long)
    assert step.num_compilations == 2
    assert step.traced_shapes == [(8, 16), (8, 32)]


def test_bad_arguments():
    graphdef, state = nnx.split(make_state(0))
    mesh = single_device_mesh()
    with pytest.raises(ValueError, match="grad_accum"):
        make_train_step(graphdef, state, mesh=mesh, grad_accum=0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        make_train_step(graphdef, state, mesh=mesh, max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="nope"):
        make_train_step(graphdef, state, mesh=mesh, objective="nope")
