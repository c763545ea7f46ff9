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
import threading
import time
import weakref

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


def reward_path(spec: str) -> str:
    """The ``PYTHONPATH`` entry a user's reward (``spec``, "module:function", imported
    already) was found on, as written there (a shell that continues the run needs it
    too); "" for a built-in reward, or a module found elsewhere (installed, or in the
    working directory, which ``satjax`` searches itself)."""
    module = sys.modules.get(spec.partition(":")[0]) if ":" in spec else None
    file = getattr(module, "__file__", None)
    if not file:
        return ""
    for entry in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        if os.path.abspath(entry) == os.getcwd():
            continue
        # the module's file below the entry: entry/pkg/mod.py for "pkg.mod"
        parts = spec.partition(":")[0].split(".")
        if any(os.path.samefile(file, os.path.join(entry, *parts) + ext)
               for ext in (".py", os.sep + "__init__.py")
               if os.path.exists(os.path.join(entry, *parts) + ext)):
            return entry
    return ""


def example_name(ex: Example) -> str:
    """How an error names an example: its row in the file and its prompt id (a built-in
    task's examples have no row: ``index`` -1)."""
    return f"example {ex.index} ({ex.prompt_id})" if ex.index >= 0 else \
        f"example {ex.prompt_id}"


EXIT_REWARD_TIMEOUT = 1  # the exit code of a process whose reward call did not return


class _Call:
    """The reward call in progress: ``current`` is a new 1-tuple of its example per call
    (compared by identity: two calls on one example differ), None between calls."""

    __slots__ = ("current", "__weakref__")

    def __init__(self) -> None:
        self.current: tuple[Example] | None = None


def _watch(call_ref: weakref.ref, spec: str, timeout_s: float) -> None:
    """Polls the call in progress; ends the process when one has lasted ``timeout_s``.
    Returns once the reward function it watches is gone."""
    poll_s = min(1.0, timeout_s / 4)  # fires between timeout_s and timeout_s + poll_s
    seen: tuple[Example] | None = None
    since = 0.0
    while True:
        time.sleep(poll_s)
        call = call_ref()
        if call is None:
            return
        current = call.current
        del call  # no reference of this thread keeps the function alive
        now = time.monotonic()
        if current is not seen:
            seen, since = current, now  # held here, so its identity is never reused
        elif current is not None and now - since >= timeout_s:
            # A thread cannot be stopped from outside in Python (an exception raised into
            # it waits for the call to come back to the interpreter, which a blocked read
            # or sleep never does), and what a hung reward left half done is unknown: the
            # process ends, this line its last. A worker's trainer reports it, naming the
            # worker; the children of a process that ends so die with it (PDEATHSIG).
            os.write(2, (f"task.reward {spec!r} did not return within {timeout_s:g}s on "
                         f"{example_name(current[0])}: stopping (a reward call "
                         "cannot be interrupted; task.reward_timeout_s allows it longer)\n"
                         ).encode())
            os._exit(EXIT_REWARD_TIMEOUT)


def checked_reward(spec: str, timeout_s: float = math.inf) -> RewardFn:
    """:func:`import_reward`'s function, with its failures raised as :class:`RewardError`
    naming the example (index and prompt id) and ``spec``.

    A call that lasts ``timeout_s`` (``task.reward_timeout_s``) ends the process with one
    line on stderr naming the example and exit code :data:`EXIT_REWARD_TIMEOUT`: a
    watchdog thread polls what the call in progress is (each call costs two attribute
    writes; see ``benchmarks/bench_reward_timeout.py``). Calls come from one thread at a time,
    as satjax makes them (another thread's calls would hide a hung one). A call stuck in
    C code that holds the GIL stops the watchdog too: it is not caught."""
    fn = import_reward(spec)
    call = _Call()
    if math.isfinite(timeout_s):
        threading.Thread(target=_watch, args=(weakref.ref(call), spec, timeout_s),
                         name="reward-timeout", daemon=True).start()

    def reward(response: str, example: Example) -> float:
        call.current = (example,)
        try:
            raw = fn(response, example)
        except Exception as e:
            raise RewardError(f"task.reward {spec!r} failed on {example_name(example)}: "
                              f"{type(e).__name__}: {e}") from e
        finally:
            call.current = None
        # a number (int, float, a numpy scalar, True/False), never a text float() would
        # parse: a reward returning "1.0" is a bug to report, not a score
        if isinstance(raw, str | bytes) or not hasattr(raw, "__float__"):
            raise RewardError(f"task.reward {spec!r} returned {raw!r} "
                              f"({type(raw).__name__}) on {example_name(example)}; must be "
                              "a number")
        value = float(raw)
        if not math.isfinite(value):
            raise RewardError(f"task.reward {spec!r} returned {value} on "
                              f"{example_name(example)}; must be finite")
        return value

    return reward


def check_on(reward: RewardFn, spec: str, example: Example) -> None:
    """Calls a user's ``reward`` (``task.reward`` ``spec``, from :func:`checked_reward`)
    once, with ``example``'s reference answer as the response, so that a reward that
    raises, takes other arguments or returns no finite number stops the start, naming the
    example (:class:`RewardError`), not a worker after its first rollouts. The built-in
    rewards are not called (their tests check them)."""
    if spec not in BUILTIN_REWARDS:
        reward(example.answer, example)


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
