"""The built-in rollout worker end to end through a real in-process queue server."""

import json
import logging
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from satjax.data.pipeline import prompt_dataset
from satjax.data.tasks import ArithmeticTask
from satjax.model import (
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    canary_logprobs,
    save_pretrained,
    token_logprobs,
)
from satjax.model.logprobs import router_mismatch
from satjax.model.tokenizer import CharTokenizer
from satjax.rollout.builtin_engine import BuiltinEngine
from satjax.rollout.engine import SamplingParams
from satjax.rollout.worker import GroupSampler, RolloutWorker, WorkerConfig
from satjax.weight_sync import WeightPublisher, WeightSubscriber


def _model(tok, seed):
    cfg = Qwen3MoeConfig.tiny(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id,
                              eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    return Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(seed))


def _publish(pub, model, version, tokens, **kw):
    pub.publish(version, lambda d: save_pretrained(model, str(d)),
                canary={"tokens": tokens, "logprobs": canary_logprobs(model, tokens)}, **kw)


@pytest.mark.slow
def test_builtin_worker_through_queue_with_weight_sync(tmp_path, queue):
    tok = CharTokenizer()
    task = ArithmeticTask()
    pub = WeightPublisher(tmp_path / "weights")
    canary = [tok.bos_id, *tok.encode("1+2=3"), tok.eos_id]
    m0, m1 = _model(tok, 0), _model(tok, 1)
    _publish(pub, m0, 0, canary)
    engine = BuiltinEngine("float32", pad_id=tok.pad_id)
    cfg = WorkerConfig(group_size=4, prompts_per_step=2, worker_id="t",
                       sampling=SamplingParams(temperature=1.0, max_new_tokens=4,
                                               stop_token_ids=(tok.eos_id,)))
    worker = RolloutWorker(engine, task, tok, queue, WeightSubscriber(tmp_path / "weights"),
                           iter(prompt_dataset(task, seed=0)), cfg)
    assert worker.run(max_batches=1, install_signal_handlers=False) == 8
    got = queue.get_batch(8, trainer_version=0, max_lag=0, timeout=10)
    assert len(got.trajectories) == 8 and {t.policy_version for t in got.trajectories} == {0}
    L, k = len(m0.config.moe_layer_indices), m0.config.num_experts_per_tok
    for t in got.trajectories:
        assert t.routed_experts.shape == (t.num_tokens - 1, L, k)
        assert len(t.behavior_logprobs) == len(t.response_tokens) >= 1
        assert np.all(t.behavior_logprobs <= 0) and t.reward in (0.0, 1.0)
        assert t.engine == "satjax-builtin" and t.group_size == 4
    # the fp32 engine's logprobs are the published model's teacher-forced ones
    t = got.trajectories[0]
    ids = jnp.asarray([np.concatenate([t.prompt_tokens, t.response_tokens])])
    lp = jnp.take_along_axis(
        jax_log_softmax(m0(ids).logits[0, :-1]), ids[0, 1:, None], axis=-1)[:, 0]
    np.testing.assert_allclose(np.asarray(lp[-len(t.response_tokens):]), t.behavior_logprobs,
                               atol=1e-5)
    queue.ack(got.cursor)

    # a new version is picked up, canary-checked and stamped on the next trajectories
    _publish(pub, m1, 1, canary)
    assert worker.run(max_batches=1, install_signal_handlers=False) == 16
    assert engine.version == 1
    got = queue.get_batch(8, trainer_version=1, max_lag=0, timeout=10)
    assert {t.policy_version for t in got.trajectories} == {1}


def jax_log_softmax(x):
    return jax.nn.log_softmax(x.astype(jnp.float32), axis=-1)


@pytest.mark.slow
def test_canary_catches_wrong_weights(tmp_path, queue, caplog):
    """Weights that do not reproduce the trainer's canary are refused, not served."""
    tok = CharTokenizer()
    pub = WeightPublisher(tmp_path / "weights")
    canary = [tok.bos_id, *tok.encode("9+9=18"), tok.eos_id]
    good, other = _model(tok, 0), _model(tok, 5)
    # the manifest claims the canary of `good` but the files hold `other`
    pub.publish(0, lambda d: save_pretrained(other, str(d)),
                canary={"tokens": canary, "logprobs": canary_logprobs(good, canary)})
    engine = BuiltinEngine("float32")
    worker = RolloutWorker(engine, ArithmeticTask(), tok, queue,
                           WeightSubscriber(tmp_path / "weights"), iter([]), WorkerConfig())
    with caplog.at_level(logging.ERROR, logger="satjax.rollout.worker"):
        assert not worker.maybe_sync()
    assert "refused version 0: weight sync canary failed for version 0" in caplog.text
    # the engine holds the weights it was given, unchecked: the worker serves nothing
    assert engine.version is None and worker.refused == 0


