"""Train state: the model, its optimizer and the counters a resume must restore."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx


class TrainState(nnx.Module):
    """NNX model + ``nnx.Optimizer`` (over ``nnx.Param``) + step, policy version, RNG key.

    ``step`` counts optimizer updates; ``policy_version`` is the version stamped on the
    weights sent to rollout workers (incremented by the step, may be reset by the caller);
    ``rng`` is a raw ``uint32[2]`` PRNG key (raw so checkpoints stay plain arrays), split
    once per step for any stochastic part of the step.

    Use functionally under jit: ``graphdef, state = nnx.split(train_state)``.
    """

    def __init__(
        self,
        model: nnx.Module,
        tx: optax.GradientTransformation,
        *,
        seed: int = 0,
        policy_version: int = 0,
    ) -> None:
        self.model = model
        self.optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        self.step = nnx.Variable(jnp.asarray(0, jnp.int32))
        self.policy_version = nnx.Variable(jnp.asarray(policy_version, jnp.int32))
        self.rng = nnx.Variable(jax.random.key_data(jax.random.key(seed)))

    def next_rng(self) -> jax.Array:
        """Splits the stored key; returns a fresh raw key for this step."""
        key, sub = jax.random.split(jax.random.wrap_key_data(self.rng[...]))
        self.rng[...] = jax.random.key_data(key)
        return jax.random.key_data(sub)


def make_optimizer(
    learning_rate: float | optax.Schedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> optax.GradientTransformation:
    """AdamW with an optional schedule (clipping is applied by the train step)."""
    return optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)


def param_count(state: Any) -> int:
    """Number of scalars in the ``nnx.Param`` leaves of a model or state."""
    params = nnx.state(state, nnx.Param) if isinstance(state, nnx.Module) else state
    return sum(int(x.size) for x in jax.tree.leaves(params))
