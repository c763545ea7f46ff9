"""Sparse MoE block (HF ``Qwen3MoeSparseMoeBlock``) with dropless batched expert dispatch.

Routing: ``probs = softmax(x @ W_router)`` over all experts (float32), top-k by prob, gate
weights renormalised over the k chosen experts iff ``norm_topk_prob``. With R3 replay the
experts that run come from ``routed_experts`` (the engine's record) and the gate weights are
the model's own ``probs`` gathered at them (renormalised the same way), so the router still
receives gradients. The block reports both the router's own top-k (``router_topk``) and what
ran (``experts_used``) in a :class:`RouteRecord`.

Three dispatch implementations, all dropless (no capacity factor, no token is ever
dropped), so replaying the model's own routes reproduces the non-replay forward exactly:

* ``"ragged"``: sort the N*k token-expert pairs by expert and run the three expert matmuls
  with ``jax.lax.ragged_dot``; cost O(N*k) where the backend has a grouped-GEMM kernel
  (GPU/TPU). Under a GSPMD mesh with expert weights sharded over an axis XLA all-gathers
  the expert weights (correct, not EP-optimal).
* ``"blocked"``: the same sort, but each expert's group is padded to a multiple of a block
  size and the blocks run as one batched matmul against per-block gathered expert weights
  (MegaBlocks-style, static shapes); cost O(N*k + E*block). XLA:CPU lowers ragged_dot
  densely, so this is ~4x faster there.
* ``"bucketed"``: the same sort into E per-expert buckets of one static capacity C, run as
  one [E, C, D] batched matmul against the expert weights as stored (no per-block weight
  gather, whose copies and per-block weight gradients dominate "blocked" on CPU). C is the
  smallest of ``BUCKET_FACTORS`` x N*k/E (rounded up to 8) that holds the busiest expert,
  picked at run time with ``lax.switch``; when none does the step falls back to "blocked",
  so it stays dropless and exact; cost O(N*k*factor) in the common case.
* ``"auto"`` (default): "blocked" on CPU, "ragged" elsewhere.
* ``"dense_einsum"``: every expert runs on every token and a [N, E] combine matrix (zero
  for unselected experts) mixes the results; cost O(N*E) but shards cleanly over experts
  (each device computes its experts, one all-reduce combines).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from satjax.model.layers import make_param
from satjax.parallel import constrain

Array = jax.Array
MOE_IMPLS = ("auto", "bucketed", "blocked", "ragged", "dense_einsum")
# bucket capacities of "bucketed" as multiples of the mean expert load N*k/E: 1.25 holds a
# near-balanced router, 2 and 3 skewed ones; past 3 the blocked fallback does less work
BUCKET_FACTORS = (1.25, 2.0, 3.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouteRecord:
    """What one MoE layer's router decided and what ran, per token.

    router_logits f32 [..., E]  the router's logits
    router_topk   i32 [..., k]  the router's own top-k, descending probability
    experts_used  i32 [..., k]  the experts that ran: the replayed ``routed_experts`` under
                                R3, else equal to ``router_topk``
    weights           [..., k]  gate weights of ``experts_used`` (compute dtype)
    """

    router_logits: Array
    router_topk: Array
    experts_used: Array
    weights: Array


def route(router_logits: Array, k: int, norm_topk_prob: bool,
          routed_experts: Array | None = None) -> RouteRecord:
    """Top-k routing from float32 logits [N, E]; ``routed_experts`` [N, k] replays experts."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    top_p, top_i = jax.lax.top_k(probs, k)
    top_i = top_i.astype(jnp.int32)
    if routed_experts is None:
        experts, weights = top_i, top_p
    else:
        # clipped so padding rows holding e.g. -1 stay harmless (their outputs are masked)
        experts = jnp.clip(routed_experts.astype(jnp.int32), 0, router_logits.shape[-1] - 1)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return RouteRecord(router_logits=router_logits, router_topk=top_i, experts_used=experts,
                       weights=weights)


