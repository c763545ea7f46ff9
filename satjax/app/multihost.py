"""What the processes of a multi-process ``satjax train`` agree on, and how.

Every process runs the same jitted step on one global mesh, so every process must take
the same decisions in the same order: train on this batch, wait, stop. Process 0 (the
*primary*) is the only queue consumer; once per poll it tells the others what happened
with one small all-gather (``process_allgather`` of a 3-int header: what, how many
payload bytes, and each process's own stop request) and, when there is a batch, one
broadcast of its trajectories in the queue's wire format. Both are JAX's own
multi-controller collectives (``jax.experimental.multihost_utils``); a peer that dies
makes them fail, and jax.distributed's heartbeat (``parallel.HEARTBEAT_TIMEOUT_S``)
aborts the survivors, so nobody hangs.

In a single-process run every method is a local no-op.
"""

from __future__ import annotations

import enum

import jax
import numpy as np
from jax.experimental import multihost_utils

from satjax.queue.codec import decode, encode, join_messages, split_messages
from satjax.trajectory import Trajectory

_FIELD = 1  # the payload is a repeated message field 1 of encoded trajectories


class Poll(enum.IntEnum):
    """What the primary's last queue poll produced."""

    EMPTY = 0  # not enough fresh trajectories yet: poll again
    BATCH = 1  # a batch: train on it
    STOP = 2  # the primary stops (its stop request, or the run is over)


class Peers:
    """This process's view of the others: who is primary, and the agreement primitives."""

    def __init__(self) -> None:
        self.index = jax.process_index()
        self.count = jax.process_count()
        self.primary = self.index == 0

    def agree(self, poll: Poll, trajectories: list[Trajectory] | None, *, stop: bool,
              num_experts: int | None = None) -> tuple[Poll, list[Trajectory], bool]:
        """The primary's ``poll`` and ``trajectories`` on every process, and whether any
        process asked to stop. Non-primary processes pass ``Poll.EMPTY, None``.

        Trajectories travel in the queue's wire format; the primary decodes its own copy
        too, so every process trains on bit-identical input.
        """
        if self.count == 1:
            return poll, list(trajectories or ()), stop
        payload = b""
        if self.primary and poll == Poll.BATCH:
            payload = join_messages(_FIELD, (encode(t, num_experts=num_experts)
                                             for t in trajectories or ()))
        header = np.array([int(poll), len(payload), int(stop)], np.int64)
        rows = np.asarray(multihost_utils.process_allgather(header))  # [processes, 3]
        poll, size, any_stop = Poll(int(rows[0, 0])), int(rows[0, 1]), bool(rows[:, 2].any())
        if poll != Poll.BATCH:
            return poll, [], any_stop
        buf = np.frombuffer(payload, np.uint8) if self.primary else np.zeros(size, np.uint8)
        buf = np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8)
        return poll, [decode(m) for m in split_messages(buf.tobytes(), _FIELD)], any_stop

    def barrier(self, name: str) -> None:
        """Returns once every process reached the barrier ``name``."""
        if self.count > 1:
            multihost_utils.sync_global_devices(name)
