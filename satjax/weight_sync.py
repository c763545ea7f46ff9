"""Trainer -> worker weight sync through a shared directory.

The trainer publishes each policy version as a Hugging Face checkpoint directory
(``save_pretrained``: the layout both the built-in engine and vLLM load) plus a
``manifest.json`` holding the version and a *canary*: the trainer's own log-probs of a
fixed token sequence at that version. A worker that loads a version recomputes the
canary and refuses weights whose log-probs disagree, because a silently failed sync
looks exactly like staleness.

Publishing is atomic: files go to a staging directory (``.vNNNNNNNN-<tag>.staging``,
a dot-name readers ignore) that is renamed into place, and the ``LATEST`` pointer is
replaced with ``os.replace``; a version is removed the same way, renamed to a dot-name
(``.vNNNNNNNN-<id>.removed``) before its files are deleted, newest first, so that a crash
leaves each version whole or gone and no delta without its base. In an exact-lag
experiment the trainer also writes ``TARGET``: the version workers must serve (``latest -
lag``). Several processes may write into one staging directory (``satjax.train.publish``);
only the one that calls :meth:`WeightPublisher.publish` renames it.

Layout (version directory names come from :func:`satjax.run_dir.version_dir`)::

    sync_dir/v00000012/{config.json, model.safetensors.index.json,
                        model-00001-of-00002.safetensors, ..., manifest.json}
    sync_dir/LATEST     "12"
    sync_dir/TARGET     "10"   (optional)

**Delta versions.** A version is either *full* (the complete checkpoint above, a
"keyframe") or a *delta* of an earlier version, its ``base``: for every tensor whose bytes
changed, the zstd-compressed XOR of its bytes with the base's (:func:`encode_delta`),
stored as a ``uint8`` tensor of that name in ``delta-0000i-of-0000N.safetensors`` files
(no ``config.json``: a delta is not a checkpoint). The manifest says which::

    {"version": 12, "id": "<uuid>", "kind": "delta", "base": 11, "base_id": "<uuid of 11>",
     "files": {"delta-00001-of-00004.safetensors": 123456, ...},
     "digests": {"delta-00001-of-00004.safetensors": "crc32:8d3f01a2", ...},
     "canary": {...}}

``id`` names one publish, so that a delta is applied only to the very bytes it was made
against (a restarted trainer publishes the same version numbers again). A reader follows
``base`` links back to a full version (:meth:`WeightSubscriber.chain`) and moves its host
copy (:class:`WeightMirror`) along them; the publisher keeps every version on the chains
of the versions it keeps. The canary of the version reached is checked after every
reconstruction, so a wrong delta fails like a wrong checkpoint.

**Checksums.** ``digests`` holds the CRC-32 of every file's bytes (:func:`file_digest`),
which readers check before they use a version (:func:`verify_files`: the worker, ``satjax
export`` and ``eval``): the canary reads only the few tensors its tokens touch, so a bit
flipped in, say, the embedding row of another token would otherwise be served and
exported. CRC-32 finds every 1- to 3-bit error and any burst of up to 32 bits, at ~4 GB/s
(zlib's, which releases the GIL); the threat is damage, not an adversary.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
import uuid
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import zstandard

from satjax.run_dir import parse_version_dir, version_dir
from satjax.utils import atomic_write, fsync_dir

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
STAGING_SUFFIX = ".staging"
REMOVED_SUFFIX = ".removed"  # a version being removed: .vNNNNNNNN-<uuid>.removed
FULL, DELTA = "full", "delta"  # the manifest's "kind"
DELTA_PREFIX = "delta-"  # delta files: delta-00001-of-00004.safetensors
# zstd level of the deltas: on these mostly-zero XORs level 1 compresses as well as the
# default 3 and a little faster; negative (faster) levels lose much of the ratio
DELTA_LEVEL = 1
APPLY_THREADS = 8  # tensors a reader decompresses and XORs at once (zstd releases the GIL)
DIGEST_CHUNK = 8 << 20  # bytes :func:`file_digest` reads at a time


class WeightSyncError(RuntimeError):
    """A published version is missing, incomplete, damaged, or fails its canary check."""


class ForeignModelError(WeightSyncError):
    """A published version is of another model than the run's: unlike a damaged version,
    which a newer one replaces, every later version will be the same."""


def crc32_digest(crc: int) -> str:
    """How a manifest writes the CRC-32 of a file (``zlib.crc32`` of all its bytes)."""
    return f"crc32:{crc & 0xFFFFFFFF:08x}"


def file_digest(path: str | os.PathLike[str]) -> str:
    """The digest of the file ``path`` as a manifest's ``digests`` hold it."""
    crc = 0
    buf = bytearray(DIGEST_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return crc32_digest(crc)


class WeightPublisher:
    """Writes versions into ``sync_dir``; keeps the newest ``keep`` of them, the ``TARGET``
    and every version their delta chains need."""

    def __init__(self, sync_dir: str | os.PathLike[str], *, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep: must be >= 1, got {keep}")
        self.sync_dir = Path(sync_dir)
        self.sync_dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep

    def staging_dir(self, version: int, tag: str) -> Path:
        """Where ``version`` is assembled before :meth:`publish` renames it into place."""
        return self.sync_dir / f".{version_dir(self.sync_dir, version).name}-{tag}{STAGING_SUFFIX}"

    def publish(
        self,
        version: int,
        write_checkpoint: Callable[[Path], dict[str, str] | None],
        *,
        canary: dict[str, Any] | None = None,
        target_version: int | None = None,
        staging: Path | None = None,
        base: int | None = None,
    ) -> Path:
        """Publishes ``version``. ``write_checkpoint(dir)`` writes the weights into ``dir``
        (normally ``lambda d: save_pretrained(model, d)``; for a delta, the delta files) and
        may return the :func:`file_digest` of files it hashed as it wrote them; the others
        are read back to hash them.
        ``canary`` holds ``{"tokens": [...], "logprobs": [...]}`` computed by the trainer
        at this version. ``base``: the published version this one is a delta of (None: a
        full version); raises :class:`WeightSyncError` if it is not published.
        ``staging`` is a :meth:`staging_dir` other processes already wrote into (default:
        a fresh one). On any error the staging directory is removed and nothing is
        visible."""
        final = version_dir(self.sync_dir, version)
        if final.exists():
            raise WeightSyncError(f"version {version} was already published at {final}")
        tmp = staging or self.staging_dir(version, uuid.uuid4().hex)
        tmp.mkdir(exist_ok=True)
        try:
            manifest: dict[str, Any] = {"version": int(version), "id": uuid.uuid4().hex,
                                        "kind": FULL}
            if base is not None:
                if not base < version:
                    raise WeightSyncError(f"version {version}: a delta's base must be older, "
                                          f"got {base}")
                manifest.update(kind=DELTA, base=int(base),
                                base_id=WeightSubscriber(self.sync_dir).manifest(base)["id"])
            known = write_checkpoint(tmp) or {}
            files = sorted(f for f in tmp.iterdir() if not f.name.startswith("."))
            manifest.update(files={f.name: f.stat().st_size for f in files},
                            digests={f.name: known.get(f.name) or file_digest(f)
                                     for f in files},
                            published_unix=time.time(), canary=canary)
            atomic_write(tmp / MANIFEST, json.dumps(manifest))
            for f in tmp.iterdir():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            os.replace(tmp, final)
            fsync_dir(self.sync_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        atomic_write(self.sync_dir / "LATEST", str(version))
        if target_version is not None:
            target_version = self._servable(target_version, version)
            atomic_write(self.sync_dir / "TARGET", str(target_version))
        self._collect(protect=target_version, published=version)
        return final

    def _servable(self, target: int, published: int) -> int:
        """``target``, or when it is gone (a resumed run asks for a version of before its
        checkpoint, long removed) the newest older version a reader can rebuild, else
        ``published``: ``TARGET`` never names a version a worker cannot load."""
        if target == published or self._rebuildable(target):
            return target
        older = [v for v in published_versions(self.sync_dir)
                 if v < target and self._rebuildable(v)]
        got = older[-1] if older else published
        log.warning("TARGET: version %d is gone; workers are pointed at version %d",
                    target, got)
        return got

    def discard_from(self, version: int) -> None:
        """Removes the versions >= ``version``: a timeline a crash discarded (a run resumed
        from an older checkpoint publishes those numbers again), with any directory of
        theirs a crash left without its manifest. ``LATEST`` (and a ``TARGET``) naming one
        of them is first pointed at the newest version kept that a reader can rebuild, or
        removed when there is none, so that no reader ever finds a pointer naming a removed
        version (it would wait for it, or fail)."""
        kept = [v for v in published_versions(self.sync_dir)
                if v < version and self._rebuildable(v)]
        for name in ("LATEST", "TARGET"):
            pointer = self.sync_dir / name
            current = _read_int(pointer)
            if current is None or current < version:
                continue
            if kept:
                atomic_write(pointer, str(kept[-1]))
            else:
                pointer.unlink(missing_ok=True)
                fsync_dir(self.sync_dir)
        self._remove(v for v in _version_dirs(self.sync_dir) if v >= version)

    def _rebuildable(self, version: int) -> bool:
        """Whether every version of the chain of ``version`` is there, whole."""
        try:
            return all(version_complete(p.path, p.manifest)
                       for p in WeightSubscriber(self.sync_dir).chain(version))
        except (WeightSyncError, OSError, ValueError, KeyError):
            return False

    def _remove(self, versions: Iterable[int]) -> None:
        """Removes ``versions``, newest first, each at once: it is renamed to a dot-name
        readers ignore before its files go. A crash then leaves every version whole or
        gone (a half-removed directory would still hold its manifest, or, without it,
        block the number's next publish), and never a delta whose base is gone (a base is
        older than its deltas)."""
        for v in sorted(versions, reverse=True):
            path = version_dir(self.sync_dir, v)
            trash = self.sync_dir / f".{path.name}-{uuid.uuid4().hex}{REMOVED_SUFFIX}"
            try:
                os.replace(path, trash)
            except FileNotFoundError:
                continue
            fsync_dir(self.sync_dir)
            shutil.rmtree(trash, ignore_errors=True)

    def _collect(self, protect: int | None, published: int) -> None:
        versions = published_versions(self.sync_dir)
        wanted = set(versions[-self.keep:])
        if protect in versions:
            wanted.add(protect)
        needed: set[int] = set()
        sub = WeightSubscriber(self.sync_dir)
        for v in wanted:  # each with the chain of bases it is rebuilt from
            while v not in needed:
                needed.add(v)
                try:
                    manifest = sub.manifest(v)
                except (WeightSyncError, OSError, ValueError):
                    break
                if manifest.get("kind", FULL) == FULL:
                    break
                v = manifest["base"]
        self._remove(v for v in versions if v not in needed)
        # staging left by a crashed or failed publish (one of a newer version may be in
        # use), and versions a crash left half removed
        for p in self.sync_dir.glob(f".*{STAGING_SUFFIX}"):
            staged = parse_version_dir(p.name[1:].split("-", 1)[0])
            if staged is not None and staged <= published:
                shutil.rmtree(p, ignore_errors=True)
        for p in self.sync_dir.glob(f".*{REMOVED_SUFFIX}"):
            shutil.rmtree(p, ignore_errors=True)


def published_versions(sync_dir: str | os.PathLike[str]) -> list[int]:
    """Complete versions present in ``sync_dir`` (staging directories excluded)."""
    root = Path(sync_dir)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        v = parse_version_dir(p.name)
        if v is not None and p.is_dir() and (p / MANIFEST).exists():
            out.append(v)
    return sorted(out)


def _version_dirs(sync_dir: Path) -> list[int]:
    """Every version directory in ``sync_dir``, with its manifest or not."""
    return sorted(v for p in sync_dir.iterdir()
                  if (v := parse_version_dir(p.name)) is not None and p.is_dir())


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


class Published(NamedTuple):
    """One published version: its number, directory and manifest."""

    version: int
    path: Path
    manifest: dict[str, Any]

    @property
    def is_delta(self) -> bool:
        return self.manifest.get("kind", FULL) == DELTA


class WeightSubscriber:
    """The worker side: which version to serve, where it is, its canary, and the versions
    to read to get there."""

    def __init__(self, sync_dir: str | os.PathLike[str], *,
                 architecture: dict[str, Any] | None = None) -> None:
        """``architecture``: the ``config.json`` values every full version must have (the
        run's model: ``Qwen3MoeConfig.architecture()``); None: not checked."""
        self.sync_dir = Path(sync_dir)
        self.architecture = architecture

    def wanted_version(self) -> int | None:
        """``TARGET`` if the trainer set one (exact-lag mode), else ``LATEST``."""
        target = _read_int(self.sync_dir / "TARGET")
        return target if target is not None else _read_int(self.sync_dir / "LATEST")

    def latest_version(self) -> int | None:
        """The newest version the trainer published."""
        return _read_int(self.sync_dir / "LATEST")

    def checkpoint_dir(self, version: int) -> Path:
        path = version_dir(self.sync_dir, version)
        if not (path / MANIFEST).exists():
            raise WeightSyncError(f"version {version} is not published: {path} has no "
                                  f"{MANIFEST}")
        return path

    def manifest(self, version: int) -> dict[str, Any]:
        return read_manifest(self.checkpoint_dir(version), version)

    def chain(self, version: int) -> list[Published]:
        """The versions ``version`` is rebuilt from, oldest first: a full version, then
        each delta of the one before it, ending with ``version``. Raises
        :class:`WeightSyncError` if a base is gone or is not the publish a delta was made
        against."""
        out = [Published(version, self.checkpoint_dir(version), self.manifest(version))]
        while out[-1].is_delta:
            delta = out[-1]
            base = int(delta.manifest["base"])
            try:
                got = Published(base, self.checkpoint_dir(base), self.manifest(base))
            except WeightSyncError as e:
                raise WeightSyncError(f"version {version} needs version {base} (the base of "
                                      f"delta {delta.version}), which is gone: {e}") from e
            if got.manifest.get("id") != delta.manifest["base_id"]:
                raise WeightSyncError(f"delta {delta.version} was made against another "
                                      f"publish of version {base} than the one in "
                                      f"{self.sync_dir}")
            out.append(got)
        return out[::-1]

    def sync_plan(self, version: int, have: tuple[int, str | None] | None
                  ) -> list[Published]:
        """What a reader holding ``have`` (version, manifest id; None: nothing) reads to
        serve ``version``, in order: the deltas after ``have`` when ``have`` is on the
        chain of ``version``, else the chain's full version and every delta after it."""
        chain = self.chain(version)
        for i, p in enumerate(chain):
            if have is not None and (p.version, p.manifest.get("id")) == have:
                return chain[i + 1:]
        return chain

    def check_architecture(self, full: Published) -> None:
        """Raises :class:`WeightSyncError` naming the keys where the ``config.json`` of the
        full version ``full`` (its files complete) differs from :attr:`architecture`: weights
        of another model (another run's, another shape) are never served, so their
        trajectories never reach the queue."""
        if self.architecture is None:
            return
        got = json.loads((full.path / "config.json").read_text())
        diff = [f"{k}={got.get(k)!r} (the run's: {v!r})"
                for k, v in self.architecture.items() if got.get(k) != v]
        if diff:
            raise ForeignModelError(f"version {full.version} in {full.path} is not the run's "
                                  f"model: its config.json has {', '.join(diff)}")

    def wait_for(self, version: int, timeout: float = 60.0, poll: float = 0.05) -> Path:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.checkpoint_dir(version)
            except WeightSyncError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(poll)


def read_manifest(path: Path, version: int | None = None) -> dict[str, Any]:
    """The manifest of the version directory ``path`` (checked to be ``version``'s)."""
    file = Path(path) / MANIFEST
    try:
        data = json.loads(file.read_bytes())
    except ValueError as e:  # not JSON, not UTF-8: damaged
        raise WeightSyncError(f"{file}: damaged manifest ({e})") from e
    if not isinstance(data, dict):
        raise WeightSyncError(f"{file}: damaged manifest (not a JSON object)")
    if version is not None and data.get("version") != version:
        raise WeightSyncError(f"manifest of {path} says version {data.get('version')}, "
                              f"expected {version}")
    return data


def version_complete(path: Path, manifest: dict[str, Any]) -> bool:
    """Whether every file of the version in ``path`` is there (on a bucket mount the
    manifest may arrive first): the files its manifest lists, or for a manifest without
    that list (older publishers) ``config.json`` and the weights the index names."""
    path = Path(path)
    if "files" in manifest:
        return all((path / name).is_file() for name in manifest["files"])
    if not (path / "config.json").is_file():
        return False
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        return all((path / name).is_file() for name in shards)
    return (path / "model.safetensors").is_file()


def verify_files(published: Published) -> None:
    """Raises :class:`WeightSyncError` naming the version and the file if a file of
    ``published`` is missing, not the size or not the :func:`file_digest` its manifest
    records (a version without ``digests``, from an older publisher, is not checked)."""
    sizes = published.manifest.get("files", {})
    for name, want in published.manifest.get("digests", {}).items():
        path = published.path / name
        try:
            size = path.stat().st_size
            got = file_digest(path) if size == sizes.get(name, size) else None
        except OSError as e:
            raise WeightSyncError(f"version {published.version}: {path}: cannot be read "
                                  f"({e.strerror})") from e
        if got is None:
            raise WeightSyncError(f"version {published.version}: {path}: {size} bytes, "
                                  f"published with {sizes[name]} (cut short or overwritten)")
        if got != want:
            raise WeightSyncError(f"version {published.version}: {path}: checksum {got}, "
                                  f"published with {want} (damaged since it was published)")


def delta_file_name(shard_file: str) -> str:
    """The delta file holding the tensors of full-version file ``shard_file``
    (``model-00001-of-00004.safetensors`` -> ``delta-00001-of-00004.safetensors``)."""
    return DELTA_PREFIX + shard_file.removeprefix("model-")


def _bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def encode_delta(new: np.ndarray, old: np.ndarray) -> bytes | None:
    """``zstd(bytes(new) XOR bytes(old))``, or None when the bytes are equal.

    The XOR is zero wherever a value kept its bit pattern (most of a bf16 tensor after a
    small step), so it compresses far better than the values; decoding is exact
    (:func:`apply_encoded_delta`). The frame carries its length and a checksum.
    """
    a, b = _bytes(new), _bytes(old)
    if a.size != b.size:
        raise ValueError(f"encode_delta: {a.size} bytes against {b.size}")
    x = np.bitwise_xor(a, b)
    if not x.any():
        return None
    return zstandard.ZstdCompressor(level=DELTA_LEVEL, write_checksum=True).compress(x)


def apply_encoded_delta(target: np.ndarray, delta: bytes) -> None:
    """XORs the decoded ``delta`` (:func:`encode_delta`) into the bytes of ``target``
    (contiguous, writable), turning the base's bytes into the new version's. Raises
    :class:`WeightSyncError` on a damaged frame or a length that is not ``target``'s."""
    view = target.reshape(-1).view(np.uint8)
    try:
        raw = zstandard.ZstdDecompressor().decompress(delta)
    except zstandard.ZstdError as e:
        raise WeightSyncError(f"damaged delta: {e}") from e
    if len(raw) != view.size:
        raise WeightSyncError(f"delta of {len(raw)} bytes for a tensor of {view.size}")
    np.bitwise_xor(view, np.frombuffer(raw, np.uint8), out=view)


@dataclasses.dataclass
class RawTensor:
    """A tensor as stored: safetensors dtype tag (``"BF16"``, ``"F32"`` ...), shape, and
    its little-endian bytes (``uint8``, writable)."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray


def read_raw_tensors(path: str | os.PathLike[str]) -> dict[str, RawTensor]:
    """Every tensor of one safetensors file, as raw bytes (any dtype, no framework): an
    8-byte little-endian header length, the JSON header ``{name: {dtype, shape,
    data_offsets}}``, then the data (https://github.com/huggingface/safetensors)."""
    out = {}
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        for name, h in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            start, stop = h["data_offsets"]
            data = np.empty(stop - start, np.uint8)
            f.seek(8 + n + start)
            if f.readinto(data.data) != data.size:
                raise WeightSyncError(f"{path}: tensor {name!r} is cut short")
            out[name] = RawTensor(h["dtype"], tuple(h["shape"]), data)
    return out


class WeightMirror:
    """A host copy of the tensors of the version a reader serves (raw bytes, the
    published dtype), moved from version to version by deltas: what a worker keeps to
    follow delta versions (``BuiltinEngine``; the vLLM plug-in keeps its own).

    ``version`` and ``id`` name the publish it holds (None: nothing, or a failed update).
    """

    def __init__(self) -> None:
        self.version: int | None = None
        self.id: str | None = None
        self.tensors: dict[str, RawTensor] = {}

    def load_full(self, path: str | os.PathLike[str]) -> None:
        """Reads the full version in ``path`` (every ``*.safetensors`` file; a checkpoint
        directory without a manifest is read too, but names no publish to apply deltas
        to)."""
        path = Path(path)
        manifest = read_manifest(path) if (path / MANIFEST).exists() else {}
        if manifest.get("kind", FULL) != FULL:
            raise WeightSyncError(f"{path} is a delta, not a full version")
        self.version = self.id = None
        self.tensors = {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightSyncError(f"no *.safetensors in {path}")
        for f in files:
            self.tensors.update(read_raw_tensors(f))
        self.version, self.id = manifest.get("version"), manifest.get("id")

    def apply_delta(self, path: str | os.PathLike[str]) -> list[str]:
        """Moves the mirror to the delta version in ``path``, whose base must be the
        publish it holds; returns the names of the tensors that changed. On an error the
        mirror holds no version (``version`` None) until the next :meth:`load_full`."""
        path = Path(path)
        manifest = read_manifest(path)
        if manifest.get("kind", FULL) != DELTA:
            raise WeightSyncError(f"{path} is a full version, not a delta")
        if self.id is None or manifest["base_id"] != self.id:
            raise WeightSyncError(
                f"version {manifest['version']} is a delta of version {manifest['base']} "
                f"(publish {manifest['base_id']}); the mirror holds version {self.version} "
                f"(publish {self.id})")
        self.version = self.id = None
        entries: dict[str, RawTensor] = {}
        for name in manifest["files"]:
            entries.update(read_raw_tensors(path / name))
        unknown = sorted(set(entries) - set(self.tensors))
        if unknown:
            raise WeightSyncError(f"{path}: deltas of tensors the base does not have: "
                                  f"{unknown[:5]}")

        def apply(name: str) -> None:
            try:
                apply_encoded_delta(self.tensors[name].data, entries[name].data.tobytes())
            except WeightSyncError as e:
                raise WeightSyncError(f"{path}: tensor {name!r}: {e}") from e

        with ThreadPoolExecutor(APPLY_THREADS) as pool:
            list(pool.map(apply, entries))
        self.version, self.id = int(manifest["version"]), manifest["id"]
        return sorted(entries)


def check_canary(
    manifest: dict[str, Any], engine_logprobs: list[float], *, atol: float
) -> float:
    """Max abs difference between the engine's canary log-probs and the trainer's;
    raises :class:`WeightSyncError` above ``atol``."""
    canary = manifest.get("canary")
    if not canary:
        return 0.0
    ref = [float(x) for x in canary["logprobs"]]
    if len(ref) != len(engine_logprobs):
        raise WeightSyncError(
            f"canary length mismatch: trainer {len(ref)}, engine {len(engine_logprobs)}"
        )
    err = max((abs(a - b) for a, b in zip(ref, engine_logprobs, strict=True)), default=0.0)
    if not err <= atol:
        raise WeightSyncError(
            f"weight sync canary failed for version {manifest.get('version')}: "
            f"max |logprob diff| {err:.3g} > {atol:.3g}; the engine is not running the "
            f"published weights"
        )
    return err
