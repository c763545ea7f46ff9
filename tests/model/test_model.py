"""Unit tests of the satjax Qwen3-MoE model: shapes, R3 replay, MoE dispatch, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM
from satjax.model.moe import (
    _chunk_rows,
    dense_einsum_experts,
    grouped_experts,
    ragged_experts,
    resolve_moe_impl,
    route,
)

ALLOWED_AXES = {"vocab", "embed", "q_heads", "kv_heads", "head_dim", "mlp", "experts",
                "expert_mlp", None}


@pytest.fixture(scope="module")
def cfg():
    # 3 layers keep compiles short; layer 1 is dense so mixed layouts are covered
    return Qwen3MoeConfig.tiny(initializer_range=0.1, num_hidden_layers=3, mlp_only_layers=(1,))


@pytest.fixture(scope="module")
def model(cfg):
    return Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0))


def _ids(cfg, b=3, t=10, seed=0):
    return jax.random.randint(jax.random.key(seed), (b, t), 3, cfg.vocab_size, jnp.int32)


@nnx.jit
def _fwd(model, ids, mask, routed_experts):
    return model(ids, attention_mask=mask, routed_experts=routed_experts)


def test_config_layout_and_hf_roundtrip():
    cfg = Qwen3MoeConfig.tiny(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert cfg.moe_layer_indices == (1, 5)
    assert Qwen3MoeConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    assert Qwen3MoeConfig.tiny(num_experts=0).moe_layer_indices == ()
    with pytest.raises(ValueError, match="num_key_value_heads"):
        Qwen3MoeConfig.tiny(num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        Qwen3MoeConfig.tiny(num_experts_per_tok=9)
    with pytest.raises(ValueError, match="rope"):
        Qwen3MoeConfig.from_hf_dict({**cfg.to_hf_dict(), "rope_parameters": {"rope_type": "yarn"}})


@pytest.mark.slow
def test_shapes_dtypes_and_axis_names(cfg, model):
    ids = _ids(cfg)
    out = _fwd(model, ids, None, None)
    b, t = ids.shape
    assert cfg.moe_layer_indices == (0, 2)
    n_moe, k = len(cfg.moe_layer_indices), cfg.num_experts_per_tok
    assert out.logits.shape == (b, t, cfg.vocab_size) and out.logits.dtype == jnp.float32
    assert out.router_logits.shape == (b, t, n_moe, cfg.num_experts)
    assert out.router_logits.dtype == jnp.float32
    assert out.router_topk.shape == (b, t, n_moe, k)
    assert out.router_topk.dtype == jnp.int32
    # top-k is in descending router-probability order
    top = jax.lax.top_k(out.router_logits, k)[1]
    np.testing.assert_array_equal(out.router_topk, top)
    specs = jax.tree.leaves(nnx.get_partition_spec(nnx.state(model, nnx.Param)),
                            is_leaf=lambda x: isinstance(x, P))
    assert specs and all(set(s) <= ALLOWED_AXES for s in specs)
    np.testing.assert_array_equal(out.experts_used, out.router_topk)  # no replay: what ran
    with pytest.raises(ValueError, match="routed_experts"):
        model(ids, routed_experts=jnp.zeros((b, t, n_moe + 1, k), jnp.int32))
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=jnp.ones((b, t + 1)))


def test_route_matches_hf_semantics():
    logits = jax.random.normal(jax.random.key(3), (20, 8)) * 2
    probs = np.asarray(jax.nn.softmax(logits))
    for norm in (True, False):
        rec = route(logits, 3, norm)
        experts, weights, own = rec.experts_used, rec.weights, rec.router_topk
        ref_idx = np.argsort(-probs, axis=-1)[:, :3]
        ref_w = np.take_along_axis(probs, ref_idx, -1)
        if norm:
            ref_w = ref_w / ref_w.sum(-1, keepdims=True)
        np.testing.assert_array_equal(experts, ref_idx)
        np.testing.assert_array_equal(own, ref_idx)
        np.testing.assert_allclose(weights, ref_w, rtol=1e-6)
        replay = jnp.asarray(np.roll(ref_idx, 1, axis=0))
        rec = route(logits, 3, norm, replay)
        experts, weights, own = rec.experts_used, rec.weights, rec.router_topk
        np.testing.assert_array_equal(experts, replay)
        np.testing.assert_array_equal(own, ref_idx)
        ref_w = np.take_along_axis(probs, np.asarray(replay), -1)
        if norm:
            ref_w = ref_w / ref_w.sum(-1, keepdims=True)
        np.testing.assert_allclose(weights, ref_w, rtol=1e-6)


@pytest.mark.slow
def test_ragged_and_dense_dispatch_agree_with_loop_reference():
    n, d, f, e, k = 24, 8, 12, 6, 2
    keys = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(keys[0], (n, d))
    wg, wu = (jax.random.normal(kk, (e, d, f)) for kk in keys[1:3])
    wd = jax.random.normal(keys[3], (e, f, d))
    rec = route(jax.random.normal(keys[4], (n, e)), k, True)
    experts, weights = rec.experts_used, rec.weights
    xn, wgn, wun, wdn = (np.asarray(a, np.float64) for a in (x, wg, wu, wd))
    ref = np.zeros((n, d))
    for i in range(n):  # independent per-token numpy reference
        for j in range(k):
            ex = int(experts[i, j])
            g, u = xn[i] @ wgn[ex], xn[i] @ wun[ex]
            ref[i] += float(weights[i, j]) * ((g / (1 + np.exp(-g)) * u) @ wdn[ex])
    for fn in (ragged_experts, grouped_experts, dense_einsum_experts):
        np.testing.assert_allclose(jax.jit(fn)(x, experts, weights, wg, wu, wd), ref, rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("routes", ["balanced", "skewed", "one_expert", "idle_experts"])
@pytest.mark.slow
def test_grouped_values_and_gradients_equal_autodiff_of_dense(routes):
    """grouped's hand-written backward vs autodiff of the dense reference, on loads that
    take full chunks, tail chunks, chunks running past an expert's rows into the next
    expert's, and experts with no rows."""
    n, d, f, e, k = 40, 8, 12, 4, 2
    assert _chunk_rows(n * k, e) == (16, 8)  # mean load 20: one full chunk + a tail
    keys = jax.random.split(jax.random.key(3), 6)
    x = jax.random.normal(keys[0], (n, d))
    wg, wu = (jax.random.normal(kk, (e, d, f)) for kk in keys[1:3])
    wd = jax.random.normal(keys[3], (e, f, d))
    weights = jax.nn.softmax(jax.random.normal(keys[4], (n, k)), axis=-1)
    cot = jax.random.normal(keys[5], (n, d))
    token = jnp.arange(n)
    ex = {"balanced": jnp.stack([token % e, (token + 1) % e], axis=1),
          "skewed": jnp.stack([jnp.where(token < 37, 0, 1), (token % 3) + 1], axis=1),
          "one_expert": jnp.stack([jnp.zeros(n, int), jnp.where(token < 3, 1, 0)], axis=1),
          "idle_experts": jnp.stack([token % 2, jnp.full(n, 3)], axis=1)}[routes]
    loads = np.bincount(np.asarray(ex).reshape(-1), minlength=e)
    assert loads.sum() == n * k and (routes != "idle_experts" or loads[2] == 0)
    loss = lambda fn: lambda *a: jnp.sum(fn(a[0], ex, *a[1:]) * cot)  # noqa: E731
    want = jax.value_and_grad(loss(dense_einsum_experts), argnums=range(5))(
        x, weights, wg, wu, wd)
    got = jax.jit(jax.value_and_grad(loss(grouped_experts), argnums=range(5)))(
        x, weights, wg, wu, wd)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4, err_msg=f"loads {loads}")


