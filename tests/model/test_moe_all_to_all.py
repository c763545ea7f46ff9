"""moe_impl "all_to_all": expert parallelism by a token exchange, against the grouped
dispatch on one device, on the emulated 8-device CPU mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from satjax.model import Qwen3MoeConfig
from satjax.model.moe import (
    SparseMoeBlock,
    exchange_moves_fewer_bytes,
    padded_ragged_all_to_all,
    resolve_moe_impl,
)
from satjax.parallel import MeshConfig, logical_to_spec, make_mesh, state_shardings

B, T = 8, 6  # 48 tokens, 6 per device on the widest batch split
CFG = Qwen3MoeConfig.tiny(initializer_range=0.2)  # hidden 64, 8 experts of width 64, top-2


def _ragged_all_to_all_reference(operand, output, input_offsets, send_sizes,
                                 output_offsets, recv_sizes):
    """jax.lax.ragged_all_to_all's documented semantics over the leading axis (devices)."""
    p, k = input_offsets.shape
    per = k // p
    result = np.array(output)
    for src in range(p):
        for i in range(k):
            dst, slot = divmod(i, per)
            lo, size = input_offsets[src, i], send_sizes[src, i]
            at = output_offsets[src, i]
            assert recv_sizes[dst, src * per + slot] == size
            result[dst, at:at + size] = operand[src, lo:lo + size]
    return result


def _padded(p: int):
    mesh = jax.make_mesh((p,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    return jax.jit(jax.shard_map(
        lambda *a: padded_ragged_all_to_all(*(x[0] for x in a), axis_name="x")[None],
        mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def test_padded_ragged_all_to_all_matches_the_documented_semantics():
    example = (np.array([[1, 2, 2], [3, 4, 0]], np.float32), np.zeros((2, 4), np.float32),
               *(np.array(a, np.int32) for a in (
                   [[0, 1], [0, 1]], [[1, 2], [1, 1]], [[0, 0], [1, 2]], [[1, 1], [2, 1]])))
    np.testing.assert_array_equal(_padded(2)(*example), [[1, 3, 0, 0], [2, 2, 4, 0]])
    # random slices, two per destination, some empty, none for device 0, taken from the
    # operand and laid out on the receiver in shuffled orders, with gaps
    p, per, rows, out_rows = 4, 2, 16, 24
    rng = np.random.default_rng(0)

    def swap(a):  # [src, dst * per + slot] <-> [dst, src * per + slot]
        return a.reshape(p, p, per).transpose(1, 0, 2).reshape(p, p * per)

    sizes = rng.integers(0, 3, (p, p * per))
    sizes[:, :per] = 0
    recv = swap(sizes)
    offsets, placed = np.zeros_like(sizes), np.zeros_like(sizes)
    for a in range(p):
        at = rng.permutation(p * per)
        offsets[a, at] = np.cumsum(sizes[a, at]) - sizes[a, at]
        at = rng.permutation(p * per)
        placed[a, at] = np.cumsum(recv[a, at] + 1) - recv[a, at] - 1
    args = (rng.normal(size=(p, rows, 3)).astype(np.float32),
            np.full((p, out_rows, 3), -1, np.float32),
            *(a.astype(np.int32) for a in (offsets, sizes, swap(placed), recv)))
    np.testing.assert_array_equal(_padded(p)(*args), _ragged_all_to_all_reference(*args))


def _block(impl: str) -> SparseMoeBlock:
    return SparseMoeBlock(CFG, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32,
                          moe_impl=impl)


def _grads(graphdef):
    """value and gradients (w.r.t. the router, the experts and x) of a masked loss."""
    def loss(state, x, cot, valid, routed):
        out, rec = nnx.merge(graphdef, state)(x, routed)
        return jnp.sum(out * cot * valid[..., None]), (out, rec.experts_used)
    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def _inputs():
    keys = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(keys[0], (B, T, CFG.hidden_size))
    cot = jax.random.normal(keys[1], (B, T, CFG.hidden_size))
    valid = jnp.ones((B, T)).at[:, :2].set(0)  # left padding: its outputs are masked
    k, e = CFG.num_experts_per_tok, CFG.num_experts
    replay = jnp.argsort(jax.random.uniform(keys[2], (B, T, e)), axis=-1)[..., :k]
    replay = jnp.where(valid[..., None] > 0, replay, -1).astype(jnp.int32)  # padding: -1
    # every token to experts 0 and 1: all rows of the axis go to the first expert device
    skewed = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (B, T, k))
    return x, cot, valid, {"router": None, "replay": replay, "one_device": skewed}


_REFERENCE: dict = {}


def _reference(routes: str):
    """The grouped dispatch on one device (cached per routing)."""
    if routes not in _REFERENCE:
        graphdef, state = nnx.split(_block("grouped"))
        x, cot, valid, routed = _inputs()
        _REFERENCE[routes] = jax.jit(_grads(graphdef))(state, x, cot, valid, routed[routes])
    return _REFERENCE[routes]


@pytest.mark.parametrize("mesh_shape", [
    dict(fsdp=2, expert=4), dict(data=2, expert=4), dict(expert=8), dict(expert=4, tensor=2)])
@pytest.mark.slow
def test_all_to_all_values_and_gradients_equal_grouped(mesh_shape):
    """Outputs, routes and gradients (router, expert weights, x) of the all_to_all dispatch
    sharded over the mesh equal grouped's on one device, float32, with the router's own
    routes, replayed ones (padding tokens replaying -1) and every token routed to the
    experts of one device (its receive buffer full: nothing dropped)."""
    mesh = make_mesh(MeshConfig(**mesh_shape))
    graphdef, state = nnx.split(_block("all_to_all"))
    state = jax.device_put(state, state_shardings(state, mesh))
    gate = state["experts"]["gate_proj"][...]
    assert gate.sharding.shard_shape(gate.shape)[0] == CFG.num_experts // mesh.shape["expert"]
    x, cot, valid, routed = _inputs()
    batch = NamedSharding(mesh, logical_to_spec(("batch",), (B,), mesh))
    x, cot, valid = (jax.device_put(a, batch) for a in (x, cot, valid))
    step = jax.jit(_grads(graphdef))
    for routes, experts in routed.items():
        with jax.set_mesh(mesh):
            got = step(state, x, cot, valid,
                       None if experts is None else jax.device_put(experts, batch))
        (want_loss, (want_out, want_used)), want_grads = _reference(routes)
        (loss, (out, used)), grads = got
        np.testing.assert_array_equal(used, want_used, err_msg=routes)
        np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5, err_msg=routes)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-4, err_msg=routes)
        for path, g, w in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(grads),
                              jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5,
                                       err_msg=f"{routes} {jax.tree_util.keystr(path[0])}")