@pytest.mark.slow
def test_bf16_engine_vs_fp32_trainer_mismatch_and_replay():
    """A bf16 engine routes some tokens differently from the fp32 trainer; with routing
    replay the trainer applies exactly the engine's experts (flip rate 0)."""
    from satjax.train.batch import make_batch

    tok = CharTokenizer()
    task = ArithmeticTask()
    model = _model(tok, 3)
    engine = BuiltinEngine("bfloat16", pad_id=tok.pad_id)
    engine.set_model(model, 0)
    sampler = GroupSampler(
        engine, task, tok, iter(prompt_dataset(task, seed=1)),
        WorkerConfig(group_size=4, prompts_per_step=8, worker_id="mm",
                     sampling=SamplingParams(temperature=1.0, max_new_tokens=6,
                                             stop_token_ids=(tok.eos_id,))),
    )
    trajectories = sampler.sample()
    L, k = len(model.config.moe_layer_indices), model.config.num_experts_per_tok
    batch = make_batch(trajectories, buckets=(32,), pad_id=tok.pad_id, num_layers_moe=L, top_k=k)
    batch = jax.tree.map(jnp.asarray, batch)
    metrics = {}
    for replay in (False, True):
        lp, out = token_logprobs(model, batch.tokens, batch.attention_mask,
                                 routed_experts=batch.routed_experts if replay else None)
        aux = router_mismatch(out.router_topk, out.experts_used, batch.routed_experts,
                              batch.route_mask())
        log_ratio = (batch.behavior_logprobs - lp) * batch.loss_mask
        kl_k3 = float(jnp.sum((jnp.exp(log_ratio) - 1 - log_ratio) * batch.loss_mask)
                      / jnp.sum(batch.loss_mask))
        metrics[replay] = {k_: float(v) for k_, v in aux.items() if k_.startswith("router_mis")}
        metrics[replay]["kl_k3"] = kl_k3
    print("bf16 engine vs fp32 trainer:", metrics)
    off, on = metrics[False], metrics[True]
    assert 0 < off["router_mismatch"] < 0.5  # bf16 numerics flip some expert sets
    assert off["router_mismatch_applied"] == off["router_mismatch"]
    assert on["router_mismatch_applied"] == 0.0  # replay: the trainer uses the engine's experts
    assert on["router_mismatch"] == off["router_mismatch"]  # the router itself is unchanged
    assert 0 < off["kl_k3"] < 0.1 and 0 <= on["kl_k3"] < 0.1


def test_worker_config_defaults_are_the_rollout_keys_defaults():
    """A WorkerConfig made without a run's config samples as a default run's worker does
    (each default is written once, in satjax.config)."""
    import dataclasses

    from satjax.app.factory import worker_config
    from satjax.config import load_config

    tok = CharTokenizer()
    made = worker_config(load_config(None), tok, seed=0, worker_id="w0")
    keys = ("group_size", "prompts_per_step", "record_routes", "partial", "queue_retry_s",
            "overlong", "overlong_buffer", "overlong_penalty")
    assert {k: getattr(WorkerConfig(), k) for k in keys} == {
        k: getattr(made, k) for k in keys}
    assert {f.name for f in dataclasses.fields(WorkerConfig)} >= set(keys)


def test_make_engine_builds_the_configured_engine():
    from satjax.config import RolloutConfig
    from satjax.rollout.factory import make_engine

    tok = CharTokenizer()
    engine = make_engine(RolloutConfig(engine="builtin", sample_dtype="float32"), tok)
    assert isinstance(engine, BuiltinEngine)
    assert engine.sample_dtype == jnp.float32 and engine.pad_id == tok.pad_id
    with pytest.raises(ValueError, match="sample_dtype"):
        make_engine(RolloutConfig(engine="builtin", sample_dtype="int8"), tok)


