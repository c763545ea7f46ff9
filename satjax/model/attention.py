"""Causal self-attention over a full (padded) sequence, in four interchangeable implementations.

All take q [B, T, H, Dh], k and v [B, T, Hkv, Dh] (grouped-query attention: H a multiple
of Hkv, Hkv = 1 is multi-query) and ``valid`` bool [B, T], which slots hold real tokens.
Query slot t attends key slot s iff ``s <= t and valid[s]`` (causal by slot index; padding
anywhere is excluded as a key):

    out[b, t, h] = sum_s softmax_s(q[b, t, h] . k[b, s, h // G] / sqrt(Dh)) v[b, s, h // G]

with scores and softmax statistics in float32 and the output in q's dtype. Outputs at
padded query slots (``valid[t]`` False) are implementation-defined and must not be used;
with a zero cotangent there (the model's loss masks them) every implementation has the
same gradients.

* ``"reference"``: the masked softmax over [B, Hkv, G, T', S'] scores, the queries split
  into up to 4 causal blocks (:func:`causal_blocks`) that skip the keys past their last
  query. Its backward stores the probabilities: O(T^2) memory per head.
* ``"blockwise"``: pure-JAX flash attention (:func:`blockwise_attention`): online softmax
  over key blocks, a custom VJP that saves only q, k, v, out and the per-row log-sum-exp
  and recomputes each block's probabilities in the backward. O(T) memory, any backend.
* ``"cudnn"``: cuDNN's fused flash attention through ``jax.nn.dot_product_attention``
  (:func:`cudnn_attention`); NVIDIA GPUs only, right padding only.
* ``"splash"``: the Pallas TPU splash attention kernel (:func:`splash_attention`); TPU only
  (or Pallas interpret mode anywhere, for tests).
* ``"auto"``: chosen per call by :func:`resolve_attention` from the backend, the
  sequence length and (on GPU) the dtype and head size.

The KV-cache path of the sampler (a [B, T, S] mask over a cache) is :func:`masked_attention`.

References:
  Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness",
  arXiv:2205.14135. Dao, "FlashAttention-2: Faster Attention with Better Parallelism and
  Work Partitioning", arXiv:2307.08691. Milakov & Gimelshein, "Online normalizer
  calculation for softmax", arXiv:1805.02867. Rabe & Staats, "Self-attention Does Not Need
  O(n^2) Memory", arXiv:2112.05682.
"""

from __future__ import annotations

import functools
import typing
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from satjax.config import AttentionImpl
from satjax.parallel import logical_to_spec, target_platform

Array = jax.Array
ATTENTION_IMPLS: tuple[str, ...] = typing.get_args(AttentionImpl)
# On CPU, "auto" keeps the reference below this many tokens (every tiny-model run, T <= 512,
# stays numerically unchanged) and switches to "blockwise" from it on: fwd+bwd time of the
# tiny model's attention at equal tokens per call, blockwise / reference, was 1.66 at T=256,
# 1.17 at 512, 0.63 at 1024, 0.44 at 2048 (benchmarks/bench_attention.py, 2 CPUs, jax 0.10.2;
# docs/model.md).
CPU_BLOCKWISE_MIN_LEN = 1024
# query and key block of "blockwise": on CPU blocks of 128 and 256 ran fwd+bwd within the
# noise of each other and 512 up to ~2x slower at T = 512..4096 (the same benchmark,
# --block-sizes); fewer, larger blocks may suit a GPU better (the block_size keyword)
BLOCKWISE_BLOCK = 256
SPLASH_BLOCK = 512  # every block size of "splash" (capped at T rounded up to 128)
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: fully masked rows stay NaN-free
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
_CUDNN_MAX_HEAD_DIM = 128  # 256 on Hopper and later; 128 holds on every cuDNN-capable GPU


