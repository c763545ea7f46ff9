"""Teacher-forced token log-probs: the one function the trainer, SFT and the canary share.

``token_logprobs`` gathers ``log p(tokens[t] | tokens[<t])`` from one forward pass, at a
temperature (the behaviour policy's log-probs are of the temperature-scaled distribution)
and optionally replaying recorded experts (R3). ``canary_logprobs`` is the same quantity
on one unpadded sequence at temperature 1 in float32: the weight-sync check compares the
trainer's value with every engine's.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from satjax.model.moe import expert_gates
from satjax.model.transformer import BackboneOutput, Qwen3MoeForCausalLM

Array = jax.Array


# Sequence positions whose logits one step of the chunked head holds at a time: a
# [B, 512, V] float32 block (311 MB per sequence at Qwen3's V = 151,936) instead of
# [B, T, V] (5 GB per 8k-token sequence).
LOGITS_CHUNK = 512


def token_logprobs(model: Qwen3MoeForCausalLM, tokens: Array, attention_mask: Array | None = None,
                   *, temperature: float = 1.0, routed_experts: Array | None = None,
                   routed_gates: Array | None = None, remat: str = "none",
                   chunk: int = LOGITS_CHUNK) -> tuple[Array, BackboneOutput]:
    """Log-probs [B, T] f32 of ``tokens`` [B, T] under ``model`` and the backbone's output.

    Position ``t`` holds ``log p(tokens[t] | tokens[<t])``; position 0 and padding (where
    ``attention_mask`` is 0) hold 0. ``routed_experts`` i32 [B, T, L, k] replays experts
    and ``routed_gates`` [B, T, L, k] their gate weights (``satjax.model.moe.route``);
    ``remat`` rematerialises each decoder layer (``Qwen3MoeForCausalLM.backbone``). The LM
    head and the log-sum-exp run ``chunk`` positions at a time (:func:`chunked_logprobs`),
    so the full-vocabulary logits of the whole batch never exist at once.
    """
    lp, _, out = _token_stats(model, tokens, attention_mask, temperature=temperature,
                              routed_experts=routed_experts, routed_gates=routed_gates,
                              remat=remat, chunk=chunk, entropy=False)
    return lp, out


def token_logprobs_entropy(model: Qwen3MoeForCausalLM, tokens: Array,
                           attention_mask: Array | None = None, *, temperature: float = 1.0,
                           routed_experts: Array | None = None,
                           routed_gates: Array | None = None, remat: str = "none",
                           chunk: int = LOGITS_CHUNK) -> tuple[Array, Array, BackboneOutput]:
    """:func:`token_logprobs` plus the entropy [B, T] f32 of each position's predictive
    distribution at ``temperature`` (:func:`chunked_logprobs_entropy`, same alignment and
    zeros as the log-probs)."""
    lp, ent, out = _token_stats(model, tokens, attention_mask, temperature=temperature,
                                routed_experts=routed_experts, routed_gates=routed_gates,
                                remat=remat, chunk=chunk, entropy=True)
    assert ent is not None  # entropy=True
    return lp, ent, out


def _token_stats(model: Qwen3MoeForCausalLM, tokens: Array, attention_mask: Array | None, *,
                 temperature: float, routed_experts: Array | None,
                 routed_gates: Array | None, remat: str, chunk: int,
                 entropy: bool) -> tuple[Array, Array | None, BackboneOutput]:
    tokens = jnp.asarray(tokens)
    out = model.backbone(tokens, attention_mask=attention_mask, routed_experts=routed_experts,
                         routed_gates=routed_gates, remat=remat)
    picked, ent = _chunked(out.hidden[:, :-1], model.head_weight(), tokens[:, 1:],
                           temperature=temperature, chunk=chunk, entropy=entropy)

    def aligned(x: Array) -> Array:
        x = jnp.pad(x, ((0, 0), (1, 0)))
        if attention_mask is not None:
            x = x * jnp.asarray(attention_mask).astype(x.dtype)
        return x

    return aligned(picked), None if ent is None else aligned(ent), out


def chunked_logprobs(hidden: Array, head: Array, targets: Array, *, temperature: float = 1.0,
                     chunk: int = LOGITS_CHUNK) -> Array:
    """``log softmax(hidden @ head / temperature)`` at ``targets``, ``chunk`` positions at a
    time: hidden [B, T, D], head [D, V], targets int [B, T] -> float32 [B, T].

    Per position: the picked logit minus the log-sum-exp over the vocabulary, with logits
    computed in ``hidden``'s dtype and then float32 (as the full head). Sequences longer
    than ``chunk`` run as a scan over chunks whose body is rematerialised, so the forward
    keeps no logits and the backward recomputes one chunk's [B, chunk, V] at a time; the
    backward never forms a log-softmax either (the gradient of logsumexp is the softmax,
    recomputed per chunk).
    """
    return _chunked(hidden, head, targets, temperature=temperature, chunk=chunk,
                    entropy=False)[0]


def chunked_logprobs_entropy(hidden: Array, head: Array, targets: Array, *,
                             temperature: float = 1.0, chunk: int = LOGITS_CHUNK
                             ) -> tuple[Array, Array]:
    """:func:`chunked_logprobs` and the token entropy of the same distribution, both
    float32 [B, T], from the same chunks (never [B, T, V] at once).

    With ``z`` the temperature-scaled logits of a position and ``p = softmax(z)``:
    ``H = logsumexp(z) - sum_v p_v z_v`` (= ``-sum_v p_v log p_v``), differentiable.
    """
    lp, ent = _chunked(hidden, head, targets, temperature=temperature, chunk=chunk,
                       entropy=True)
    assert ent is not None  # entropy=True
    return lp, ent


def _chunked(hidden: Array, head: Array, targets: Array, *, temperature: float, chunk: int,
             entropy: bool) -> tuple[Array, Array | None]:
    """The chunked head: (log-probs [B, T], entropy [B, T] or None)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")

    def block(h: Array, y: Array) -> tuple[Array, Array | None]:
        scaled = (h @ head).astype(jnp.float32) / temperature
        lse = jax.nn.logsumexp(scaled, axis=-1)
        picked = jnp.take_along_axis(scaled, y[..., None], axis=-1)[..., 0] - lse
        if not entropy:
            return picked, None
        return picked, lse - jnp.sum(jax.nn.softmax(scaled, axis=-1) * scaled, axis=-1)

    b, t = targets.shape
    if t <= chunk:
        return block(hidden, targets)
    n = -(-t // chunk)
    pad = n * chunk - t  # padded positions are computed and cut off
    hs = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, -1)
    ys = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk)
    step = jax.checkpoint(lambda _, xs: (None, block(*xs)))
    _, out = jax.lax.scan(step, None, (jnp.moveaxis(hs, 1, 0), jnp.moveaxis(ys, 1, 0)))

    def unchunk(x: Array) -> Array:
        return jnp.moveaxis(x, 0, 1).reshape(b, n * chunk)[:, :t]

    return unchunk(out[0]), None if out[1] is None else unchunk(out[1])


