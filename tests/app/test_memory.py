"""The on-paper measurement of the train step (satjax.app.memory): abstract state, the
trainer's own step, XLA's per-device bytes and FLOPs."""

import dataclasses
from pathlib import Path

import pytest

from satjax.app.factory import build_tokenizer, model_config
from satjax.app.memory import StepMemory, active_params, compile_step, model_flops_per_token
from satjax.config import load_config
from satjax.model import Qwen3MoeConfig

REPO = Path(__file__).resolve().parents[2]


def test_extrapolation_is_linear_in_depth():
    two = StepMemory(arguments=10, outputs=4, aliased=4, temporaries=100)
    four = StepMemory(arguments=14, outputs=6, aliased=6, temporaries=120)
    at48 = two.extrapolate(four, 2, 4, 48)
    assert at48 == StepMemory(arguments=10 + 2 * 46, outputs=4 + 46, aliased=4 + 46,
                              temporaries=100 + 10 * 46)
    assert at48.peak == at48.arguments + at48.outputs - at48.aliased + at48.temporaries


def test_active_parameters_of_qwen3_30b_a3b():
    # Qwen's own figure: 3.3B activated parameters, embeddings included
    cfg = load_config(REPO / "configs/qwen3-30b-a3b.yaml")
    shape = model_config(cfg)
    with_embedding = active_params(shape) + shape.vocab_size * shape.hidden_size
    assert 3.25e9 < with_embedding < 3.45e9


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(overrides=["train.mesh={data: 2, fsdp: 2, expert: 2}",
                                 "model.scan_layers=true", "rollout.group_size=4"])
    return cfg, model_config(cfg, build_tokenizer(cfg))


@pytest.mark.slow
def test_step_memory_of_the_tiny_run_on_8_devices(tiny):
    cfg, shape = tiny
    one = StepMemory.of(compile_step(cfg, shape, micro_batch=1, seq_len=256))
    two = StepMemory.of(compile_step(cfg, shape, micro_batch=2, seq_len=256))
    # the donated train state is an argument and aliases its output
    assert one.aliased > 0 and one.arguments >= one.aliased and one.outputs >= one.aliased
    assert one.temporaries < two.temporaries  # a second sequence per device costs memory
    assert two.arguments > one.arguments  # ... and a larger batch argument
    # remat keeps far less per sequence: with "full" a layer saves only its input
    full = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, remat="full"))
    one_r = StepMemory.of(compile_step(full, shape, micro_batch=1, seq_len=256))
    two_r = StepMemory.of(compile_step(full, shape, micro_batch=2, seq_len=256))
    assert (two_r.temporaries - one_r.temporaries) < 0.5 * (two.temporaries - one.temporaries)
    # a KL to the reference policy: its parameters are one more argument
    kl = dataclasses.replace(cfg, objective=dataclasses.replace(cfg.objective, kl_coef=1e-3))
    one_kl = StepMemory.of(compile_step(kl, shape, micro_batch=1, seq_len=256))
    assert one_kl.arguments > one.arguments
    odd_groups = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout,
                                                                     group_size=3))
    with pytest.raises(ValueError, match="whole groups"):
        compile_step(odd_groups, shape, micro_batch=1, seq_len=16)


@pytest.mark.slow
def test_model_flops_agree_with_the_analytic_count(tiny):
    cfg, _ = tiny
    # a shape where the weight matmuls dominate (attention 5/8 vs 1/2 of T x T aside)
    shape = Qwen3MoeConfig.tiny(hidden_size=256, moe_intermediate_size=256, vocab_size=512,
                                num_hidden_layers=3)
    xla, analytic = model_flops_per_token(cfg, shape, seq_len=64)
    assert 0.95 < xla / analytic < 1.1, (xla, analytic)
