"""Sharded background weight publishing (satjax.train.publish) in one process, 8 devices.

The 2-process cases (each process writes its own files, byte-equal to one process) are in
test_multiprocess.py.
"""

from __future__ import annotations

import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from satjax import parallel
from satjax.model import canary_logprobs, from_pretrained, save_pretrained, token_logprobs
from satjax.model.hf_io import hf_state_dict
from satjax.rollout.builtin_engine import BuiltinEngine
from satjax.train import publish as publish_mod
from satjax.train.publish import ShardedPublisher
from satjax.utils import atomic_write
from satjax.weight_sync import (
    WeightMirror,
    WeightPublisher,
    WeightSubscriber,
    WeightSyncError,
    check_canary,
    published_versions,
    read_raw_tensors,
)

TOKENS = [1, 5, 9, 17, 30, 2]


@pytest.fixture(scope="module")
def sharded(tiny_model):
    """The tiny model with its parameters sharded over data=2, fsdp=2, expert=2."""
    model = tiny_model(3)
    mesh = parallel.make_mesh(parallel.MeshConfig(data=2, fsdp=2, expert=2))
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, parallel.state_shardings(state, mesh))
    return nnx.merge(graphdef, state), mesh


def version_tensors(path) -> dict[str, np.ndarray]:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for fname in set(index.values()):
        out.update(load_file(path / fname))
    assert out.keys() == index.keys()
    return out


@pytest.mark.slow
def test_layout_round_trips_and_equals_save_pretrained(sharded, tmp_path):
    model, mesh = sharded
    pub = ShardedPublisher(WeightPublisher(tmp_path / "w"), mesh, TOKENS)
    pub.publish(model, 4, target_version=2)
    pub.wait()
    sub = WeightSubscriber(tmp_path / "w")
    # TARGET never names a version that is not published (2 is not): the newest one
    assert (sub.latest_version(), sub.wanted_version()) == (4, 4)
    path = sub.checkpoint_dir(4)
    # several files (one process still writes WRITE_THREADS of them), hidden files gone
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(shards) == publish_mod.WRITE_THREADS and shards[-1].endswith("-of-00004.safetensors")
    assert not [p for p in path.iterdir() if p.name.startswith(".")]
    want = hf_state_dict(model)
    loaded = from_pretrained(str(path))
    got = hf_state_dict(loaded)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # the synchronous single-file writer produces the very same tensors
    save_pretrained(model, str(tmp_path / "sync"))
    sync = load_file(tmp_path / "sync" / "model.safetensors")
    mine = version_tensors(path)
    assert sync.keys() == mine.keys()
    assert all(sync[k].tobytes() == mine[k].tobytes() and sync[k].shape == mine[k].shape
               for k in sync)
    # the canary (jitted on the sharded model) matches the loaded weights; others fail it
    # (what model.canary_logprobs computes, jitted: one compile for both models)
    canary = nnx.jit(lambda m: token_logprobs(m, jnp.asarray([TOKENS]))[0][0, 1:])
    manifest = sub.manifest(4)
    check_canary(manifest, np.asarray(canary(loaded)).tolist(), atol=1e-5)
    loaded.lm_head.set_value(loaded.lm_head[...] * 100)
    with pytest.raises(WeightSyncError, match="canary failed for version 4"):
        check_canary(manifest, np.asarray(canary(loaded)).tolist(), atol=1e-3)


@pytest.mark.slow
def test_snapshot_survives_donation_and_a_failed_write_surfaces(sharded, tmp_path,
                                                               monkeypatch):
    """publish() returns at once: the files hold the weights of the publish call although
    the state's buffers are donated and overwritten before anything is copied to host or
    written. A write that fails leaves no visible version and is raised by the next call."""
    model, mesh = sharded
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: x + 0, state)  # own buffers, so donating them is safe
    before = hf_state_dict(nnx.merge(graphdef, state))
    gate = threading.Event()
    real_snapshot = publish_mod.snapshot

    def gated(*args, **kwargs):
        assert gate.wait(60)
        return real_snapshot(*args, **kwargs)

    monkeypatch.setattr(publish_mod, "snapshot", gated)
    pub = ShardedPublisher(WeightPublisher(tmp_path), mesh, TOKENS)
    pub.publish(nnx.merge(graphdef, state), 0)
    donated = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 7, s), donate_argnums=0)(state)
    assert float(np.asarray(jax.tree.leaves(donated)[0]).ravel()[0]) == -7
    assert published_versions(tmp_path) == []  # still writing
    gate.set()
    pub.wait()
    got = version_tensors(WeightSubscriber(tmp_path).checkpoint_dir(0))
    for k in before:
        np.testing.assert_array_equal(got[k], before[k], err_msg=k)
    real = publish_mod.write_safetensors

    def broken(path, *args, **kwargs):
        with open(path, "wb") as fh:
            fh.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(publish_mod, "write_safetensors", broken)
    pub.publish(model, 1)  # returns: the error is in the background
    with pytest.raises(WeightSyncError, match=r"version 1 failed: OSError\('disk full'\)"):
        pub.publish(model, 2)  # the next call raises it (and starts nothing)
    assert published_versions(tmp_path) == [0]
    assert WeightSubscriber(tmp_path).latest_version() == 0
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".v")]
    monkeypatch.setattr(publish_mod, "write_safetensors", real)
    pub.publish(model, 2)  # reported once; publishing goes on
    pub.wait()
    assert published_versions(tmp_path) == [0, 2]


