"""Batched autoregressive sampler with a KV cache (jitted prefill + lax.while_loop decode).

Prompts of different lengths are left-padded to a common (bucketed) length so every row's
next token lands in the same cache slot; positions count real tokens only and padded slots
are masked out of attention. Per generated token the sampler returns its log-prob under the
*processed* distribution it was sampled from (temperature, then top-k, then top-p, as vLLM's
``processed_logprobs``); with ``temperature == 0`` it decodes greedily and reports the
log-prob under the raw (unscaled, unfiltered) distribution. It also returns, per token, the
experts the router chose in every MoE layer (vLLM's convention: one row per input position,
``P + N - 1`` of them). ``generate`` returns host arrays (:class:`Samples`); turning them into
per-prompt records is the rollout engine's job.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from satjax.model.transformer import Qwen3MoeForCausalLM

Array = jax.Array
_PROMPT_BUCKET = 16  # prompt lengths are padded up to a multiple of this (fewer recompiles)


@dataclasses.dataclass(frozen=True)
class Samples:
    """Host arrays of one ``generate`` call: B prompts left-padded to P, N new-token slots.

    prompt_lengths i32 [B]                 real prompt tokens of each row
    lengths        i32 [B]                 generated tokens of each row (<= N)
    tokens         i32 [B, N]              generated tokens, ``pad_id`` after ``lengths``
    logprobs       f32 [B, N]              their log-probs under the processed distribution
    stopped        bool [B]                the row ended on a stop token
    routed_experts i32 [B, P + N - 1, L, k] experts the router chose per input position of
                                           the padded sequence (row r's real positions are
                                           ``P - prompt_lengths[r] : P + lengths[r] - 1``)
    """

    prompt_lengths: np.ndarray
    lengths: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    stopped: np.ndarray
    routed_experts: np.ndarray


def processed_logprobs(logits: Array, temperature: float | Array, top_k: int | Array = 0,
                       top_p: float | Array = 1.0) -> Array:
    """Log-probs [..., V] of the distribution the sampler draws from (-inf = filtered out).

    temperature == 0 (a Python number) means greedy: the raw ``log_softmax(logits)``.
    Otherwise: ``logits / temperature``; keep the ``top_k`` largest (0 = all; ties at the
    k-th value are kept); keep the smallest prefix of the descending-sorted top-k
    distribution whose mass reaches ``top_p`` (a token is kept iff the mass strictly above
    it is < top_p); renormalise. The teacher-forced side of the trainer must call this with
    the same values to compare log-probs with the behaviour policy.
    """
    logits = logits.astype(jnp.float32)
    if isinstance(temperature, int | float) and temperature == 0:
        return jax.nn.log_softmax(logits, axis=-1)
    logits = logits / temperature
    vocab = logits.shape[-1]
    top_k = jnp.asarray(top_k, jnp.int32)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    desc = -jnp.sort(-logits, axis=-1)
    kth = jnp.take_along_axis(desc, jnp.broadcast_to(k - 1, desc.shape[:-1])[..., None], -1)
    desc = jnp.where(jnp.arange(vocab) < k, desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    mass_above = jnp.cumsum(probs, axis=-1) - probs
    top_p = jnp.asarray(top_p, jnp.float32)
    keep = (mass_above < top_p) | (top_p >= 1.0)
    p_thresh = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    threshold = jnp.maximum(kth, p_thresh)
    return jax.nn.log_softmax(jnp.where(logits >= threshold, logits, -jnp.inf), axis=-1)


def with_compute_dtype(model: Qwen3MoeForCausalLM, dtype: jnp.dtype) -> Qwen3MoeForCausalLM:
    """A view of ``model`` (same parameter arrays) that computes in ``dtype``."""
    graphdef, state = nnx.split(model)
    view = nnx.merge(graphdef, state)
    for _, module in nnx.iter_modules(view):
        if hasattr(module, "dtype"):
            module.dtype = dtype
    return view


def _decode(graphdef, state, tokens, prompt_mask, rng, temperature, top_k, top_p, *,
            max_new_tokens: int, greedy: bool, stop_ids: tuple[int, ...], pad_id: int):
    """Prefill + while-loop decode. tokens/prompt_mask: [B, P] left-padded."""
    model = nnx.merge(graphdef, state)
    b, p = tokens.shape
    cfg = model.config
    n_moe, k = len(cfg.moe_layer_indices), cfg.num_experts_per_tok
    cache = model.init_cache(b, p + max_new_tokens)
    kv_valid = jnp.zeros((b, p + max_new_tokens), jnp.bool_).at[:, :p].set(prompt_mask)
    positions = jnp.maximum(jnp.cumsum(prompt_mask.astype(jnp.int32), axis=1) - 1, 0)
    out, cache = model.forward_with_cache(tokens, positions, kv_valid, cache, 0)
    prompt_routes = out.router_topk
    stop = jnp.asarray(stop_ids if stop_ids else (-1,), jnp.int32)

    def cond(carry):
        i, done = carry[0], carry[5]
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, cache, kv_valid, logits, pos, done, toks, lps, routes, lengths = carry
        lp = processed_logprobs(logits, 0 if greedy else temperature, top_k, top_p)
        if greedy:
            tok = jnp.argmax(lp, axis=-1).astype(jnp.int32)
        else:
            tok = jax.random.categorical(jax.random.fold_in(rng, i), lp).astype(jnp.int32)
        tok_lp = jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]
        tok = jnp.where(done, pad_id, tok)
        toks = toks.at[:, i].set(tok)
        lps = lps.at[:, i].set(jnp.where(done, 0.0, tok_lp))
        lengths = jnp.where(done, lengths, i + 1)
        kv_valid = kv_valid.at[:, p + i].set(~done)
        done = done | jnp.isin(tok, stop)
        step, cache = model.forward_with_cache(tok[:, None], pos[:, None], kv_valid, cache,
                                               p + i)
        routes = routes.at[:, i].set(step.router_topk[:, 0])
        return (i + 1, cache, kv_valid, step.logits[:, 0], pos + 1, done, toks, lps, routes,
                lengths)

    carry = (jnp.int32(0), cache, kv_valid, out.logits[:, -1], positions[:, -1] + 1,
             jnp.zeros((b,), jnp.bool_), jnp.full((b, max_new_tokens), pad_id, jnp.int32),
             jnp.zeros((b, max_new_tokens), jnp.float32),
             jnp.zeros((b, max_new_tokens, n_moe, k), jnp.int32), jnp.zeros((b,), jnp.int32))
    carry = jax.lax.while_loop(cond, body, carry)
    _, _, _, _, _, _, toks, lps, routes, lengths = carry
    return toks, lps, prompt_routes, routes, lengths


_decode_jit = jax.jit(_decode, static_argnums=(0,), static_argnames=(
    "max_new_tokens", "greedy", "stop_ids", "pad_id"))


def generate(model: Qwen3MoeForCausalLM, prompts: Sequence[Sequence[int] | np.ndarray], *,
             temperature: float, top_k: int, top_p: float, max_new_tokens: int,
             stop_token_ids: Sequence[int], rng: Array, dtype: jnp.dtype | None = None,
             pad_id: int = 0) -> Samples:
    """Sample one completion per prompt (see module docstring for the conventions).

    ``top_k=0`` and ``top_p=1`` disable those filters; ``temperature == 0`` is greedy.
    dtype overrides the model's compute dtype for sampling (e.g. ``jnp.bfloat16``).
    """
    if not prompts:
        raise ValueError("prompts must be a non-empty list")
    prompt_arrays = [np.asarray(pr, np.int32).reshape(-1) for pr in prompts]
    if any(a.size == 0 for a in prompt_arrays):
        raise ValueError("prompts must each contain at least one token")
    if dtype is not None:
        model = with_compute_dtype(model, dtype)
    longest = max(a.size for a in prompt_arrays)
    p = -(-longest // _PROMPT_BUCKET) * _PROMPT_BUCKET
    tokens = np.full((len(prompt_arrays), p), pad_id, np.int32)
    mask = np.zeros((len(prompt_arrays), p), bool)
    for row, a in enumerate(prompt_arrays):
        tokens[row, p - a.size:] = a
        mask[row, p - a.size:] = True
    graphdef, state = nnx.split(model)
    greedy = temperature == 0
    stop_ids = tuple(int(t) for t in stop_token_ids)
    toks, lps, prompt_routes, gen_routes, lengths = jax.device_get(_decode_jit(
        graphdef, state, jnp.asarray(tokens), jnp.asarray(mask), rng,
        jnp.float32(temperature if not greedy else 1.0), jnp.int32(top_k),
        jnp.float32(top_p), max_new_tokens=max_new_tokens, greedy=greedy,
        stop_ids=stop_ids, pad_id=int(pad_id)))
    lengths = np.asarray(lengths, np.int32)
    last = np.take_along_axis(toks, np.maximum(lengths - 1, 0)[:, None], axis=1)[:, 0]
    return Samples(
        prompt_lengths=np.asarray([a.size for a in prompt_arrays], np.int32),
        lengths=lengths,
        tokens=np.asarray(toks, np.int32),
        logprobs=np.asarray(lps, np.float32),
        stopped=(lengths > 0) & np.isin(last, stop_ids),
        routed_experts=np.concatenate([prompt_routes, gen_routes[:, :-1]], axis=1).astype(
            np.int32),
    )