def resolve_attention(impl: str, seq_len: int, backend: str | None = None, *,
                      dtype: jnp.dtype | None = None, head_dim: int | None = None) -> str:
    """The implementation ``impl`` stands for at sequence length ``seq_len``.

    ``"auto"`` resolves by backend (default :func:`satjax.parallel.target_platform`: the
    current mesh's devices', else JAX's default backend):

    * TPU: ``"splash"``.
    * GPU (CUDA): ``"cudnn"``, except where cuDNN's flash attention cannot run the call, then
      ``"blockwise"``: a ``dtype`` other than bfloat16/float16 (e.g. float32 compute) or a
      ``head_dim`` that is not a multiple of 8 or exceeds 128 (Hopper allows 256; 128 is
      assumed everywhere). ``None`` means "assume supported".
    * CPU (and anything else): ``"reference"`` below :data:`CPU_BLOCKWISE_MIN_LEN` tokens,
      ``"blockwise"`` from it on.

    Other names are returned unchanged; an unknown name raises ValueError.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    backend = backend or target_platform()
    if backend == "tpu":
        return "splash"
    if backend in ("gpu", "cuda"):
        dtype_ok = dtype is None or jnp.dtype(dtype) in [jnp.dtype(d) for d in _CUDNN_DTYPES]
        head_ok = head_dim is None or (head_dim % 8 == 0 and head_dim <= _CUDNN_MAX_HEAD_DIM)
        return "cudnn" if dtype_ok and head_ok else "blockwise"
    return "reference" if seq_len < CPU_BLOCKWISE_MIN_LEN else "blockwise"


def causal_attention(q: Array, k: Array, v: Array, valid: Array, *, impl: str = "auto",
                     block_size: int | None = None, interpret: bool = False) -> Array:
    """Causal GQA self-attention of a full padded sequence (module docstring).

    q [B, T, H, Dh]; k, v [B, T, Hkv, Dh]; valid bool [B, T] -> [B, T, H, Dh] in q's dtype.
    ``impl`` is one of :data:`ATTENTION_IMPLS` ("auto" resolves from T, the backend, q's
    dtype and Dh); ``block_size`` overrides the block of "blockwise" / "splash";
    ``interpret`` runs "splash" in Pallas interpret mode (any backend).
    """
    impl = resolve_attention(impl, q.shape[1], dtype=q.dtype, head_dim=q.shape[-1])
    if impl == "reference":
        return reference_attention(q, k, v, valid)
    if impl == "cudnn":
        return cudnn_attention(q, k, v, valid)
    blocks = {} if block_size is None else {"block_size": block_size}
    if impl == "blockwise":
        return blockwise_attention(q, k, v, valid, **blocks)
    return splash_attention(q, k, v, valid, interpret=interpret, **blocks)


# ----------------------------------------------------------------------------- reference
def causal_blocks(t: int) -> int:
    """Query blocks of the reference over t tokens: 4 while each block keeps >= 64 queries
    (smaller ones run the score matmuls inefficiently), else fewer."""
    for blocks in (4, 2):
        if t % blocks == 0 and t // blocks >= 64:
            return blocks
    return 1


def masked_attention(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """Softmax attention of q [B, T, H, Dh] over k, v [B, S, Hkv, Dh] where mask bool
    [B, T, S] allows it -> [B, T, H, Dh] in q's dtype; scores and softmax in float32.

    A fully masked row gets the mean of v (finite mask value, no NaN)."""
    b, t, h, d = q.shape
    hkv = k.shape[2]
    q = q.reshape(b, t, hkv, h // hkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k).astype(jnp.float32)
    scores = scores * (d ** -0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, d)


def reference_attention(q: Array, k: Array, v: Array, valid: Array) -> Array:
    """:func:`masked_attention` with the causal-and-valid-key mask, the queries split into
    :func:`causal_blocks` blocks that each attend only the keys up to their last query (the
    skipped probabilities are exactly 0, so values are those of one masked softmax; at 4
    blocks 3/8 of the score and value work is saved). Memory O(T^2) per head."""
    t = q.shape[1]
    slots = jnp.arange(t)
    mask = (slots[None, :, None] >= slots[None, None, :]) & valid[:, None, :]
    size = t // causal_blocks(t)
    return jnp.concatenate([
        masked_attention(q[:, lo:lo + size], k[:, :lo + size], v[:, :lo + size],
                         mask[:, lo:lo + size, :lo + size])
        for lo in range(0, t, size)], axis=1)


# ----------------------------------------------------------------------------- blockwise
def blockwise_attention(q: Array, k: Array, v: Array, valid: Array, *,
                        block_size: int = BLOCKWISE_BLOCK) -> Array:
    """Flash attention in pure JAX: O(T) memory in the forward and the backward.

    Shapes as :func:`causal_attention`. T is padded to a multiple of the block
    ``c = min(block_size, T)`` (padded slots are invalid keys). Query block i visits key
    blocks 0..i (causal block skipping), keeping per row the running max m, normaliser l and
    unnormalised output acc in float32 (online softmax, arXiv:1805.02867):

        m' = max(m, max_s s),  l' = l e^(m - m') + sum_s e^(s - m'),
        acc' = acc e^(m - m') + sum_s e^(s - m') v_s,   out = acc / l,  lse = m + log l.

    The VJP (FlashAttention-2, arXiv:2307.08691, Alg. 2) saves only q, k, v, out and lse
    and, per key block j and query block i >= j, recomputes P = exp(S - lse) and

        dV_j += P^T dO_i,  dS = P * (dO_i V_j^T - rowsum(dO_i * O_i)),
        dQ_i += dS K_j / sqrt(Dh),  dK_j += dS^T Q_i / sqrt(Dh).

    GQA runs as grouped einsums, never repeating k/v. A query with no valid key (a padded
    slot before the first real token) outputs 0. Probabilities are cast to v's dtype for
    the value product, as the reference does; accumulators are float32. Under a mesh it
    runs per device (:func:`_per_shard`), so the block loops never see a sharded array.
    """

    def local(q, k, v, valid):
        b, t, h, d = q.shape
        hkv = k.shape[2]
        c = min(block_size, t)
        pad = -t % c
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        qg = jnp.pad(q, widths).reshape(b, t + pad, hkv, h // hkv, d)
        out = _flash(qg, jnp.pad(k, widths), jnp.pad(v, widths),
                     jnp.pad(valid, ((0, 0), (0, pad))), c)
        return out[:, :t].reshape(b, t, h, d)

    return _per_shard(local, q, k, v, valid)


def _block_scores(qi: Array, kj: Array, valid_j: Array, i: Array, j: Array, c: int
                  ) -> Array:
    """Scaled float32 scores [B, Hkv, G, c, c] of query block i against key block j, -inf
    where the key is later than the query or invalid."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=jnp.float32)
    s = s * (qi.shape[-1] ** -0.5)
    q_pos = i * c + jnp.arange(c)
    k_pos = j * c + jnp.arange(c)
    allowed = (q_pos[:, None] >= k_pos[None, :]) & valid_j[:, None, None, None, :]
    return jnp.where(allowed, s, -jnp.inf)


def _block(x: Array, i: Array, c: int, axis: int = 1) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, i * c, c, axis=axis)


