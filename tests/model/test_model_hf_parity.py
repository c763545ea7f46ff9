"""Parity of the satjax Qwen3-MoE model with HF transformers' Qwen3MoeForCausalLM (CPU, fp32).

Both directions: HF random model -> save_pretrained -> satjax.from_pretrained, and
satjax random model -> satjax.save_pretrained -> transformers.from_pretrained. Compared:
logits (max abs err <= 1e-4) and the top-k experts per token and MoE layer.
"""

import glob
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM, from_pretrained, save_pretrained  # noqa: E402

ATOL = 1e-4


def _hf_config(**over):
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[2], rms_norm_eps=1e-6,
                max_position_embeddings=256, tie_word_embeddings=False,
                attention_bias=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    base.update(over)
    cfg = transformers.Qwen3MoeConfig(**base)
    cfg._attn_implementation = "eager"
    return cfg


def _random_hf_model(seed=0, **over):
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(_hf_config(**over)).eval()
    with torch.no_grad():  # scale up from the 0.02 init so every part matters numerically
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def _batch(vocab, padded):
    rng = np.random.default_rng(1)
    ids = rng.integers(3, vocab, size=(3, 12)).astype(np.int64)
    mask = np.ones_like(ids)
    if padded:
        mask[0, :5] = 0  # left padding
        mask[1, 9:] = 0  # right padding
        ids[mask == 0] = 0
    return ids, mask


def _hf_forward(model, ids, mask):
    pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                    position_ids=torch.from_numpy(pos), output_router_logits=True)
    b, t = ids.shape
    k = model.config.num_experts_per_tok
    experts = []
    for rl in out.router_logits:
        probs = torch.softmax(rl.float(), dim=-1)
        experts.append(torch.topk(probs, k, dim=-1).indices.reshape(b, t, k).numpy())
    return out.logits.numpy(), np.stack(experts, axis=2)


@nnx.jit
def _sj_forward(model, ids, mask):
    return model(ids, attention_mask=mask)


def _compare(sj_model, hf_model, padded):
    ids, mask = _batch(sj_model.config.vocab_size, padded)
    hf_logits, hf_experts = _hf_forward(hf_model, ids, mask)
    out = _sj_forward(sj_model, jnp.asarray(ids, jnp.int32), jnp.asarray(mask))
    valid = mask.astype(bool)
    err = np.abs(np.asarray(out.logits) - hf_logits)[valid].max()
    assert err <= ATOL, f"max abs logit error {err}"
    np.testing.assert_array_equal(np.asarray(out.router_topk)[valid], hf_experts[valid])


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.slow
def test_hf_to_satjax(tmp_path, padded):
    hf_model = _random_hf_model()
    hf_model.save_pretrained(tmp_path)
    model = from_pretrained(str(tmp_path), jnp.float32)
    assert model.config.moe_layer_indices == (0, 1, 3)
    _compare(model, hf_model, padded)


@pytest.mark.slow
def test_hf_tied_embeddings_and_sparse_step(tmp_path):
    hf_model = _random_hf_model(seed=3, tie_word_embeddings=True, mlp_only_layers=[],
                                decoder_sparse_step=2, norm_topk_prob=False,
                                attention_bias=True)
    hf_model.save_pretrained(tmp_path)
    model = from_pretrained(str(tmp_path))
    assert model.config.moe_layer_indices == (1, 3)
    _compare(model, hf_model, padded=True)


@pytest.mark.slow
def test_satjax_to_hf(tmp_path):
    cfg = Qwen3MoeConfig.tiny(initializer_range=0.15, mlp_only_layers=(1,))
    model = Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(7))
    save_pretrained(model, str(tmp_path))
    with open(tmp_path / "config.json") as fh:
        hf_cfg = json.load(fh)
    assert hf_cfg["model_type"] == "qwen3_moe"
    assert hf_cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    # the classic per-expert hub layout that vLLM expects
    from safetensors import safe_open
    (st_file,) = glob.glob(os.path.join(tmp_path, "*.safetensors"))
    with safe_open(st_file, framework="numpy") as st:
        keys = set(st.keys())
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in keys
    assert "model.layers.1.mlp.gate_proj.weight" in keys
    hf_model = transformers.Qwen3MoeForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32).eval()
    _compare(model, hf_model, padded=True)
    # and back: satjax -> disk -> satjax is exact
    again = from_pretrained(str(tmp_path))
    ids = jnp.arange(24, dtype=jnp.int32).reshape(2, 12) % cfg.vocab_size
    mask = jnp.ones_like(ids)
    np.testing.assert_array_equal(np.asarray(_sj_forward(again, ids, mask).logits),
                                  np.asarray(_sj_forward(model, ids, mask).logits))


def test_sharded_checkpoint_roundtrip(tmp_path):
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny(), rngs=nnx.Rngs(1))
    save_pretrained(model, str(tmp_path), max_shard_bytes=100_000)
    assert len(glob.glob(os.path.join(tmp_path, "model-*-of-*.safetensors"))) > 1
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    hf_model = transformers.Qwen3MoeForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32).eval()
    _compare(model, hf_model, padded=False)


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type"):
        from_pretrained(str(tmp_path))


def test_fused_transformers5_layout(tmp_path):
    """The in-memory transformers-5 layout (fused gate_up_proj) also loads."""
    from safetensors.torch import save_file

    hf_model = _random_hf_model(seed=5)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf_model.config.save_pretrained(tmp_path)
    _compare(from_pretrained(str(tmp_path)), hf_model, padded=True)
