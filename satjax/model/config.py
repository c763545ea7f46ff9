"""Model configuration with the field names of Hugging Face's ``Qwen3MoeConfig``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# the fields of Qwen3MoeConfig that fix the parameters' shapes and the routing
ARCHITECTURE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size",
                       "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
                       "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                       "tie_word_embeddings", "attention_bias")


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig:
    """Hyperparameters of a Qwen3-MoE decoder. Field names equal HF ``Qwen3MoeConfig``.

    Layer ``i`` is a sparse MoE layer iff ``i not in mlp_only_layers`` and
    ``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0`` (as in HF); other layers
    use a dense SwiGLU MLP of width ``intermediate_size``.
    """

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    moe_intermediate_size: int = 768
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    router_aux_loss_coef: float = 0.001
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.mlp_only_layers, list):
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "decoder_sparse_step")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts > 0 and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                f"got {self.num_experts_per_tok}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {self.hidden_act!r}")

    # ----------------------------------------------------------------------------------
    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        """Indices of the decoder layers that are sparse MoE blocks (``L`` = its length)."""
        return tuple(
            i for i in range(self.num_hidden_layers)
            if i not in self.mlp_only_layers and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """``eos_token_id`` as a (possibly empty) tuple."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @classmethod
    def tiny(cls, **overrides: Any) -> Qwen3MoeConfig:
        """The embedded default: small enough to train and sample on a CPU in minutes.

        ``head_dim=32`` because vLLM's CPU attention supports head sizes of 32 and up.
        """
        base: dict[str, Any] = dict(
            vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, rope_theta=10000.0,
            max_position_embeddings=512, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
        base.update(overrides)
        return cls(**base)

    # ----------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> Qwen3MoeConfig:
        """Build from a HF ``config.json`` dict (transformers 4.x or 5.x layout)."""
        d = dict(d)
        if d.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope type {rope_type!r} is not supported (only 'default')")
        if "rope_theta" not in d and "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
        if "num_experts" not in d and "num_local_experts" in d:
            d["num_experts"] = d["num_local_experts"]
        if d.get("model_type") == "qwen3":  # dense Qwen3: every layer a dense MLP
            d["num_experts"] = 0
        if d.get("head_dim") is None:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in fields}
        if kwargs.get("mlp_only_layers") is None:
            kwargs["mlp_only_layers"] = ()
        return cls(**kwargs)

    def architecture(self) -> dict[str, Any]:
        """The ``config.json`` values (:meth:`to_hf_dict`'s) that a checkpoint of this model
        must have: those that fix the parameters' shapes and the routing. A worker refuses
        a published version whose config.json differs in any of them."""
        d = self.to_hf_dict()
        return {k: d[k] for k in ARCHITECTURE_FIELDS}

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` dict transformers (4.x and 5.x) and vLLM load."""
        d = dataclasses.asdict(self)
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        if isinstance(self.eos_token_id, tuple):
            d["eos_token_id"] = list(self.eos_token_id)
        dense = not self.moe_layer_indices  # a dense Qwen3 (model_type qwen3)
        d.update(
            architectures=["Qwen3ForCausalLM" if dense else "Qwen3MoeForCausalLM"],
            model_type="qwen3" if dense else "qwen3_moe",
            # 5.x reads rope_parameters; 4.x and vLLM read the top-level rope_theta.
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            rope_scaling=None,
            use_sliding_window=False,
            sliding_window=None,
            attention_dropout=0.0,
            use_cache=True,
            output_router_logits=False,
            torch_dtype="float32",
        )
        return d
