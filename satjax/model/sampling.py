"""Batched autoregressive sampler with a KV cache (jitted prefill + lax.while_loop decode).

Prompts of different lengths are left-padded to a common (bucketed) length so every row's
next token lands in the same cache slot; positions count real tokens only and padded slots
are masked out of attention. Per generated token the sampler returns its log-prob under the
*processed* distribution it was sampled from (temperature, then top-k, then top-p, as vLLM's
``processed_logprobs``); with ``temperature == 0`` it decodes greedily and reports the
log-prob under the raw (unscaled, unfiltered) distribution. It also returns, per token, the
experts the router chose in every MoE layer and their gate weights, and optionally the full
router logits (vLLM's convention: one row per input position, ``P + N - 1`` of them).
``generate`` returns host arrays (:class:`Samples`); turning them into per-prompt records is
the rollout engine's job. :class:`Generation` decodes in segments, so the weights may change
between two segments (partial rollouts): the KV cache is kept and every token records the
version that sampled it.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from satjax.model.transformer import Qwen3MoeForCausalLM

Array = jax.Array
_PROMPT_BUCKET = 16  # prompt lengths are padded up to a multiple of this (fewer recompiles)


@dataclasses.dataclass(frozen=True)
class Samples:
    """Host arrays of one sampled batch: B prompts left-padded to P, N new-token slots; the
    router record has one row per input position of the padded sequence (row r's real
    positions are ``P - prompt_lengths[r] : P + lengths[r] - 1``).

    prompt_lengths i32 [B]                   real prompt tokens of each row
    lengths        i32 [B]                   generated tokens of each row (<= N)
    tokens         i32 [B, N]                generated tokens, ``pad_id`` after ``lengths``
    logprobs       f32 [B, N]                their log-probs under the processed distribution
    stopped        bool [B]                  the row ended on a stop token
    routed_experts i32 [B, P + N - 1, L, k]  experts the router chose per input position
    routed_gates   f16 [B, P + N - 1, L, k]  their gate weights (normalised top-k probs)
    router_logits  f16 [B, P + N - 1, L, E] or None  the full router logits, when recorded
    token_versions i32 [B, N]                the version of the weights whose logits each
                                             token was sampled from (0 after ``lengths``)
    """

    prompt_lengths: np.ndarray
    lengths: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    stopped: np.ndarray
    routed_experts: np.ndarray
    routed_gates: np.ndarray
    router_logits: np.ndarray | None
    token_versions: np.ndarray


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


class _Carry(typing.NamedTuple):
    """The decode loop's state (a pytree kept on the device between segments). R = P + N
    router-record rows; ``logits`` are the next token's, computed by ``logit_version``."""

    i: Array               # i32 []: tokens generated so far (the next slot is P + i)
    cache: Any             # the KV cache, P + N slots
    kv_valid: Array        # bool [B, P + N]
    logits: Array          # f32 [B, V]
    logit_version: Array   # i32 []
    pos: Array             # i32 [B] position of the next token
    done: Array            # bool [B]
    tokens: Array          # i32 [B, N]
    logprobs: Array        # f32 [B, N]
    versions: Array        # i32 [B, N]
    lengths: Array         # i32 [B]
    routes: Array          # i32 [B, R, L, k]
    gates: Array           # f16 [B, R, L, k]
    router_logits: Array | None  # f16 [B, R, L, E] when recorded


def _record(carry: _Carry, row: Array | int, out, n_rows: int) -> dict[str, Array]:
    """The router record fields of ``carry`` with ``out``'s T rows written from ``row``."""
    def put(buf, new):
        return jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), row, axis=1)

    rec = {"routes": put(carry.routes, out.router_topk[:, :n_rows]),
           "gates": put(carry.gates, out.gate_weights[:, :n_rows])}
    if carry.router_logits is not None:
        rec["router_logits"] = put(carry.router_logits, out.router_logits[:, :n_rows])
    return rec


def _prefill(graphdef, state, tokens, prompt_mask, version, *, max_new_tokens: int,
             record_logits: bool, pad_id: int) -> _Carry:
    """The prompt's forward into a fresh cache. tokens/prompt_mask: [B, P] left-padded."""
    model = nnx.merge(graphdef, state)
    b, p = tokens.shape
    cfg = model.config
    n_moe, k = len(cfg.moe_layer_indices), cfg.num_experts_per_tok
    rows = p + max_new_tokens
    cache = model.init_cache(b, rows)
    kv_valid = jnp.zeros((b, rows), jnp.bool_).at[:, :p].set(prompt_mask)
    positions = jnp.maximum(jnp.cumsum(prompt_mask.astype(jnp.int32), axis=1) - 1, 0)
    out, cache = model.forward_with_cache(tokens, positions, kv_valid, cache, 0)
    carry = _Carry(
        i=jnp.int32(0), cache=cache, kv_valid=kv_valid, logits=out.logits[:, -1],
        logit_version=jnp.asarray(version, jnp.int32), pos=positions[:, -1] + 1,
        done=jnp.zeros((b,), jnp.bool_),
        tokens=jnp.full((b, max_new_tokens), pad_id, jnp.int32),
        logprobs=jnp.zeros((b, max_new_tokens), jnp.float32),
        versions=jnp.zeros((b, max_new_tokens), jnp.int32), lengths=jnp.zeros((b,), jnp.int32),
        routes=jnp.zeros((b, rows, n_moe, k), jnp.int32),
        gates=jnp.zeros((b, rows, n_moe, k), jnp.float16),
        router_logits=(jnp.zeros((b, rows, n_moe, cfg.num_experts), jnp.float16)
                       if record_logits else None))
    return carry._replace(**_record(carry, 0, out, p))