@pytest.mark.parametrize("impl", ["grouped", "ragged", "dense_einsum"])
@pytest.mark.slow
def test_replay_own_routes_is_exact(cfg, model, impl):
    assert resolve_moe_impl(model.layers[0].mlp.moe_impl) == "grouped"  # "auto" on CPU
    if impl != "grouped":
        model = Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0), moe_impl=impl)
    ids = _ids(cfg)
    mask = jnp.ones(ids.shape, jnp.int32).at[0, :4].set(0)
    out = _fwd(model, ids, mask, None)
    replay = _fwd(model, ids, mask, out.router_topk)
    np.testing.assert_array_equal(replay.logits, out.logits)
    np.testing.assert_array_equal(replay.router_topk, out.router_topk)
    np.testing.assert_array_equal(replay.experts_used, out.router_topk)


def test_left_padding_matches_unpadded(cfg, model):
    ids = _ids(cfg)  # same shapes as the other tests: no recompilation
    pad = 4
    padded = jnp.zeros_like(ids).at[:, pad:].set(ids[:, :-pad])
    mask = jnp.ones_like(ids).at[:, :pad].set(0)
    a, b = _fwd(model, ids, None, None), _fwd(model, padded, mask, None)
    np.testing.assert_allclose(b.logits[:, pad:], a.logits[:, :-pad], atol=1e-5)
    np.testing.assert_array_equal(b.router_topk[:, pad:], a.router_topk[:, :-pad])
    assert np.isfinite(np.asarray(b.logits)).all()


