"""The router record: the sampler's gates and logits, gate replay (straight-through), and
a batch sampled across a weight update (partial rollouts).

References are independent of the code under test: the teacher-forced full-sequence
forward (``model(...)``), the KV-cache path fed a whole segment at once, and the dense
expert mix written out with the gate weights as an input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM
from satjax.model.logprobs import token_logprobs
from satjax.model.moe import SparseMoeBlock, dense_einsum_experts, expert_gates
from satjax.model.sampling import processed_logprobs
from satjax.rollout.builtin_engine import SEGMENT_TOKENS, BuiltinEngine
from satjax.rollout.engine import SamplingParams

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24]]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=12)  # no stop token: 12 tokens each
F16_GATE_ATOL = 2.0 ** -11  # float16 rounding of a weight in [0, 1]


@pytest.fixture(scope="module")
def cfg():
    return Qwen3MoeConfig.tiny(initializer_range=0.15, num_hidden_layers=2)


@pytest.fixture(scope="module")
def model(cfg):
    return Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0))


def _perturbed(model, scale, only=None, seed=1):
    """A copy of ``model`` with noise added to its parameters (``only``: those whose path
    contains it), as a later policy version."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for (path, x), k in zip(leaves, keys, strict=True):
        hit = only is None or only in jax.tree_util.keystr(path)
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        out.append(x + scale * jax.random.normal(k, x.shape, x.dtype) if hit and floating else x)
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, out))


def _engine(model, version, record_logits=False):
    engine = BuiltinEngine("float32", record_router_logits=record_logits)
    engine.set_model(model, version)
    return engine


@nnx.jit
def _forward(model, ids):
    return model(ids)


@pytest.mark.slow
def test_sampler_records_gates_and_logits_of_its_routing(model, cfg):
    comps = _engine(model, 3, record_logits=True).generate(PROMPTS, PARAMS, seed=1)
    for c in comps:
        p, n = len(c.prompt_tokens), len(c.response_tokens)
        assert c.routed_gates.dtype == np.float16 and c.router_logits.dtype == np.float16
        assert c.routed_gates.shape == c.routed_experts.shape == (p + n - 1, 2, 2)
        assert c.router_logits.shape == (p + n - 1, 2, cfg.num_experts)
        np.testing.assert_array_equal(c.token_versions, np.full(n, 3))
        seq = np.concatenate([c.prompt_tokens, c.response_tokens])[None, :-1]
        out = _forward(model, jnp.asarray(seq))
        np.testing.assert_array_equal(c.routed_experts, out.router_topk[0])
        np.testing.assert_allclose(c.router_logits, out.router_logits[0], atol=1e-2)
        ref = expert_gates(out.router_logits[0], out.router_topk[0], cfg.norm_topk_prob)
        np.testing.assert_allclose(c.routed_gates.astype(np.float32), ref, atol=F16_GATE_ATOL)


