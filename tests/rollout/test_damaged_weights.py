"""A worker serves only versions whose files are the bytes that were published, and a
version it cannot load does not stop it: it refuses that version (logged with the file),
goes on serving the one it has, and loads the next. Real publishes (ShardedPublisher), the
built-in engine, a real in-process queue."""

import json
import logging

import jax
import numpy as np
import pytest
from flax import nnx

from satjax import parallel
from satjax.data.pipeline import prompt_dataset
from satjax.data.tasks import ArithmeticTask
from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM, canary_logprobs, from_pretrained
from satjax.model.hf_io import hf_state_dict
from satjax.model.tokenizer import CharTokenizer
from satjax.rollout.builtin_engine import BuiltinEngine
from satjax.rollout.engine import SamplingParams
from satjax.rollout.worker import RolloutWorker, WorkerConfig
from satjax.train.publish import ShardedPublisher
from satjax.weight_sync import WeightPublisher, WeightSubscriber, check_canary

EMBED = "model.embed_tokens.weight"


def models(tok, n):
    """``n`` versions of one tiny model, each a small step from the one before."""
    cfg = Qwen3MoeConfig.tiny(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id,
                              eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    out = [Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0))]
    for v in range(1, n):
        graphdef, state = nnx.split(out[-1])
        out.append(nnx.merge(graphdef, jax.tree.map(lambda x, v=v: x * (1 + 1e-3 * v), state)))
    return out


def publisher(weights, canary, keyframe_every):
    mesh = parallel.make_mesh(parallel.MeshConfig(), devices=jax.devices()[:1])
    return ShardedPublisher(WeightPublisher(weights, keep=10), mesh, canary,
                            keyframe_every=keyframe_every)


def tensor_file(path, name):
    """(file, byte offset in it, bytes) of tensor ``name`` in the version directory."""
    for f in sorted(path.glob("*.safetensors")):
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        if name in header:
            start, stop = header[name]["data_offsets"]
            return f, 8 + n + start, stop - start
    raise KeyError(name)


def flip_bit(file, offset, bit):
    data = bytearray(file.read_bytes())
    data[offset] ^= 1 << bit
    file.write_bytes(bytes(data))


def worker_for(weights, tok, queue):
    task = ArithmeticTask()
    cfg = WorkerConfig(group_size=2, prompts_per_step=1, worker_id="d",
                       sampling=SamplingParams(max_new_tokens=4, stop_token_ids=(tok.eos_id,)))
    engine = BuiltinEngine("float32", pad_id=tok.pad_id)
    return engine, RolloutWorker(engine, task, tok, queue, WeightSubscriber(weights),
                                 iter(prompt_dataset(task, seed=0)), cfg)


@pytest.mark.slow
def test_a_bit_flip_the_canary_cannot_see_is_refused_and_the_next_version_loads(
        tmp_path, caplog):
    tok = CharTokenizer()
    canary = [tok.bos_id, *tok.encode("1+2=3"), tok.eos_id]
    weights = tmp_path / "weights"
    pub = publisher(weights, canary, keyframe_every=1)
    ms = models(tok, 3)
    sub = WeightSubscriber(weights)
    engine, worker = worker_for(weights, tok, None)
    pub.publish(ms[0], 0)
    pub.wait()
    assert worker.maybe_sync() and engine.version == 0
    pub.publish(ms[1], 1)
    pub.wait()
    # one bit of the embedding row of a token the canary prompt does not hold
    row = tok.encode("z")[0]
    assert row not in canary
    file, offset, size = tensor_file(sub.checkpoint_dir(1), EMBED)
    row_bytes = size // tok.vocab_size
    flip_bit(file, offset + row * row_bytes + 3, 6)  # the exponent of its first value
    damaged = from_pretrained(sub.checkpoint_dir(1))
    assert not np.array_equal(hf_state_dict(damaged)[EMBED][row],
                              hf_state_dict(ms[1])[EMBED][row])
    # the premise: the canary passes on the damaged weights
    check_canary(sub.manifest(1), canary_logprobs(damaged, canary), atol=engine.canary_atol)

    with caplog.at_level(logging.ERROR, logger="satjax.rollout.worker"):
        assert not worker.maybe_sync()
    assert engine.version == 0 and worker.refused == 1  # still serving the last good one
    [line] = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert f"refused version 1: version 1: {file}: checksum crc32:" in line
    assert line.endswith("(damaged since it was published); serving version 0 until a newer "
                         "version loads")
    assert not worker.maybe_sync()  # a refused version is not read again
    pub.publish(ms[2], 2)
    pub.wait()
    assert worker.maybe_sync() and engine.version == 2


@pytest.mark.slow
def test_a_damaged_delta_does_not_stop_the_worker(tmp_path, queue):
    """Delta v2 is damaged: the worker refuses it, samples on with v1 (no trajectory is
    stamped v2) and takes keyframe v3."""
    tok = CharTokenizer()
    canary = [tok.bos_id, *tok.encode("4+4=8"), tok.eos_id]
    weights = tmp_path / "weights"
    pub = publisher(weights, canary, keyframe_every=3)  # v0 full, v1 and v2 deltas, v3 full
    ms = models(tok, 4)
    sub = WeightSubscriber(weights)
    engine, worker = worker_for(weights, tok, queue)
    for v in (0, 1):
        pub.publish(ms[v], v)
        pub.wait()
    assert worker.maybe_sync() and engine.version == 1
    pub.publish(ms[2], 2)
    pub.wait()
    assert sub.manifest(2)["kind"] == "delta"
    file, offset, size = tensor_file(sub.checkpoint_dir(2), EMBED)
    flip_bit(file, offset + size // 2, 0)  # inside the zstd frame of its delta

    assert worker.run(max_batches=1, install_signal_handlers=False) == 2
    assert engine.version == 1 and worker.refused == 2
    got = queue.get_batch(2, trainer_version=2, max_lag=5, timeout=10)
    assert {t.policy_version for t in got.trajectories} == {1}
    pub.publish(ms[3], 3)
    pub.wait()
    assert sub.manifest(3)["kind"] == "full"
    assert worker.maybe_sync() and engine.version == 3