def _flash_forward(q: Array, k: Array, v: Array, valid: Array, c: int
                   ) -> tuple[Array, Array]:
    """Grouped q [B, Tp, Hkv, G, Dh], k/v [B, Tp, Hkv, Dh], valid [B, Tp] (Tp = n c) ->
    (out like q, lse f32 [B, Hkv, G, Tp]; 0 on rows without a valid key)."""
    b, tp, hkv, g, d = q.shape
    stats = (b, hkv, g, c)

    def query_block(i, carry):
        out, lse = carry
        qi = _block(q, i, c)

        def key_block(j, state):
            m, l, acc = state
            s = _block_scores(qi, _block(k, j, c), _block(valid, j, c), i, j, c)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            # rows with no valid key so far keep m = -inf; shift them by 0 (their p are 0)
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - shift[..., None])
            corr = jnp.exp(m - shift)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), _block(v, j, c),
                            preferred_element_type=jnp.float32)
            return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv

        init = (jnp.full(stats, -jnp.inf, jnp.float32), jnp.zeros(stats, jnp.float32),
                jnp.zeros(stats + (d,), jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, i + 1, key_block, init)
        seen = l > 0
        o = acc / jnp.where(seen, l, 1.0)[..., None]
        # any finite lse works for rows without a valid key: all their scores are -inf
        lse_i = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
        out = jax.lax.dynamic_update_slice_in_dim(
            out, jnp.einsum("bkgqd->bqkgd", o).astype(out.dtype), i * c, axis=1)
        lse = jax.lax.dynamic_update_slice_in_dim(lse, lse_i, i * c, axis=3)
        return out, lse

    init = (jnp.zeros_like(q), jnp.zeros((b, hkv, g, tp), jnp.float32))
    return jax.lax.fori_loop(0, tp // c, query_block, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q: Array, k: Array, v: Array, valid: Array, c: int) -> Array:
    return _flash_forward(q, k, v, valid, c)[0]


def _flash_fwd(q, k, v, valid, c):
    out, lse = _flash_forward(q, k, v, valid, c)
    return out, (q, k, v, valid, out, lse)


def _flash_bwd(c, res, d_out):
    q, k, v, valid, out, lse = res
    n, scale = q.shape[1] // c, q.shape[-1] ** -0.5
    # D_i = rowsum(dO_i * O_i), FlashAttention-2's correction term [B, Hkv, G, Tp]; a
    # reduction, not a dot, so XLA fuses the float32 casts instead of materialising them
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    delta = jnp.einsum("bqkg->bkgq", delta)

    def key_block(j, carry):
        dq, dk, dv = carry
        kj, vj, valid_j = _block(k, j, c), _block(v, j, c), _block(valid, j, c)

        def query_block(i, state):
            dq, dkj, dvj = state
            qi, doi = _block(q, i, c), _block(d_out, i, c)
            s = _block_scores(qi, kj, valid_j, i, j, c)
            p = jnp.exp(s - _block(lse, i, c, axis=3)[..., None])  # masked -> exactly 0
            dvj = dvj + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(doi.dtype), doi,
                                   preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj, preferred_element_type=jnp.float32)
            ds = (p * (dp - _block(delta, i, c, axis=3)[..., None])).astype(q.dtype)
            dqi = jnp.einsum("bkgqs,bskd->bqkgd", ds, kj, preferred_element_type=jnp.float32)
            dq = jax.lax.dynamic_update_slice_in_dim(dq, _block(dq, i, c) + dqi * scale,
                                                     i * c, axis=1)
            dkj = dkj + jnp.einsum("bkgqs,bqkgd->bskd", ds, qi,
                                   preferred_element_type=jnp.float32) * scale
            return dq, dkj, dvj

        zeros = jnp.zeros(kj.shape, jnp.float32)
        dq, dkj, dvj = jax.lax.fori_loop(j, n, query_block, (dq, zeros, zeros))
        dk = jax.lax.dynamic_update_slice_in_dim(dk, dkj, j * c, axis=1)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, dvj, j * c, axis=1)
        return dq, dk, dv

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
            jnp.zeros(v.shape, jnp.float32))
    dq, dk, dv = jax.lax.fori_loop(0, n, key_block, init)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------- cuDNN
