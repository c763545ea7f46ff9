"""Gradient accumulation: a batch's gradient in micro-batches, exact for batch-level losses.

The rollout batch's rows are split into ``num`` strided micro-batches (:func:`split_micro`:
micro-batch m holds rows m, m + num, ...). Strided, not contiguous, so that a batch sharded
in contiguous blocks over the data-parallel devices stays sharded without moving data, and
so that the objective's per-micro-batch statistics (``satjax.objectives.make(...,
microbatches=num)``: SAT's gate with ``scope="microbatch"``, taken over rows m, m + num, ...
by ``satjax.losses.sat``) see exactly the rows a micro-step holds.

:func:`value_and_grad` is exact for every loss, including those with batch-level
statistics (SAT's quantile gate, group baselines): the loss depends on the parameters only
through the per-row outputs of the forward (the token log-probs), so

  1. a forward pass over the micro-batches gives the full batch's outputs ``y``;
  2. the loss and its gradient ``g = dL/dy`` are taken on the whole batch at once;
  3. a second pass pulls ``g`` back through each micro-batch (``jax.vjp``) and sums.

This costs one extra forward pass per micro-batch over a single ``jax.value_and_grad``,
which is what the step takes when ``num == 1``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp

Out = TypeVar("Out")
Aux = TypeVar("Aux")


def split_micro(x: jax.Array, num: int) -> jax.Array:
    """[B, ...] -> [num, B/num, ...]; micro-batch m holds rows m, m + num, ... (strided, so
    a batch sharded in contiguous blocks over devices stays sharded without moving data)."""
    return jnp.swapaxes(x.reshape(x.shape[0] // num, num, *x.shape[1:]), 0, 1)


def merge_micro(x: jax.Array) -> jax.Array:
    """Inverse of :func:`split_micro`: [num, B/num, ...] -> [B, ...] in the batch's order."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def micro_map(fn: Callable[[Any], Out], batch: Any, num: int) -> Out:
    """``fn(batch)`` computed ``num`` strided micro-batches at a time (``jax.lax.map``, so
    one micro-batch's activations are live at once); ``fn``'s outputs are per row
    ([rows, ...] leaves) and come back merged in the batch's row order."""
    micro = jax.tree.map(lambda x: split_micro(x, num), batch)
    return jax.tree.map(merge_micro, jax.lax.map(fn, micro))


def value_and_grad(
    forward: Callable[[Any, Any], tuple[Out, Aux]],
    loss: Callable[[Out], tuple[jax.Array, Any]],
    params: Any,
    batch: Any,
    num: int,
) -> tuple[tuple[jax.Array, Any], tuple[Out, Aux], Any]:
    """The value and ``params`` gradient of ``loss(forward(params, batch)[0])``, the
    forward run in ``num`` strided micro-batches (module docstring).

    Args:
      forward: ``(params, micro_batch) -> (outputs, aux)``: ``outputs`` the pytree the loss
        is taken of, ``aux`` one that is not differentiated; both of per-row leaves
        ([rows, ...]).
      loss: ``outputs -> (value, loss_aux)`` of the whole batch's ``outputs``.
      params: what the gradient is taken with respect to.
      batch: a pytree of [B, ...] leaves, B divisible by ``num``.
      num: the number of micro-batches.

    Returns:
      ``((value, loss_aux), (outputs, aux), grads)``: ``outputs`` and ``aux`` the whole
      batch's, in its row order.
    """
    micro = jax.tree.map(lambda x: split_micro(x, num), batch)
    out_m, aux_m = jax.lax.map(lambda mb: forward(params, mb), micro)
    out, aux = jax.tree.map(merge_micro, out_m), jax.tree.map(merge_micro, aux_m)
    (value, loss_aux), g_out = jax.value_and_grad(loss, has_aux=True)(out)
    g_micro = jax.tree.map(lambda g: split_micro(g, num), g_out)

    def pull_back(acc: Any, xs: tuple[Any, Any]) -> tuple[Any, None]:
        mb, g = xs
        _, vjp = jax.vjp(lambda p: forward(p, mb)[0], params)
        (gp,) = vjp(g)
        return jax.tree.map(jnp.add, acc, gp), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, _ = jax.lax.scan(pull_back, zeros, (micro, g_micro))
    return (value, loss_aux), (out, aux), grads
