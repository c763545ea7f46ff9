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
from satjax.model import from_pretrained, save_pretrained, token_logprobs
from satjax.model.hf_io import hf_state_dict
from satjax.train import publish as publish_mod
from satjax.train.publish import ShardedPublisher
from satjax.weight_sync import (
    WeightPublisher,
    WeightSubscriber,
    WeightSyncError,
    check_canary,
    published_versions,
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


def test_layout_round_trips_and_equals_save_pretrained(sharded, tmp_path):
    model, mesh = sharded
    pub = ShardedPublisher(WeightPublisher(tmp_path / "w"), mesh, TOKENS)
    pub.publish(model, 4, target_version=2)
    pub.wait()
    sub = WeightSubscriber(tmp_path / "w")
    assert (sub.latest_version(), sub.wanted_version()) == (4, 2)
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