@pytest.mark.slow
def test_each_group_is_its_own_put(tmp_path, queue):
    """A batch of groups goes to the queue one group per put, so a worker that dies
    between puts has delivered every group it finished before."""
    tok = CharTokenizer()
    task = ArithmeticTask()
    canary = [tok.bos_id, *tok.encode("1+1=2"), tok.eos_id]
    _publish(WeightPublisher(tmp_path / "weights"), _model(tok, 0), 0, canary)
    puts = []

    class RecordingClient:  # the real client, recording the size of each put
        def __getattr__(self, name):
            return getattr(queue, name)

        def put(self, trajectories):
            puts.append(sorted({t.group_id for t in trajectories}))
            return queue.put(trajectories)

    cfg = WorkerConfig(group_size=4, prompts_per_step=3, worker_id="g",
                       sampling=SamplingParams(max_new_tokens=3, stop_token_ids=(tok.eos_id,)))
    worker = RolloutWorker(BuiltinEngine("float32", pad_id=tok.pad_id), task, tok,
                           RecordingClient(), WeightSubscriber(tmp_path / "weights"),
                           iter(prompt_dataset(task, seed=0)), cfg)
    assert worker.run(max_batches=1, install_signal_handlers=False) == 12
    assert len(puts) == 3 and all(len(g) == 1 for g in puts)  # one group per put
    assert len({g[0] for g in puts}) == 3
    stats = queue.stats()
    assert stats["accepted_total"] == 12 and stats["incomplete_groups"] == 0


@pytest.mark.slow
def test_worker_waits_for_files_that_arrive_after_the_manifest(tmp_path, queue):
    """On a bucket mount a version's files appear one by one: a worker that sees the
    manifest first waits for the weights instead of failing or loading half a version."""
    import threading

    tok = CharTokenizer()
    canary = [tok.bos_id, *tok.encode("2+2=4"), tok.eos_id]
    _publish(WeightPublisher(tmp_path / "weights"), _model(tok, 0), 0, canary)
    weights = tmp_path / "weights" / "v00000000" / "model.safetensors"
    shutil.move(weights, tmp_path / "held")  # as if the copy had not reached it yet
    engine = BuiltinEngine("float32", pad_id=tok.pad_id)
    worker = RolloutWorker(engine, ArithmeticTask(), tok, queue,
                           WeightSubscriber(tmp_path / "weights"), iter([]), WorkerConfig())
    timer = threading.Timer(0.5, shutil.move, (tmp_path / "held", weights))
    timer.start()
    assert worker.maybe_sync() and engine.version == 0  # loaded once the file arrived
    timer.join()


