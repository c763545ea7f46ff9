import dataclasses
import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file

from satjax.weight_sync import (
    WeightMirror,
    WeightPublisher,
    WeightSubscriber,
    WeightSyncError,
    apply_encoded_delta,
    check_canary,
    encode_delta,
    published_versions,
    read_raw_tensors,
    version_complete,
)


def _writer(payload):
    def write(d):
        (d / "model.safetensors").write_text(payload)
        (d / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))

    return write


def test_publish_latest_target_and_gc(tmp_path):
    pub = WeightPublisher(tmp_path, keep=2)
    sub = WeightSubscriber(tmp_path)
    assert sub.wanted_version() is None
    for v in range(5):
        pub.publish(v, _writer(f"w{v}"), canary={"tokens": [1, 2], "logprobs": [-0.5, -1.0]})
    assert sub.wanted_version() == 4
    assert published_versions(tmp_path) == [3, 4]
    assert (sub.checkpoint_dir(4) / "model.safetensors").read_text() == "w4"
    assert sub.manifest(4)["canary"]["logprobs"] == [-0.5, -1.0]
    pub.publish(5, _writer("w5"), target_version=3)
    assert sub.wanted_version() == 3
    assert 3 in published_versions(tmp_path)  # the target is protected from collection
    with pytest.raises(WeightSyncError, match="already published"):
        pub.publish(5, _writer("again"))
    with pytest.raises(WeightSyncError, match="not published"):
        sub.checkpoint_dir(0)


def test_failed_write_leaves_nothing(tmp_path):
    pub = WeightPublisher(tmp_path)

    def broken(d):
        (d / "model.safetensors").write_text("partial")
        raise OSError("disk full")

    with pytest.raises(OSError):
        pub.publish(0, broken)
    assert published_versions(tmp_path) == []
    assert WeightSubscriber(tmp_path).wanted_version() is None
    assert not any(p.name.startswith(".v") for p in tmp_path.iterdir())


def test_canary_check():
    manifest = {"version": 3, "canary": {"tokens": [1, 2, 3], "logprobs": [-1.0, -2.0]}}
    assert check_canary(manifest, [-1.0, -2.0 + 1e-6], atol=1e-5) <= 1e-5
    with pytest.raises(WeightSyncError, match="canary failed for version 3"):
        check_canary(manifest, [-1.0, -1.5], atol=1e-3)
    with pytest.raises(WeightSyncError, match="length"):
        check_canary(manifest, [-1.0], atol=1e-3)
    with pytest.raises(WeightSyncError):
        check_canary(manifest, [float("nan"), -2.0], atol=1e-3)


# -- delta versions ----------------------------------------------------------------------
def _full_writer(tensors):
    def write(d):
        save_file(tensors, d / "model.safetensors")
        (d / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))

    return write


def _delta_writer(new, old):
    """What the trainer's processes write for a delta (satjax.train.publish): one uint8
    tensor per changed tensor, split over two files."""
    def write(d):
        names = sorted(new)
        for i, part in enumerate((names[::2], names[1::2])):
            blobs = {n: encode_delta(new[n], old[n]) for n in part}
            save_file({n: np.frombuffer(b, np.uint8) for n, b in blobs.items() if b is not None},
                      d / f"delta-{i + 1:05d}-of-00002.safetensors")

    return write


def _step(tensors, rng, frac=0.02):
    """A small update: ``frac`` of the entries of every float tensor but "frozen" get a
    new bit pattern (as bf16 values do after a small optimizer step); "frozen" keeps its
    bytes, so a delta has no entry for it."""
    out = {}
    for name, x in tensors.items():
        y = x.copy()
        if name != "frozen":
            flat = y.reshape(-1)
            hit = rng.random(flat.size) < frac
            hit[rng.integers(flat.size)] = True
            flat[hit] *= flat.dtype.type(1.01)  # > 1 ulp in float16 too
        out[name] = y
    return out


@pytest.fixture()
def chain(tmp_path):
    """Versions 0..6 in tmp_path: 0 and 5 full (keyframes), the others deltas of the one
    before; and the tensors of each."""
    rng = np.random.default_rng(0)
    tensors = {"a": rng.normal(size=(64, 32)).astype(np.float32),
               "b": rng.normal(size=(7,)).astype(np.float16),
               "frozen": rng.normal(size=(16, 3)).astype(np.float32)}
    pub = WeightPublisher(tmp_path, keep=10)
    versions = [tensors]
    pub.publish(0, _full_writer(tensors), canary={"tokens": [1, 2], "logprobs": [-1.0]})
    for v in range(1, 7):
        versions.append(_step(versions[-1], rng))
        writer = _full_writer(versions[v]) if v == 5 else _delta_writer(versions[v],
                                                                        versions[v - 1])
        pub.publish(v, writer, base=None if v == 5 else v - 1)
    return WeightSubscriber(tmp_path), versions