def cudnn_attention(q: Array, k: Array, v: Array, valid: Array, *,
                    implementation: Literal["cudnn", "xla"] = "cudnn") -> Array:
    """cuDNN flash attention via ``jax.nn.dot_product_attention(is_causal=True,
    key_value_seq_lengths=valid.sum(1))``; shapes as :func:`causal_attention`.

    cuDNN takes a key length per row, not a mask, so this assumes RIGHT padding (each row's
    valid slots are a prefix). That is checked when ``valid`` is a concrete array; under
    ``jit`` it cannot be, and left- or middle-padded rows would silently attend padding.
    Rows of length 0 are given length 1 so their (unused) outputs stay finite. cuDNN needs
    bfloat16/float16 inputs and Dh a multiple of 8 up to 128 (256 on Hopper): see
    :func:`resolve_attention`. ``implementation="xla"`` runs the same call through XLA, which
    is how the argument construction is tested on CPU; the cuDNN kernel itself has not been
    run in this repository (no GPU here).
    """
    if not isinstance(valid, jax.core.Tracer):
        rows = np.asarray(valid, bool)
        if np.any(rows[:, 1:] & ~rows[:, :-1]):
            raise ValueError("cudnn attention needs right padding: each row of valid must be "
                             "a prefix of True")
    lengths = jnp.maximum(jnp.sum(valid, axis=1, dtype=jnp.int32), 1)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                        key_value_seq_lengths=lengths,
                                        implementation=implementation)