class _CountingEngine(BuiltinEngine):
    """The built-in engine, counting full loads and delta applications."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def load(self, checkpoint_dir, version):
        self.calls.append(("full", version))
        super().load(checkpoint_dir, version)

    def apply_deltas(self, delta_dirs, version):
        self.calls.append(("deltas", [int(d.name[1:]) for d in delta_dirs]))
        super().apply_deltas(delta_dirs, version)


@pytest.mark.slow
def test_builtin_worker_follows_delta_versions_bit_exactly(tmp_path):
    """A worker that follows delta versions (one at a time, then two at once) serves the
    very weights of a full load of the last version; one that starts late rebuilds it
    from the keyframe; a delta that decodes but is wrong fails the canary."""
    from satjax import parallel
    from satjax.model.hf_io import hf_state_dict
    from satjax.train.publish import ShardedPublisher
    from satjax.weight_sync import MANIFEST, file_digest, read_raw_tensors

    tok = CharTokenizer()
    canary = [tok.bos_id, *tok.encode("3+4=7"), tok.eos_id]
    mesh = parallel.make_mesh(parallel.MeshConfig(), devices=jax.devices()[:1])
    pub = ShardedPublisher(WeightPublisher(tmp_path / "weights"), mesh, canary,
                           keyframe_every=10)
    models = [_model(tok, 0)]
    for v in range(1, 4):  # a small update of every parameter
        graphdef, state = nnx.split(models[-1])
        models.append(nnx.merge(graphdef, jax.tree.map(lambda x, v=v: x * (1 + 1e-3 * v),
                                                       state)))
    sub = WeightSubscriber(tmp_path / "weights")

    def worker(engine):
        return RolloutWorker(engine, ArithmeticTask(), tok, None, sub, iter([]), WorkerConfig())

    engine = _CountingEngine("float32", pad_id=tok.pad_id)
    w = worker(engine)
    for v in (0, 1):
        pub.publish(models[v], v)
        pub.wait()
        assert w.maybe_sync() and engine.version == v
    for v in (2, 3):
        pub.publish(models[v], v)
    pub.wait()
    assert w.maybe_sync() and engine.version == 3
    assert engine.calls == [("full", 0), ("deltas", [1]), ("deltas", [2, 3])]
    assert [sub.manifest(v)["kind"] for v in range(4)] == ["full"] + ["delta"] * 3
    want = hf_state_dict(models[3])
    got = hf_state_dict(engine.model)
    assert got.keys() == want.keys()
    assert all(got[k].tobytes() == want[k].tobytes() for k in want)  # bit-identical
    late = _CountingEngine("float32", pad_id=tok.pad_id)
    assert worker(late).maybe_sync() and late.calls == [("full", 0), ("deltas", [1, 2, 3])]
    assert all(hf_state_dict(late.model)[k].tobytes() == want[k].tobytes() for k in want)

    # version 4: a delta that decodes fine but holds another update of one tensor
    import zstandard
    from safetensors.numpy import save_file

    pub.publish(models[3], 4)  # nothing changed: every delta file is empty
    pub.wait()
    path = sub.checkpoint_dir(4)
    assert not any(read_raw_tensors(path / f) for f in sub.manifest(4)["files"])
    name = "lm_head.weight"
    flip = np.zeros(want[name].nbytes, np.uint8)
    flip[3::4] = 0x01  # the exponent's low bit of every float32 value
    first = sorted(sub.manifest(4)["files"])[0]
    shutil.copy(path / first, tmp_path / "good")
    shutil.copy(path / MANIFEST, tmp_path / "good-manifest")
    save_file({name: np.frombuffer(zstandard.ZstdCompressor().compress(flip), np.uint8)},
              path / first)
    # published so (its checksum in the manifest): only the canary can tell
    manifest = sub.manifest(4)
    manifest["files"][first] = (path / first).stat().st_size
    manifest["digests"][first] = file_digest(path / first)
    (path / MANIFEST).write_text(json.dumps(manifest))
    assert not w.maybe_sync() and w.refused == 4
    assert engine.version is None  # it holds a wrong version: nothing is served
    # with the file repaired, the worker does not build on the weights it refused: it
    # rebuilds version 5 from the keyframe
    shutil.copy(tmp_path / "good", path / first)
    shutil.copy(tmp_path / "good-manifest", path / MANIFEST)
    pub.publish(models[2], 5)
    pub.wait()
    engine.calls.clear()
    assert w.maybe_sync() and engine.version == 5
    assert engine.calls == [("full", 0), ("deltas", [1, 2, 3, 4, 5])]
    want = hf_state_dict(models[2])
    assert all(hf_state_dict(engine.model)[k].tobytes() == want[k].tobytes() for k in want)


@pytest.mark.slow
def test_a_worker_counts_the_time_the_queues_back_pressure_paused_it(tmp_path):
    """What the staleness model reads as the rollout side's capacity: a worker's time
    after its first weights (``active_s``) and, of it, the time it waited on the queue's
    back-pressure (``paused_s``)."""
    import threading

    from satjax.queue.client import QueueClient
    from satjax.queue.core import QueueSettings
    from satjax.queue.server import QueueServer

    token = "rollout-test-token"
    server = QueueServer(tmp_path / "queue", token, settings=QueueSettings(max_pending=8))
    client = QueueClient(f"127.0.0.1:{server.start(0)}", token=token)
    client.wait_ready(timeout=30)
    tok = CharTokenizer()
    task = ArithmeticTask()
    canary = [tok.bos_id, *tok.encode("1+1=2"), tok.eos_id]
    _publish(WeightPublisher(tmp_path / "weights"), _model(tok, 0), 0, canary)
    cfg = WorkerConfig(group_size=4, prompts_per_step=2, worker_id="p",
                       sampling=SamplingParams(max_new_tokens=3, stop_token_ids=(tok.eos_id,)))
    worker = RolloutWorker(BuiltinEngine("float32", pad_id=tok.pad_id), task, tok, client,
                           WeightSubscriber(tmp_path / "weights"),
                           iter(prompt_dataset(task, seed=0)), cfg)
    try:
        # one batch of 8 fills the queue (nobody takes it): the worker then pauses until
        # stopped, 3 s after that batch is stored (timed from the batch, not from the
        # start: the first batch's compile time depends on the machine's load)
        def stop_after_first_batch():
            deadline = time.monotonic() + 120
            while worker.produced < 8 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(3.0)
            worker.stop_event.set()

        stopper = threading.Thread(target=stop_after_first_batch)
        stopper.start()
        assert worker.run(max_batches=3, install_signal_handlers=False) == 8
        stopper.join()
        assert worker.paused_s > 2.0, worker.paused_s
        assert worker.paused_s < worker.active_s
    finally:
        client.close()
        server.stop(1.0)
