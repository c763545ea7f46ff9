"""Orbax checkpoints of the full train state, restorable onto a different mesh.

A checkpoint (one directory per step, the last ``keep`` kept) holds two items:

- ``state``: every array of the split ``TrainState`` as a pure nested dict: parameters,
  optimizer state, ``step``, ``policy_version`` and the raw RNG key;
- ``extra`` (JSON): ``queue_cursor``, the trajectory-queue position. That cursor is the
  trainer's whole data position: the prompt iterators live in the rollout workers, and
  what they produced but the trainer had not consumed is still on the queue. And
  ``loop_state``, the training loop's own JSON state (the lag controller's,
  ``satjax.train.lag_control``; ``{}`` when it has none).

Saves are asynchronous where Orbax supports it; ``close()`` (or leaving the ``with``
block) waits for pending writes. Restoring takes a state template (concrete or from
``nnx.eval_shape``) and the target mesh's shardings, so a run saved on one mesh resumes
on another: each array is read directly into its new sharding.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

log = logging.getLogger(__name__)

def _str_keys(tree: Any) -> Any:
    """Nested dict with every key a string (Orbax stores keys as strings)."""
    if isinstance(tree, dict):
        return {str(k): _str_keys(v) for k, v in tree.items()}
    return tree


def _pure(state: nnx.State) -> dict[str, Any]:
    return _str_keys(nnx.to_pure_dict(state))


@dataclasses.dataclass
class Restored:
    """What ``Checkpointer.restore`` returns."""

    state: nnx.State
    step: int
    queue_cursor: int
    loop_state: dict[str, Any] = dataclasses.field(default_factory=dict)


class Checkpointer:
    """Orbax ``CheckpointManager`` wrapper for ``nnx.split(TrainState)[1]`` states.

    Args:
      directory: checkpoint root (created if missing).
      save_every: ``maybe_save`` writes only on multiples of this step.
      keep: number of most recent checkpoints kept.
      async_save: write in a background thread (Orbax async checkpointing).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        save_every: int = 100,
        keep: int = 3,
        async_save: bool = True,
    ) -> None:
        if save_every < 1:
            raise ValueError(f"save_every: must be >= 1, got {save_every!r}")
        if keep < 1:
            raise ValueError(f"keep: must be >= 1, got {keep!r}")
        self.save_every = save_every
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "extra")
        )

    def save(
        self,
        step: int,
        state: nnx.State,
        *,
        queue_cursor: int = 0,
        loop_state: dict[str, Any] | None = None,
    ) -> bool:
        """Saves ``state`` as checkpoint ``step`` now (e.g. at exit); returns whether saved.
        ``loop_state``: JSON-serialisable state of the loop, given back by :meth:`restore`."""
        extra = {
            "queue_cursor": int(queue_cursor),
            "step": int(step),
            "loop_state": dict(loop_state or {}),
        }
        saved = self.manager.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_pure(state)), extra=ocp.args.JsonSave(extra)
            ),
            force=True,
        )
        if saved:
            log.info("checkpoint step %d queued for %s", step, self.directory)
        return bool(saved)

    def maybe_save(self, step: int, state: nnx.State, **kwargs: Any) -> bool:
        """Saves only when ``step`` is a positive multiple of ``save_every``."""
        if step <= 0 or step % self.save_every:
            return False
        return self.save(step, state, **kwargs)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def restore(self, template: nnx.State, shardings: Any, *, step: int | None = None) -> Restored:
        """Restores checkpoint ``step`` (default: latest) onto ``shardings``.

        Args:
          template: the state to fill (concrete or abstract, e.g. from
            ``nnx.split(nnx.eval_shape(make_train_state))``); it is not modified.
          shardings: ``parallel.state_shardings(template, mesh)`` for the *target* mesh.
          step: which checkpoint; None = latest.
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            _pure(template),
            _pure(shardings),
        )
        restored = self.manager.restore(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), extra=ocp.args.JsonRestore()
            ),
        )
        state = jax.tree.map(lambda x: x, template)  # fresh container, template untouched
        nnx.replace_by_pure_dict(state, restored["state"])
        extra = restored["extra"]
        return Restored(
            state=state,
            step=int(step),
            queue_cursor=int(extra.get("queue_cursor", 0)),
            loop_state=dict(extra.get("loop_state", {})),
        )

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self.manager.wait_until_finished()
        self.manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