def ragged_experts(x: Array, experts: Array, weights: Array, w_gate: Array, w_up: Array,
                   w_down: Array) -> Array:
    """Dropless sorted dispatch. x [N, D]; experts/weights [N, k]; w_* [E, ...] -> [N, D]."""
    n, k = experts.shape
    num_experts = w_gate.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    inverse = jnp.argsort(order)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    xs = x[order // k]
    g = jax.lax.ragged_dot(xs, w_gate, group_sizes)
    u = jax.lax.ragged_dot(xs, w_up, group_sizes)
    y = jax.lax.ragged_dot(jax.nn.silu(g) * u, w_down, group_sizes)
    y = y[inverse].reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", y, weights.astype(y.dtype))


def _block_size(m: int, num_experts: int) -> int:
    """Power of two in [8, 128] near m / (4 E): padding waste stays <= ~25% + E blocks."""
    target = max(m // (4 * num_experts), 1)
    return int(min(max(1 << (target.bit_length() - 1), 8), 128))


def blocked_experts(x: Array, experts: Array, weights: Array, w_gate: Array, w_up: Array,
                    w_down: Array) -> Array:
    """Dropless block-padded dispatch. x [N, D]; experts/weights [N, k] -> [N, D]."""
    n, k = experts.shape
    num_experts = w_gate.shape[0]
    m = n * k
    bk = _block_size(m, num_experts)
    num_blocks = -(-m // bk) + num_experts  # static bound on sum_e ceil(size_e / bk)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sorted_e = flat[order]
    sizes = jnp.bincount(flat, length=num_experts)
    padded = (sizes + bk - 1) // bk * bk
    start, padded_start = jnp.cumsum(sizes) - sizes, jnp.cumsum(padded) - padded
    dest = (padded_start[sorted_e] + jnp.arange(m) - start[sorted_e]).astype(jnp.int32)
    slot = jnp.zeros((m,), jnp.int32).at[order].set(dest)  # padded row of each (token, j)
    xs = jnp.zeros((num_blocks * bk, x.shape[1]), x.dtype).at[slot].set(
        jnp.repeat(x, k, axis=0))
    block_expert = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(num_blocks) * bk,
                                    side="right")
    block_expert = jnp.minimum(block_expert, num_experts - 1)  # unused tail blocks: zeros
    xs = xs.reshape(num_blocks, bk, -1)
    g = jnp.einsum("bcd,bdf->bcf", xs, w_gate[block_expert])
    u = jnp.einsum("bcd,bdf->bcf", xs, w_up[block_expert])
    y = jnp.einsum("bcf,bfd->bcd", jax.nn.silu(g) * u, w_down[block_expert])
    y = y.reshape(num_blocks * bk, -1)[slot].reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", y, weights.astype(y.dtype))


def _bucket_experts(x: Array, experts: Array, weights: Array, w_gate: Array, w_up: Array,
                    w_down: Array, capacity: int) -> Array:
    """Sorted dispatch into [E, capacity] buckets; requires every expert's load <= capacity."""
    n, k = experts.shape
    num_experts = w_gate.shape[0]
    m = n * k
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sorted_e = flat[order]
    sizes = jnp.bincount(flat, length=num_experts)
    start = jnp.cumsum(sizes) - sizes
    dest = (sorted_e * capacity + jnp.arange(m) - start[sorted_e]).astype(jnp.int32)
    slot = jnp.zeros((m,), jnp.int32).at[order].set(dest)  # bucket row of each (token, j)
    # each bucket row names its source token; empty rows read an appended zero row
    src = jnp.full((num_experts * capacity,), n, jnp.int32).at[slot].set(
        jnp.arange(m, dtype=jnp.int32) // k)
    xs = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[src]
    xs = xs.reshape(num_experts, capacity, -1)
    g = jnp.einsum("ecd,edf->ecf", xs, w_gate)
    u = jnp.einsum("ecd,edf->ecf", xs, w_up)
    y = jnp.einsum("ecf,efd->ecd", jax.nn.silu(g) * u, w_down)
    y = y.reshape(num_experts * capacity, -1)[slot].reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", y, weights.astype(y.dtype))


def bucket_capacities(m: int, num_experts: int) -> tuple[int, ...]:
    """Static capacities (multiples of 8) tried by "bucketed" for m = N*k pairs; the list
    stops at the first one that holds all m (then no fallback is needed)."""
    caps: list[int] = []
    for f in BUCKET_FACTORS:
        c = min(math.ceil(m * f / num_experts / 8) * 8, math.ceil(m / 8) * 8)
        if not caps or c > caps[-1]:
            caps.append(c)
        if c >= m:
            break
    return tuple(caps)


def _bucketed_branches(experts: Array, num_experts: int) -> tuple[Array, list]:
    """The ``lax.switch`` index and branches of "bucketed" for routes [N, k]."""
    n, k = experts.shape
    caps = bucket_capacities(n * k, num_experts)
    branches = [functools.partial(_bucket_experts, capacity=c) for c in caps]
    if caps[-1] < n * k:
        branches.append(blocked_experts)
    busiest = jnp.max(jnp.bincount(experts.reshape(-1), length=num_experts))
    return jnp.sum(busiest > jnp.asarray(caps, jnp.int32)).astype(jnp.int32), branches


# A custom VJP because differentiating lax.switch makes every branch return the residuals
# of all branches (zero-filled), which costs more than the matmuls; the backward instead
# recomputes the taken branch's forward from the inputs (MoE-block rematerialisation).
@jax.custom_vjp
def bucketed_experts(x: Array, experts: Array, weights: Array, w_gate: Array, w_up: Array,
                     w_down: Array) -> Array:
    """Dropless bucketed dispatch (see module docstring). x [N, D]; experts [N, k] -> [N, D]."""
    index, branches = _bucketed_branches(experts, w_gate.shape[0])
    return jax.lax.switch(index, branches, x, experts, weights, w_gate, w_up, w_down)


def _bucketed_fwd(x, experts, weights, w_gate, w_up, w_down):
    out = bucketed_experts(x, experts, weights, w_gate, w_up, w_down)
    return out, (x, experts, weights, w_gate, w_up, w_down)


def _bucketed_bwd(res, g):
    x, experts, weights, w_gate, w_up, w_down = res
    index, branches = _bucketed_branches(experts, w_gate.shape[0])

    def grad_of(branch):
        def f(x, weights, w_gate, w_up, w_down, g):
            _, vjp = jax.vjp(lambda *a: branch(a[0], experts, *a[1:]), x, weights, w_gate,
                             w_up, w_down)
            return vjp(g)
        return f

    dx, dweights, dg, du, dd = jax.lax.switch(index, [grad_of(b) for b in branches], x,
                                              weights, w_gate, w_up, w_down, g)
    zero_experts = np.zeros(experts.shape, jax.dtypes.float0)
    return dx, zero_experts, dweights, dg, du, dd


bucketed_experts.defvjp(_bucketed_fwd, _bucketed_bwd)


def resolve_moe_impl(moe_impl: str) -> str:
    """Map "auto" to the fastest dropless implementation for the default backend."""
    if moe_impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {moe_impl!r}")
    if moe_impl == "auto":
        return "blocked" if jax.default_backend() == "cpu" else "ragged"
    return moe_impl


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


_IMPLS = {"ragged": ragged_experts, "blocked": blocked_experts,
          "bucketed": bucketed_experts,
          "dense_einsum": dense_einsum_experts}


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
    """Router + experts: ``(x [B, T, D], routed_experts [B, T, k] | None) -> (out, RouteRecord)``
    with the record's fields shaped [B, T, E] / [B, T, k]."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, dtype: jnp.dtype, param_dtype: jnp.dtype,
                 moe_impl: str = "auto"):
        self.gate = make_param(rngs, (cfg.hidden_size, cfg.num_experts), ("embed", None),
                               param_dtype, std=cfg.initializer_range)
        self.experts = Experts(cfg, rngs=rngs, param_dtype=param_dtype)
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.moe_impl = resolve_moe_impl(moe_impl)
        self.dtype = dtype

    def __call__(self, x: Array, routed_experts: Array | None = None
                 ) -> tuple[Array, RouteRecord]:
        b, t, d = x.shape
        flat = constrain(x.reshape(b * t, d), ("batch", None))
        logits = (flat @ self.gate[...].astype(self.dtype)).astype(jnp.float32)
        flat_replay = (None if routed_experts is None
                       else routed_experts.reshape(b * t, self.top_k))
        rec = route(logits, self.top_k, self.norm_topk_prob, flat_replay)
        weights = rec.weights.astype(self.dtype)  # HF casts gate weights to the hidden dtype
        # The sorted dispatches gather per-group expert weights, which GSPMD cannot do on
        # sharded weights without a full rematerialisation: all-gather them explicitly
        # (dense_einsum keeps them sharded over experts).
        keep = ("experts", None, None) if self.moe_impl == "dense_einsum" else (None,) * 3
        ws = [constrain(p[...].astype(self.dtype), keep) for p in
              (self.experts.gate_proj, self.experts.up_proj, self.experts.down_proj)]
        out = constrain(_IMPLS[self.moe_impl](flat, rec.experts_used, weights, *ws),
                        ("batch", None))
        rec = RouteRecord(router_logits=logits, router_topk=rec.router_topk,
                          experts_used=rec.experts_used, weights=weights)
        return out.reshape(b, t, d), jax.tree.map(lambda a: a.reshape(b, t, -1), rec)