def _mirror_bytes(mirror):
    return {n: t.data.tobytes() for n, t in mirror.tensors.items()}


def _bytes_of(tensors):
    return {n: x.tobytes() for n, x in tensors.items()}


def _follow(sub, mirror, version):
    have = None if mirror.version is None else (mirror.version, mirror.id)
    steps = sub.sync_plan(version, have)
    for s in steps:
        assert version_complete(s.path, s.manifest)
        if s.is_delta:
            mirror.apply_delta(s.path)
        else:
            mirror.load_full(s.path)
    return [(s.version, s.is_delta) for s in steps]


def test_encode_delta_round_trips_bit_exactly():
    rng = np.random.default_rng(1)
    for dtype in (np.float32, np.float16, np.int8):
        old = rng.normal(size=(33, 5)).astype(dtype)
        new = old.copy()
        new.reshape(-1)[::7] += np.asarray(1, dtype)
        delta = encode_delta(new, old)
        assert delta is not None and len(delta) < new.nbytes
        got = old.copy()
        apply_encoded_delta(got, delta)
        assert got.tobytes() == new.tobytes()
        assert encode_delta(new, new.copy()) is None  # unchanged: no entry
    with pytest.raises(WeightSyncError, match="delta of 4 bytes for a tensor of 8"):
        apply_encoded_delta(np.zeros(2, np.float32), encode_delta(np.ones(1, np.float32),
                                                                  np.zeros(1, np.float32)))
    damaged = bytearray(encode_delta(new, old))
    damaged[len(damaged) // 2] ^= 0xFF
    with pytest.raises(WeightSyncError, match="damaged delta"):
        apply_encoded_delta(old.copy(), bytes(damaged))


def test_delta_chain_reconstructs_every_version_bit_exactly(chain):
    sub, versions = chain
    manifests = [sub.manifest(v) for v in range(7)]
    assert [m["kind"] for m in manifests] == ["full"] + ["delta"] * 4 + ["full", "delta"]
    assert manifests[3]["base"] == 2 and manifests[3]["base_id"] == manifests[2]["id"]
    assert len({m["id"] for m in manifests}) == 7
    assert set(manifests[3]["files"]) == {"delta-00001-of-00002.safetensors",
                                          "delta-00002-of-00002.safetensors"}
    assert [p.version for p in sub.chain(4)] == [0, 1, 2, 3, 4]
    assert [p.version for p in sub.chain(6)] == [5, 6]
    mirror = WeightMirror()
    # a late reader: the keyframe, then every delta after it
    assert _follow(sub, mirror, 2) == [(0, False), (1, True), (2, True)]
    assert _mirror_bytes(mirror) == _bytes_of(versions[2])
    # one version further, and then one skipped: only the deltas after the version held
    assert _follow(sub, mirror, 3) == [(3, True)]
    assert _follow(sub, mirror, 4) == [(4, True)]
    assert _mirror_bytes(mirror) == _bytes_of(versions[4])
    assert _follow(sub, mirror, 6) == [(5, False), (6, True)]  # past a keyframe: from it
    assert _mirror_bytes(mirror) == _bytes_of(versions[6])
    skip = WeightMirror()
    _follow(sub, skip, 1)
    assert _follow(sub, skip, 4) == [(2, True), (3, True), (4, True)]  # 2 and 3 skipped
    assert _mirror_bytes(skip) == _bytes_of(versions[4])
    # the unchanged tensor has no delta entry; the delta files are far smaller
    entries = {n for f in manifests[3]["files"]
               for n in read_raw_tensors(sub.checkpoint_dir(3) / f)}
    assert entries == {"a", "b"}
    full = sum(manifests[0]["files"].values())
    assert sum(manifests[3]["files"].values()) < full / 3


def test_a_delta_is_applied_only_to_the_publish_it_was_made_against(chain, tmp_path):
    sub, versions = chain
    mirror = WeightMirror()
    _follow(sub, mirror, 2)
    with pytest.raises(WeightSyncError, match=r"delta of version 3 .* holds version 2"):
        mirror.apply_delta(sub.checkpoint_dir(4))
    # version 2 published again (a restarted trainer): delta 3 no longer chains to it
    shutil.rmtree(sub.checkpoint_dir(2))
    WeightPublisher(tmp_path, keep=10).publish(2, _delta_writer(versions[2], versions[1]),
                                               base=1)
    with pytest.raises(WeightSyncError, match="another publish of version 2"):
        sub.chain(4)
    assert sub.sync_plan(2, (2, mirror.id)) != []  # the new 2 is not the one held
    shutil.rmtree(sub.checkpoint_dir(0))
    with pytest.raises(WeightSyncError, match="needs version 0 .* which is gone"):
        sub.chain(1)


def test_a_damaged_delta_is_refused_and_leaves_no_version(chain):
    sub, _ = chain
    mirror = WeightMirror()
    _follow(sub, mirror, 2)
    path = sub.checkpoint_dir(3) / "delta-00001-of-00002.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-20] ^= 0xFF  # inside the last tensor's zstd frame
    path.write_bytes(bytes(raw))
    with pytest.raises(WeightSyncError, match="tensor .*: damaged delta"):
        mirror.apply_delta(sub.checkpoint_dir(3))
    assert mirror.version is None and mirror.id is None
    with pytest.raises(WeightSyncError, match="holds version None"):
        mirror.apply_delta(sub.checkpoint_dir(4))


def test_retention_keeps_the_chains_of_kept_versions(tmp_path):
    rng = np.random.default_rng(2)
    tensors = {"a": rng.normal(size=(8, 8)).astype(np.float32)}
    pub = WeightPublisher(tmp_path, keep=2)
    prev = tensors
    for v in range(7):  # full at 0 and 4
        new = _step(prev, rng, frac=0.5)
        pub.publish(v, _full_writer(new) if v in (0, 4) else _delta_writer(new, prev),
                    base=None if v in (0, 4) else v - 1,
                    target_version=1 if v >= 3 else None)  # exact lag: every publish
        prev = new
        if v == 3:  # the newest two (2, 3), their chain back to 0, and TARGET 1
            assert published_versions(tmp_path) == [0, 1, 2, 3]
    # TARGET 1 with its chain, and 5, 6 with theirs (4); 2 and 3 are no longer needed
    assert published_versions(tmp_path) == [0, 1, 4, 5, 6]
    pub.publish(7, _delta_writer(_step(prev, rng), prev), base=6, target_version=6)
    assert published_versions(tmp_path) == [4, 5, 6, 7]
    with pytest.raises(WeightSyncError, match="not published"):
        pub.publish(8, _delta_writer(prev, prev), base=2)  # a base that is gone
    with pytest.raises(WeightSyncError, match="must be older"):
        pub.publish(8, _delta_writer(prev, prev), base=8)
    assert published_versions(tmp_path) == [4, 5, 6, 7]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".v")]


