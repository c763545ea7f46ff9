"""Per-token log-probs of a batch under the current model, with routing-replay metrics."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from satjax.train.batch import Batch


def gather_token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float) -> jax.Array:
    """[B,T,V] logits, [B,T] tokens -> [B,T] log p(tokens[t] | < t); position 0 gets 0."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / temperature, axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(picked, ((0, 0), (1, 0)))


def expert_set_mismatch(a: jax.Array, b: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """Fraction of valid entries whose top-k expert SETS differ (order ignored).

    a, b: int [B,T,L,k]; mask: bool [B,T]. Returns
      per_layer: fraction of (token, layer) pairs that differ;
      any_layer: fraction of tokens that differ in at least one layer.
    """
    differs = jnp.any(jnp.sort(a, axis=-1) != jnp.sort(b, axis=-1), axis=-1)  # [B,T,L]
    m = mask.astype(jnp.float32)
    n_tok = jnp.maximum(jnp.sum(m), 1.0)
    per_layer = jnp.sum(jnp.mean(differs.astype(jnp.float32), axis=-1) * m) / n_tok
    any_layer = jnp.sum(jnp.any(differs, axis=-1).astype(jnp.float32) * m) / n_tok
    return {"per_layer": per_layer, "any_layer": any_layer}


def token_logprobs(
    model: Any, batch: Batch, *, replay: bool, temperature: float = 1.0
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Log-probs of ``batch.tokens`` under ``model``.

    Args:
      model: a ``Qwen3MoeForCausalLM``-like callable (see INTERFACES.md).
      batch: the batch; ``batch.routes`` is replayed when ``replay`` and it is present.
      replay: R3 on/off.
      temperature: the sampling temperature (behavior log-probs are of the
        temperature-scaled distribution).

    Returns:
      logprobs [B,T] float32: ``log p(tokens[t] | tokens[<t])``, 0 at t=0 and on padding.
      aux: ``selected_experts`` [B,T,L,k] (experts actually used: the replayed routes
        under replay, else the router's choice), ``router_topk`` [B,T,L,k] (the trainer
        router's own top-k, the model's ``selected_experts`` output), and when routes are present
        ``router_mismatch`` / ``router_mismatch_any_layer`` (the trainer router's own
        top-k vs the engine routes: what replay corrects) and
        ``router_mismatch_applied`` (experts used vs engine routes: 0 under replay).
    """
    routing = batch.routes if (replay and batch.routes is not None) else None
    out = model(batch.tokens, attention_mask=batch.attention_mask, routing=routing)
    lp = gather_token_logprobs(out.logits, batch.tokens, temperature)
    lp = lp * batch.attention_mask.astype(lp.dtype)
    own = out.selected_experts  # the trainer router's own top-k (INTERFACES.md)
    aux: dict[str, jax.Array] = {
        "selected_experts": own if routing is None else routing.astype(own.dtype),
        "router_topk": own,
    }
    aux.update(router_metrics(aux["router_topk"], aux["selected_experts"], batch))
    return lp, aux


def router_metrics(
    router_topk: jax.Array, selected_experts: jax.Array, batch: Batch
) -> dict[str, jax.Array]:
    """Engine-vs-trainer routing mismatch metrics (empty dict when the batch has no routes)."""
    if batch.routes is None:
        return {}
    mask = batch.route_mask()
    own = expert_set_mismatch(router_topk, batch.routes, mask)
    return {
        "router_mismatch": own["per_layer"],
        "router_mismatch_any_layer": own["any_layer"],
        "router_mismatch_applied": expert_set_mismatch(selected_experts, batch.routes, mask)[
            "per_layer"
        ],
    }
