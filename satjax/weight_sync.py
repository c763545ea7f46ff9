"""Trainer -> worker weight sync through a shared directory.

The trainer publishes each policy version as a Hugging Face checkpoint directory
(``save_pretrained``: the layout both the built-in engine and vLLM load) plus a
``manifest.json`` holding the version and a *canary*: the trainer's own log-probs of a
fixed token sequence at that version. A worker that loads a version recomputes the
canary and refuses weights whose log-probs disagree, because a silently failed sync
looks exactly like staleness.

Publishing is atomic: files go to a staging directory (``.vNNNNNNNN-<tag>.staging``,
a dot-name readers ignore) that is renamed into place, and the ``LATEST`` pointer is
replaced with ``os.replace``. In an exact-lag experiment the trainer also writes
``TARGET``: the version workers must serve (``latest - lag``). Several processes may write
into one staging directory (``satjax.train.publish``); only the one that calls
:meth:`WeightPublisher.publish` renames it.

Layout (version directory names come from :func:`satjax.run_dir.version_dir`)::

    sync_dir/v00000012/{config.json, model.safetensors.index.json,
                        model-00001-of-00002.safetensors, ..., manifest.json}
    sync_dir/LATEST     "12"
    sync_dir/TARGET     "10"   (optional)
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from satjax.run_dir import parse_version_dir, version_dir
from satjax.utils import atomic_write, fsync_dir

MANIFEST = "manifest.json"
STAGING_SUFFIX = ".staging"


class WeightSyncError(RuntimeError):
    """A published version is missing, incomplete, or fails its canary check."""


class WeightPublisher:
    """Writes versions into ``sync_dir``; keeps the newest ``keep`` of them."""

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
        write_checkpoint: Callable[[Path], None],
        *,
        canary: dict[str, Any] | None = None,
        target_version: int | None = None,
        staging: Path | None = None,
    ) -> Path:
        """Publishes ``version``. ``write_checkpoint(dir)`` writes the weights into ``dir``
        (normally ``lambda d: save_pretrained(model, d)``). ``canary`` holds
        ``{"tokens": [...], "logprobs": [...]}`` computed by the trainer at this version.
        ``staging`` is a :meth:`staging_dir` other processes already wrote into (default:
        a fresh one). On any error the staging directory is removed and nothing is
        visible."""
        final = version_dir(self.sync_dir, version)
        if final.exists():
            raise WeightSyncError(f"version {version} was already published at {final}")
        tmp = staging or self.staging_dir(version, uuid.uuid4().hex)
        tmp.mkdir(exist_ok=True)
        try:
            write_checkpoint(tmp)
            manifest = {"version": int(version), "published_unix": time.time(),
                        "canary": canary}
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
            atomic_write(self.sync_dir / "TARGET", str(target_version))
        self._collect(protect=target_version, published=version)
        return final

    def _collect(self, protect: int | None, published: int) -> None:
        versions = sorted(published_versions(self.sync_dir))
        for v in versions[: -self.keep]:
            if v != protect:
                shutil.rmtree(version_dir(self.sync_dir, v), ignore_errors=True)
        # staging left by a crashed or failed publish; one of a newer version may be in use
        for p in self.sync_dir.glob(f".*{STAGING_SUFFIX}"):
            staged = parse_version_dir(p.name[1:].split("-", 1)[0])
            if staged is not None and staged <= published:
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


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


class WeightSubscriber:
    """The worker side: which version to serve, where it is, and its canary."""

    def __init__(self, sync_dir: str | os.PathLike[str]) -> None:
        self.sync_dir = Path(sync_dir)

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
            raise WeightSyncError(f"version {version} is not published in {self.sync_dir}")
        return path

    def manifest(self, version: int) -> dict[str, Any]:
        data = json.loads((self.checkpoint_dir(version) / MANIFEST).read_text())
        if data.get("version") != version:
            raise WeightSyncError(
                f"manifest of {self.checkpoint_dir(version)} says version "
                f"{data.get('version')}, expected {version}"
            )
        return data

    def wait_for(self, version: int, timeout: float = 60.0, poll: float = 0.05) -> Path:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.checkpoint_dir(version)
            except WeightSyncError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(poll)


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
