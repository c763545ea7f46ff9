"""One run of a lag sweep and where its files are: what ``satjax lag-sweep`` (which
writes them) and :mod:`satjax.app.sweep_report` (which reads them) share."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from pathlib import Path
from typing import Any, Literal

from satjax.run_dir import METRICS_FILE
from satjax.utils import atomic_write

LagMode = Literal["exact", "broadcast"]
# one line per invocation of a sweep that ran runs: its share of the sweep's compute (a sweep
# may be spread over sessions; each one's share is read from here)
SESSIONS_FILE = "sessions.jsonl"
# a run's name: <variant>-<prefix><lag>-seed<seed>
NAME_PREFIX: dict[str, str] = {"exact": "lag", "broadcast": "bcast"}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One objective (``variant``, a key of ``lag_sweep.VARIANTS``) at one lag, one seed.
    ``lag_mode``: "exact" (``train.exact_lag`` = ``lag``) or "broadcast"
    (``train.broadcast_every`` = ``lag``: the served lag cycles 1..lag)."""

    variant: str
    lag: int
    seed: int
    lag_mode: LagMode = "exact"

    @classmethod
    def of(cls, result: dict[str, Any]) -> RunSpec:
        """The spec of a run's ``result.json`` (one written before lag modes: exact)."""
        return cls(result["variant"], result["lag"], result["seed"],
                   result.get("lag_mode", "exact"))

    @property
    def name(self) -> str:
        return f"{self.variant}-{NAME_PREFIX[self.lag_mode]}{self.lag}-seed{self.seed}"

    def run_dir(self, out: str | os.PathLike[str]) -> Path:
        """This run's directory (a :class:`satjax.run_dir.RunDirs` root) in sweep ``out``."""
        return Path(out) / "runs" / self.name

    def result_path(self, out: str | os.PathLike[str]) -> Path:
        return self.run_dir(out) / "result.json"

    def metrics_archive(self, out: str | os.PathLike[str]) -> Path:
        """A finished run's per-step metrics, compressed (:func:`archive_metrics`)."""
        return self.run_dir(out) / "logs" / METRICS_ARCHIVE

    def read_metrics(self, out: str | os.PathLike[str]) -> list[dict[str, Any]]:
        """This run's per-step metrics rows: the archive of a finished run, else the
        ``metrics.jsonl`` its logger writes (empty when neither exists)."""
        archive = self.metrics_archive(out)
        if archive.exists():
            text = gzip.decompress(archive.read_bytes()).decode()
        else:
            plain = self.run_dir(out) / "logs" / METRICS_FILE
            text = plain.read_text() if plain.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.strip()]


# A finished run keeps its per-step metrics gzipped with floats at this many significant
# digits, the step and its wall-clock time exact (about 9x smaller: a 120-step run's 170 KB
# become ~19 KB), so a sweep's finished runs can be committed and a later session resumes it
# from a fresh checkout.
METRICS_ARCHIVE = "metrics.jsonl.gz"
ARCHIVE_DIGITS = 6
ARCHIVE_EXACT = ("step", "time")


def archive_metrics(spec: RunSpec, out: str | os.PathLike[str]) -> None:
    """Replaces a finished run's ``logs/metrics.jsonl`` by ``logs/metrics.jsonl.gz`` (floats
    to :data:`ARCHIVE_DIGITS` significant digits but :data:`ARCHIVE_EXACT`) and removes the
    run's empty directories (a sweep run writes no checkpoint or weights), leaving
    ``result.json`` and the archive.

    >>> import tempfile
    >>> out = tempfile.mkdtemp(); spec = RunSpec("gspo", 1, 0)
    >>> logs = spec.run_dir(out) / "logs"; logs.mkdir(parents=True)
    >>> row = '{"step": 1, "time": 1797000123.25, "loss": 0.123456789}\\n'
    >>> _ = (logs / METRICS_FILE).write_text(row)
    >>> archive_metrics(spec, out); spec.read_metrics(out)
    [{'step': 1, 'time': 1797000123.25, 'loss': 0.123457}]
    """
    def rounded(key: str, value: Any) -> Any:
        if isinstance(value, float) and key not in ARCHIVE_EXACT:
            return float(f"{value:.{ARCHIVE_DIGITS}g}")
        return value

    plain = spec.run_dir(out) / "logs" / METRICS_FILE
    rows = spec.read_metrics(out)
    text = "".join(json.dumps({k: rounded(k, v) for k, v in row.items()},
                              separators=(",", ":")) + "\n" for row in rows)
    atomic_write(spec.metrics_archive(out), gzip.compress(text.encode(), mtime=0))
    plain.unlink(missing_ok=True)
    for sub in spec.run_dir(out).iterdir():
        if sub.is_dir() and not any(sub.iterdir()):
            sub.rmdir()
