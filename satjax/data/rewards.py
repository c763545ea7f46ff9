"""Reward functions a run names in ``task.reward``, and DAPO's overlong reward shaping.

A reward function takes the response text and the :class:`~satjax.data.tasks.Example`
(its ``answer``, ``index`` and the row's ``fields``) and returns a float. ``task.reward``
is "math_verify", "exact" or a user's "module:function", imported once per process.
"""

from __future__ import annotations

import importlib
import math
import os
import sys

from satjax.data.tasks import Example, RewardFn, exact_match_reward, math_answer_reward

BUILTIN_REWARDS = ("math_verify", "exact")


class RewardError(RuntimeError):
    """A reward function failed or returned no finite number; names the example."""


def _math_verify(response: str, example: Example) -> float:
    return math_answer_reward(response, example.answer)


def _exact(response: str, example: Example) -> float:
    return exact_match_reward(response, example.answer)


def import_reward(spec: str) -> RewardFn:
    """The function ``spec`` names: "math_verify", "exact" or "module:function" (the
    module importable from the working directory or ``PYTHONPATH``; imported once per
    process, as any module). Raises ValueError
    (one line) when it cannot be imported or is not callable."""
    if spec == "math_verify":
        return _math_verify
    if spec == "exact":
        return _exact
    module_name, _, func_name = spec.partition(":")
    # the working directory first, as `python -m` has it: the console script `satjax`
    # (whose sys.path starts at its bin directory) finds a reward module next to the data
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"task.reward {spec!r}: cannot import module {module_name!r} "
                         f"({e}); is its directory on PYTHONPATH?") from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ValueError(f"task.reward {spec!r}: module {module_name!r} has no function "
                         f"{func_name!r}")
    return fn


def checked_reward(spec: str) -> RewardFn:
    """:func:`import_reward`'s function, with its failures raised as :class:`RewardError`
    naming the example (index and prompt id) and ``spec``."""
    fn = import_reward(spec)

    def reward(response: str, example: Example) -> float:
        try:
            value = float(fn(response, example))
        except Exception as e:
            raise RewardError(f"task.reward {spec!r} failed on example {example.index} "
                              f"({example.prompt_id}): {type(e).__name__}: {e}") from e
        if not math.isfinite(value):
            raise RewardError(f"task.reward {spec!r} returned {value} on example "
                              f"{example.index} ({example.prompt_id}); must be finite")
        return value

    return reward


def overlong_penalty(length: int, truncated: bool, max_new_tokens: int, buffer: int,
                     penalty: float) -> float:
    """DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13), added to the reward.

    With ``L = max_new_tokens`` and ``C = buffer`` (the punishment interval): 0 for
    ``length <= L - C``, ``-penalty * (length - (L - C)) / C`` inside the last ``C``
    tokens, and ``-penalty`` for a response cut at ``L`` (``truncated``: no stop token;
    DAPO's ``length > L``, which a sampler capped at ``L`` shows as a cut). ``C = 0``:
    only a cut response is punished.
    """
    if truncated:
        return -penalty
    start = max_new_tokens - buffer
    if length <= start:
        return 0.0
    return -penalty * (length - start) / buffer
