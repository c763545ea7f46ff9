"""Fixtures of the trainer tests: the real tiny model, train states, synthetic batches.

Compiled steps are cached per (mesh shape, options) for the whole session and reused with
fresh states by every test file, to keep the number of XLA compilations (the cost of these
tests) small.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from satjax import parallel
from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM
from satjax.train.batch import Batch
from satjax.train.state import TrainState
from satjax.train.step import StepOptions, make_train_step

TINY = Qwen3MoeConfig.tiny(num_hidden_layers=2, vocab_size=48)


def _lr_schedule(count):
    return 0.1 / (1.0 + count)


def _tiny_model(seed: int = 0) -> Qwen3MoeForCausalLM:
    return Qwen3MoeForCausalLM(TINY, rngs=nnx.Rngs(seed), dtype=jnp.float32,
                               param_dtype=jnp.float32)


def _make_state(seed: int = 0) -> TrainState:
    # SGD with momentum: the update is linear in the gradient, so parameter comparisons
    # across meshes test gradient equality (Adam's g/sqrt(v) amplifies float noise in
    # near-zero gradients far beyond fp32 rounding).
    return TrainState(_tiny_model(seed), optax.sgd(_lr_schedule, momentum=0.9))


def _synthetic_batch(seed: int, *, B: int = 8, T: int = 16, group_size: int = 4,
                     routed: bool = False) -> Batch:
    """Deterministic right-padded batch: prompt 4 tokens, responses of varying length;
    ``routed`` adds random engine routes (k distinct experts per token and layer)."""
    cfg = TINY
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
    routed_experts = None
    if routed:
        routed_experts = (
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
        routed_experts=routed_experts,
        group_size=group_size,
    )


def _host(tree):
    """Tree of numpy copies (for comparisons that survive donation)."""
    return jax.tree.map(lambda x: np.asarray(x), tree)


@functools.cache
def _mesh_of(shape):
    if shape == (1, 1, 1, 1):
        return parallel.make_mesh(parallel.MeshConfig(), devices=jax.devices()[:1])
    return parallel.make_mesh(parallel.MeshConfig(*shape))


@functools.cache
def _cached_step(shape=(1, 1, 1, 1), **kw):
    graphdef, state = nnx.split(_make_state(0))
    return make_train_step(graphdef, state, mesh=_mesh_of(shape),
                           options=StepOptions(lr_schedule=_lr_schedule, **kw))


def _run_steps(batches, shape=(1, 1, 1, 1), **kw):
    """Runs a fresh state (seed 0) through ``batches``; returns (host state, host metrics)."""
    step = _cached_step(shape, **kw)
    state = step.place_state(nnx.split(_make_state(0))[1])
    metrics = []
    for b in batches:
        state, m = step(state, step.place_batch(b))
        metrics.append(_host(m))
    return _host(state), metrics


@pytest.fixture(scope="session")
def tiny_model():
    """``tiny_model(seed=0)`` -> a fresh 2-MoE-layer ``Qwen3MoeForCausalLM``."""
    return _tiny_model


@pytest.fixture(scope="session")
def make_state():
    """``make_state(seed=0)`` -> a fresh ``TrainState`` (SGD + momentum, decaying lr)."""
    return _make_state


@pytest.fixture(scope="session")
def synthetic_batch():
    """``synthetic_batch(seed, *, B=8, T=16, group_size=4, routed=False)`` -> ``Batch``."""
    return _synthetic_batch


@pytest.fixture(scope="session")
def host():
    return _host


@pytest.fixture(scope="session")
def mesh_of():
    """``mesh_of((data, fsdp, expert, tensor))`` -> a cached mesh ((1,1,1,1): one device)."""
    return _mesh_of


@pytest.fixture(scope="session")
def cached_step():
    """``cached_step(shape, **StepOptions fields)`` -> a session-cached train step."""
    return _cached_step


@pytest.fixture(scope="session")
def run_steps():
    """``run_steps(batches, shape, **options)`` -> (host state, host metrics per step)."""
    return _run_steps
