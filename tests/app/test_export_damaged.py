"""``satjax export`` and ``satjax eval`` refuse published weights that are not the bytes
that were published (one line naming the version and the file, exit 1, nothing written),
and a full weights disk ends the run with a line that names the disk, ``LATEST`` on a
complete version and no staging left behind. Real publishes (ShardedPublisher)."""

import errno
import json
import os
import shutil

import jax
import pytest
from flax import nnx

from satjax import parallel
from satjax.app.commands import evaluate, export, next_step
from satjax.model import Qwen3MoeForCausalLM
from satjax.train.publish import ShardedPublisher
from satjax.weight_sync import (
    WeightPublisher,
    WeightSubscriber,
    WeightSyncError,
    published_versions,
    verify_files,
)

CANARY = [1, 5, 9, 2]


def tiny_model():
    from satjax.app.factory import build_tokenizer, model_config
    from satjax.config import load_config

    cfg = load_config(None, [])
    return Qwen3MoeForCausalLM(model_config(cfg, build_tokenizer(cfg)), rngs=nnx.Rngs(0))


def publisher(weights, keyframe_every=3):
    mesh = parallel.make_mesh(parallel.MeshConfig(), devices=jax.devices()[:1])
    return ShardedPublisher(WeightPublisher(weights, keep=10), mesh, CANARY,
                            keyframe_every=keyframe_every)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """A run directory whose weights are v0 (full), v1 and v2 (deltas)."""
    run = tmp_path_factory.mktemp("chain") / "run"
    model = tiny_model()
    pub = publisher(run / "weights")
    for v in range(3):
        graphdef, state = nnx.split(model)
        pub.publish(nnx.merge(graphdef, jax.tree.map(lambda x, v=v: x * (1 + 1e-3 * v),
                                                     state)), v)
    pub.wait()
    return run


def first_file(version_dir, prefix):
    return sorted(version_dir.glob(f"{prefix}*.safetensors"))[0]


def flip(file, where):
    """Flips one bit of ``file`` ``where`` (a fraction) of the way into its tensor data."""
    data = bytearray(file.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    data[start + int((len(data) - start) * where)] ^= 0x40
    file.write_bytes(bytes(data))


def damage_keyframe(run):
    file = first_file(run / "weights/v00000000", "model-")
    flip(file, 0.5)
    return 0, file


def flip_delta(run):
    file = max((run / "weights/v00000001").glob("delta-*.safetensors"),
               key=lambda f: f.stat().st_size)
    flip(file, 0.5)
    return 1, file


def truncate_delta(run):
    file = max((run / "weights/v00000002").glob("delta-*.safetensors"),
               key=lambda f: f.stat().st_size)
    os.truncate(file, file.stat().st_size // 2)
    return 2, file


def delete_base(run):
    shutil.rmtree(run / "weights/v00000000")
    return 0, run / "weights/v00000000"


@pytest.mark.slow
@pytest.mark.parametrize("damage", [damage_keyframe, flip_delta, truncate_delta, delete_base])
def test_export_of_a_damaged_chain_is_one_line_and_writes_nothing(chain, tmp_path, capsys,
                                                                   damage):
    run = tmp_path / "run"
    shutil.copytree(chain, run)
    version, file = damage(run)
    out = tmp_path / "hf"
    assert export(["--set", f"run_dir={run}", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("satjax export: error: version ")
    assert f"version {version}" in err and str(file) in err
    assert not out.exists()


@pytest.mark.slow
def test_a_bit_flip_in_a_keyframe_is_refused_by_eval_and_the_good_chain_exports(
        chain, tmp_path, capsys):
    out = tmp_path / "hf"
    assert export(["--set", f"run_dir={chain}", "--version", "2", "--out", str(out)]) == 0
    assert (out / "config.json").is_file()
    run = tmp_path / "run"
    shutil.copytree(chain, run)
    _, file = damage_keyframe(run)
    capsys.readouterr()
    assert evaluate(["--set", f"run_dir={run}", "--num-prompts", "1", "--k", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"satjax eval: error: version 0: {file}: checksum crc32:")
    assert err.count("\n") == 0


@pytest.fixture
def small_disk(tmp_path, mount_tmpfs):
    """A 24 MiB tmpfs (needs mount rights: root or a user namespace)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    return mount_tmpfs(disk, "size=24m")


@pytest.mark.slow
def test_a_full_weights_disk_names_the_disk_and_keeps_latest_on_a_complete_version(
        small_disk):
    run = small_disk / "run"
    weights = run / "weights"
    (run / "checkpoints" / "3").mkdir(parents=True)  # a run that can be resumed
    model = tiny_model()
    pub = publisher(weights, keyframe_every=1)
    pub.publish(model, 0)
    pub.wait()
    size = sum(f.stat().st_size for f in (weights / "v00000000").iterdir())
    stat = os.statvfs(small_disk)
    room = stat.f_bavail * stat.f_frsize
    assert room > size, "the tmpfs must hold a second version but half"
    filler = small_disk / "filler"
    filler.write_bytes(bytes(room - size // 2))  # version 1 fails half way through
    pub.publish(model, 1)
    with pytest.raises(WeightSyncError) as e:
        pub.wait()
    line = next_step(str(run), e.value)
    assert line.startswith(f"fix the cause ({os.strerror(errno.ENOSPC)}: {weights}/"), line
    assert line.endswith(f"then continue with: satjax train --set run_dir={run} --resume")
    sub = WeightSubscriber(weights)
    assert sub.latest_version() == 0 and published_versions(weights) == [0]
    verify_files(sub.chain(0)[0])  # the version LATEST names is whole
    assert sorted(p.name for p in weights.iterdir()) == ["LATEST", "v00000000"]  # no staging
    # once there is room, the next publish goes through (a full version)
    filler.unlink()
    pub.publish(model, 2)
    pub.wait()
    assert sub.latest_version() == 2 and sub.manifest(2)["kind"] == "full"
    assert json.loads((weights / "v00000002" / "manifest.json").read_text())["digests"]