def test_version_complete_waits_for_every_file_the_manifest_lists(chain):
    sub, _ = chain
    path = sub.checkpoint_dir(3)
    manifest = sub.manifest(3)
    assert version_complete(path, manifest)
    held = path / "delta-00002-of-00002.safetensors"
    held.rename(path / "elsewhere")
    assert not version_complete(path, manifest)


def test_the_vllm_plugin_side_imports_no_jax():
    """vLLM imports satjax.rollout.vllm_ext (and through it satjax.weight_sync) inside its
    own venv, which has no jax."""
    import subprocess
    import sys

    code = ("import sys, satjax.weight_sync, satjax.rollout.vllm_ext; "
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_a_version_of_another_architecture_is_refused(tmp_path):
    """A subscriber told the run's architecture refuses a full version whose config.json
    differs in it (4 experts where the run has 8), naming the key; other keys (dtype) and
    versions of the run's model pass."""
    from satjax.model import Qwen3MoeConfig

    run = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                         moe_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, num_experts=8,
                         num_experts_per_tok=2)

    def writer(cfg):
        def write(d):
            (d / "model.safetensors").write_text("w")
            (d / "config.json").write_text(json.dumps({**cfg.to_hf_dict(),
                                                       "torch_dtype": "bfloat16"}))
        return write

    pub = WeightPublisher(tmp_path, keep=5)
    pub.publish(0, writer(run))
    pub.publish(1, writer(dataclasses.replace(run, num_experts=4)))
    sub = WeightSubscriber(tmp_path, architecture=run.architecture())
    sub.check_architecture(sub.sync_plan(0, None)[0])
    with pytest.raises(WeightSyncError, match=r"version 1 .* not the run's model: its "
                                              r"config.json has num_experts=4 \(the run's: 8\)"):
        sub.check_architecture(sub.sync_plan(1, None)[0])
    WeightSubscriber(tmp_path).check_architecture(sub.sync_plan(1, None)[0])  # unchecked
