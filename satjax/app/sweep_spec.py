"""One run of a lag sweep and where its files are: what ``satjax lag-sweep`` (which
writes them) and :mod:`satjax.app.sweep_report` (which reads them) share."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One objective (``variant``, a key of ``lag_sweep.VARIANTS``) at one lag, one seed."""

    variant: str
    lag: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.variant}-lag{self.lag}-seed{self.seed}"

    def run_dir(self, out: str | os.PathLike[str]) -> Path:
        """This run's directory (a :class:`satjax.run_dir.RunDirs` root) in sweep ``out``."""
        return Path(out) / "runs" / self.name

    def result_path(self, out: str | os.PathLike[str]) -> Path:
        return self.run_dir(out) / "result.json"