def canary_logprobs(model: Qwen3MoeForCausalLM, tokens: Sequence[int]) -> list[float]:
    """float32 log-probs of ``tokens[1:]`` given their prefixes (temperature 1)."""
    lp, _ = token_logprobs(model, jnp.asarray([list(tokens)], jnp.int32))
    return np.asarray(lp[0, 1:], np.float32).tolist()


def expert_set_mismatch(a: Array, b: Array, mask: Array) -> dict[str, Array]:
    """Fraction of valid entries whose top-k expert SETS differ (order ignored).

    a, b: int [B, T, L, k]; mask: bool [B, T]. Returns
      per_layer: fraction of (token, layer) pairs that differ;
      any_layer: fraction of tokens that differ in at least one layer.
    """
    differs = jnp.any(jnp.sort(a, axis=-1) != jnp.sort(b, axis=-1), axis=-1)  # [B, T, L]
    m = mask.astype(jnp.float32)
    n_tok = jnp.maximum(jnp.sum(m), 1.0)
    per_layer = jnp.sum(jnp.mean(differs.astype(jnp.float32), axis=-1) * m) / n_tok
    any_layer = jnp.sum(jnp.any(differs, axis=-1).astype(jnp.float32) * m) / n_tok
    return {"per_layer": per_layer, "any_layer": any_layer}