_REFERENCE = {}


def _loss_fn(graphdef):
    def loss(state, ids, mask, routed_experts):
        out = nnx.merge(graphdef, state)(ids, attention_mask=mask, routed_experts=routed_experts)
        return jnp.mean(jax.nn.log_softmax(out.logits)[..., 7]), out.logits
    return jax.value_and_grad(loss, has_aux=True)


def _reference(impl):
    """Unsharded 2-MoE-layer model, batch, non-own routes, and its jitted loss/logits/grads."""
    if impl not in _REFERENCE:
        cfg = Qwen3MoeConfig.tiny(initializer_range=0.1, num_hidden_layers=2)
        model = Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(2), moe_impl=impl)
        graphdef, state = nnx.split(model)
        ids = _ids(cfg, b=4, t=12)
        mask = jnp.ones(ids.shape, jnp.int32).at[1, :3].set(0)
        # k distinct random experts per token and layer: almost never the router's own
        rng = np.random.default_rng(0)
        other = np.argsort(rng.random((4, 12, 2, cfg.num_experts)), axis=-1)[..., :2]
        other = jnp.asarray(other, jnp.int32)
        result = jax.jit(_loss_fn(graphdef))(state, ids, mask, other)
        _REFERENCE[impl] = (cfg, model, graphdef, state, ids, mask, other, result)
    return _REFERENCE[impl]


@pytest.mark.slow
def test_replay_other_routes_changes_output_and_trains_router():
    cfg, model, _, _, ids, mask, other, ((_, logits), grads) = _reference("grouped")
    own = _fwd(model, ids, mask, None)
    valid = np.asarray(mask, bool)
    differs = np.any(np.sort(own.router_topk, -1) != np.sort(other, -1), axis=(-1, -2))
    replayed = _fwd(model, ids, mask, other)
    np.testing.assert_array_equal(replayed.experts_used, other)  # what ran: the replay
    # the first MoE layer's input does not depend on replay: its router's choice is unchanged
    np.testing.assert_array_equal(replayed.router_topk[:, :, 0], own.router_topk[:, :, 0])
    assert differs[valid].mean() > 0.8
    # every position after the first differing token changes
    assert float(jnp.abs(logits - own.logits).max(axis=-1)[valid][1:].min()) > 1e-4
    for li in cfg.moe_layer_indices:
        g = grads["layers"][li]["mlp"]["gate"][...]
        assert float(jnp.abs(g).max()) > 0.0, f"router of layer {li} got no gradient"


@pytest.mark.parametrize("impl,axis_type", [("grouped", AxisType.Auto),
                                            ("grouped", AxisType.Explicit),
                                            ("ragged", AxisType.Auto),
                                            ("dense_einsum", AxisType.Auto),
                                            ("all_to_all", AxisType.Auto),
                                            ("all_to_all", AxisType.Explicit)])
