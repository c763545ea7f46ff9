"""Step metrics computed on the host, and the scalar logger (JSON lines + TensorBoard).

Each metric has one owner. The jitted step (``satjax/train/step.py``) computes everything
it can see in the batch: ``loss``, ``grad_norm``, ``nonfinite_steps`` and ``empty_steps``
(1 when the update was skipped: not finite / no active token), ``tokens``, ``sequences``,
``reward_mean``,
``advantage_abs_mean``, ``lag_mean``, ``lag_max``, ``learning_rate``, the objective's
metrics (``kl_k3`` among them), the staleness diagnostics ``token_gate_frac`` and
``token_extreme_frac`` (``satjax.train.step.staleness_metrics``) and the router's metrics
(``router_mismatch*``, ``router_gate_diff*``, ``router_kl``).
:func:`trajectory_metrics` adds what needs the raw trajectories; the run loop
(``satjax/app/run.py``) adds the queue's and the wall clock's.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from satjax.run_dir import METRICS_FILE
from satjax.trajectory import Trajectory
from satjax.utils import atomic_write


def to_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Keeps the scalar entries of ``metrics`` as Python floats (arrays of size 1 included)."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        arr = np.asarray(value)
        # jnp.issubdtype, not np's: numpy does not count bfloat16 (ml_dtypes, kind "V") as
        # a number, and a bf16 grad_norm must not vanish from the log
        if arr.size == 1 and (jnp.issubdtype(arr.dtype, jnp.number) or arr.dtype == np.bool_):
            out[name] = float(arr.reshape(()))
    return out


def trajectory_metrics(
    trajectories: Sequence[Trajectory], *, trainer_version: int
) -> dict[str, float]:
    """``reward_max``, ``response_len_mean``, ``truncated_frac`` (cut at max_new_tokens),
    ``lag_hist/<lag>`` (how many trajectories were generated ``lag`` versions behind
    ``trainer_version``, the version trained on them, by their oldest token), and for
    partial rollouts ``partial_frac`` (the share of trajectories sampled by more than one
    version) and ``lag_token_mean`` (``trainer_version`` minus each response token's own
    version, averaged over the tokens; equal to the trajectories' token-weighted lag
    without partial rollouts). For the staleness model of the SAT page
    (``scripts/staleness_model.py``): ``response_len_group_max_mean`` (each group's longest
    response, averaged over groups: with ``response_len_mean``, the page's ``M_tail``) and
    ``rollout_tokens_per_s`` (response tokens over the engine's generation seconds: one
    worker's rate while it generates)."""
    rewards = np.array([t.reward for t in trajectories], np.float32)
    token_versions = np.concatenate([t.versions for t in trajectories])
    lengths = np.array([len(t.response_tokens) for t in trajectories])
    group_max: dict[str, int] = {}
    for t, n in zip(trajectories, lengths, strict=True):
        group_max[t.group_id] = max(group_max.get(t.group_id, 0), int(n))
    generating = sum(t.generation_seconds for t in trajectories)
    out = {
        "reward_max": float(rewards.max()),
        "response_len_mean": float(lengths.mean()),
        "response_len_group_max_mean": float(np.mean(list(group_max.values()))),
        "rollout_tokens_per_s": float(lengths.sum() / generating) if generating > 0 else 0.0,
        "truncated_frac": float(np.mean([t.truncated for t in trajectories])),
        "partial_frac": float(np.mean([t.partial for t in trajectories])),
        "lag_token_mean": float(np.mean(trainer_version - token_versions))
        if token_versions.size else 0.0,
    }
    hist = Counter(trainer_version - t.policy_version for t in trajectories)
    out.update({f"lag_hist/{k}": float(v) for k, v in sorted(hist.items())})
    return out


def _truncate_after(path: str, step: int) -> None:
    """Rewrites ``path`` (atomically) without the records of steps after ``step``; a torn
    last line (a crash mid-write) is dropped too."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if int(record.get("step", 0)) <= step:
            kept.append(line + "\n")
    if len(kept) != len(lines):
        atomic_write(path, "".join(kept))


class MetricsLogger:
    """Writes one JSON object per ``log`` call to ``<logdir>/metrics.jsonl`` and the same
    scalars to TensorBoard event files in ``logdir``. Non-scalar values are skipped.

    Args:
      logdir: output directory (created).
      tensorboard: also write TensorBoard events.
      resume_step: the step a resumed run restarts from: records of later steps (logged
        before a crash, about to be re-run) are dropped first, so the file keeps one
        record per step. None: append to what is there.
    """

    def __init__(self, logdir: str | os.PathLike, *, tensorboard: bool = True,
                 resume_step: int | None = None) -> None:
        self.logdir = os.fspath(logdir)
        os.makedirs(self.logdir, exist_ok=True)
        self.jsonl_path = os.path.join(self.logdir, METRICS_FILE)
        if resume_step is not None:
            _truncate_after(self.jsonl_path, resume_step)
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
