"""The layout of a run directory: every path the trainer, workers and tools share.

    <run_dir>/LOCK                  flock held by the process that runs the run (its pid)
    <run_dir>/config.yaml           the resolved config (workers read it)
    <run_dir>/config.sha256         its digest (satjax.config.config_digest): --resume
                                    refuses a hand-edited config.yaml
    <run_dir>/checkpoints/<step>/   Orbax checkpoints of the train state
    <run_dir>/weights/vNNNNNNNN/    published policy versions (see satjax/weight_sync.py)
    <run_dir>/weights/run_config.yaml  the config again, next to the weights: a worker on
                                    another host needs only the weights directory
    <run_dir>/queue/                the local queue server's data directory
    <run_dir>/sft/                  the cached SFT warm-up (a Hugging Face checkpoint)
    <run_dir>/sft/settings.json     the settings it was made with (a change re-runs it)
    <run_dir>/logs/metrics.jsonl    one JSON object per step (plus TensorBoard events)
    <run_dir>/logs/<process>.log    output of each child process (queue, worker0, ...)
    <run_dir>/logs/vllm-<worker>/   a vLLM worker's server logs

Only this module spells these names; everything else asks it for paths.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from satjax.utils import LockHeldError, PidLock

METRICS_FILE = "metrics.jsonl"
WEIGHTS_CONFIG_FILE = "run_config.yaml"
_VERSION_PREFIX = "v"


def weights_config(weights_dir: str | os.PathLike[str]) -> Path:
    """The run's public config inside ``weights_dir`` (what ``satjax rollout --weights``
    reads)."""
    return Path(weights_dir) / WEIGHTS_CONFIG_FILE


def version_dir(weights_dir: str | os.PathLike[str], version: int) -> Path:
    """Where policy ``version`` is published under ``weights_dir``: ``vNNNNNNNN``."""
    return Path(weights_dir) / f"{_VERSION_PREFIX}{version:08d}"


def parse_version_dir(name: str) -> int | None:
    """The version a ``version_dir`` name holds, or None for any other name."""
    digits = name[len(_VERSION_PREFIX):]
    if not name.startswith(_VERSION_PREFIX) or not digits.isdigit():
        return None
    return int(digits)


@dataclasses.dataclass(frozen=True, init=False)
class RunDirs:
    """Paths inside one run directory ``root`` (nothing is created here)."""

    root: Path

    def __init__(self, root: str | os.PathLike[str]) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def config_digest(self) -> Path:
        """The digest of ``config.yaml`` as the run wrote it (hex, one line)."""
        return self.root / "config.sha256"

    @property
    def lock(self) -> Path:
        return self.root / "LOCK"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def has_checkpoint(self) -> bool:
        """Whether ``checkpoints/`` holds anything (a checkpoint, or one being written)."""
        return self.checkpoints.is_dir() and any(self.checkpoints.iterdir())

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def weights_config(self) -> Path:
        return weights_config(self.weights)

    @property
    def queue(self) -> Path:
        return self.root / "queue"

    @property
    def sft(self) -> Path:
        return self.root / "sft"

    @property
    def sft_settings(self) -> Path:
        """The settings the cached warm-up was made with (JSON)."""
        return self.sft / "settings.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def metrics(self) -> Path:
        return self.logs / METRICS_FILE

    def process_log(self, name: str) -> Path:
        """The log file of child process ``name`` (``queue``, ``worker0``, ...)."""
        return self.logs / f"{name}.log"

    def vllm_logs(self, worker_id: str) -> Path:
        """The directory where worker ``worker_id``'s vLLM server writes its logs."""
        return self.logs / f"vllm-{worker_id}"

    def version(self, version: int) -> Path:
        """Published policy ``version``: ``weights/vNNNNNNNN``."""
        return version_dir(self.weights, version)


class RunDirError(RuntimeError):
    """The run directory cannot be used: held by a running ``satjax train`` (the message
    names its pid), not writable (the message says why), or without a checkpoint for
    ``--resume``."""


class RunLock:
    """Exclusive ``flock`` on ``<run_dir>/LOCK``: one running trainer per run directory,
    taken before anything in it is read or written (``satjax train``, ``--resume``
    included), so a second start cannot overwrite the config of a running run or truncate
    its metrics.

    The kernel drops the lock with the process (``kill -9`` included), so a LOCK file left
    behind never blocks a ``--resume``; the pid written into it only names the holder in
    the refusal. The descriptor is not inherited by children (Python's default), so an
    orphaned queue server or worker does not hold the run.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        dirs = RunDirs(root)
        try:
            dirs.root.mkdir(parents=True, exist_ok=True)
            self._lock = PidLock(dirs.lock)
        except LockHeldError as e:
            raise RunDirError(
                f"run_dir {str(root)!r}: in use by a running satjax train (pid {e.holder}, "
                f"which holds {dirs.lock.name}); stop it first, or choose another "
                "run_dir") from None
        except OSError as e:
            raise RunDirError(f"run_dir {str(root)!r}: must be a writable directory, got "
                              f"{e.strerror or e} ({e.filename or dirs.lock})") from None

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
