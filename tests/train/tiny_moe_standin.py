"""A tiny causal MoE language model with the INTERFACES.md call signature (test fake).

Used by the trainer tests only where the real ``satjax.model`` is not importable; it has
the same parameter logical axis names (embedding, experts, router) so sharding rules and
routing replay can be exercised.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 32
    hidden_size: int = 16
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 8
    num_hidden_layers: int = 2

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        return tuple(range(self.num_hidden_layers))


@dataclasses.dataclass
class Output:
    logits: jax.Array
    router_logits: jax.Array
    selected_experts: jax.Array


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str | None, ...]) -> nnx.Param:
    value = 0.3 * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


class MoeLayer(nnx.Module):
    def __init__(self, cfg: TinyConfig, rngs: nnx.Rngs):
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.k = cfg.num_experts_per_tok
        self.gate = _param(rngs, (d, e), ("embed", None))
        self.w_in = _param(rngs, (e, d, f), ("experts", "embed", "expert_mlp"))
        self.w_out = _param(rngs, (e, f, d), ("experts", "expert_mlp", "embed"))
        self.mix = _param(rngs, (d, d), ("embed", "mlp"))

    def __call__(self, x, mask, routing):
        # causal mean over previous real tokens, so position t only sees tokens <= t
        m = mask[..., None].astype(x.dtype)
        ctx = jnp.cumsum(x * m, axis=1) / jnp.maximum(jnp.cumsum(m, axis=1), 1.0)
        h = x + jnp.tanh(ctx @ self.mix[...])
        logits = h @ self.gate[...]
        probs = jax.nn.softmax(logits, axis=-1)
        own = jax.lax.top_k(probs, self.k)[1]
        experts = own if routing is None else routing
        w = jnp.take_along_axis(probs, experts, axis=-1)
        w = w / jnp.sum(w, axis=-1, keepdims=True)
        combine = jnp.einsum("btke,btk->bte", jax.nn.one_hot(experts, probs.shape[-1]), w)
        y = jnp.einsum("btd,edf->btef", h, self.w_in[...])
        y = jnp.einsum("btef,efd->bted", jax.nn.silu(y), self.w_out[...])
        return h + jnp.einsum("bted,bte->btd", y, combine), logits, own


class TinyMoeLM(nnx.Module):
    def __init__(self, cfg: TinyConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"))
        self.layers = nnx.List([MoeLayer(cfg, rngs) for _ in range(cfg.num_hidden_layers)])
        self.norm = nnx.Param(
            jnp.ones((cfg.hidden_size,)), out_sharding=(None,), eager_sharding=False
        )

    def __call__(self, input_ids, *, attention_mask=None, positions=None, routing=None):
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        x = self.embed[...][input_ids]
        rl, sel = [], []
        for i, layer in enumerate(self.layers):
            x, logits, own = layer(x, attention_mask, None if routing is None else routing[:, :, i])
            rl.append(logits)
            sel.append(own)
        x = x * self.norm[...]
        return Output(
            logits=x @ self.embed[...].T,
            router_logits=jnp.stack(rl, axis=2),
            selected_experts=jnp.stack(sel, axis=2).astype(jnp.int32),
        )
