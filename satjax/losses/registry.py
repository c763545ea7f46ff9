"""Named objectives, each registered where its loss is defined.

``@register("gspo", GspoHParams)`` on a loss function records the name, its hyperparameter
dataclass and the loss in :data:`OBJECTIVES`; :mod:`satjax.objectives` builds the named
objectives from it, so adding an objective is one decorator next to its loss (plus its
dataclass in :mod:`satjax.losses.hparams`). The order of registration (the order of the
definitions in :mod:`satjax.losses.policy_gradient`, the project's default ``sat_gspo``
first) is the order of ``satjax.objectives.NAMES`` and of the messages that list them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from satjax.losses.hparams import HParams

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(frozen=True)
class Registered:
    """An objective: ``loss(logprobs, behavior_logprobs, advantages, mask, **hp)`` with
    ``hp`` the fields of ``hparams`` other than the IS correction's."""

    hparams: type[HParams]
    loss: Callable[..., Any]


OBJECTIVES: dict[str, Registered] = {}


def register(name: str, hparams: type[HParams]) -> Callable[[F], F]:
    """Decorator: records the decorated loss as objective ``name`` with ``hparams``."""

    def add(loss: F) -> F:
        if name in OBJECTIVES:
            raise ValueError(f"objective {name!r}: must be registered once, got a second "
                             f"registration ({loss.__qualname__})")
        OBJECTIVES[name] = Registered(hparams, loss)
        return loss

    return add
