"""What the queue's client and server agree on, beyond the wire schema: result types,
limits and metadata keys.

Both sides import this module; neither imports the other. A producer (a rollout worker)
therefore loads :mod:`satjax.queue.client`, this module and the codec, never the server,
its queue logic or its storage.
"""

from __future__ import annotations

import dataclasses

# The environment variable holding the bearer token (``satjax serve-queue``, workers).
TOKEN_ENV = "SATJAX_QUEUE_TOKEN"
# The shortest token the server accepts (a config can be checked against it up front).
MIN_TOKEN_CHARS = 16
# The longest wait one GetBatch may ask for; a longer wait is a loop of calls. Bounded so
# that a caller's ``inf`` or ``1e300`` is refused with a message instead of overflowing
# the server's wait (and the client's call deadline).
MAX_WAIT_S = 3600.0
# Trailing metadata that tells a client a RESOURCE_EXHAUSTED is the disk, not the message
# size: the client retries the former (the server kept nothing) and not the latter.
ERROR_KIND_KEY, STORAGE_ERROR = "satjax-error", "storage"
# What grpc's server answers (RESOURCE_EXHAUSTED) to a call beyond its maximum_concurrent_rpcs:
# the server is busy, nothing was done, and the client retries it like UNAVAILABLE.
SERVER_BUSY_DETAILS = "Concurrent RPC limit exceeded!"


def check_wait(name: str, seconds: float) -> float:
    """``seconds`` as a float when it is a finite wait in ``[0, MAX_WAIT_S]``; else
    ValueError naming ``name`` (a ``nan``, ``inf`` or negative wait has no meaning)."""
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: must be a number of seconds, got {seconds!r}") from None
    if not 0.0 <= value <= MAX_WAIT_S:  # also false for nan
        raise ValueError(f"{name}: must be a finite number of seconds in [0, {MAX_WAIT_S:g}] "
                         f"(call again to wait longer), got {seconds!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Rejection:
    """Why the item at ``index`` of a put was not stored; ``field`` names the culprit."""

    index: int
    trajectory_id: str
    field: str
    message: str


@dataclasses.dataclass(frozen=True)
class PutResult:
    """A put's answer: every item is accepted (``duplicates`` among them) or rejected."""

    accepted: list[str]      # stored (including duplicates of earlier puts)
    duplicates: list[str]
    rejected: list[Rejection]

    @property
    def ok(self) -> bool:
        return not self.rejected


@dataclasses.dataclass(frozen=True)
class PauseDecision:
    """ShouldPause's answer for a worker at some version (fields as ``ShouldPauseReply``)."""

    pause: bool
    reason: str
    trainer_version: int
    max_lag: int
    predicted_lag: int
    pending_fresh: int