@pytest.mark.slow
def test_a_batch_sampled_across_a_weight_update(model, cfg):
    """Each token carries the version whose logits it was drawn from; tokens and router
    rows of the first version equal its teacher-forced forward; those of the second equal
    its forward over the segment, conditioned on the KV the first version computed for the
    prefix (the sampler keeps its KV cache across the update)."""
    v2 = _perturbed(model, 0.05)
    engine = _engine(model, 1)
    swaps = []

    def sync():
        if not swaps:
            engine.set_model(v2, 2)
        swaps.append(engine.version)
        return len(swaps) == 1

    comps = engine.generate(PROMPTS, PARAMS, seed=4, sync=sync)
    assert len(swaps) == -(-PARAMS.max_new_tokens // SEGMENT_TOKENS) - 1
    b = SEGMENT_TOKENS + 1  # the first token of v2: its logits came from v2's first forward
    for c in comps:
        p, n = len(c.prompt_tokens), len(c.response_tokens)
        np.testing.assert_array_equal(c.token_versions, [1] * b + [2] * (n - b))
        seq = np.concatenate([c.prompt_tokens, c.response_tokens])
        # version 1: the teacher-forced forward, tokens < b and router rows < p + b - 1
        out1 = _forward(model, jnp.asarray(seq[None, :-1]))
        lp1 = processed_logprobs(out1.logits[0], PARAMS.temperature)
        np.testing.assert_allclose(c.logprobs[:b], lp1[np.arange(p - 1, p + b - 1),
                                                       seq[p:p + b]], atol=1e-5)
        np.testing.assert_array_equal(c.routed_experts[:p + b - 1],
                                      out1.router_topk[0, :p + b - 1])
        # version 2: its forward of rows p + b - 1.. after version 1's cache of the prefix
        rows = len(seq) - 1
        cache = model.init_cache(1, rows)
        valid = jnp.ones((1, rows), bool)
        pos = jnp.arange(rows)[None]
        _, cache = model.forward_with_cache(jnp.asarray(seq[None, :p + b - 1]),
                                            pos[:, :p + b - 1], valid, cache, 0)
        out2, _ = v2.forward_with_cache(jnp.asarray(seq[None, p + b - 1:rows]),
                                        pos[:, p + b - 1:], valid, cache, p + b - 1)
        lp2 = processed_logprobs(out2.logits[0], PARAMS.temperature)
        np.testing.assert_allclose(c.logprobs[b:], lp2[np.arange(n - b), seq[p + b:]],
                                   atol=1e-5)
        np.testing.assert_array_equal(c.routed_experts[p + b - 1:], out2.router_topk[0])
        ref = expert_gates(out2.router_logits[0], out2.router_topk[0], cfg.norm_topk_prob)
        np.testing.assert_allclose(c.routed_gates[p + b - 1:].astype(np.float32), ref,
                                   atol=F16_GATE_ATOL)
        # the update mattered: version 1 would have given other log-probs to v2's tokens
        assert np.abs(c.logprobs[b:] - lp1[np.arange(p + b - 1, p + n - 1),
                                           seq[p + b:]]).max() > 1e-3


@pytest.mark.slow
def test_gate_replay_computes_the_engine_function(model):
    """A trainer whose router moved on (router weights perturbed) reproduces the engine's
    log-probs under gate replay, not under expert replay alone."""
    comps = _engine(model, 0).generate(PROMPTS, PARAMS, seed=7)
    trainer = _perturbed(model, 0.3, only="gate'")
    c = comps[1]
    seq = np.concatenate([c.prompt_tokens, c.response_tokens])[None]
    pad = np.zeros((1, 1, 2, 2))  # the last position: no route recorded
    experts = jnp.asarray(np.concatenate([c.routed_experts[None], pad], 1), jnp.int32)
    gates = jnp.asarray(np.concatenate([c.routed_gates[None], pad], 1), jnp.float32)
    p = len(c.prompt_tokens)
    errs = {}
    for mode, kw in (("experts", {}), ("gates", {"routed_gates": gates})):
        lp, out = token_logprobs(trainer, jnp.asarray(seq), routed_experts=experts, **kw)
        errs[mode] = float(np.abs(np.asarray(lp[0, p:]) - c.logprobs).max())
        if mode == "gates":
            np.testing.assert_array_equal(out.gate_weights[0], gates[0])
    assert errs["gates"] < 2e-3, errs  # float16 gates; the rest of the network is f32
    assert errs["experts"] > 10 * errs["gates"], errs


@pytest.mark.slow
def test_gate_replay_forward_and_straight_through_gradient(cfg):
    """Forward: the engine's gates exactly. Gradient to the router: nonzero, and equal to
    the straight-through reference, the gradient of the expert mix with respect to its
    gate weights (at the engine's) pulled back through the router's own gates."""
    block = SparseMoeBlock(cfg, rngs=nnx.Rngs(3), dtype=jnp.float32, param_dtype=jnp.float32,
                           moe_impl="grouped")
    x = jax.random.normal(jax.random.key(0), (2, 5, cfg.hidden_size))
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    experts = jax.random.randint(jax.random.key(1), (2, 5, k), 0, e)
    experts = experts.at[..., 1].set((experts[..., 0] + 1) % e)  # distinct per token
    raw = jax.random.uniform(jax.random.key(2), (2, 5, k), minval=0.1)
    gates = raw / raw.sum(-1, keepdims=True)
    target = jax.random.normal(jax.random.key(3), x.shape)
    graphdef, params = nnx.split(block)

    def loss(p):
        out, rec = nnx.merge(graphdef, p)(x, experts, gates)
        return jnp.sum(out * target), (out, rec)

    (_, (out, rec)), grads = jax.value_and_grad(loss, has_aux=True)(params)
    np.testing.assert_array_equal(rec.weights.reshape(gates.shape), gates)
    ws = [block.experts.gate_proj[...], block.experts.up_proj[...], block.experts.down_proj[...]]
    flat_x, flat_e = x.reshape(-1, x.shape[-1]), experts.reshape(-1, k)

    def mix(weights):
        return jnp.sum(dense_einsum_experts(flat_x, flat_e, weights, *ws)
                       * target.reshape(flat_x.shape))

    np.testing.assert_allclose(out.reshape(flat_x.shape),
                               dense_einsum_experts(flat_x, flat_e, gates.reshape(-1, k), *ws),
                               rtol=1e-5, atol=1e-5)
    d_gates = jax.grad(mix)(gates.reshape(-1, k))  # dL/dw at the engine's gates
    _, pull = jax.vjp(lambda w: expert_gates(flat_x @ w, flat_e, cfg.norm_topk_prob),
                      block.gate[...])
    (ref,) = pull(d_gates)
    got = grads["gate"][...]
    assert float(jnp.abs(got).max()) > 1e-4
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6)


def test_samples_of_one_version_are_unchanged_by_segmenting(model):
    """Decoding in segments with the same weights is the same sampler."""
    one = _engine(model, 5).generate(PROMPTS, PARAMS, seed=9)
    seg = _engine(model, 5).generate(PROMPTS, PARAMS, seed=9, sync=lambda: False)
    for a, b in zip(one, seg, strict=True):
        for f in dataclasses.fields(a):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if isinstance(x, np.ndarray):
                np.testing.assert_array_equal(x, y)
            else:
                assert x == y
