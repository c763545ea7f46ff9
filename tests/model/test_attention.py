"""satjax.model.attention: every implementation's values and gradients against the reference,
the blockwise memory growth, sharded runs, and the model wired to it.

Gradients are the vjp of (q, k, v) with a random cotangent that is zero on padded query
rows (the model's loss masks them; outputs there are implementation-defined), so dq, dk
and dv are compared everywhere and the output on valid rows only. Tolerances: float32
inputs within 2e-5 (output) and 5e-5 of the largest gradient entry; bfloat16 inputs no
farther from the float32 reference than twice the bfloat16 reference is (plus 1e-3).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM, token_logprobs
from satjax.model.attention import (
    ATTENTION_IMPLS,
    CPU_BLOCKWISE_MIN_LEN,
    blockwise_attention,
    causal_attention,
    cudnn_attention,
    reference_attention,
    resolve_attention,
    splash_attention,
)


def _inputs(b, t, h, hkv, d, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = [(b, t, h, d), (b, t, hkv, d), (b, t, hkv, d), (b, t, h, d)]
    return [jax.random.normal(key, s, jnp.float32).astype(dtype)
            for key, s in zip(keys, shapes, strict=True)]


def _valid(b, t, padding, seed=1):
    """bool [B, T]: "right" (row r keeps a prefix, one row full, one empty when B > 2),
    "left" (padding first) or "any" (random holes, first slot padded in row 0)."""
    if padding == "any":
        valid = np.random.default_rng(seed).random((b, t)) > 0.3
        valid[0, 0] = False
        return jnp.asarray(valid)
    lengths = np.linspace(t, 0 if b > 2 else t // 2, b).astype(int)
    prefix = np.arange(t)[None, :] < lengths[:, None]
    return jnp.asarray(prefix if padding == "right" else prefix[:, ::-1])


def _fwd_bwd(attend, q, k, v, valid, d_out):
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, valid), q, k, v)
    return (out, *vjp(d_out * valid[:, :, None, None].astype(d_out.dtype)))


_reference_fwd_bwd = jax.jit(functools.partial(_fwd_bwd, reference_attention))


def _errors(got, want, valid):
    """[max |out - out_ref| on valid rows, then max |g - g_ref| / max |g_ref| per grad]."""
    got = [x.astype(jnp.float32) for x in got]
    want = [x.astype(jnp.float32) for x in want]
    rows = valid[:, :, None, None]
    errs = [float(jnp.max(jnp.where(rows, jnp.abs(got[0] - want[0]), 0.0)))]
    errs += [float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w)))
             for g, w in zip(got[1:], want[1:], strict=True)]
    return np.asarray(errs)


def _check(attend, b, t, h, hkv, d, dtype, padding):
    q, k, v, d_out = _inputs(b, t, h, hkv, d, dtype)
    valid = _valid(b, t, padding)
    got = jax.jit(functools.partial(_fwd_bwd, attend))(q, k, v, valid, d_out)
    assert all(x.dtype == dtype for x in got)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, d_out)]
    want = _reference_fwd_bwd(*f32[:3], valid, f32[3])
    errs = _errors(got, want, valid)
    if dtype == jnp.float32:
        bound = np.array([2e-5, 5e-5, 5e-5, 5e-5])
    else:
        ref_low = _reference_fwd_bwd(q, k, v, valid, d_out)
        bound = 2 * _errors(ref_low, want, valid) + 1e-3
    assert np.all(errs <= bound), (errs, bound)
    return got, valid


# (B, T, H, Hkv, Dh, block, dtype, padding): T a multiple of the block, not one, below it;
# GQA ratios 1, 2, 4 and MQA; right, left and arbitrary padding. The last two shapes recur
# in the cudnn test, which then reuses the jitted reference.
BLOCKWISE_CASES = [
    (2, 200, 4, 2, 16, 64, jnp.float32, "any"),
    (3, 40, 2, 2, 16, 64, jnp.bfloat16, "right"),
    (3, 96, 8, 2, 16, 32, jnp.float32, "left"),
    (3, 72, 4, 1, 16, 32, jnp.bfloat16, "any"),
]


@pytest.mark.parametrize("b,t,h,hkv,d,block,dtype,padding", BLOCKWISE_CASES)
@pytest.mark.slow
def test_blockwise_values_and_grads_equal_reference(b, t, h, hkv, d, block, dtype, padding):
    _check(functools.partial(blockwise_attention, block_size=block), b, t, h, hkv, d, dtype,
           padding)


def test_blockwise_rows_without_a_valid_key_are_zero():
    q, k, v, _ = _inputs(2, 50, 2, 1, 16, jnp.float32)
    valid = jnp.asarray(np.arange(50)[None, :] >= np.array([[7], [50]]))  # row 1: no token
    out = blockwise_attention(q, k, v, valid, block_size=16)
    assert np.all(np.asarray(out[0, :7]) == 0) and np.all(np.asarray(out[1]) == 0)
    assert np.all(np.isfinite(np.asarray(out)))


# splash in Pallas interpret mode is slow (~3 s a case): few, small cases
@pytest.mark.parametrize("b,t,h,hkv,d,dtype,padding", [
    (2, 200, 4, 2, 64, jnp.float32, "any"),   # T padded to 256, GQA 2
    (2, 128, 4, 1, 64, jnp.bfloat16, "right"),  # MQA
])
@pytest.mark.slow
def test_splash_interpret_values_and_grads_equal_reference(b, t, h, hkv, d, dtype, padding):
    _check(functools.partial(splash_attention, block_size=128, interpret=True), b, t, h, hkv,
           d, dtype, padding)


@pytest.mark.parametrize("t,h,hkv,dtype", [(96, 8, 2, jnp.float32), (72, 4, 1, jnp.bfloat16)])
@pytest.mark.slow
def test_cudnn_arguments_through_xla_equal_reference(t, h, hkv, dtype):
    """The cuDNN path's call (lengths from valid, is_causal) run by XLA's implementation:
    the kernel itself needs an NVIDIA GPU."""
    got, valid = _check(functools.partial(cudnn_attention, implementation="xla"), 3, t, h,
                        hkv, 16, dtype, "right")
    assert not np.any(np.asarray(valid[-1]))  # an all-padding row stays finite
    assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in got)
    q, k, v, _ = _inputs(2, 16, h, hkv, 16, dtype)
    with pytest.raises(ValueError, match="right padding"):
        cudnn_attention(q, k, v, _valid(2, 16, "left"), implementation="xla")


def test_resolve_attention_rules():
    cpu_short, cpu_long = CPU_BLOCKWISE_MIN_LEN - 1, CPU_BLOCKWISE_MIN_LEN
    assert resolve_attention("auto", 512, "cpu") == "reference"  # the tiny runs unchanged
    assert resolve_attention("auto", cpu_short, "cpu") == "reference"
    assert resolve_attention("auto", cpu_long, "cpu") == "blockwise"
    assert resolve_attention("auto", 64, "tpu") == "splash"
    assert resolve_attention("auto", 8192, "gpu", dtype=jnp.bfloat16, head_dim=128) == "cudnn"
    assert resolve_attention("auto", 8192, "gpu", dtype=jnp.float32) == "blockwise"
    assert resolve_attention("auto", 8192, "gpu", dtype=jnp.bfloat16, head_dim=100) == "blockwise"
    assert resolve_attention("splash", 8, "cpu") == "splash"
    with pytest.raises(ValueError, match="blockwise"):
        resolve_attention("flash", 8)
    q, k, v, _ = _inputs(1, 8, 2, 1, 8, jnp.float32)
    out = causal_attention(q, k, v, jnp.ones((1, 8), bool))  # auto on CPU, short: reference
    np.testing.assert_array_equal(out, reference_attention(q, k, v, jnp.ones((1, 8), bool)))
    assert set(ATTENTION_IMPLS) == {"auto", "reference", "blockwise", "cudnn", "splash"}


def _temp_bytes(attend, t):
    """Compiled (not run) temporaries of fwd+bwd at length t: B=1, H=4, Hkv=2, Dh=64, f32."""
    args = [jax.ShapeDtypeStruct(s, dt) for s, dt in [
        ((1, t, 4, 64), jnp.float32), ((1, t, 2, 64), jnp.float32),
        ((1, t, 2, 64), jnp.float32), ((1, t), jnp.bool_), ((1, t, 4, 64), jnp.float32)]]
    compiled = jax.jit(functools.partial(_fwd_bwd, attend)).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_blockwise_memory_grows_linearly_reference_quadratically():
    """Doubling T (2048 -> 4096): blockwise temporaries at most 2.5x (linear is 2x), the
    reference's at least 3.5x (its [T, T] probabilities: 4x)."""
    blockwise = [_temp_bytes(blockwise_attention, t) for t in (2048, 4096)]
    reference = [_temp_bytes(reference_attention, t) for t in (2048, 4096)]
    print(f"fwd+bwd temp bytes at T=2048, 4096: blockwise {blockwise}, reference {reference}")
    assert blockwise[1] / blockwise[0] <= 2.5
    assert reference[1] / reference[0] >= 3.5
    assert blockwise[1] < reference[1] / 4


