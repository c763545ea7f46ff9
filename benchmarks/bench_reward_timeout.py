"""What ``task.reward_timeout_s`` costs a reward call: the watchdog's bookkeeping (two
attribute writes per call; ``satjax.data.rewards.checked_reward``) against the same wrapper
without it (the code before the timeout, copied here as the baseline).

Tiny rewards called many times, the worst case for a per-call cost: ``exact`` (a string
compare) on a 2-token response. Two figures, each the best of ``--repeats`` interleaved
runs: ``--calls`` reward calls alone, and the worker's steady-state path without the
engine's sampling: ``GroupSampler.sample`` over an engine that returns ready completions
(stop strings, decode, reward, the trajectory), 8 x 8 per batch, ``--calls`` trajectories.
Target: <= 2% on the path (sampling itself, left out, costs far more than all of it).

  PYTHONPATH=. python benchmarks/bench_reward_timeout.py [--calls 20000] [--repeats 60]
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks.machine import print_versions  # noqa: E402
from satjax.data.rewards import RewardError, checked_reward, import_reward  # noqa: E402
from satjax.data.tasks import Example, FileTask  # noqa: E402
from satjax.model.tokenizer import CharTokenizer  # noqa: E402
from satjax.rollout.engine import Completion  # noqa: E402
from satjax.rollout.worker import GroupSampler, WorkerConfig  # noqa: E402

TARGET = 0.02


def baseline_reward(spec: str):
    """``checked_reward`` as it was before the timeout (no bookkeeping, no watchdog)."""
    fn = import_reward(spec)

    def reward(response: str, example: Example) -> float:
        try:
            value = float(fn(response, example))
        except Exception as e:
            raise RewardError(f"task.reward {spec!r} failed: {e}") from e
        if not math.isfinite(value):
            raise RewardError(f"task.reward {spec!r} returned {value}")
        return value

    return reward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=20_000)
    p.add_argument("--repeats", type=int, default=60)
    args = p.parse_args()
    print_versions(("satjax", "numpy"))
    tok = CharTokenizer()
    ex = Example("train-3", "12+34=", "46", index=3)
    tokens = tok.encode("46", add_eos=True)
    rewards = {"before": baseline_reward("exact"), "timeout": checked_reward("exact", 60.0)}

    def call_only(reward) -> float:
        t0 = time.perf_counter()
        for _ in range(args.calls):
            reward("46", ex)
        return (time.perf_counter() - t0) / args.calls

    class ReadyEngine:
        """Returns the same completions at once: the sampler's path without sampling."""

        name, version = "ready", 0

        def generate(self, prompts, sampling, seed, sync=None):
            return [Completion(prompt_tokens=np.asarray(p, np.int32),
                               response_tokens=np.asarray(tokens, np.int32),
                               logprobs=np.full(len(tokens), -0.5, np.float32),
                               routed_experts=np.zeros((len(p) + len(tokens) - 1, 2, 2),
                                                       np.int32),
                               finish_reason="stop") for p in prompts]

    cfg = WorkerConfig(group_size=8, prompts_per_step=8, record_routes=True)

    def path(reward) -> float:
        sampler = GroupSampler(ReadyEngine(), FileTask([ex], reward), tok,
                               itertools.repeat(ex), cfg)
        batches = max(1, args.calls // 64)
        t0 = time.perf_counter()
        for _ in range(batches):
            sampler.sample()
        return (time.perf_counter() - t0) / (batches * 64)

    bests = {}
    for name, bench in (("reward call", call_only), ("reward path", path)):
        best = bests[name] = {k: math.inf for k in rewards}
        for _ in range(args.repeats):  # interleaved: a busy moment hits both alike
            for k, r in rewards.items():
                best[k] = min(best[k], bench(r))
        over = best["timeout"] / best["before"] - 1
        print(f"{name}: {best['before'] * 1e9:.0f} ns before, {best['timeout'] * 1e9:.0f} ns "
              f"with the timeout: {over:+.1%}"
              + (f" (target <= {TARGET:.0%})" if name == "reward path" else ""))
    # the path's own run-to-run noise on a busy machine exceeds the bookkeeping: its cost
    # is the call's difference, a fixed time per trajectory
    cost = bests["reward call"]["timeout"] - bests["reward call"]["before"]
    print(f"bookkeeping: {cost * 1e9:.0f} ns a call = "
          f"{cost / bests['reward path']['before']:.2%} of the path")


if __name__ == "__main__":
    main()
