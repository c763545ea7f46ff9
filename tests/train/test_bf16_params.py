"""``model.param_dtype: bfloat16`` (bf16 master weights): the built-in engine accepts the
published weights (both canaries in float32), and bf16 metrics reach metrics.jsonl."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from satjax.model import Qwen3MoeForCausalLM
from satjax.train.metrics import MetricsLogger, to_scalars


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.slow
def test_bf16_master_weights_pass_the_builtin_engines_canary(tiny_model, mesh_of, tmp_path,
                                                             dtype):
    from satjax.rollout.builtin_engine import BuiltinEngine
    from satjax.train.publish import ShardedPublisher
    from satjax.weight_sync import WeightPublisher, WeightSubscriber, check_canary

    model = Qwen3MoeForCausalLM(tiny_model().config, rngs=nnx.Rngs(3),
                                dtype=jnp.dtype(dtype), param_dtype=jnp.bfloat16)
    tokens = [1, 5, 9, 17, 30, 2]
    # as the Trainer publishes: in model.dtype
    pub = ShardedPublisher(WeightPublisher(tmp_path), mesh_of((2, 2, 2, 1)), tokens,
                           dtype=dtype)
    pub.publish(model, 0)
    pub.wait()
    sub = WeightSubscriber(tmp_path)
    engine = BuiltinEngine()
    engine.load(sub.checkpoint_dir(0), 0)
    # the engine's float32 forward of the published bytes vs the trainer's float32 canary
    err = check_canary(sub.manifest(0), engine.canary_logprobs(tokens), atol=engine.canary_atol)
    assert err < 1e-5


def test_bf16_metrics_are_logged_as_floats(tmp_path):
    metrics = {"grad_norm": jnp.asarray(1.5, jnp.bfloat16), "loss": np.float16(0.25),
               "tokens": jnp.asarray(7, jnp.int32), "hist": np.zeros(3)}
    assert to_scalars(metrics) == {"grad_norm": 1.5, "loss": 0.25, "tokens": 7.0}
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        assert log.log(1, metrics)["grad_norm"] == 1.5
    assert '"grad_norm": 1.5' in (tmp_path / "metrics.jsonl").read_text()