def test_experts_not_dividing_the_expert_axis_are_refused():
    cfg = Qwen3MoeConfig.tiny(num_experts=6)
    block = SparseMoeBlock(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32,
                           moe_impl="all_to_all")
    x = jnp.zeros((B, T, cfg.hidden_size))
    with jax.set_mesh(make_mesh(MeshConfig(data=2, expert=4))), \
            pytest.raises(ValueError, match="6 experts do not divide over the expert axis of 4"):
        jax.eval_shape(lambda x: block(x)[0], x)


def test_auto_exchanges_tokens_where_that_moves_fewer_bytes():
    assert [resolve_moe_impl("auto", p) for p in ("cpu", "tpu", "gpu")] == [
        "grouped", "ragged", "ragged"]
    assert resolve_moe_impl("auto", "tpu", exchange_wins=True) == "all_to_all"
    assert resolve_moe_impl("auto", "cpu", exchange_wins=True) == "grouped"
    assert resolve_moe_impl("all_to_all", "cpu") == "all_to_all"
    # the paper's layer (hidden 2048, 128 experts of width 768, top-8): the XLA:TPU counts
    # of benchmarks/bench_moe_dispatch.py, 1024 MiB exchanged at 8192 tokens per device
    # (+ 288 MiB for its own experts over fsdp 2) against 2304 MiB gathered and reduced
    def wins(tokens, expert=8, fsdp=1, experts=128):
        return exchange_moves_fewer_bytes(tokens, 8, experts, 2048, 768, expert, fsdp)

    assert wins(8192) and wins(8192, expert=4, fsdp=2)
    assert wins(18000) and not wins(18500)  # the crossover: 18432 tokens
    assert wins(16000, fsdp=8) and not wins(16500, fsdp=8)  # 16128
    assert not wins(33280, fsdp=8)  # the paper's 32k-token buckets
    assert not wins(8192, expert=1) and not wins(8192, expert=3, experts=128)
