"""Dense building blocks of the Qwen3-MoE decoder: RMSNorm, RoPE, GQA attention, SwiGLU.

Parameters are stored in the JAX ``x @ W`` layout and carry logical axis names (mapped to
mesh axes by ``satjax.parallel.LOGICAL_RULES``) in their ``out_sharding`` metadata;
``eager_sharding=False`` so a model can be built without a mesh and sharded later.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from satjax.model.attention import causal_attention, masked_attention, resolve_attention

Array = jax.Array


def make_param(rngs: nnx.Rngs | None, shape: Sequence[int], names: tuple[str | None, ...],
               param_dtype: jnp.dtype, *, std: float | None = 0.02) -> nnx.Param:
    """A parameter initialised N(0, std) (or ones when ``std is None``) with logical axes."""
    if std is None:
        value = jnp.ones(shape, param_dtype)
    else:
        assert rngs is not None
        value = std * jax.random.normal(rngs.params(), tuple(shape), param_dtype)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


class RMSNorm(nnx.Module):
    """``w * x / sqrt(mean(x^2) + eps)``, normalised in float32 like HF ``Qwen3MoeRMSNorm``."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype, param_dtype: jnp.dtype):
        self.weight = make_param(None, (dim,), (None,), param_dtype, std=None)
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(self.dtype) * normed.astype(self.dtype)


def rope_cos_sin(positions: Array, head_dim: int, theta: float, dtype: jnp.dtype
                 ) -> tuple[Array, Array]:
    """cos/sin tables [B, T, head_dim] for integer positions [B, T] (HF 'default' rope)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate-half RoPE. x: [B, T, H, Dh]; cos/sin: [B, T, Dh]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


class Attention(nnx.Module):
    """Grouped-query attention with per-head q/k RMSNorm and RoPE, optional KV cache.

    ``impl`` (one of ``satjax.model.attention.ATTENTION_IMPLS``) computes the full-sequence
    path; "auto" resolves per call from the sequence length and backend.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs, dtype: jnp.dtype, param_dtype: jnp.dtype,
                 impl: str = "auto"):
        d, h, kv, hd = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                        cfg.head_dim)
        std = cfg.initializer_range
        self.q_proj = make_param(rngs, (d, h, hd), ("embed", "q_heads", "head_dim"),
                                 param_dtype, std=std)
        self.k_proj = make_param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"),
                                 param_dtype, std=std)
        self.v_proj = make_param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"),
                                 param_dtype, std=std)
        self.o_proj = make_param(rngs, (h, hd, d), ("q_heads", "head_dim", "embed"),
                                 param_dtype, std=std)
        if cfg.attention_bias:
            zeros = dict(std=0.0)
            self.q_bias = make_param(rngs, (h, hd), ("q_heads", "head_dim"), param_dtype, **zeros)
            self.k_bias = make_param(rngs, (kv, hd), ("kv_heads", "head_dim"), param_dtype,
                                     **zeros)
            self.v_bias = make_param(rngs, (kv, hd), ("kv_heads", "head_dim"), param_dtype,
                                     **zeros)
            self.o_bias = make_param(rngs, (d,), ("embed",), param_dtype, **zeros)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.use_bias = cfg.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, hd
        self.dtype = dtype
        resolve_attention(impl, 0)  # validates the name; "auto" needs T, known per call
        self.impl = impl

    def _w(self, p: nnx.Param) -> Array:
        return p[...].astype(self.dtype)

    def __call__(self, x: Array, cos: Array, sin: Array, mask: Array,
                 cache: tuple[Array, Array] | None = None, cache_index: Array | int = 0
                 ) -> tuple[Array, tuple[Array, Array] | None]:
        """x: [B, T, D] -> ([B, T, D], updated cache or None).

        Without a cache, mask is ``valid`` bool [B, T] (which slots hold real tokens) and
        the attention is causal by slot with padding excluded as a key
        (``satjax.model.attention.causal_attention`` with ``impl``). With a cache (k, v each
        [B, S, Hkv, Dh]) mask is bool [B, T, S] (query may attend key slot) and the new keys
        and values are written at slots ``cache_index .. cache_index + T - 1`` first.
        """
        q = jnp.einsum("btd,dhk->bthk", x, self._w(self.q_proj))
        k = jnp.einsum("btd,dhk->bthk", x, self._w(self.k_proj))
        v = jnp.einsum("btd,dhk->bthk", x, self._w(self.v_proj))
        if self.use_bias:
            q, k, v = q + self._w(self.q_bias), k + self._w(self.k_bias), v + self._w(self.v_bias)
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k), cos, sin)
        if cache is not None:
            zero = jnp.zeros((), jnp.int32)
            start = (zero, jnp.asarray(cache_index, jnp.int32), zero, zero)
            k = jax.lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype), start)
            v = jax.lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype), start)
            cache = (k, v)
            k, v = k.astype(self.dtype), v.astype(self.dtype)
        if cache is None:
            out = causal_attention(q, k, v, mask, impl=self.impl)
        else:
            out = masked_attention(q, k, v, mask)
        out = jnp.einsum("bthk,hkd->btd", out, self._w(self.o_proj))
        if self.use_bias:
            out = out + self._w(self.o_bias)
        return out, cache


class DenseMLP(nnx.Module):
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))`` for the non-MoE layers."""

    def __init__(self, hidden: int, inter: int, std: float, *, rngs: nnx.Rngs,
                 dtype: jnp.dtype, param_dtype: jnp.dtype):
        self.gate_proj = make_param(rngs, (hidden, inter), ("embed", "mlp"), param_dtype, std=std)
        self.up_proj = make_param(rngs, (hidden, inter), ("embed", "mlp"), param_dtype, std=std)
        self.down_proj = make_param(rngs, (inter, hidden), ("mlp", "embed"), param_dtype, std=std)
        self.dtype = dtype

    def __call__(self, x: Array) -> Array:
        g = x @ self.gate_proj[...].astype(self.dtype)
        u = x @ self.up_proj[...].astype(self.dtype)
        return (jax.nn.silu(g) * u) @ self.down_proj[...].astype(self.dtype)