@pytest.mark.parametrize("attend", [
    functools.partial(blockwise_attention, block_size=32),
    functools.partial(splash_attention, block_size=128, interpret=True),
], ids=["blockwise", "splash"])
@pytest.mark.slow
def test_sharded_equals_single_device(attend):
    """On 8 devices, batch over "data" (4) and heads over "tensor" (2), the per-shard run
    equals the single-device one."""
    q, k, v, d_out = _inputs(4, 96, 4, 2, 64, jnp.float32)
    valid = _valid(4, 96, "any")
    fn = jax.jit(functools.partial(_fwd_bwd, attend))
    want = fn(q, k, v, valid, d_out)
    mesh = jax.make_mesh((4, 2), ("data", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = NamedSharding(mesh, P("data", None, "tensor"))
    args = [jax.device_put(a, x) for a in (q, k, v)]
    args += [jax.device_put(valid, NamedSharding(mesh, P("data"))), jax.device_put(d_out, x)]
    with jax.set_mesh(mesh):
        got = fn(*args)
        assert "shard_map" in str(jax.make_jaxpr(fn)(*args))  # per-device, not GSPMD
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_model_blockwise_equals_reference_and_scans():
    """Final hidden states on valid rows and parameter gradients of the token
    log-likelihood (right- and left-padded rows), blockwise (scanned layers, 2 blocks of
    256) against the reference (unrolled). Only tokens whose previous slot is real count:
    the first token of a left-padded row is predicted from a padded slot, whose output is
    implementation-defined."""
    # dense layers: the MoE dispatch has its own tests and doubles the compile time
    cfg = Qwen3MoeConfig.tiny(initializer_range=0.1, num_hidden_layers=2, mlp_only_layers=(0, 1))
    t = 300
    ids = jax.random.randint(jax.random.key(0), (2, t), 3, cfg.vocab_size, jnp.int32)
    mask = jnp.asarray(np.stack([np.arange(t) < 250, np.arange(t) >= 40]).astype(np.int32))

    def loss_and_grads(attention, scan_layers):
        model = Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0), attention=attention,
                                    scan_layers=scan_layers)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        @jax.jit
        def run(params):
            def loss(params):
                lp, out = token_logprobs(nnx.merge(graphdef, params, rest), ids, mask)
                return jnp.sum(lp[:, 1:] * mask[:, :-1]), out.hidden
            return jax.value_and_grad(loss, has_aux=True)(params)

        return run(params)

    (loss_b, hidden_b), grads_b = loss_and_grads("blockwise", True)
    (loss_r, hidden_r), grads_r = loss_and_grads("reference", False)
    rows = np.asarray(mask, bool)
    np.testing.assert_allclose(np.asarray(hidden_b)[rows], np.asarray(hidden_r)[rows],
                               atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(loss_b, loss_r, rtol=1e-5)
    for gb, gr in zip(jax.tree.leaves(grads_b), jax.tree.leaves(grads_r), strict=True):
        np.testing.assert_allclose(gb, gr, atol=2e-5 * float(jnp.max(jnp.abs(gr))) + 1e-7)
    with pytest.raises(ValueError, match="attention must be one of"):
        Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0), attention="flash")
