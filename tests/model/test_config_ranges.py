"""Every architecture field of ``Qwen3MoeConfig`` has a range, written beside it, and a
value outside it is refused naming the field (was: accepted, then a traceback deep in the
model build, 14 s into ``satjax train``)."""

import dataclasses

import pytest

from satjax.model import Qwen3MoeConfig

# one degenerate value per field (the tiny preset's other values)
DEGENERATE = {
    "vocab_size": 0, "hidden_size": -1, "intermediate_size": 0, "moe_intermediate_size": 0,
    "num_hidden_layers": 0, "num_attention_heads": 0, "num_key_value_heads": 3,
    "head_dim": 31, "num_experts": -1, "num_experts_per_tok": 9, "norm_topk_prob": 1,
    "decoder_sparse_step": 0, "mlp_only_layers": [4], "rms_norm_eps": 0.0,
    "rope_theta": float("nan"), "max_position_embeddings": 0, "tie_word_embeddings": "no",
    "attention_bias": None, "hidden_act": "gelu", "initializer_range": -0.1,
    "router_aux_loss_coef": float("inf"), "bos_token_id": 64, "eos_token_id": [2, -1],
    "pad_token_id": 1.5,
}


def test_every_field_has_a_range():
    fields = [f.name for f in dataclasses.fields(Qwen3MoeConfig)]
    assert sorted(DEGENERATE) == sorted(fields)
    assert all("must" in f.metadata for f in dataclasses.fields(Qwen3MoeConfig))


@pytest.mark.parametrize("field", sorted(DEGENERATE))
def test_a_value_out_of_range_is_refused_naming_the_field(field):
    with pytest.raises(ValueError, match=rf"^{field}: must be "):
        Qwen3MoeConfig.tiny(**{field: DEGENERATE[field]})


def test_the_ranges_keep_what_real_checkpoints_have():
    assert Qwen3MoeConfig().num_experts == 128  # the defaults are Qwen3-30B-A3B's, in range
    dense = Qwen3MoeConfig.tiny(num_experts=0, num_experts_per_tok=0)  # a dense Qwen3
    assert dense.moe_layer_indices == ()
    assert Qwen3MoeConfig.tiny(eos_token_id=[2, 3], mlp_only_layers=[0, 3]).eos_token_ids == (2, 3)
    cfg = Qwen3MoeConfig.tiny()
    assert Qwen3MoeConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