def _decode(graphdef, state, carry: _Carry, rng, temperature, top_k, top_p, version,
            until, *, greedy: bool, stop_ids: tuple[int, ...], pad_id: int) -> _Carry:
    """While-loop decode with the weights ``state`` (``version``) until ``until`` tokens
    are generated or every row is done. Token i is sampled from ``carry.logits``, so its
    version is ``carry.logit_version`` (the weights that computed them); feeding it runs
    the forward with the weights given here, which writes router-record row P + i."""
    model = nnx.merge(graphdef, state)
    p = carry.kv_valid.shape[1] - carry.tokens.shape[1]
    stop = jnp.asarray(stop_ids if stop_ids else (-1,), jnp.int32)
    version = jnp.asarray(version, jnp.int32)

    def cond(c: _Carry):
        return (c.i < jnp.minimum(until, c.tokens.shape[1])) & ~jnp.all(c.done)

    def body(c: _Carry) -> _Carry:
        i, done = c.i, c.done
        lp = processed_logprobs(c.logits, 0 if greedy else temperature, top_k, top_p)
        if greedy:
            tok = jnp.argmax(lp, axis=-1).astype(jnp.int32)
        else:
            tok = jax.random.categorical(jax.random.fold_in(rng, i), lp).astype(jnp.int32)
        tok_lp = jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]
        tok = jnp.where(done, pad_id, tok)
        kv_valid = c.kv_valid.at[:, p + i].set(~done)
        step, cache = model.forward_with_cache(tok[:, None], c.pos[:, None], kv_valid,
                                               c.cache, p + i)
        c = c._replace(
            i=i + 1, cache=cache, kv_valid=kv_valid, logits=step.logits[:, 0],
            logit_version=version, pos=c.pos + 1, done=done | jnp.isin(tok, stop),
            tokens=c.tokens.at[:, i].set(tok),
            logprobs=c.logprobs.at[:, i].set(jnp.where(done, 0.0, tok_lp)),
            versions=c.versions.at[:, i].set(jnp.where(done, 0, c.logit_version)),
            lengths=jnp.where(done, c.lengths, i + 1))
        return c._replace(**_record(c, p + i, step, 1))

    return jax.lax.while_loop(cond, body, carry)


_prefill_jit = jax.jit(_prefill, static_argnums=(0,), static_argnames=(
    "max_new_tokens", "record_logits", "pad_id"))
_decode_jit = jax.jit(_decode, static_argnums=(0,), static_argnames=(
    "greedy", "stop_ids", "pad_id"))


def compile_sampler(model: Qwen3MoeForCausalLM, rows: int, prompt_len: int, *,
                    max_new_tokens: int, dtype: jnp.dtype | None = None,
                    record_logits: bool = False, batch_sharding: Any = None,
                    ) -> tuple[jax.stages.Compiled, jax.stages.Compiled]:
    """The sampler's two programs, compiled for ``rows`` prompts of ``prompt_len`` tokens
    and ``max_new_tokens`` to generate: the prefill (the prompts' forward into the KV
    cache) and the decode loop, as :class:`Generation` runs them. ``model`` may be
    abstract (``nnx.eval_shape``, its arrays carrying shardings) and the prompts are
    placed by ``batch_sharding``: an ahead-of-time compile (``satjax plan``, under
    ``jax.set_mesh``), nothing computed. The decode loop takes the cache as the prefill
    lays it out.
    """
    graphdef, state = nnx.split(model if dtype is None else with_compute_dtype(model, dtype))
    tokens = jax.ShapeDtypeStruct((rows, prompt_len), jnp.int32, sharding=batch_sharding)
    mask = jax.ShapeDtypeStruct((rows, prompt_len), jnp.bool_, sharding=batch_sharding)
    prefill = _prefill_jit.lower(graphdef, state, tokens, mask, 0,
                                 max_new_tokens=max_new_tokens, record_logits=record_logits,
                                 pad_id=0).compile()
    carry = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                         prefill.out_info, prefill.output_shardings)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    count = jax.ShapeDtypeStruct((), jnp.int32)
    decode = _decode_jit.lower(graphdef, state, carry, jax.eval_shape(jax.random.key, 0),
                               scalar, count, scalar, count, count, greedy=False, stop_ids=(),
                               pad_id=0).compile()
    return prefill, decode


