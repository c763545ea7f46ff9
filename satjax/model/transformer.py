"""Qwen3-MoE decoder-only causal LM in Flax NNX (HF ``Qwen3MoeForCausalLM`` layout)."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from satjax.config import Remat
from satjax.model.config import Qwen3MoeConfig
from satjax.model.layers import Attention, DenseMLP, RMSNorm, make_param, rope_cos_sin
from satjax.model.moe import RouteRecord, SparseMoeBlock
from satjax.parallel import constrain

Array = jax.Array
# logical axes of the residual stream [B, T, D] at layer boundaries: batch-sharded only
ACTIVATION = ("batch", "length", None)
KVCache = tuple[tuple[Array, Array], ...]  # per decoder layer (k, v), each [B, S, Hkv, Dh]
# what the trainer replays: (routed_experts, routed_gates), each [B, T, L, k] or None
Replay = tuple[Array | None, Array | None]
# the RouteRecord fields the model outputs stacked over its MoE layers, in output order
_ROUTE_FIELDS = ("router_logits", "router_topk", "experts_used", "weights")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelOutput:
    """The forward's outputs; L = number of MoE layers.

    logits        f32 [B, T, V]
    router_logits f32 [B, T, L, E]
    router_topk   i32 [B, T, L, k]  the router's own top-k (descending prob), also under
                                    replay, so engine-vs-trainer mismatch stays measurable
    experts_used  i32 [B, T, L, k]  what ran: the replayed ``routed_experts`` under R3,
                                    else equal to ``router_topk``
    gate_weights  f32 [B, T, L, k]  the gate weights ``experts_used`` ran with (the
                                    replayed ``routed_gates`` under gate replay)
    """

    logits: Array
    router_logits: Array
    router_topk: Array
    experts_used: Array
    gate_weights: Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BackboneOutput:
    """The decoder stack's outputs before the LM head (:meth:`Qwen3MoeForCausalLM.backbone`).

    hidden        [B, T, D]     final-norm hidden states, compute dtype
    router_logits, router_topk, experts_used, gate_weights: as in :class:`ModelOutput`
    """

    hidden: Array
    router_logits: Array
    router_topk: Array
    experts_used: Array
    gate_weights: Array


# What a rematerialised decoder layer keeps for the backward (``remat`` of the forward):
# "full" only its input (the layer is recomputed), "dots" also the outputs of matmuls
# without batch dimensions (the weight projections; attention scores are recomputed).
REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
assert tuple(REMAT_POLICIES) == typing.get_args(Remat)  # the config's choices, in order


def _explicit_mesh_axes() -> bool:
    """True inside ``jax.set_mesh`` with Explicit axes."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return False
    return any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)); then x + mlp(norm(x)) with a MoE or dense MLP."""

    def __init__(self, cfg: Qwen3MoeConfig, layer_idx: int, *, rngs: nnx.Rngs,
                 dtype: jnp.dtype, param_dtype: jnp.dtype, moe_impl: str, attention: str):
        self.self_attn = Attention(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                                   impl=attention)
        self.is_moe = layer_idx in cfg.moe_layer_indices
        self.mlp: SparseMoeBlock | DenseMLP
        if self.is_moe:
            self.mlp = SparseMoeBlock(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                                      moe_impl=moe_impl)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.initializer_range,
                                rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        norm = dict(dtype=dtype, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)

    def __call__(self, x: Array, cos: Array, sin: Array, mask: Array,
                 cache: tuple[Array, Array] | None = None, cache_index: Array | int = 0,
                 routed_experts: Array | None = None, routed_gates: Array | None = None
                 ) -> tuple[Array, tuple[Array, Array] | None, RouteRecord | None]:
        """x [B, T, D] -> (x, updated cache, RouteRecord of a MoE layer else None).

        mask: valid bool [B, T] without a cache, bool [B, T, S] with one (``Attention``).
        routed_experts i32 [B, T, k] replays these experts, routed_gates [B, T, k] their
        gate weights too (MoE layers only; ``moe.route``).
        """
        h, cache = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, cache_index)
        x = x + h
        h = self.post_attention_layernorm(x)
        routes = None
        if isinstance(self.mlp, SparseMoeBlock):  # i.e. self.is_moe
            h, routes = self.mlp(h, routed_experts, routed_gates)
        else:
            h = self.mlp(h)
        return x + h, cache, routes


class Qwen3MoeForCausalLM(nnx.Module):
    """Token embedding -> decoder layers -> RMSNorm -> LM head (tied or untied).

    Args:
      cfg: model configuration.
      rngs: initialisation RNGs (weights ~ N(0, initializer_range), norms = 1).
      dtype: compute dtype (activations, matmuls); softmaxes and norms run in float32.
      param_dtype: storage dtype of the parameters (the optimizer's master weights).
      moe_impl: "auto" | "grouped" | "ragged" | "dense_einsum" | "all_to_all" dropless
        dispatch (moe.py).
      attention: "auto" | "reference" | "blockwise" | "cudnn" | "splash" full-sequence
        attention (attention.py); the KV-cache path always runs the reference math.
      scan_layers: run the full-sequence forward as one ``jax.lax.scan`` over the decoder
        layers (their parameters stacked per call) when all layers are alike (all MoE or all
        dense), so compile time stops growing with depth. Parameters stay per layer, so HF
        I/O and sharding rules are unchanged; the KV-cache path always unrolls.
    """

    def __init__(self, cfg: Qwen3MoeConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32,
                 param_dtype: jnp.dtype = jnp.float32, moe_impl: str = "auto",
                 attention: str = "auto", scan_layers: bool = False):
        self.config = cfg
        self.scan_layers = scan_layers
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.moe_impl = moe_impl
        self.attention = attention
        std = cfg.initializer_range
        self.embed_tokens = make_param(rngs, (cfg.vocab_size, cfg.hidden_size),
                                       ("vocab", "embed"), param_dtype, std=std)
        self.layers = nnx.List([
            DecoderLayer(cfg, i, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                         moe_impl=moe_impl, attention=attention)
            for i in range(cfg.num_hidden_layers)
        ])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype,
                            param_dtype=param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = make_param(rngs, (cfg.hidden_size, cfg.vocab_size),
                                      ("embed", "vocab"), param_dtype, std=std)

    def with_dtype(self, dtype: jnp.dtype) -> Qwen3MoeForCausalLM:
        """This model's parameters (shared, not copied) computing in ``dtype``: e.g. the
        float32 reference of a bf16-compute policy."""
        abstract = nnx.eval_shape(lambda: Qwen3MoeForCausalLM(
            self.config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=self.param_dtype,
            moe_impl=self.moe_impl, attention=self.attention, scan_layers=self.scan_layers))
        return nnx.merge(nnx.graphdef(abstract), nnx.state(self))

    # ------------------------------------------------------------------------------------
    def __call__(self, input_ids: Array, *, attention_mask: Array | None = None,
                 positions: Array | None = None, routed_experts: Array | None = None,
                 routed_gates: Array | None = None, remat: str = "none") -> ModelOutput:
        """Full-sequence forward: :meth:`backbone`, then the LM head's float32 logits."""
        return self._with_logits(self.backbone(
            input_ids, attention_mask=attention_mask, positions=positions,
            routed_experts=routed_experts, routed_gates=routed_gates, remat=remat))

    def _with_logits(self, out: BackboneOutput) -> ModelOutput:
        logits = (out.hidden @ self.head_weight()).astype(jnp.float32)
        return ModelOutput(logits, out.router_logits, out.router_topk, out.experts_used,
                           out.gate_weights)

    def head_weight(self) -> Array:
        """The LM head [D, V] in the compute dtype (the embedding table's transpose when
        ``tie_word_embeddings``)."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens[...].astype(self.dtype).T
        return self.lm_head[...].astype(self.dtype)

    def backbone(self, input_ids: Array, *, attention_mask: Array | None = None,
                 positions: Array | None = None, routed_experts: Array | None = None,
                 routed_gates: Array | None = None, remat: str = "none") -> BackboneOutput:
        """Embedding, decoder layers and the final norm, without the LM head (a caller
        that needs only some logits, e.g. chunked log-probs, applies :meth:`head_weight`).

        input_ids int32 [B, T]; attention_mask [B, T] (1 = real token; padding anywhere is
        excluded as a key); positions int32 [B, T] (default cumsum(mask) - 1, clipped at 0);
        routed_experts int32 [B, T, L, k] replays these experts in the L MoE layers (R3);
        routed_gates [B, T, L, k] (with routed_experts) replays their gate weights too,
        straight-through (``satjax.model.moe.route``); remat: what each decoder layer keeps
        for the backward (:data:`REMAT_POLICIES`: "none", "full" or "dots"); the values are
        the same either way.
        """
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {input_ids.shape}")
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {tuple(REMAT_POLICIES)}, got {remat!r}")
        b, t = input_ids.shape
        if attention_mask is None:
            valid = jnp.ones((b, t), jnp.bool_)
        else:
            if tuple(attention_mask.shape) != (b, t):
                raise ValueError(
                    f"attention_mask must have shape {(b, t)}, got {attention_mask.shape}")
            valid = jnp.asarray(attention_mask).astype(jnp.bool_)
        if positions is None:
            positions = jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=1) - 1, 0)
        elif tuple(positions.shape) != (b, t):
            raise ValueError(f"positions must have shape {(b, t)}, got {positions.shape}")
        replay = (routed_experts, routed_gates)
        if _explicit_mesh_axes():
            return self._call_auto_axes(input_ids, valid, positions, replay, remat)
        return self._full_forward(input_ids, valid, positions, replay, remat)

    def _full_forward(self, input_ids: Array, valid: Array, positions: Array,
                      replay: Replay, remat: str) -> BackboneOutput:
        # the attention builds its causal mask itself (blockwise: never as a [T, T] array)
        out, _ = self._run(input_ids, positions, valid, replay, None, 0, remat)
        return out

    def _call_auto_axes(self, input_ids: Array, valid: Array, positions: Array,
                        replay: Replay, remat: str) -> BackboneOutput:
        """Under an Explicit-axis mesh run the model body with GSPMD (auto) sharding.

        Several ops (embedding gather, ragged_dot) have no explicit-sharding rule; outputs
        keep the batch/sequence sharding of ``input_ids``.
        """
        spec = tuple(jax.typeof(input_ids).sharding.spec)
        spec = spec + (None,) * (2 - len(spec))
        graphdef, state = nnx.split(self)

        def body(state, input_ids, valid, positions, replay):
            model = nnx.merge(graphdef, state)
            return model._full_forward(input_ids, valid, positions, replay, remat)

        P = jax.sharding.PartitionSpec
        lead, per_layer = P(*spec, None), P(*spec, None, None)
        # the output's pytree with PartitionSpec leaves (the fields say Array)
        out_sharding = BackboneOutput(lead, *(per_layer,) * 4)  # type: ignore[arg-type]
        return jax.sharding.auto_axes(body, out_sharding=out_sharding)(
            state, input_ids, valid, positions, replay)

    def forward_with_cache(self, input_ids: Array, positions: Array, kv_valid: Array,
                           cache: KVCache, cache_index: Array | int,
                           routed_experts: Array | None = None) -> tuple[ModelOutput, KVCache]:
        """Incremental forward writing T new tokens at cache slots cache_index..+T-1.

        kv_valid bool [B, S]: which cache slots hold real tokens (including the new ones).
        A query at slot s attends slots <= s that are valid.
        """
        t = input_ids.shape[1]
        s = cache[0][0].shape[1]
        q_slots = jnp.asarray(cache_index, jnp.int32) + jnp.arange(t)
        mask = (q_slots[None, :, None] >= jnp.arange(s)[None, None, :]) & kv_valid[:, None, :]
        out, new_cache = self._run(input_ids, positions, mask, (routed_experts, None), cache,
                                   cache_index, "none")
        assert new_cache is not None  # _run returns the updated cache when given one
        return self._with_logits(out), new_cache

    def init_cache(self, batch: int, max_len: int, dtype: jnp.dtype | None = None) -> KVCache:
        """Zero KV cache for ``batch`` rows of ``max_len`` slots."""
        cfg = self.config
        shape = (batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        dt = dtype or self.dtype
        return tuple((jnp.zeros(shape, dt), jnp.zeros(shape, dt))
                     for _ in range(cfg.num_hidden_layers))

    # ------------------------------------------------------------------------------------
    def _run(self, input_ids: Array, positions: Array, mask: Array, replay: Replay,
             cache: KVCache | None, cache_index: Array | int, remat: str
             ) -> tuple[BackboneOutput, KVCache | None]:
        """mask: valid bool [B, T] without a cache, bool [B, T, S] with one; replay:
        (routed_experts, routed_gates), each [B, T, L, k] or None."""
        cfg = self.config
        b, t = input_ids.shape
        n_moe, k = len(cfg.moe_layer_indices), cfg.num_experts_per_tok
        routed_experts, routed_gates = replay
        if routed_gates is not None and routed_experts is None:
            raise ValueError("routed_gates: gate replay needs the routed_experts they weight")
        for name, arr in (("routed_experts", routed_experts), ("routed_gates", routed_gates)):
            if arr is not None and tuple(jnp.shape(arr)) != (b, t, n_moe, k):
                raise ValueError(f"{name} must have shape [B, T, L, k] = {(b, t, n_moe, k)}, "
                                 f"got {jnp.shape(arr)}")
        # the lookup gathers whole rows: keep the table sharded over vocab only (GSPMD masks
        # and all-reduces), an embed-sharded table would need a full rematerialisation
        table = constrain(self.embed_tokens[...], ("vocab", None))
        x = constrain(jnp.take(table, input_ids, axis=0).astype(self.dtype), ACTIVATION)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, self.dtype)
        if cache is None and self.scan_layers and len({m.is_moe for m in self.layers}) == 1:
            x, stacked = self._scan_layers(x, cos, sin, mask, replay, remat)
            return self._finish(x, stacked, b, t, k), None
        routes: list[RouteRecord] = []
        new_cache: list[tuple[Array, Array]] = []
        for i, layer in enumerate(self.layers):
            layer_replay = _moe_layer(replay, len(routes)) if layer.is_moe else (None, None)
            if cache is None:
                x, rec = _layer_forward(nnx.graphdef(layer), remat)(
                    nnx.state(layer), x, cos, sin, mask, layer_replay)
            else:
                x, layer_cache, rec = layer(x, cos, sin, mask, cache[i], cache_index,
                                            *layer_replay)
                assert layer_cache is not None  # a layer given a cache returns it updated
                new_cache.append(layer_cache)
            if rec is not None:
                routes.append(rec)
        stacked = [jnp.stack([getattr(r, name) for r in routes], axis=2)
                   for name in _ROUTE_FIELDS] if routes else None
        return self._finish(x, stacked, b, t, k), (None if cache is None else tuple(new_cache))

    def _scan_layers(self, x: Array, cos: Array, sin: Array, mask: Array, replay: Replay,
                     remat: str) -> tuple[Array, list[Array] | None]:
        """All (alike) layers as one scan; returns x and the stacked [B, T, L, ...] routes."""
        layer_fn = _layer_forward(nnx.graphdef(self.layers[0]), remat)
        params = jax.tree.map(lambda *ws: jnp.stack(ws),
                              *[nnx.state(layer) for layer in self.layers])
        per_layer = tuple(None if a is None else jnp.moveaxis(jnp.asarray(a), 2, 0)
                          for a in replay)

        def body(x, xs):
            state, layer_replay = xs
            x, rec = layer_fn(state, x, cos, sin, mask, layer_replay)
            ys = None if rec is None else tuple(getattr(rec, n) for n in _ROUTE_FIELDS)
            return x, ys

        x, ys = jax.lax.scan(body, x, (params, per_layer))
        return x, None if ys is None else [jnp.moveaxis(y, 0, 2) for y in ys]

    def _finish(self, x: Array, stacked: list[Array] | None, b: int, t: int, k: int
                ) -> BackboneOutput:
        """Final norm; ``stacked``: the :data:`_ROUTE_FIELDS` stacked over the MoE layers."""
        cfg = self.config
        if stacked is None:
            none = jnp.zeros((b, t, 0, k), jnp.int32)
            stacked = [jnp.zeros((b, t, 0, max(cfg.num_experts, 0)), jnp.float32), none, none,
                       jnp.zeros((b, t, 0, k), jnp.float32)]
        return BackboneOutput(self.norm(x), *stacked)


def _moe_layer(replay: Replay, j: int) -> Replay:
    """The replay of the j-th MoE layer: [B, T, k] slices of the [B, T, L, k] arrays."""
    experts, gates = replay
    return (None if experts is None else jnp.asarray(experts)[:, :, j],
            None if gates is None else jnp.asarray(gates)[:, :, j])


def _layer_forward(graphdef: nnx.GraphDef, remat: str):
    """``(layer state, x, cos, sin, valid, (experts, gates)) -> (x, RouteRecord | None)`` of
    one decoder layer's full-sequence forward, rematerialised by ``REMAT_POLICIES[remat]``."""

    def forward(state, x, cos, sin, valid, replay):
        x, _, rec = nnx.merge(graphdef, state)(x, cos, sin, valid, None, 0, *replay)
        return constrain(x, ACTIVATION), rec

    if remat == "none":
        return forward
    return jax.checkpoint(forward, policy=REMAT_POLICIES[remat])