@pytest.mark.slow
def test_expert_sharded_forward_and_grad_equal_unsharded(impl, axis_type):
    """Sharded run of each impl vs the unsharded "grouped" reference (identical weights)."""
    assert jax.device_count() == 8
    cfg, _, _, state, ids, mask, other, ((ref_loss, ref_logits), ref_grad) = _reference(
        "grouped")
    graphdef = nnx.split(Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(2), moe_impl=impl))[0]
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(axis_type,) * 2)
    rules = {"experts": "expert"}
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, P(*[rules.get(a) for a in s])),
                             nnx.get_partition_spec(state), is_leaf=lambda x: isinstance(x, P))
    sharded = jax.device_put(state, shardings)
    gate = sharded["layers"][0]["mlp"]["experts"]["gate_proj"][...]
    assert gate.sharding.shard_shape(gate.shape)[0] == cfg.num_experts // 4
    batch = NamedSharding(mesh, P("data"))
    with jax.set_mesh(mesh):
        (l2, logits2), grad2 = jax.jit(_loss_fn(graphdef))(
            sharded, *(jax.device_put(a, batch) for a in (ids, mask, other)))
    np.testing.assert_allclose(logits2, ref_logits, atol=1e-5)
    np.testing.assert_allclose(l2, ref_loss, atol=1e-6)
    for name in ("gate_proj", "down_proj"):
        g_ref = ref_grad["layers"][0]["mlp"]["experts"][name][...]
        g_sh = grad2["layers"][0]["mlp"]["experts"][name][...]
        np.testing.assert_allclose(g_sh, g_ref, atol=1e-6)
    np.testing.assert_allclose(grad2["layers"][1]["mlp"]["gate"][...],
                               ref_grad["layers"][1]["mlp"]["gate"][...], atol=1e-6)


@pytest.mark.slow
def test_scan_layers_equals_unrolled():
    """scan_layers=True computes the same outputs, replay and gradients as the unrolled loop."""
    cfg = Qwen3MoeConfig.tiny(num_hidden_layers=3, initializer_range=0.1)
    unrolled = Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0))
    scanned = Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0), scan_layers=True)
    ids = _ids(cfg, b=2, t=9)
    a, b = _fwd(unrolled, ids, None, None), _fwd(scanned, ids, None, None)
    for name in ("logits", "router_logits", "router_topk", "experts_used"):
        np.testing.assert_allclose(getattr(b, name), getattr(a, name), atol=1e-5, err_msg=name)
    other = a.router_topk[..., ::-1]
    a, b = _fwd(unrolled, ids, None, other), _fwd(scanned, ids, None, other)
    np.testing.assert_allclose(b.logits, a.logits, atol=1e-5)
    np.testing.assert_array_equal(b.experts_used, other)

    @nnx.jit  # one compile per layout instead of an eager dispatch per op
    @nnx.grad
    def grad(m):
        return m(ids).logits.mean()

    for x, y in zip(jax.tree.leaves(grad(unrolled)), jax.tree.leaves(grad(scanned)),
                    strict=True):
        np.testing.assert_allclose(y, x, atol=1e-6)


@pytest.mark.slow
def test_grouped_dispatch_runs_per_batch_shard_under_a_data_mesh():
    """Under a data-parallel mesh each device sorts and runs only its own tokens: the
    compiled expert loops carry the local rows, not the whole batch's (a global sort
    would make every device gather every token and run all of them)."""
    cfg = Qwen3MoeConfig.tiny(num_hidden_layers=1)
    graphdef, state = nnx.split(Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0)))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    ids = jax.device_put(jnp.ones((8, 32), jnp.int32), NamedSharding(mesh, P("data")))

    def loss(state, ids):
        return jnp.mean(nnx.merge(graphdef, state)(ids).logits)

    with jax.set_mesh(mesh):
        hlo = jax.jit(jax.grad(loss)).lower(state, ids).compile().as_text()
    k, d = cfg.num_experts_per_tok, cfg.hidden_size
    full, _ = _chunk_rows(32 * k, cfg.num_experts)  # one device: 32 tokens
    loops = [line for line in hlo.splitlines() if " while(" in line]
    assert loops and all(f"f32[{8 * 32 * k + full}," not in line for line in loops)
    assert any(f"f32[{32 * k + full},{d}]" in line for line in loops)