class Generation:
    """One batch being sampled: the prompts' prefill, then decode in segments, each with
    the weights the caller gives it (a partial rollout moves to new weights mid-batch).

    The KV cache, positions and finished rows survive a change of weights: later tokens
    attend to the keys and values the earlier weights computed, as the engine sampled them.
    Each token records the version of the weights whose logits it was sampled from
    (``Samples.token_versions``), and each router-record row the routing of the weights
    that fed it, i.e. of the version of the token it predicts (see the module docstring
    for the conventions and :func:`generate` for the arguments).
    """

    def __init__(self, model: Qwen3MoeForCausalLM, prompts: Sequence[Sequence[int] | np.ndarray],
                 *, temperature: float, top_k: int, top_p: float, max_new_tokens: int,
                 stop_token_ids: Sequence[int], rng: Array, dtype: jnp.dtype | None = None,
                 pad_id: int = 0, version: int = 0, record_logits: bool = False) -> None:
        if not prompts:
            raise ValueError("prompts must be a non-empty list")
        prompt_arrays = [np.asarray(pr, np.int32).reshape(-1) for pr in prompts]
        if any(a.size == 0 for a in prompt_arrays):
            raise ValueError("prompts must each contain at least one token")
        longest = max(a.size for a in prompt_arrays)
        p = -(-longest // _PROMPT_BUCKET) * _PROMPT_BUCKET
        tokens = np.full((len(prompt_arrays), p), pad_id, np.int32)
        mask = np.zeros((len(prompt_arrays), p), bool)
        for row, a in enumerate(prompt_arrays):
            tokens[row, p - a.size:] = a
            mask[row, p - a.size:] = True
        self.prompt_lengths = np.asarray([a.size for a in prompt_arrays], np.int32)
        self.dtype, self.rng, self.pad_id = dtype, rng, int(pad_id)
        self.greedy = temperature == 0
        self.stop_ids = tuple(int(t) for t in stop_token_ids)
        self.sampling = (jnp.float32(temperature if not self.greedy else 1.0),
                         jnp.int32(top_k), jnp.float32(top_p))
        graphdef, state = self._split(model)
        self.carry = _prefill_jit(graphdef, state, jnp.asarray(tokens), jnp.asarray(mask),
                                  version, max_new_tokens=max_new_tokens,
                                  record_logits=record_logits, pad_id=self.pad_id)
        self.finished = False

    def _split(self, model: Qwen3MoeForCausalLM):
        return nnx.split(model if self.dtype is None else with_compute_dtype(model, self.dtype))

    def decode(self, model: Qwen3MoeForCausalLM, version: int = 0,
               steps: int | None = None) -> bool:
        """Generates up to ``steps`` more tokens (None: to the end) with ``model``, the
        weights of ``version``; True once every row is finished."""
        if self.finished:
            return True
        graphdef, state = self._split(model)
        until = self.carry.tokens.shape[1] if steps is None else int(self.carry.i) + steps
        self.carry = _decode_jit(graphdef, state, self.carry, self.rng, *self.sampling,
                                 jnp.int32(version), jnp.int32(until), greedy=self.greedy,
                                 stop_ids=self.stop_ids, pad_id=self.pad_id)
        i, done = jax.device_get((self.carry.i, self.carry.done))
        self.finished = bool(i >= self.carry.tokens.shape[1] or done.all())
        return self.finished

    def samples(self) -> Samples:
        """The host arrays of what was generated so far."""
        c = jax.device_get(self.carry)
        lengths = np.asarray(c.lengths, np.int32)
        toks = np.asarray(c.tokens, np.int32)
        last = np.take_along_axis(toks, np.maximum(lengths - 1, 0)[:, None], axis=1)[:, 0]
        return Samples(
            prompt_lengths=self.prompt_lengths, lengths=lengths, tokens=toks,
            logprobs=np.asarray(c.logprobs, np.float32),
            stopped=(lengths > 0) & np.isin(last, self.stop_ids),
            routed_experts=np.asarray(c.routes[:, :-1], np.int32),
            routed_gates=np.asarray(c.gates[:, :-1], np.float16),
            router_logits=(None if c.router_logits is None
                           else np.asarray(c.router_logits[:, :-1], np.float16)),
            token_versions=np.asarray(c.versions, np.int32))


def generate(model: Qwen3MoeForCausalLM, prompts: Sequence[Sequence[int] | np.ndarray], *,
             temperature: float, top_k: int, top_p: float, max_new_tokens: int,
             stop_token_ids: Sequence[int], rng: Array, dtype: jnp.dtype | None = None,
             pad_id: int = 0, version: int = 0, record_logits: bool = False) -> Samples:
    """Sample one completion per prompt with one set of weights (see module docstring).

    ``top_k=0`` and ``top_p=1`` disable those filters; ``temperature == 0`` is greedy.
    dtype overrides the model's compute dtype for sampling (e.g. ``jnp.bfloat16``);
    ``version`` stamps ``Samples.token_versions``; ``record_logits`` keeps the full router
    logits. :class:`Generation` samples across a change of weights.
    """
    gen = Generation(model, prompts, temperature=temperature, top_k=top_k, top_p=top_p,
                     max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, rng=rng,
                     dtype=dtype, pad_id=pad_id, version=version, record_logits=record_logits)
    gen.decode(model, version)
    return gen.samples()
