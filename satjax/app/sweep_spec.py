"""One run of a lag sweep and where its files are: what ``satjax lag-sweep`` (which
writes them) and :mod:`satjax.app.sweep_report` (which reads them) share."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal

LagMode = Literal["exact", "broadcast"]
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
