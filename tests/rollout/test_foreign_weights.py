"""A worker never serves weights of another model: a published version whose config.json
differs from the run's architecture stops it before the engine loads anything, so none of
its trajectories can reach the queue. The engine is a unit-test stand-in that records what
it was asked to load."""

from __future__ import annotations

import dataclasses
import json

import pytest

from satjax.data.pipeline import prompt_dataset
from satjax.data.tasks import ArithmeticTask
from satjax.model import Qwen3MoeConfig
from satjax.model.tokenizer import CharTokenizer
from satjax.rollout.worker import RolloutWorker, WorkerConfig
from satjax.weight_sync import WeightPublisher, WeightSubscriber, WeightSyncError

RUN = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                     moe_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=8, num_experts=8, num_experts_per_tok=2)


class LoadRecorder:
    name, canary_atol, version = "recorder", 0.0, None

    def __init__(self):
        self.loaded = []

    def load(self, checkpoint_dir, version):
        self.loaded.append(version)
        self.version = version

    def canary_logprobs(self, tokens):
        return [0.0] * (len(tokens) - 1)


def _publish(pub, version, cfg):
    def write(d):
        (d / "model.safetensors").write_bytes(b"w")
        (d / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    pub.publish(version, write)


def test_a_worker_refuses_a_version_of_another_model(tmp_path):
    weights = tmp_path / "weights"
    pub = WeightPublisher(weights, keep=5)
    _publish(pub, 0, RUN)
    tok = CharTokenizer()
    task = ArithmeticTask()
    engine = LoadRecorder()
    worker = RolloutWorker(engine, task, tok, None,
                           WeightSubscriber(weights, architecture=RUN.architecture()),
                           iter(prompt_dataset(task, seed=0)), WorkerConfig())
    assert worker.maybe_sync() and engine.loaded == [0]
    _publish(pub, 1, dataclasses.replace(RUN, num_experts=4))  # 4 experts, the run has 8
    with pytest.raises(WeightSyncError, match=r"version 1 .* not the run's model: its "
                                              r"config.json has num_experts=4 \(the run's: 8\)"):
        worker.maybe_sync()
    assert engine.loaded == [0]  # never loaded, so never sampled from
