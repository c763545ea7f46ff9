"""Shared helpers for the trainer tests: a tiny MoE model, train states, synthetic batches.

The real ``satjax.model.Qwen3MoeForCausalLM`` (tiny config) is used when it is importable;
otherwise the test stand-in in ``tiny_moe_standin.py`` (same call signature and logical
axis names) keeps the trainer tests meaningful on a branch without the model package.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from satjax import parallel
from satjax.train.batch import Batch
from satjax.train.state import TrainState
from satjax.train.step import make_train_step

try:  # the real model (INTERFACES.md)
    from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM

    REAL_MODEL = True
except ImportError:  # branch without satjax.model
    REAL_MODEL = False


def tiny_config():
    if REAL_MODEL:
        return Qwen3MoeConfig.tiny(num_hidden_layers=2, vocab_size=48)
    from tiny_moe_standin import TinyConfig

    return TinyConfig()


def tiny_model(seed: int = 0) -> nnx.Module:
    cfg = tiny_config()
    if REAL_MODEL:
        return Qwen3MoeForCausalLM(
            cfg, rngs=nnx.Rngs(seed), dtype=jnp.float32, param_dtype=jnp.float32
        )
    from tiny_moe_standin import TinyMoeLM

    return TinyMoeLM(cfg, rngs=nnx.Rngs(seed))


def num_moe_layers() -> int:
    return len(tiny_config().moe_layer_indices)


def lr_schedule(count):
    return 0.1 / (1.0 + count)


def make_state(seed: int = 0) -> TrainState:
    # SGD with momentum: the update is linear in the gradient, so parameter comparisons
    # across meshes test gradient equality (Adam's g/sqrt(v) amplifies float noise in
    # near-zero gradients far beyond fp32 rounding).
    return TrainState(tiny_model(seed), optax.sgd(lr_schedule, momentum=0.9), seed=seed)


def single_device_mesh():
    return parallel.make_mesh(parallel.MeshConfig(), devices=jax.devices()[:1])


def synthetic_batch(
    seed: int, *, B: int = 8, T: int = 16, group_size: int = 4, routes: bool = False
) -> Batch:
    """Deterministic right-padded batch: prompt 4 tokens, responses of varying length."""
    cfg = tiny_config()
    r = np.random.default_rng(seed)
    tokens = r.integers(3, cfg.vocab_size, (B, T)).astype(np.int32)
    lengths = r.integers(T // 2, T + 1, B)
    pos = np.arange(T)[None, :]
    attn = (pos < lengths[:, None]).astype(np.int32)
    tokens = np.where(attn > 0, tokens, 0).astype(np.int32)
    loss_mask = ((pos >= 4) & (attn > 0)).astype(np.float32)
    blp = (np.log(1.0 / cfg.vocab_size) + 0.3 * r.standard_normal((B, T))).astype(np.float32)
    blp = blp * loss_mask
    k, L = cfg.num_experts_per_tok, len(cfg.moe_layer_indices)
    rt = None
    if routes:
        rt = (
            np.stack([r.permutation(cfg.num_experts)[:k] for _ in range(B * T * L)])
            .reshape(B, T, L, k)
            .astype(np.int32)
        )
    return Batch(
        tokens=tokens,
        attention_mask=attn,
        loss_mask=loss_mask,
        behavior_logprobs=blp,
        rewards=r.standard_normal(B).astype(np.float32),
        group_ids=np.repeat(np.arange(B // group_size), group_size).astype(np.int32),
        policy_versions=np.zeros(B, np.int32),
        routes=rt,
        group_size=group_size,
    )


def host(tree):
    """Tree of numpy copies (for comparisons that survive donation)."""
    return jax.tree.map(lambda x: np.asarray(x), tree)


# Compiled steps are cached per (mesh shape, options) and reused with fresh states by all
# test files, to keep the number of XLA compilations (the cost of these tests) small.


@functools.cache
def mesh_of(shape):
    if shape == (1, 1, 1, 1):
        return single_device_mesh()
    return parallel.make_mesh(parallel.MeshConfig(*shape))


@functools.cache
def cached_step(shape=(1, 1, 1, 1), **kw):
    graphdef, state = nnx.split(make_state(0))
    return make_train_step(graphdef, state, mesh=mesh_of(shape), lr_schedule=lr_schedule, **kw)


def run_steps(batches, shape=(1, 1, 1, 1), **kw):
    """Runs a fresh state (seed 0) through ``batches``; returns (host state, host metrics)."""
    step = cached_step(shape, **kw)
    state = step.place_state(nnx.split(make_state(0))[1])
    metrics = []
    for b in batches:
        state, m = step(state, step.place_batch(b))
        metrics.append(host(m))
    return host(state), metrics