def router_mismatch(router_topk: Array, experts_used: Array, routed_experts: Array,
                    mask: Array) -> dict[str, Array]:
    """Engine-vs-trainer routing mismatch over ``mask`` [B, T] (all expert ids [B, T, L, k]).

    ``router_mismatch`` / ``router_mismatch_any_layer``: the trainer router's own top-k vs
    the engine's ``routed_experts`` (what replay corrects); ``router_mismatch_applied``:
    the experts that ran vs the engine's (0 under replay).
    """
    own = expert_set_mismatch(router_topk, routed_experts, mask)
    return {
        "router_mismatch": own["per_layer"],
        "router_mismatch_any_layer": own["any_layer"],
        "router_mismatch_applied": expert_set_mismatch(experts_used, routed_experts, mask)[
            "per_layer"],
    }


def router_gate_stats(router_logits: Array, experts_used: Array, gate_weights: Array,
                      routed_experts: Array, routed_gates: Array, *, norm_topk_prob: bool,
                      engine_logits: Array | None = None) -> dict[str, Array]:
    """Per-token engine-vs-trainer gate statistics, each float32 [B, T].

    Inputs: the trainer's ``router_logits`` f32 [B, T, L, E], ``experts_used`` and their
    ``gate_weights`` [B, T, L, k] (what its forward ran); the engine's ``routed_experts``
    and ``routed_gates`` [B, T, L, k] and optionally its ``engine_logits`` [B, T, L, E].
    With ``g`` the engine's gates, ``w`` the trainer router's own gates of the engine's
    experts (``satjax.model.moe.expert_gates``) and ``a`` the gate weight the trainer's
    forward applied to each engine expert (0 for one that did not run), means over (L, k):

    * ``router_gate_diff``: ``|g - w|``, how far the trainer's router has moved from the
      engine's on the engine's own experts;
    * ``router_gate_diff_applied``: ``|g - a|``, what the forward actually differs by
      (0 under gate replay, ``router_gate_diff`` under expert replay);
    * ``router_kl`` (with ``engine_logits``): ``KL(softmax(engine) || softmax(trainer))``
      of the full router distributions, mean over the L layers.
    """
    engine = jnp.clip(routed_experts.astype(jnp.int32), 0, router_logits.shape[-1] - 1)
    g = routed_gates.astype(jnp.float32)
    own = expert_gates(router_logits, engine, norm_topk_prob)
    same = experts_used[..., :, None] == engine[..., None, :]  # [B, T, L, k_used, k_engine]
    applied = jnp.sum(jnp.where(same, gate_weights.astype(jnp.float32)[..., :, None], 0.0),
                      axis=-2)
    out = {"router_gate_diff": jnp.mean(jnp.abs(g - own), axis=(-2, -1)),
           "router_gate_diff_applied": jnp.mean(jnp.abs(g - applied), axis=(-2, -1))}
    if engine_logits is not None:
        log_p = jax.nn.log_softmax(engine_logits.astype(jnp.float32), axis=-1)
        log_q = jax.nn.log_softmax(router_logits.astype(jnp.float32), axis=-1)
        kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)  # [B, T, L]
        out["router_kl"] = jnp.mean(kl, axis=-1)
    return out
