"""Rematerialised decoder layers and the chunked LM head: same values and gradients as the
plain forward, less memory (read from XLA's buffer assignment of the compiled gradient)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM, token_logprobs
from satjax.model.logprobs import chunked_logprobs

CFG = Qwen3MoeConfig.tiny(num_hidden_layers=3, initializer_range=0.1)


def _batch(b=2, t=24, seed=0):
    ids = jax.random.randint(jax.random.key(seed), (b, t), 3, CFG.vocab_size, jnp.int32)
    mask = jnp.ones((b, t), jnp.int32).at[1, t - 6:].set(0)  # a right-padded row
    return ids, mask


def _grad_of_logprobs(model, ids, mask, **kw):
    """(weighted sum of token log-probs, its gradient) w.r.t. the parameters."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    weights = jnp.arange(ids.shape[1], dtype=jnp.float32)

    def f(p):
        lp, _ = token_logprobs(nnx.merge(graphdef, p, rest), ids, mask, **kw)
        return jnp.sum(lp * weights)

    return jax.jit(jax.value_and_grad(f))(params)


def _assert_grads_close(a, b, rtol):
    """Every leaf within ``rtol`` of its largest entry (float32 rounding of a different
    but equivalent XLA program: remat recomputes, chunks split the head's matmul)."""
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b),
                            strict=True):
        x, y = np.asarray(x), np.asarray(y)
        scale = max(np.abs(x).max(), 1e-30)
        assert np.abs(x - y).max() <= rtol * scale, (jax.tree_util.keystr(path),
                                                     np.abs(x - y).max() / scale)


@pytest.mark.slow
def test_chunked_logprobs_equal_one_chunk_values_and_gradients():
    r = np.random.default_rng(0)
    b, t, d, v = 2, 37, 16, 50  # 37 = 4 chunks of 10, the last one padded
    hidden = jnp.asarray(r.standard_normal((b, t, d)), jnp.float32)
    head = jnp.asarray(r.standard_normal((d, v)) * 0.3, jnp.float32)
    targets = jnp.asarray(r.integers(0, v, (b, t)), jnp.int32)
    # independent reference: a gather from the full log-softmax
    ref = jnp.take_along_axis(jax.nn.log_softmax(hidden @ head / 0.7, axis=-1),
                              targets[..., None], axis=-1)[..., 0]
    for chunk in (10, 37, 64):
        out = chunked_logprobs(hidden, head, targets, temperature=0.7, chunk=chunk)
        np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-5)
    cot = jnp.asarray(r.standard_normal((b, t)), jnp.float32)

    def grads(fn):
        return jax.grad(lambda h, w: jnp.sum(fn(h, w) * cot), argnums=(0, 1))(hidden, head)

    full = grads(lambda h, w: jnp.take_along_axis(
        jax.nn.log_softmax(h @ w / 0.7, axis=-1), targets[..., None], axis=-1)[..., 0])
    chunked = grads(lambda h, w: chunked_logprobs(h, w, targets, temperature=0.7, chunk=10))
    for a, c in zip(full, chunked, strict=True):
        np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="chunk"):
        chunked_logprobs(hidden, head, targets, chunk=0)


def test_chunked_head_holds_one_chunk_of_logits():
    # the gradient of the log-probs over a large vocabulary: in one chunk XLA's
    # temporaries hold the [B, T, V] logits (and their softmax); in 8 chunks about an
    # eighth of that
    b, t, d, v = 2, 1024, 64, 8192
    full_logits = b * t * v * 4

    def temporaries(chunk):
        def f(h, w, y):
            return jnp.sum(chunked_logprobs(h, w, y, chunk=chunk))

        args = (jax.ShapeDtypeStruct((b, t, d), jnp.float32),
                jax.ShapeDtypeStruct((d, v), jnp.float32),
                jax.ShapeDtypeStruct((b, t), jnp.int32))
        compiled = jax.jit(jax.grad(f, argnums=(0, 1))).lower(*args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    one, eight = temporaries(t), temporaries(t // 8)
    print(f"temporaries: one chunk {one / 2**20:.0f} MiB, 8 chunks {eight / 2**20:.0f} MiB, "
          f"full logits {full_logits / 2**20:.0f} MiB")
    assert one >= full_logits
    assert eight < full_logits / 3


@pytest.mark.slow
def test_token_logprobs_in_chunks_equal_the_full_heads():
    model = Qwen3MoeForCausalLM(CFG, rngs=nnx.Rngs(0))
    ids, mask = _batch()

    @nnx.jit  # one compile instead of an eager dispatch (and compile) per op
    def reference_and_chunked(model, ids, mask):
        logits = model(ids, attention_mask=mask).logits
        ref = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1], axis=-1),
                                  ids[:, 1:, None], axis=-1)[..., 0]
        return jnp.pad(ref, ((0, 0), (1, 0))) * mask, token_logprobs(model, ids, mask,
                                                                     chunk=5)[0]

    ref, lp = reference_and_chunked(model, ids, mask)
    np.testing.assert_allclose(lp, ref, rtol=1e-5, atol=1e-5)
    (v1, g1), (v5, g5) = (_grad_of_logprobs(model, ids, mask, chunk=c) for c in (512, 5))
    np.testing.assert_allclose(v5, v1, rtol=1e-6)
    _assert_grads_close(g1, g5, rtol=1e-5)