# ----------------------------------------------------------------------------- splash
def splash_attention(q: Array, k: Array, v: Array, valid: Array, *,
                     block_size: int = SPLASH_BLOCK, interpret: bool = False) -> Array:
    """The Pallas TPU splash attention kernel (``jax.experimental.pallas.ops.tpu.
    splash_attention``, ``make_splash_mha`` with native GQA), vmapped over the batch.

    Shapes as :func:`causal_attention`. Padding becomes segment ids (real tokens segment 0,
    padding segment 1) and-ed with a causal mask, so padding anywhere is excluded as a key;
    a padded query attends the padding before it (never an empty row). T is padded to a
    multiple of the block ``min(block_size, T rounded up to 128)``, used for every forward
    and backward block. The kernel does not scale, so q is multiplied by 1/sqrt(Dh) first
    (in q's dtype). Under a mesh the kernel runs per device (:func:`_per_shard`).
    ``interpret=True`` runs it in Pallas interpret mode (any backend; slow, for tests).
    """
    # imported here: the TPU kernel module costs ~0.7 s to import and only TPU runs need it
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as splash_mask,
    )

    def local(q, k, v, valid):
        b, t, h, d = q.shape
        c = min(block_size, -(-t // 128) * 128)
        tp = -(-t // c) * c
        widths = ((0, 0), (0, 0), (0, tp - t), (0, 0))
        # kernel layout [B, heads, T, Dh]
        qt, kt, vt = (jnp.pad(jnp.swapaxes(x, 1, 2), widths) for x in (q, k, v))
        qt = qt * jnp.asarray(d ** -0.5, qt.dtype)
        segments = jnp.pad(jnp.where(valid, 0, 1).astype(jnp.int32), ((0, 0), (0, tp - t)),
                           constant_values=1)
        blocks = splash.BlockSizes(block_q=c, block_kv=c, block_kv_compute=c, block_q_dkv=c,
                                   block_kv_dkv=c, block_kv_dkv_compute=c, block_q_dq=c,
                                   block_kv_dq=c)
        mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((tp, tp))] * h)
        kernel = splash.make_splash_mha(mask, block_sizes=blocks, head_shards=1,
                                        q_seq_shards=1, interpret=interpret)
        out = jax.vmap(kernel)(qt, kt, vt, splash.SegmentIds(q=segments, kv=segments))
        return jnp.swapaxes(out[:, :, :t], 1, 2)

    return _per_shard(local, q, k, v, valid)


def _per_shard(fn, q: Array, k: Array, v: Array, valid: Array) -> Array:
    """``fn(q, k, v, valid)`` run by each device on its own batch rows (and its own heads
    when both H and Hkv divide over ``tensor``) under the current mesh; ``fn`` itself
    without one; mesh axes neither of those use hold replicas. A Pallas kernel is a
    per-device program that GSPMD cannot partition, and the blockwise loops' carries would
    otherwise be left to GSPMD's propagation."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return fn(q, k, v, valid)
    P = jax.sharding.PartitionSpec
    q_spec = tuple(logical_to_spec(("batch", "length", "q_heads", None), q.shape, mesh))
    kv_spec = tuple(logical_to_spec(("batch", "length", "kv_heads", None), k.shape, mesh))
    rows = q_spec[0] if q_spec else None
    q_heads = q_spec[2] if len(q_spec) > 2 else None
    kv_heads = kv_spec[2] if len(kv_spec) > 2 else None
    heads = q_heads if q_heads == kv_heads else None  # a kv head's queries on its device
    x_spec = P(rows, None, heads, None)
    # Every axis manual, the unused ones replicated: Mosaic refuses a kernel left to GSPMD
    # on any axis, even one of size 1 (found compiling for a TPU topology).
    # check_vma=False: the kernels' loop carries start as replicated zeros
    return jax.shard_map(fn, mesh=mesh, in_specs=(x_spec, x_spec, x_spec, P(rows, None)),
                         out_specs=x_spec, check_vma=False)(q, k, v, valid)
