"""Sparse MoE block (HF ``Qwen3MoeSparseMoeBlock``) with dropless batched expert dispatch.

Routing: ``probs = softmax(x @ W_router)`` over all experts (float32), top-k by prob, gate
weights renormalised over the k chosen experts iff ``norm_topk_prob``. With R3 replay
(``train.replay: experts``) the experts that run come from ``routed_experts`` (the engine's
record) and the gate weights are the model's own ``probs`` gathered at them (renormalised
the same way), so the router still receives gradients. With gate replay (``train.replay:
gates``) the engine's gate weights ``routed_gates`` are used as well, straight-through: the
forward computes with the engine's gates exactly, the backward sends their cotangent to
the model's own gates of those experts (:func:`route`). The block reports the router's own
top-k (``router_topk``), what ran (``experts_used``) and with which gate weights in a
:class:`RouteRecord`.

Four dispatch implementations, all dropless (no capacity factor, no token is ever
dropped), so replaying the model's own routes reproduces the non-replay forward exactly:

* ``"grouped"``: sort the N*k token-expert pairs by expert, then run each expert's SwiGLU
  on its own rows in chunks (``full`` rows while at least that many are left, then
  ``full / 4``-row tail chunks) inside a loop over experts, against the expert weights as
  stored: no weight copies, padding under one tail chunk per expert, cost O(N*k). The
  loops have data-dependent trip counts, so the backward is written out (a custom VJP):
  per-expert weight-gradient accumulation and gathers only, no scatter. XLA:CPU's GEMMs
  are fast but it lowers ``ragged_dot`` densely, so this is the CPU path.
* ``"ragged"``: the same sort, the three expert matmuls as ``jax.lax.ragged_dot``; cost
  O(N*k) where the backend has a grouped-GEMM kernel (GPU/TPU).
* ``"dense_einsum"``: every expert runs on every token and a [N, E] combine matrix (zero
  for unselected experts) mixes the results; cost O(N*E) but shards cleanly over experts
  (each device computes its experts, one all-reduce combines).
* ``"all_to_all"``: expert parallelism by a token exchange (:func:`expert_parallel`): the
  expert weights stay sharded over ``expert`` and each device sends each of its (token,
  expert) pairs to the device holding the expert (``jax.lax.ragged_all_to_all``; on
  XLA:CPU, which lacks it, :func:`padded_ragged_all_to_all`), which runs its experts on
  the rows it receives ("ragged" or "grouped" on pre-sorted rows) and sends the results
  back. Dropless: the receive buffer has room for every pair of the expert axis.
* ``"auto"`` (default): "grouped" on CPU; elsewhere "all_to_all" where that moves fewer
  bytes per chip than all-gathering the experts (:func:`exchange_moves_fewer_bytes`: an
  ``expert`` axis over 1 and fewer than about 16k tokens per device at the paper's
  shape), else "ragged".

Under a mesh, "grouped" and "ragged" run per batch shard (:func:`per_batch_shard`: each
device sorts and dispatches its own tokens) against all-gathered expert weights: every
device receives every expert's weights per layer, and reduces their gradients, whatever
its token count; "all_to_all" moves its tokens instead (docs/parallel.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from satjax.config import MoeImpl
from satjax.model.layers import make_param
from satjax.parallel import constrain, logical_to_spec, target_platform

Array = jax.Array
MOE_IMPLS: tuple[str, ...] = typing.get_args(MoeImpl)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouteRecord:
    """What one MoE layer's router decided and what ran, per token.

    router_logits f32 [..., E]  the router's logits
    router_topk   i32 [..., k]  the router's own top-k, descending probability
    experts_used  i32 [..., k]  the experts that ran: the replayed ``routed_experts`` under
                                R3, else equal to ``router_topk``
    weights       f32 [..., k]  gate weights of ``experts_used`` (the engine's under gate
                                replay; the dispatch casts them to the compute dtype)
    """

    router_logits: Array
    router_topk: Array
    experts_used: Array
    weights: Array


def expert_gates(router_logits: Array, experts: Array, norm_topk_prob: bool) -> Array:
    """The router's gate weights f32 [..., k] of ``experts`` [..., k] from its logits
    [..., E]: ``softmax(logits)`` gathered at the experts, divided by their sum iff
    ``norm_topk_prob`` (HF Qwen3-MoE; vLLM's ``fused_topk(renormalize=...)``)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    return _normalised(jnp.take_along_axis(probs, experts, axis=-1), norm_topk_prob)


def _normalised(weights: Array, norm_topk_prob: bool) -> Array:
    return weights / jnp.sum(weights, axis=-1, keepdims=True) if norm_topk_prob else weights


def route(router_logits: Array, k: int, norm_topk_prob: bool,
          routed_experts: Array | None = None, routed_gates: Array | None = None
          ) -> RouteRecord:
    """Top-k routing from float32 logits [N, E].

    ``routed_experts`` [N, k] replays experts (R3): they run, weighted by the router's own
    gates of them (:func:`expert_gates`). ``routed_gates`` [N, k] (with ``routed_experts``)
    also replays the engine's gate weights, straight-through::

        w = g_engine + (w_own - stop_gradient(w_own))

    whose value is ``g_engine`` exactly (``x - x`` is 0 in floating point) and whose
    gradient reaches the router as if ``w_own`` had been used: the trainer computes the
    function the engine sampled from while its router still learns.
    """
    if routed_gates is not None and routed_experts is None:
        raise ValueError("routed_gates: gate replay needs the routed_experts they weight")
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    top_p, top_i = jax.lax.top_k(probs, k)
    top_i = top_i.astype(jnp.int32)
    if routed_experts is None:
        experts, weights = top_i, _normalised(top_p, norm_topk_prob)
    else:
        # clipped so padding rows holding e.g. -1 stay harmless (their outputs are masked)
        experts = jnp.clip(routed_experts.astype(jnp.int32), 0, router_logits.shape[-1] - 1)
        weights = _normalised(jnp.take_along_axis(probs, experts, axis=-1), norm_topk_prob)
    if routed_gates is not None:
        weights = routed_gates.astype(jnp.float32) + (weights - jax.lax.stop_gradient(weights))
    return RouteRecord(router_logits=router_logits, router_topk=top_i, experts_used=experts,
                       weights=weights)


def _sort_pairs(experts: Array, num_experts: int) -> tuple[Array, Array, Array]:
    """The N*k (token, slot) pairs of routes [N, k] sorted by expert (stable): ``order``
    (the pair i * k + j at each sorted row), ``inverse`` (the sorted row of each pair) and
    the int32 per-expert ``sizes``, whose rows are contiguous in that order."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, jnp.argsort(order), sizes


def ragged_rows(xs: Array, sizes: Array, w_gate: Array, w_up: Array, w_down: Array
                ) -> Array:
    """SwiGLU of rows xs [R, D] sorted by expert, ``sizes`` [E] rows each (their sum at most
    R; rows past it come out zero), as three ``jax.lax.ragged_dot`` -> [R, D]."""
    g = jax.lax.ragged_dot(xs, w_gate, sizes)
    u = jax.lax.ragged_dot(xs, w_up, sizes)
    return jax.lax.ragged_dot(jax.nn.silu(g) * u, w_down, sizes)


def ragged_experts(x: Array, experts: Array, weights: Array, w_gate: Array, w_up: Array,
                   w_down: Array) -> Array:
    """Dropless sorted dispatch. x [N, D]; experts/weights [N, k]; w_* [E, ...] -> [N, D]."""
    n, k = experts.shape
    order, inverse, sizes = _sort_pairs(experts, w_gate.shape[0])
    y = ragged_rows(x[order // k], sizes, w_gate, w_up, w_down)[inverse].reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", y, weights.astype(y.dtype))


def _chunk_rows(m: int, num_experts: int) -> tuple[int, int]:
    """Static (full, tail) chunk rows of "grouped" for m = N*k pairs over E experts: full
    chunks a power of two in [16, 256] near the mean expert load, tail chunks a quarter of
    that, so an expert's padding stays under a tail chunk."""
    mean = max(m // num_experts, 1)
    full = int(min(max(1 << (mean.bit_length() - 1), 16), 256))
    return full, max(full // 4, 8)


def _chunk_loop(starts: Array, sizes: Array, chunks: tuple[int, int], body, carry,
                local=None, flush=None):
    """Run ``body(e, lo, rows, (carry, local))`` over each expert's sorted rows in chunks.

    Expert e owns sorted rows ``[starts[e], starts[e] + sizes[e])``; with ``chunks = (full,
    tail)`` they are covered by ``sizes[e] // full`` chunks of ``full`` rows, then chunks of
    ``tail`` rows (the last one may run past the expert's rows into later experts' rows or
    the zero padding). Experts go in ascending order, so a row a chunk runs over is
    rewritten by its own expert's chunk later; backward bodies mask the rows past
    ``starts[e] + sizes[e]`` themselves.
    ``local`` starts afresh for each expert and ``flush(e, carry, local)`` folds it into
    the carry after the expert's last chunk (per-expert accumulators).
    """
    full, tail = chunks
    n_full = sizes // full
    n_tail = -(-(sizes - n_full * full) // tail)

    def expert(e, carry):
        start = starts[e]
        state = jax.lax.fori_loop(
            0, n_full[e], lambda c, st: body(e, start + c * full, full, st), (carry, local))
        rest = start + n_full[e] * full
        carry, acc = jax.lax.fori_loop(
            0, n_tail[e], lambda c, st: body(e, rest + c * tail, tail, st), state)
        return carry if flush is None else flush(e, carry, acc)

    return jax.lax.fori_loop(0, starts.shape[0], expert, carry)


def _rows_forward(xs, starts, sizes, w_gate, w_up, w_down, chunks, *, save: bool):
    """SwiGLU of sorted rows xs [R, D] (expert e's at ``[starts[e], starts[e] + sizes[e])``,
    ``chunks[0]`` zero rows at the end) in chunks -> (ys, and when ``save`` the gate and
    up activations the backward needs)."""
    rows, d = xs.shape
    f = w_gate.shape[-1]

    def body(e, lo, size, state):
        (ys, gs, us), _ = state
        xc = jax.lax.dynamic_slice_in_dim(xs, lo, size)
        g, u = xc @ w_gate[e], xc @ w_up[e]
        ys = jax.lax.dynamic_update_slice_in_dim(ys, (jax.nn.silu(g) * u) @ w_down[e], lo, 0)
        if save:
            gs = jax.lax.dynamic_update_slice_in_dim(gs, g, lo, 0)
            us = jax.lax.dynamic_update_slice_in_dim(us, u, lo, 0)
        return (ys, gs, us), None

    hidden = (jnp.zeros((rows, f), xs.dtype),) * 2 if save else (None, None)
    return _chunk_loop(starts, sizes, chunks, body, (jnp.zeros((rows, d), xs.dtype), *hidden))


def _rows_backward(xs, gs, us, dys, starts, sizes, w_gate, w_up, w_down, chunks):
    """The backward of :func:`_rows_forward`: dys like xs -> (dxs, (dw_gate, dw_up, dw_down))."""
    ends = starts + sizes

    def body(e, lo, size, state):
        (dxs, grads), (dwg, dwu, dwd) = state
        own = (lo + jnp.arange(size) < ends[e])[:, None]  # rows past the expert: no gradient
        dyc = jnp.where(own, jax.lax.dynamic_slice_in_dim(dys, lo, size), 0)
        xc = jax.lax.dynamic_slice_in_dim(xs, lo, size)
        g = jax.lax.dynamic_slice_in_dim(gs, lo, size)
        u = jax.lax.dynamic_slice_in_dim(us, lo, size)
        sig = jax.nn.sigmoid(g)
        silu = g * sig
        da = dyc @ w_down[e].T
        dg = da * u * sig * (1 + g * (1 - sig))  # d silu(g) / dg = sig * (1 + g * (1 - sig))
        du = da * silu
        dx = dg @ w_gate[e].T + du @ w_up[e].T
        dxs = jax.lax.dynamic_update_slice_in_dim(dxs, dx, lo, 0)
        return (dxs, grads), (dwg + xc.T @ dg, dwu + xc.T @ du, dwd + (silu * u).T @ dyc)

    def flush(e, carry, acc):  # each expert's weight gradient, written once
        dxs, grads = carry
        return dxs, tuple(jax.lax.dynamic_update_index_in_dim(w, a, e, 0)
                          for w, a in zip(grads, acc, strict=True))

    ws = (w_gate, w_up, w_down)
    return _chunk_loop(
        starts, sizes, chunks, body, (jnp.zeros_like(xs), tuple(map(jnp.zeros_like, ws))),
        local=tuple(jnp.zeros(w.shape[1:], w.dtype) for w in ws), flush=flush)


def _grouped_forward(x, experts, weights, w_gate, w_up, w_down, *, save: bool):
    """Sorted rows, per-expert chunked SwiGLU, unsort and combine; the residuals of the
    backward when ``save``."""
    n, k = experts.shape
    num_experts, d, _ = w_gate.shape
    chunks = _chunk_rows(n * k, num_experts)
    order, inverse, sizes = _sort_pairs(experts, num_experts)
    starts = jnp.cumsum(sizes) - sizes
    # zero padding of one full chunk: a chunk's window never reaches past the end (where
    # dynamic_slice would clamp it back over real rows)
    xs = jnp.concatenate([x[order // k], jnp.zeros((chunks[0], d), x.dtype)])
    ys, gs, us = _rows_forward(xs, starts, sizes, w_gate, w_up, w_down, chunks, save=save)
    y = ys[inverse].reshape(n, k, d)  # row of pair (token i, slot j) at i * k + j
    out = jnp.einsum("nkd,nk->nd", y, weights.astype(y.dtype))
    return out, (xs, gs, us, y, order, inverse, sizes, starts)


# A custom VJP because the chunk loops have data-dependent trip counts (while loops, which
# reverse-mode autodiff cannot differentiate), and because writing the backward by hand
# keeps every weight gradient a per-expert accumulation and every token gradient a gather
# (autodiff of the gathers would scatter-add, slow on CPU).
@jax.custom_vjp
def grouped_experts(x: Array, experts: Array, weights: Array, w_gate: Array, w_up: Array,
                    w_down: Array) -> Array:
    """Dropless grouped dispatch (see module docstring). x [N, D]; experts/weights [N, k];
    w_gate/w_up [E, D, F], w_down [E, F, D] -> [N, D]."""
    return _grouped_forward(x, experts, weights, w_gate, w_up, w_down, save=False)[0]


def _grouped_fwd(x, experts, weights, w_gate, w_up, w_down):
    out, res = _grouped_forward(x, experts, weights, w_gate, w_up, w_down, save=True)
    return out, (res, experts, weights, w_gate, w_up, w_down)


def _grouped_bwd(saved, dout):
    (xs, gs, us, y, order, inverse, sizes, starts), experts, weights, w_gate, w_up, w_down = saved
    n, k = experts.shape
    chunks = _chunk_rows(n * k, w_gate.shape[0])
    d = w_gate.shape[1]
    dweights = jnp.einsum("nkd,nd->nk", y, dout).astype(weights.dtype)
    dy = (dout[:, None, :] * weights[:, :, None].astype(dout.dtype)).reshape(n * k, d)
    dys = jnp.concatenate([dy[order], jnp.zeros((chunks[0], d), dy.dtype)])
    dxs, (dwg, dwu, dwd) = _rows_backward(xs, gs, us, dys, starts, sizes, w_gate, w_up,
                                          w_down, chunks)
    dx = jnp.sum(dxs[inverse].reshape(n, k, d), axis=1)
    return dx, np.zeros(experts.shape, jax.dtypes.float0), dweights, dwg, dwu, dwd


grouped_experts.defvjp(_grouped_fwd, _grouped_bwd)


def _grouped_rows_forward(xs, sizes, w_gate, w_up, w_down, load, *, save: bool):
    chunks = _chunk_rows(load, w_gate.shape[0])
    starts = jnp.cumsum(sizes) - sizes
    xs = jnp.concatenate([xs, jnp.zeros((chunks[0], xs.shape[1]), xs.dtype)])
    ys, gs, us = _rows_forward(xs, starts, sizes, w_gate, w_up, w_down, chunks, save=save)
    return ys[:xs.shape[0] - chunks[0]], (xs, gs, us, starts)


# the same custom VJP as grouped_experts, on rows that arrive sorted
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def grouped_rows(xs: Array, sizes: Array, w_gate: Array, w_up: Array, w_down: Array,
                 load: int) -> Array:
    """:func:`ragged_rows` by grouped's chunk loops: rows past ``sum(sizes)`` cost nothing
    (and come out zero). ``load`` (static) is the rows expected in all, which sizes the
    chunks (:func:`_chunk_rows`)."""
    return _grouped_rows_forward(xs, sizes, w_gate, w_up, w_down, load, save=False)[0]


def _grouped_rows_fwd(xs, sizes, w_gate, w_up, w_down, load):
    ys, res = _grouped_rows_forward(xs, sizes, w_gate, w_up, w_down, load, save=True)
    return ys, (res, sizes, w_gate, w_up, w_down)


def _grouped_rows_bwd(load, saved, dys):
    (xs, gs, us, starts), sizes, w_gate, w_up, w_down = saved
    chunks = _chunk_rows(load, w_gate.shape[0])
    dys = jnp.concatenate([dys, jnp.zeros((chunks[0], dys.shape[1]), dys.dtype)])
    dxs, dws = _rows_backward(xs, gs, us, dys, starts, sizes, w_gate, w_up, w_down, chunks)
    return (dxs[:dxs.shape[0] - chunks[0]], np.zeros(sizes.shape, jax.dtypes.float0), *dws)


grouped_rows.defvjp(_grouped_rows_fwd, _grouped_rows_bwd)


def resolve_moe_impl(moe_impl: str, platform: str | None = None, *,
                     exchange_wins: bool = False) -> str:
    """Map "auto" to the dropless implementation for ``platform`` (default:
    :func:`satjax.parallel.target_platform`): "grouped" on CPU; elsewhere "all_to_all"
    where exchanging the tokens moves fewer bytes than all-gathering the experts
    (``exchange_wins``:
    :func:`exchange_moves_fewer_bytes` under the mesh), else "ragged"."""
    if moe_impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {moe_impl!r}")
    if moe_impl != "auto":
        return moe_impl
    if (platform or target_platform()) == "cpu":
        return "grouped"
    return "all_to_all" if exchange_wins else "ragged"


def exchange_moves_fewer_bytes(tokens: int, k: int, num_experts: int, hidden: int,
                               width: int, expert_devices: int, embed_devices: int) -> bool:
    """Whether "all_to_all" moves fewer bytes per chip than all-gathering the experts, for
    one layer's forward and backward with ``tokens`` on the device: four exchanges of its
    tokens * k rows (there and back, each transposed in the backward), plus an all-gather
    and a reduce-scatter of its own experts when ``embed_devices`` split them, against an
    all-gather and a gradient all-reduce of all experts (both in the compute dtype). The
    XLA:TPU figures of benchmarks/bench_moe_dispatch.py are these counts (docs/parallel.md):
    at the paper's layer the exchange wins below 16128 tokens per device on
    ``{fsdp: 8, expert: 8}`` (18432 without fsdp)."""
    if expert_devices < 2 or num_experts % expert_devices:
        return False
    expert = 3 * hidden * width
    own = 2 * num_experts // expert_devices * expert if embed_devices > 1 else 0
    return 4 * tokens * k * hidden + own < 2 * num_experts * expert


def dense_einsum_experts(x: Array, experts: Array, weights: Array, w_gate: Array,
                         w_up: Array, w_down: Array) -> Array:
    """All experts on all tokens, mixed by a dropless one-hot combine matrix -> [N, D]."""
    num_experts = w_gate.shape[0]
    combine = jnp.einsum("nke,nk->ne", jax.nn.one_hot(experts, num_experts, dtype=x.dtype),
                         weights.astype(x.dtype))
    g = jnp.einsum("nd,edf->nef", x, w_gate)
    u = jnp.einsum("nd,edf->nef", x, w_up)
    y = jnp.einsum("nef,efd->ned", jax.nn.silu(g) * u, w_down)
    return jnp.einsum("ned,ne->nd", y, combine)


_IMPLS: dict[str, Callable[..., jax.Array]] = {
    "ragged": ragged_experts, "grouped": grouped_experts, "dense_einsum": dense_einsum_experts}


def per_batch_shard(fn, num_tokens: int):
    """``fn`` (a sorted dispatch) run by each batch shard on its own tokens under the
    current mesh, the expert weights replicated; ``fn`` itself without a mesh.

    A dispatch sorts all its tokens by expert: under GSPMD that sort is global, so every
    device would gather every token and run the whole batch's experts. Per shard, each
    device sorts and runs only its tokens.

    The weights enter as one copy per shard (a broadcast over a leading shard axis that
    GSPMD partitions), not as a replicated input: the weight gradients are then summed
    over the shards by the broadcast's transpose, a reduction GSPMD partitions itself,
    instead of the psum shard_map's transpose would emit inside the manual computation
    (whose bf16 form aborts XLA:CPU's all-reduce promotion pass).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return fn
    spec = logical_to_spec(("batch", None), (num_tokens, 1), mesh)
    rows = spec[0] if len(spec) else None  # a spec may leave trailing dims out
    if rows is None:
        return fn
    axes = rows if isinstance(rows, tuple) else (rows,)
    shards = math.prod(mesh.shape[a] for a in axes)
    tok = jax.sharding.PartitionSpec(rows, None)
    per_shard = jax.sharding.PartitionSpec(rows)

    def local(x, experts, weights, *ws):
        return fn(x, experts, weights, *(w[0] for w in ws))

    # manual over the batch axes only (other axes stay with GSPMD); check_vma=False because
    # the dispatch's loop carries start as replicated zeros and become per-shard values
    mapped = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, *(per_shard,) * 3),
                           out_specs=tok, axis_names=set(axes), check_vma=False)

    def run(x, experts, weights, *ws):
        copies = [jax.lax.with_sharding_constraint(
            jnp.broadcast_to(w[None], (shards, *w.shape)), per_shard) for w in ws]
        return mapped(x, experts, weights, *copies)

    return run


# Tokens one sorted dispatch takes at once: more are split into equal chunks run one after
# another, each rematerialised, so a long sequence's N*k sorted rows (and their backward
# buffers) exist one chunk at a time.
MOE_CHUNK_TOKENS = 2048


def in_token_chunks(fn, max_tokens: int = MOE_CHUNK_TOKENS):
    """``fn(x [N, D], experts, weights, *ws)`` run on ``ceil(N / max_tokens)`` equal chunks
    of tokens in turn (a ``lax.map`` of rematerialised calls; the fewest chunks that divide
    N), so its working set is one chunk's; ``fn`` itself for ``N <= max_tokens``."""

    def run(x, experts, weights, *ws):
        n = x.shape[0]
        chunks = next(c for c in range(-(-n // max_tokens), n + 1) if n % c == 0)
        if chunks == 1:
            return fn(x, experts, weights, *ws)

        @jax.checkpoint
        def one(args):
            return fn(*args, *ws)

        split = [a.reshape(chunks, n // chunks, *a.shape[1:]) for a in (x, experts, weights)]
        return jax.lax.map(one, tuple(split)).reshape(x.shape)

    return run


# ----------------------------------------------------------------- expert parallelism
def padded_ragged_all_to_all(operand: Array, output: Array, input_offsets: Array,
                             send_sizes: Array, output_offsets: Array, recv_sizes: Array,
                             axis_name: str) -> Array:
    """``jax.lax.ragged_all_to_all`` (same arguments, same result) as one ``all_to_all``
    of a padded buffer, for backends without the ragged collective (XLA:CPU).

    The slices bound for each device are packed back to back into a block as long as the
    whole operand, so nothing is dropped whatever the sizes, at the price of sending
    axis-size blocks of the operand's length: axis-size times the bytes of the ragged
    collective, mostly zeros.
    """
    p = jax.lax.axis_size(axis_name)
    per = input_offsets.shape[0] // p  # slices per destination
    rows = operand.shape[0]
    trail = (None,) * (operand.ndim - 1)

    def block_rows(sizes: Array, n: int) -> tuple[Array, Array, Array]:
        """Per block of ``per`` slices packed back to back: each of its n rows' slice, the
        slice's first row in the block, and whether the row is inside a slice."""
        packed = jnp.cumsum(sizes, axis=1) - sizes
        r = jnp.arange(n)
        t = jax.vmap(lambda at: jnp.searchsorted(at, r, side="right") - 1)(packed)
        return t, jnp.take_along_axis(packed, t, axis=1), r < jnp.sum(sizes, 1, keepdims=True)

    t, packed, inside = block_rows(send_sizes.reshape(p, per), rows)
    src = jnp.take_along_axis(input_offsets.reshape(p, per), t, axis=1) + jnp.arange(rows) - packed
    send = jnp.where(inside[(..., *trail)], operand[jnp.clip(src, 0, rows - 1)], 0)
    recv = jax.lax.all_to_all(send, axis_name, 0, 0).reshape(p * rows, *operand.shape[1:])
    # receiver: slice i came from device i // per, packed as its sender packed it, and goes
    # to offsets[i]; each output row finds the slice covering it (empty ones cover nothing)
    offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    sizes = recv_sizes.reshape(p, per)
    at = ((jnp.cumsum(sizes, axis=1) - sizes) + rows * jnp.arange(p)[:, None]).reshape(-1)
    starts = jnp.where(recv_sizes > 0, offsets, -1)
    by_start = jnp.argsort(starts)
    q = jnp.arange(output.shape[0])
    i = by_start[jnp.searchsorted(starts[by_start], q, side="right") - 1]
    covered = (q >= offsets[i]) & (q < offsets[i] + recv_sizes[i])
    got = recv[jnp.clip(at[i] + q - offsets[i], 0, p * rows - 1)]
    return jnp.where(covered[(..., *trail)], got, output)


EXCHANGES: dict[str, Callable[..., Array]] = {
    "ragged": jax.lax.ragged_all_to_all, "padded": padded_ragged_all_to_all}


def _exchange_experts(x: Array, experts: Array, weights: Array, w_gate: Array, w_up: Array,
                      w_down: Array, *, kernel: str, exchange: str, axis: str) -> Array:
    """One device's tokens through the experts of every device on ``axis``, by a token
    exchange (inside ``shard_map``). x [n, D], experts/weights [n, k]: this device's
    tokens; w_* [E_l, ...]: its E_l experts, expert e living on device e // E_l.

    The n*k (token, expert) pairs are sorted by expert, hence by the device holding it, and
    each device's slice is sent there (:data:`EXCHANGES`), landing expert-major: a device
    receives its experts' rows already sorted, each expert's rows device by device. It
    runs its experts on them (``kernel``: "grouped" or "ragged"), sends the results back
    by the reverse exchange and combines them with the gate weights. The receive buffer
    holds every pair of the axis (the case of all of them routed to this device's
    experts), so no pair is ever dropped; the exchange moves only the real rows.
    """
    n, k = experts.shape
    m, d = n * k, x.shape[1]
    e_local = w_gate.shape[0]
    p = jax.lax.axis_size(axis)
    order, inverse, sizes = _sort_pairs(experts, e_local * p)
    counts = jax.lax.all_gather(sizes, axis)  # [p, E]: the rows each device sends each expert
    before = jnp.cumsum(counts, axis=0) - counts  # ... of them from lower devices
    sent_at = jnp.cumsum(counts, axis=1) - counts  # the row each slice starts at on its sender
    load = jnp.sum(counts, axis=0).reshape(p, e_local)
    starts = (jnp.cumsum(load, axis=1) - load).reshape(-1)  # e's first row on its device

    me = jax.lax.axis_index(axis)

    def mine(a: Array) -> Array:  # the columns of this device's experts
        return jax.lax.dynamic_slice_in_dim(a, me * e_local, e_local, axis=-1)

    recv_sizes = mine(counts).reshape(-1)  # slice s * E_l + l: device s's rows of expert l
    send = EXCHANGES[exchange]
    xs = send(x[order // k], jnp.zeros((p * m, d), x.dtype), sent_at[me], sizes,
              starts + before[me], recv_sizes, axis_name=axis)
    w = (w_gate, w_up, w_down)
    ys = grouped_rows(xs, load[me], *w, m) if kernel == "grouped" else ragged_rows(xs, load[me], *w)
    y = send(ys, jnp.zeros((m, d), ys.dtype), (mine(starts)[None] + mine(before)).reshape(-1),
             recv_sizes, mine(sent_at).reshape(-1), sizes, axis_name=axis)
    y = y[inverse].reshape(n, k, d)
    return jnp.einsum("nkd,nk->nd", y, weights.astype(y.dtype))


def _mesh_axes(spec: jax.sharding.PartitionSpec, dim: int) -> tuple[str, ...]:
    entry = spec[dim] if dim < len(spec) else None
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def expert_parallel(dtype: jnp.dtype, *, kernel: str, exchange: str):
    """The "all_to_all" dispatch ``fn(x [N, D], experts, weights, w_gate, w_up, w_down)``
    under the current mesh: the expert weights stay where they are stored (experts over
    ``expert``, embed over ``fsdp``, expert MLP over ``tensor``) and the tokens travel
    (:func:`_exchange_experts` over ``expert``). Per device, in ``shard_map`` over every
    mesh axis: the weights (param dtype, cast to ``dtype`` here, so the gradient sum over
    replicas runs in the param dtype) are all-gathered over the axes of their embed
    dimension only; the tokens run in chunks (:func:`in_token_chunks`); with the expert
    MLP split over ``tensor`` each device holds a partial sum, summed in float32. Without a
    mesh, or an ``expert`` axis of size 1, every expert is local: ``kernel``'s dispatch.
    """
    def cast(ws):
        return [w.astype(dtype) for w in ws]

    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        local = in_token_chunks(_IMPLS[kernel])
        return lambda x, experts, weights, *ws: local(x, experts, weights, *cast(ws))
    ep = mesh.shape.get("expert", 1)
    dispatch = _IMPLS[kernel] if ep == 1 else functools.partial(
        _exchange_experts, kernel=kernel, exchange=exchange, axis="expert")
    P = jax.sharding.PartitionSpec

    def run(x, experts, weights, w_gate, w_up, w_down):
        if w_gate.shape[0] % ep:
            raise ValueError(f"moe_impl all_to_all: {w_gate.shape[0]} experts do not divide "
                             f"over the expert axis of {ep} devices")
        rows = logical_to_spec(("batch", None), x.shape, mesh)
        tok = P(rows[0] if len(rows) else None, None)
        up = logical_to_spec(("experts", "embed", "expert_mlp"), w_gate.shape, mesh)
        down = logical_to_spec(("experts", "expert_mlp", "embed"), w_down.shape, mesh)
        embed, partial = _mesh_axes(up, 1), _mesh_axes(up, 2)

        def local(x, experts, weights, w_gate, w_up, w_down):
            w_gate, w_up, w_down = (
                jax.lax.all_gather(w, embed, axis=axis, tiled=True) if embed else w
                for w, axis in zip(cast((w_gate, w_up, w_down)), (1, 1, 2), strict=True))
            out = in_token_chunks(dispatch)(x, experts, weights, w_gate, w_up, w_down)
            if partial:
                out = jax.lax.psum(out.astype(jnp.float32), partial).astype(out.dtype)
            return out

        # check_vma=False: the kernels' loop carries start as replicated zeros
        return jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, up, up, down),
                             out_specs=tok, check_vma=False)(
            x, experts, weights, w_gate, w_up, w_down)

    return run


class Experts(nnx.Module):
    """E SwiGLU experts stored stacked: gate/up [E, D, F], down [E, F, D]."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, param_dtype: jnp.dtype):
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        std = cfg.initializer_range
        self.gate_proj = make_param(rngs, (e, d, f), ("experts", "embed", "expert_mlp"),
                                    param_dtype, std=std)
        self.up_proj = make_param(rngs, (e, d, f), ("experts", "embed", "expert_mlp"),
                                  param_dtype, std=std)
        self.down_proj = make_param(rngs, (e, f, d), ("experts", "expert_mlp", "embed"),
                                    param_dtype, std=std)


class SparseMoeBlock(nnx.Module):
    """Router + experts: ``(x [B, T, D], routed_experts [B, T, k] | None, routed_gates
    [B, T, k] | None) -> (out, RouteRecord)`` with the record's fields shaped [B, T, E] /
    [B, T, k] (:func:`route` for the replays)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, dtype: jnp.dtype, param_dtype: jnp.dtype,
                 moe_impl: str = "auto", platform: str | None = None):
        self.gate = make_param(rngs, (cfg.hidden_size, cfg.num_experts), ("embed", None),
                               param_dtype, std=cfg.initializer_range)
        self.experts = Experts(cfg, rngs=rngs, param_dtype=param_dtype)
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        # the backend the dispatch compiles for; None: the current mesh's devices' (a TPU
        # topology's when compiled from a CPU host), else JAX's default backend, per call
        self.platform = platform
        # "auto" stays unresolved here: under a mesh it depends on the expert axis
        self.moe_impl = moe_impl if moe_impl == "auto" else resolve_moe_impl(moe_impl)
        self.dtype = dtype

    def _exchange_wins(self, tokens: int) -> bool:
        """:func:`exchange_moves_fewer_bytes` for ``tokens`` under the current mesh."""
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            return False
        e, d, f = self.experts.gate_proj.shape
        batch = logical_to_spec(("batch",), (tokens,), mesh)
        embed = logical_to_spec(("experts", "embed", "expert_mlp"), (e, d, f), mesh)
        return exchange_moves_fewer_bytes(
            tokens // math.prod(mesh.shape[a] for a in _mesh_axes(batch, 0)), self.top_k, e,
            d, f, mesh.shape.get("expert", 1),
            math.prod(mesh.shape[a] for a in _mesh_axes(embed, 1)))

    def __call__(self, x: Array, routed_experts: Array | None = None,
                 routed_gates: Array | None = None) -> tuple[Array, RouteRecord]:
        b, t, d = x.shape
        flat = constrain(x.reshape(b * t, d), ("batch", None))
        logits = (flat @ self.gate[...].astype(self.dtype)).astype(jnp.float32)

        def flat_k(a: Array | None) -> Array | None:
            return None if a is None else a.reshape(b * t, self.top_k)

        rec = route(logits, self.top_k, self.norm_topk_prob, flat_k(routed_experts),
                    flat_k(routed_gates))
        weights = rec.weights.astype(self.dtype)  # HF casts gate weights to the hidden dtype
        params = (self.experts.gate_proj, self.experts.up_proj, self.experts.down_proj)
        platform = self.platform or target_platform()
        impl = resolve_moe_impl(self.moe_impl, platform,
                                exchange_wins=self._exchange_wins(b * t))
        if impl == "all_to_all":  # the weights stay sharded; the tokens travel
            cpu = platform == "cpu"  # XLA:CPU has no ragged-all-to-all
            dispatch = expert_parallel(self.dtype, kernel=resolve_moe_impl("auto", platform),
                                       exchange="padded" if cpu else "ragged")
            ws = [p[...] for p in params]  # cast per device, after the gradient's sum
        else:
            # The sorted dispatches gather per-group expert weights, which GSPMD cannot do on
            # sharded weights without a full rematerialisation: all-gather them explicitly
            # (dense_einsum keeps them sharded over experts).
            keep = ("experts", None, None) if impl == "dense_einsum" else (None,) * 3
            ws = [constrain(p[...].astype(self.dtype), keep) for p in params]
            dispatch = _IMPLS[impl]
            if impl != "dense_einsum":
                dispatch = per_batch_shard(in_token_chunks(dispatch), b * t)
        out = constrain(dispatch(flat, rec.experts_used, weights, *ws), ("batch", None))
        return out.reshape(b, t, d), jax.tree.map(lambda a: a.reshape(b, t, -1), rec)
