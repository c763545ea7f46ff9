"""The train step's replay modes and router-gate metrics on batches that carry the
engine's gate weights and router logits (references computed in numpy from the initial
model's own forward, outside the step)."""

import jax
import numpy as np
import pytest
from flax import nnx

from satjax.model import token_logprobs


@pytest.fixture(scope="module")
def cfg(tiny_model):
    return tiny_model().config


@pytest.fixture(scope="module")
def gate_batch(synthetic_batch, cfg):
    """A routed synthetic batch with engine gates (normalised, float16) and router logits."""
    batch = synthetic_batch(0, routed=True)
    r = np.random.default_rng(7)
    shape = batch.routed_experts.shape
    raw = r.uniform(0.1, 1.0, shape)
    gates = (raw / raw.sum(-1, keepdims=True)).astype(np.float16)
    logits = r.normal(size=(*shape[:3], cfg.num_experts)).astype(np.float16)
    return batch.replace(routed_gates=gates, router_logits=logits)


@pytest.fixture(scope="module")
def trainer_routing(make_state, gate_batch):
    """``trainer_routing(gates)``: the initial model's router logits [B, T, L, E] (f64)
    under expert replay, or with ``gates`` under gate replay (a layer's router sees the
    hidden state the replayed gates of the layers before it made)."""
    graphdef, state = nnx.split(make_state(0).model)

    @jax.jit
    def logits(b, gates):
        _, out = token_logprobs(nnx.merge(graphdef, state), b.tokens, b.attention_mask,
                                routed_experts=b.routed_experts, routed_gates=gates)
        return out.router_logits

    def run(gates):
        return np.asarray(logits(gate_batch, gate_batch.routed_gates if gates else None),
                          np.float64)

    return run


def _masked_mean(x, mask):
    return float((x * mask).sum() / mask.sum())


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


@pytest.mark.slow
def test_gates_replay_applies_the_engine_gates_and_still_trains_the_router(
        run_steps, gate_batch, trainer_routing, make_state, host, cfg):
    mask = np.asarray(gate_batch.route_mask(), np.float64)
    engine = gate_batch.routed_gates.astype(np.float64)

    def gate_diff(router_logits):
        own = np.take_along_axis(_softmax(router_logits), gate_batch.routed_experts, -1)
        if cfg.norm_topk_prob:
            own = own / own.sum(-1, keepdims=True)
        return _masked_mean(np.abs(engine - own).mean((-2, -1)), mask)

    log_p = np.log(_softmax(gate_batch.router_logits.astype(np.float64)))
    log_q = np.log(_softmax(trainer_routing(gates=True)))
    kl = _masked_mean((np.exp(log_p) * (log_p - log_q)).sum(-1).mean(-1), mask)

    on, (m,) = run_steps([gate_batch], replay="gates")
    assert m["router_gate_diff_applied"] == 0.0 and m["router_mismatch_applied"] == 0.0
    np.testing.assert_allclose(m["router_gate_diff"], gate_diff(trainer_routing(gates=True)),
                               rtol=1e-5)
    assert m["router_gate_diff"] > 0.05
    np.testing.assert_allclose(m["router_kl"], kl, rtol=1e-4)

    _, (m_exp,) = run_steps([gate_batch], replay="experts")
    ref = gate_diff(trainer_routing(gates=False))
    np.testing.assert_allclose(m_exp["router_gate_diff"], ref, rtol=1e-5)
    np.testing.assert_allclose(m_exp["router_gate_diff_applied"], ref, rtol=1e-5)
    assert m_exp["router_mismatch_applied"] == 0.0
    assert not np.isclose(m["loss"], m_exp["loss"], rtol=1e-6, atol=0)

    # the router weights still moved under gate replay (straight-through gradient)
    init = host(nnx.state(make_state(0)))["model"]["layers"]
    for layer, before in init.items():
        moved = np.abs(on["model"]["layers"][layer]["mlp"]["gate"] - before["mlp"]["gate"])
        assert moved.max() > 0, layer


def test_gates_replay_needs_gates(run_steps, synthetic_batch):
    with pytest.raises(ValueError, match="no routed_gates"):
        run_steps([synthetic_batch(0, routed=True)], replay="gates")
