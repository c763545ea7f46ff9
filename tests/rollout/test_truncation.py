"""Truncated responses are kept and marked, shaped as rollout.overlong says, and a group the
queue refuses stops the worker with the reason instead of vanishing."""

import numpy as np
import pytest
from flax import nnx

from satjax.config import load_config, max_sequence_tokens, train_buckets
from satjax.data.pipeline import prompt_dataset
from satjax.data.rewards import overlong_penalty
from satjax.data.tasks import ArithmeticTask
from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM, canary_logprobs, save_pretrained
from satjax.model.tokenizer import CharTokenizer
from satjax.queue.client import QueueClient
from satjax.queue.core import QueueSettings
from satjax.queue.server import QueueServer
from satjax.queue.validation import Limits
from satjax.rollout.builtin_engine import BuiltinEngine
from satjax.rollout.engine import Completion, SamplingParams
from satjax.rollout.worker import QueueRejectedError, RolloutWorker, WorkerConfig, cut_at_stop
from satjax.train.batch import make_batch
from satjax.trajectory import Trajectory
from satjax.weight_sync import WeightPublisher, WeightSubscriber

TOKEN = "truncation-test-token"


def _published_worker(tmp_path, client, cfg: WorkerConfig):
    tok = CharTokenizer()
    mcfg = Qwen3MoeConfig.tiny(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id,
                               eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    model = Qwen3MoeForCausalLM(mcfg, rngs=nnx.Rngs(0))
    canary = [tok.bos_id, *tok.encode("1+2=3"), tok.eos_id]
    WeightPublisher(tmp_path / "weights").publish(
        0, lambda d: save_pretrained(model, str(d)),
        canary={"tokens": canary, "logprobs": canary_logprobs(model, canary)})
    task = ArithmeticTask()
    return RolloutWorker(BuiltinEngine("float32", pad_id=tok.pad_id), task, tok, client,
                         WeightSubscriber(tmp_path / "weights"),
                         iter(prompt_dataset(task, seed=0)), cfg)


def _queue(tmp_path, max_seq_len):
    server = QueueServer(tmp_path / "queue", TOKEN,
                         settings=QueueSettings(limits=Limits(max_seq_len=max_seq_len)))
    client = QueueClient(f"127.0.0.1:{server.start(0)}", token=TOKEN)
    client.wait_ready(timeout=30)
    return server, client


@pytest.mark.slow
def test_truncated_kept_marked_and_penalised_and_refusal_stops_the_worker(tmp_path):
    # no stop token: every response runs to max_new_tokens (cut, "length")
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=())
    cfg = WorkerConfig(group_size=2, prompts_per_step=2, worker_id="t", sampling=sampling,
                       overlong="penalty", overlong_buffer=0, overlong_penalty=0.5)
    server, client = _queue(tmp_path, max_seq_len=64)
    try:
        worker = _published_worker(tmp_path, client, cfg)
        assert worker.run(max_batches=1, install_signal_handlers=False) == 4
        got = client.get_batch(4, trainer_version=0, max_lag=0, timeout=10).trajectories
        assert len(got) == 4
        for t in got:
            assert t.truncated and len(t.response_tokens) == 4
            # the arithmetic reward is 0 or 1 before the penalty of a cut response
            assert t.reward in (-0.5, 0.5)
    finally:
        client.close()
        server.stop(1.0)

    # a queue whose limit is below prompt + response: the worker stops with the reason
    server, client = _queue(tmp_path / "small", max_seq_len=6)
    try:
        worker = _published_worker(tmp_path / "small", client,
                                   WorkerConfig(group_size=2, prompts_per_step=1,
                                                worker_id="r", sampling=sampling))
        with pytest.raises(QueueRejectedError, match=r"refused 2 of the 2 trajectories of "
                                                     r"group .*max_seq_len 6"):
            worker.run(max_batches=1, install_signal_handlers=False)
        assert worker.produced == 0
    finally:
        client.close()
        server.stop(1.0)


def test_overlong_penalty_is_dapos_ramp():
    # independent reference: DAPO eq. 13 with L_max = 100, L_cache = 20
    def dapo(n, l_max=100, l_cache=20):
        if n <= l_max - l_cache:
            return 0.0
        if n <= l_max:
            return ((l_max - l_cache) - n) / l_cache
        return -1.0

    for n in (1, 80, 81, 90, 99, 100):  # ended by a stop token
        assert overlong_penalty(n, False, 100, 20, 1.0) == pytest.approx(dapo(n))
    # cut at the cap: DAPO's "longer than L_max" (the sampler never makes one longer)
    assert overlong_penalty(100, True, 100, 20, 1.0) == dapo(101) == -1.0
    assert overlong_penalty(100, True, 100, 0, 2.0) == -2.0
    assert overlong_penalty(100, False, 100, 0, 2.0) == 0.0


def _traj(i, finish, n=3):
    return Trajectory(trajectory_id=f"t{i}", group_id="g", prompt_id="p",
                      prompt_tokens=np.array([1, 5, 6], np.int32),
                      response_tokens=np.arange(3, 3 + n, dtype=np.int32),
                      behavior_logprobs=np.full(n, -1.0, np.float32), policy_version=0,
                      reward=float(i), group_size=2, finish_reason=finish)


def test_mask_leaves_truncated_out_of_the_loss_only():
    trajs = [_traj(0, "stop"), _traj(1, "length")]
    kept = make_batch(trajs, buckets=(8,))
    masked = make_batch(trajs, buckets=(8,), mask_truncated=True)
    assert np.asarray(kept.loss_mask).sum(axis=1).tolist() == [3, 3]
    assert np.asarray(masked.loss_mask).sum(axis=1).tolist() == [3, 0]
    # still in the batch: its reward counts in the group's baseline
    np.testing.assert_array_equal(masked.rewards, kept.rewards)


def test_buckets_follow_prompt_and_response_limits():
    cfg = load_config(overrides=["task.max_prompt_tokens=512", "rollout.max_new_tokens=4096",
                                 "train.buckets=[1024,2048,4096]"])
    assert max_sequence_tokens(cfg) == 4608
    assert train_buckets(cfg) == (1024, 2048, 4096, 4608)  # the README recipe's trap
    cfg = load_config(overrides=["task.max_prompt_tokens=100", "rollout.max_new_tokens=20",
                                 "train.buckets=[32,64,128,256]"])
    assert train_buckets(cfg) == (32, 64, 128, 256)  # 256 holds 120 already


def test_stop_strings_cut_after_the_completing_token():
    tok = CharTokenizer()
    resp = np.asarray(tok.encode("12=3;45"), np.int32)
    c = Completion(prompt_tokens=np.asarray([1, 4], np.int32), response_tokens=resp,
                   logprobs=-np.arange(len(resp), dtype=np.float32),
                   routed_experts=np.zeros((2 + len(resp) - 1, 1, 2), np.int32),
                   finish_reason="length")
    cut = cut_at_stop(c, tok, ("=3;", "5"))
    assert tok.decode(cut.response_tokens) == "12=3;" and cut.finish_reason == "stop"
    np.testing.assert_array_equal(cut.logprobs, c.logprobs[:5])
    assert cut.routed_experts.shape[0] == 2 + 5 - 1
    assert cut_at_stop(c, tok, ("zz",)) is c