def _nudged(model, paths, scale):
    """A copy of ``model`` with the parameters at ``paths`` (None: all) times (1 + scale):
    a small update that changes some float32 values' bfloat16 rounding and not others."""
    graphdef, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        if paths is None or path in paths:
            flat[path] = var.replace(var[...] * (1 + scale))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


@pytest.mark.slow
def test_delta_versions_round_trip_bit_exactly_in_bf16(sharded, tmp_path):
    """Versions 0..4 of a float32 model published as bfloat16 with a keyframe every 3:
    0 and 3 full, 1, 2, 4 deltas of the version before. Following them (each version, and
    with skips) gives the bytes of each version's own full bfloat16 copy; a delta holds
    only the tensors whose bf16 bytes changed; the canary is the rounded weights'."""
    model, mesh = sharded
    models = [model]
    q0 = ("layers", 0, "self_attn", "q_proj")
    for v, (paths, scale) in enumerate([({q0}, 1e-2), (None, 1e-3), (None, 1e-3),
                                        (None, 1e-3)], 1):
        models.append(_nudged(models[v - 1], paths, scale))
    pub = ShardedPublisher(WeightPublisher(tmp_path, keep=10), mesh, TOKENS,
                           keyframe_every=3, dtype="bfloat16")
    for v, m in enumerate(models):
        pub.publish(m, v)
    pub.wait()
    sub = WeightSubscriber(tmp_path)
    kinds = [(sub.manifest(v)["kind"], sub.manifest(v).get("base")) for v in range(5)]
    assert kinds == [("full", None), ("delta", 0), ("delta", 1), ("full", None), ("delta", 3)]
    want = [{k: x.astype(jnp.bfloat16) for k, x in hf_state_dict(m).items()} for m in models]
    assert version_tensors(sub.checkpoint_dir(3)).keys() == want[3].keys()
    assert all(version_tensors(sub.checkpoint_dir(3))[k].tobytes() == want[3][k].tobytes()
               for k in want[3])
    # version 1 changed one tensor: its delta holds that one only
    entries = {n for f in sub.manifest(1)["files"]
               for n in read_raw_tensors(sub.checkpoint_dir(1) / f)}
    assert entries == {"model.layers.0.self_attn.q_proj.weight"}
    for path in [[0, 1, 2, 3, 4], [0, 2], [1, 4], [2, 3]]:
        mirror = WeightMirror()
        for v in path:
            for step in sub.sync_plan(v, None if mirror.id is None
                                      else (mirror.version, mirror.id)):
                (mirror.apply_delta if step.is_delta else mirror.load_full)(step.path)
            assert mirror.version == v
            assert {k: t.data.tobytes() for k, t in mirror.tensors.items()} == \
                {k: x.tobytes() for k, x in want[v].items()}, (path, v)
    # the canary is computed from the weights as published (bf16), in float32
    engine = BuiltinEngine("float32")
    engine.load(sub.checkpoint_dir(3), 3)
    assert check_canary(sub.manifest(3), engine.canary_logprobs(TOKENS), atol=1e-5) < 1e-5
    with pytest.raises(WeightSyncError, match="canary failed"):  # not the float32 masters'
        check_canary({"version": 3, "canary": {"logprobs": canary_logprobs(models[3], TOKENS)}},
                     engine.canary_logprobs(TOKENS), atol=1e-5)


def test_processes_writing_against_different_bases_fail_the_publish(tmp_path):
    """Process 0 refuses to commit a version whose files were written against another
    base by some process (possible only after a failure that one process saw)."""
    atomic_write(tmp_path / ".done-1", json.dumps({"files": {"x": "crc32:0000002a"},
                                                   "base": 3}))
    with pytest.raises(WeightSyncError, match="process 1 wrote a delta of version 3, "
                                              "process 0 full files"):
        publish_mod.wait_for_peers(tmp_path, 2, timeout=1)
    # the digests of its files go into the manifest process 0 writes
    assert publish_mod.wait_for_peers(tmp_path, 2, timeout=1, base=3) == {"x": "crc32:0000002a"}
    assert not (tmp_path / ".done-1").exists()
