"""The lag the queue admits, set from the mismatch measured on recent batches.

Peers bound staleness by a version count (``max_lag``). What hurts is the mismatch between
the behaviour policy and the policy being trained, which the step measures on every batch
(``kl_k3``: k3 KL of the behaviour to the current policy; ``token_gate_frac``: the share of
tokens past SAT's gate). :class:`LagController` turns that measurement into the lag limit
the trainer asks the queue with (``GetBatch(max_lag=limit)``; the queue's ShouldPause
follows the trainer's last limit, so workers pause instead of producing what would be
dropped):

* after a batch whose mismatch, averaged over the batches since the last decision, is over
  ``target``: ``limit - 1`` (at least 0), at once;
* after ``window`` batches whose mean mismatch stays at or under ``target``: ``limit + 1``
  (at most ``max_lag``).

Lowering reacts to one bad batch, raising waits for a window of good ones (additive steps
both ways; each decision starts a new window, measured under the new limit). The limit
never exceeds ``max_lag``, so no trajectory staler than ``max_lag`` is admitted, whatever
the measurements. A non-finite measurement counts as over the target. The state
(:meth:`state_dict`) is checkpointed with the train state, so a resumed run goes on with
the same limit and window.
"""

from __future__ import annotations

import math
from typing import Any


class LagController:
    """The admitted lag, between 0 and ``max_lag``, from measured mismatch.

    Args:
      max_lag: the hard bound (``train.max_lag``); also the starting limit.
      target: the mismatch to stay under (``train.mismatch_target``, > 0).
      window: batches of mismatch at or under ``target`` before the limit is raised
        (``train.mismatch_window``, >= 1).

    Example:
      >>> c = LagController(max_lag=2, target=0.1, window=2)
      >>> [c.update(m) for m in (0.3, 0.05, 0.05, 0.2, 0.01, 0.01, 0.01, 0.01)]
      [1, 1, 2, 1, 1, 2, 2, 2]
    """

    def __init__(self, *, max_lag: int, target: float, window: int) -> None:
        if max_lag < 0 or not target > 0 or window < 1:
            raise ValueError(f"max_lag >= 0, target > 0, window >= 1: got {max_lag}, "
                             f"{target}, {window}")
        self.max_lag, self.target, self.window = max_lag, float(target), window
        self.limit = max_lag
        self.recent: list[float] = []  # measurements since the last decision

    def update(self, mismatch: float) -> int:
        """Records one batch's mismatch; returns the limit for the fetches from now on."""
        self.recent.append(float(mismatch) if math.isfinite(mismatch) else math.inf)
        mean = sum(self.recent) / len(self.recent)
        if mean > self.target:
            self.limit, self.recent = max(0, self.limit - 1), []
        elif len(self.recent) >= self.window:
            self.limit, self.recent = min(self.max_lag, self.limit + 1), []
        return self.limit

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (``math.inf`` is kept as the string "inf")."""
        return {"limit": self.limit, "recent": [str(x) if math.isinf(x) else x
                                                for x in self.recent]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`; a limit above ``max_lag`` (a run resumed with a
        smaller ``train.max_lag``) is cut to it."""
        self.limit = max(0, min(self.max_lag, int(state["limit"])))
        self.recent = [float(x) for x in state["recent"]]
