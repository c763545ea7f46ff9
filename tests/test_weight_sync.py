import json

import pytest

from satjax.weight_sync import (
    WeightPublisher,
    WeightSubscriber,
    WeightSyncError,
    check_canary,
    published_versions,
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