@functools.cache
def _grad_without_remat(scan_layers: bool):
    """The reference of each remat mode (compiled once per layout, not once per mode)."""
    model = Qwen3MoeForCausalLM(CFG, rngs=nnx.Rngs(0), scan_layers=scan_layers)
    return _grad_of_logprobs(model, *_batch(), remat="none")


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("remat", ["full", "dots"])
@pytest.mark.slow
def test_remat_gives_the_same_gradients(remat, scan_layers):
    # all layers MoE, so scan_layers really scans
    model = Qwen3MoeForCausalLM(CFG, rngs=nnx.Rngs(0), scan_layers=scan_layers)
    ids, mask = _batch()
    v0, g0 = _grad_without_remat(scan_layers)
    v1, g1 = _grad_of_logprobs(model, ids, mask, remat=remat)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    _assert_grads_close(g0, g1, rtol=1e-5)


@pytest.mark.slow
def test_remat_keeps_only_the_layer_inputs():
    # With the layers scanned, each extra layer adds its whole activations to the
    # gradient's temporaries without remat, and little more than its input with "full".
    cfg = Qwen3MoeConfig.tiny(vocab_size=256, hidden_size=128, moe_intermediate_size=64)
    ids = jax.ShapeDtypeStruct((2, 512), jnp.int32)

    def temporaries(layers, remat):
        shape = Qwen3MoeConfig(**{**cfg.__dict__, "num_hidden_layers": layers})
        model = nnx.eval_shape(lambda: Qwen3MoeForCausalLM(shape, rngs=nnx.Rngs(0),
                                                           scan_layers=True))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def f(p, x):
            return jnp.sum(token_logprobs(nnx.merge(graphdef, p, rest), x, remat=remat)[0])

        compiled = jax.jit(jax.grad(f)).lower(params, ids).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    per_layer = {r: (temporaries(4, r) - temporaries(2, r)) / 2 for r in ("none", "full")}
    # what a layer adds anyway: its input (saved), and its parameters stacked for the scan
    # and their gradient
    layer_input = 2 * 512 * 128 * 4
    model = nnx.eval_shape(lambda: Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0)))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model.layers[0], nnx.Param))) * 4
    print({r: f"{v / 2**20:.2f} MiB per layer" for r, v in per_layer.items()},
          f"input {layer_input / 2**20:.2f} MiB, parameters {params / 2**20:.2f} MiB")
    assert per_layer["full"] <= layer_input + 2 * params
    assert per_layer["none"] > 10 * per_layer["full"]


def test_unknown_remat_is_refused():
    model = Qwen3MoeForCausalLM(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="remat must be one of"):
        model(_batch()[0], remat="everything")


@pytest.mark.parametrize("impl", ["grouped", "ragged"])
@pytest.mark.slow
def test_moe_token_chunks_give_the_same_values_and_gradients(impl):
    from satjax.model.moe import _IMPLS, in_token_chunks, route

    r = np.random.default_rng(1)
    n, d, f, e, k = 96, 16, 8, 8, 2  # 96 tokens at most 40 at once: 3 chunks of 32
    x = jnp.asarray(r.standard_normal((n, d)), jnp.float32)
    rec = route(jnp.asarray(r.standard_normal((n, e)), jnp.float32), k, True)
    ws = [jnp.asarray(r.standard_normal(s) * 0.3, jnp.float32)
          for s in ((e, d, f), (e, d, f), (e, f, d))]
    cot = jnp.asarray(r.standard_normal((n, d)), jnp.float32)

    def value_and_grads(fn):
        def loss(x, w, *ws):
            return jnp.sum(fn(x, rec.experts_used, w, *ws) * cot)
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(x, rec.weights, *ws)

    whole = value_and_grads(_IMPLS[impl])
    chunked = value_and_grads(in_token_chunks(_IMPLS[impl], max_tokens=40))
    np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-5)
    for a, b in zip(whole[1], chunked[1], strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    # the chunks really run apart: the traced program maps over 3 chunks of 32 tokens
    jaxpr = str(jax.make_jaxpr(in_token_chunks(_IMPLS[impl], max_tokens=40))(
        x, rec.experts_used, rec.weights, *ws))
    assert "f32[3,32,16]" in jaxpr
