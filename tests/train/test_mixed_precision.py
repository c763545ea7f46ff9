"""Mixed precision: bf16 compute over float32 master weights, on one device and on sharded
meshes, against float32 compute; the weight-sync canary stays float32."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from satjax.model import Qwen3MoeForCausalLM, canary_logprobs
from satjax.train.state import TrainState
from satjax.train.step import StepOptions, make_train_step


def _lr(count):
    return 0.1 / (1.0 + count)


@pytest.fixture(scope="module")
def run(tiny_model, synthetic_batch, mesh_of, host):
    def run(dtype, shape, steps=2):
        """Initial and final float32 parameters, the optimizer state and the per-step
        metrics of SGD steps with ``dtype`` compute on mesh ``shape``."""
        model = Qwen3MoeForCausalLM(tiny_model().config, rngs=nnx.Rngs(0), dtype=dtype,
                                    param_dtype=jnp.float32)
        graphdef, state = nnx.split(TrainState(model, optax.sgd(_lr, momentum=0.9)))
        step = make_train_step(graphdef, state, mesh=mesh_of(shape),
                               options=StepOptions(lr_schedule=_lr))
        state = step.place_state(state)
        p0 = host(nnx.state(nnx.merge(graphdef, state).model, nnx.Param))
        metrics = []
        for i in range(steps):
            state, m = step(state, step.place_batch(synthetic_batch(i, routed=True)))
            metrics.append(host(m))
        final = nnx.merge(graphdef, state)
        return p0, host(nnx.state(final.model, nnx.Param)), host(nnx.state(final.optimizer)), \
            metrics

    return run


@pytest.fixture(scope="module")
def float32_run(run):
    return run(jnp.float32, (1, 1, 1, 1))


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 1, 4, 1), (1, 2, 2, 2)])
@pytest.mark.slow
def test_bf16_compute_trains_like_float32(shape, run, float32_run):
    # Tolerances, from bf16's 8-bit mantissa over 2 SGD steps of the tiny model (measured
    # here: loss 0.5%, grad norm 0.2%, updates 3% apart): loss within 2%, gradient
    # norm within 1%, every parameter's update within 8% of the largest update.
    p0, ref, _, ref_metrics = float32_run
    _, params, opt_state, metrics = run(jnp.bfloat16, shape)
    for m, r in zip(metrics, ref_metrics, strict=True):
        # and an absolute 5e-4: the loss is a mean of terms of size |advantage| ~ 1 that
        # nearly cancel (~0.009 here), so bf16's rounding of the terms (~2^-9 each) is
        # not relative to the mean (2.5e-4 = 2.8% apart at mesh (2, 1, 4, 1))
        np.testing.assert_allclose(m["loss"], r["loss"], rtol=2e-2, atol=5e-4)
        np.testing.assert_allclose(m["grad_norm"], r["grad_norm"], rtol=1e-2)
        assert m["nonfinite_steps"] == 0
    update = max(float(np.abs(a - b).max()) for a, b in
                 zip(jax.tree.leaves(ref), jax.tree.leaves(p0), strict=True))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref), strict=True):
        assert float(np.abs(a - b).max()) <= 0.08 * update
    # the master weights and the optimizer state stay float32
    for leaf in jax.tree.leaves(params) + [x for x in jax.tree.leaves(opt_state)
                                           if np.issubdtype(x.dtype, np.floating)]:
        assert leaf.dtype == np.float32


@pytest.mark.slow
def test_with_dtype_shares_the_parameters(tiny_model):
    cfg = tiny_model().config
    bf16 = Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    f32 = Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)
    ref = bf16.with_dtype(jnp.float32)
    assert ref.dtype == jnp.float32 and bf16.dtype == jnp.bfloat16
    assert ref.embed_tokens is bf16.embed_tokens  # the same Param, not a copy
    tokens = [1, 5, 7, 9, 11, 2]
    np.testing.assert_array_equal(canary_logprobs(ref, tokens), canary_logprobs(f32, tokens))
    assert np.abs(np.subtract(canary_logprobs(bf16, tokens),
                              canary_logprobs(f32, tokens))).max() > 1e-4


@pytest.mark.slow
def test_published_canary_is_float32_under_bf16_compute(tiny_model, mesh_of, tmp_path):
    # the engines compute their canary in float32 (BuiltinEngine's atol 1e-4): a trainer
    # computing in bf16 must publish the float32 value of the same weights
    from satjax.model import from_pretrained
    from satjax.rollout.builtin_engine import BuiltinEngine
    from satjax.train.publish import ShardedPublisher
    from satjax.weight_sync import WeightPublisher, WeightSubscriber, check_canary

    model = Qwen3MoeForCausalLM(tiny_model().config, rngs=nnx.Rngs(2), dtype=jnp.bfloat16)
    tokens = [1, 5, 9, 17, 30, 2]
    pub = ShardedPublisher(WeightPublisher(tmp_path), mesh_of((2, 2, 2, 1)), tokens)
    pub.publish(model, 0)
    pub.wait()
    sub = WeightSubscriber(tmp_path)
    engine = BuiltinEngine()
    engine.load(sub.checkpoint_dir(0), 0)
    err = check_canary(sub.manifest(0), engine.canary_logprobs(tokens), atol=engine.canary_atol)
    assert err < 1e-5
    loaded = from_pretrained(sub.checkpoint_dir(0))
    np.testing.assert_allclose(sub.manifest(0)["canary"]["logprobs"],
                               canary_logprobs(loaded, tokens), atol=1e-6)
