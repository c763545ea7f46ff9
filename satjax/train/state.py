"""Train state: the model, its optimizer and the counters a resume must restore."""

from __future__ import annotations

import jax.numpy as jnp
import optax
from flax import nnx

from satjax.config import TrainConfig


class TrainState(nnx.Module):
    """NNX model + ``nnx.Optimizer`` (over ``nnx.Param``) + step and policy version.

    ``step`` counts optimizer updates; ``policy_version`` is the version stamped on the
    weights sent to rollout workers (incremented by the step, may be reset by the caller).

    Use functionally under jit: ``graphdef, state = nnx.split(train_state)``.
    """

    def __init__(
        self, model: nnx.Module, tx: optax.GradientTransformation, *, policy_version: int = 0
    ) -> None:
        self.model = model
        self.optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        self.step = nnx.Variable(jnp.asarray(0, jnp.int32))
        self.policy_version = nnx.Variable(jnp.asarray(policy_version, jnp.int32))


def lr_schedule(t: TrainConfig) -> optax.Schedule:
    """``train.learning_rate``, reached linearly over ``train.warmup_steps``."""
    if t.warmup_steps > 0:
        return optax.linear_schedule(0.0, t.learning_rate, max(1, t.warmup_steps))
    return optax.constant_schedule(t.learning_rate)


def make_optimizer(
    learning_rate: float | optax.Schedule,
    *,
    max_grad_norm: float | None,
    b1: float = TrainConfig.adam_b1,
    b2: float = TrainConfig.adam_b2,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> optax.GradientTransformation:
    """Global-norm gradient clipping (skipped when ``max_grad_norm`` is None), then AdamW.

    ``b1``, ``b2``: the decays of Adam's first and second moments (``train.adam_b1``,
    ``train.adam_b2``), each in [0, 1).
    """
    if max_grad_norm is not None and max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm: must be > 0 or None, got {max_grad_norm!r}")
    for name, b in (("b1", b1), ("b2", b2)):
        if not 0 <= b < 1:
            raise ValueError(f"{name}: must be >= 0 and < 1, got {b!r}")
    adamw = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    if max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)
