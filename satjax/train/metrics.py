"""Scalar metrics logger: JSON lines + TensorBoard (tensorboardX)."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np


def to_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Keeps the scalar entries of ``metrics`` as Python floats (arrays of size 1 included)."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        arr = np.asarray(value)
        if arr.size == 1 and (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
            out[name] = float(arr.reshape(()))
    return out


class MetricsLogger:
    """Writes one JSON object per ``log`` call to ``<logdir>/metrics.jsonl`` and the same
    scalars to TensorBoard event files in ``logdir``. Non-scalar values are skipped.

    Args:
      logdir: output directory (created).
      tensorboard: also write TensorBoard events.
    """

    def __init__(self, logdir: str | os.PathLike, *, tensorboard: bool = True) -> None:
        self.logdir = os.fspath(logdir)
        os.makedirs(self.logdir, exist_ok=True)
        self.jsonl_path = os.path.join(self.logdir, "metrics.jsonl")
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")  # noqa: SIM115
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(self.logdir)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Logs the scalars of ``metrics`` at ``step``; returns what was written."""
        scalars = to_scalars(metrics)
        record: dict[str, Any] = {"step": int(step), "time": time.time()}
        # JSON has no NaN/inf: write them as strings so the file stays valid JSON
        record.update({k: (v if math.isfinite(v) else str(v)) for k, v in scalars.items()})
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for name, value in scalars.items():
                self._tb.add_scalar(name, value, int(step))
        return scalars

    def flush(self) -> None:
        self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        self.flush()
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
