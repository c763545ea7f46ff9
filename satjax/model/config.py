"""Model configuration with the field names of Hugging Face's ``Qwen3MoeConfig``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

# the fields of Qwen3MoeConfig that fix the parameters' shapes and the routing
ARCHITECTURE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size",
                       "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
                       "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                       "tie_word_embeddings", "attention_bias")


def _field(default: Any, must: str, ok: Callable[[Any, Any], bool]) -> Any:
    """A field that takes the values ``ok(value, config)`` accepts (fields before it are
    checked already); ``must`` says which, for the error
    ``"<field>: must be <must>, got <value>"``."""
    return dataclasses.field(default=default, metadata={"must": must, "ok": ok})


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive(v: Any, c: Any) -> bool:
    return _int(v) and v >= 1


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _bool(v: Any, c: Any) -> bool:
    return isinstance(v, bool)


def _token_id(v: Any, c: Any) -> bool:
    return v is None or (_int(v) and 0 <= v < c.vocab_size)


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig:
    """Hyperparameters of a Qwen3-MoE decoder. Field names equal HF ``Qwen3MoeConfig``.

    Layer ``i`` is a sparse MoE layer iff ``i not in mlp_only_layers`` and
    ``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0`` (as in HF); other layers
    use a dense SwiGLU MLP of width ``intermediate_size``. Each field's range is written
    beside it; constructing a config checks them in order, raising ValueError
    ``"<field>: must be ..., got ..."`` for the first value out of range.
    """

    vocab_size: int = _field(151936, "an int >= 1", _positive)
    hidden_size: int = _field(2048, "an int >= 1", _positive)
    intermediate_size: int = _field(6144, "an int >= 1 (the dense MLP's width)", _positive)
    moe_intermediate_size: int = _field(768, "an int >= 1 (an expert's width)", _positive)
    num_hidden_layers: int = _field(24, "an int >= 1", _positive)
    num_attention_heads: int = _field(32, "an int >= 1", _positive)
    num_key_value_heads: int = _field(
        4, "an int >= 1 that divides num_attention_heads (grouped-query attention)",
        lambda v, c: _positive(v, c) and c.num_attention_heads % v == 0)
    head_dim: int = _field(128, "an even int >= 2 (RoPE rotates pairs of dimensions)",
                           lambda v, c: _positive(v, c) and v % 2 == 0)
    num_experts: int = _field(128, "an int >= 0 (0: every layer a dense MLP)",
                              lambda v, c: _int(v) and v >= 0)
    num_experts_per_tok: int = _field(
        8, "an int in [1, num_experts] (the experts each token is routed to)",
        lambda v, c: c.num_experts == 0 or (_int(v) and 1 <= v <= c.num_experts))
    norm_topk_prob: bool = _field(True, "true or false", _bool)
    decoder_sparse_step: int = _field(1, "an int >= 1", _positive)
    mlp_only_layers: tuple[int, ...] = _field(
        (), "a list of layer indices in [0, num_hidden_layers)",
        lambda v, c: isinstance(v, tuple)
        and all(_int(i) and 0 <= i < c.num_hidden_layers for i in v))
    rms_norm_eps: float = _field(1e-6, "a number > 0", lambda v, c: _number(v) and v > 0)
    rope_theta: float = _field(1_000_000.0, "a number > 0",
                               lambda v, c: _number(v) and v > 0)
    max_position_embeddings: int = _field(32768, "an int >= 1", _positive)
    tie_word_embeddings: bool = _field(False, "true or false", _bool)
    attention_bias: bool = _field(False, "true or false", _bool)
    hidden_act: str = _field("silu", "'silu' (the only activation Qwen3 uses)",
                             lambda v, c: v == "silu")
    initializer_range: float = _field(0.02, "a number >= 0",
                                      lambda v, c: _number(v) and v >= 0)
    router_aux_loss_coef: float = _field(0.001, "a number >= 0",
                                         lambda v, c: _number(v) and v >= 0)
    bos_token_id: int | None = _field(None, "null or a token id in [0, vocab_size)", _token_id)
    eos_token_id: int | tuple[int, ...] | None = _field(
        None, "null or token id(s) in [0, vocab_size)",
        lambda v, c: all(_token_id(i, c) for i in v) if isinstance(v, tuple)
        else _token_id(v, c))
    pad_token_id: int | None = _field(None, "null or a token id in [0, vocab_size)", _token_id)

    def __post_init__(self) -> None:
        if isinstance(self.mlp_only_layers, list):
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not f.metadata["ok"](value, self):
                raise ValueError(f"{f.name}: must be {f.metadata['must']}, got {value!r}")

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
