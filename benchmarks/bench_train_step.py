"""Full train-step benchmark on the tiny Qwen3-MoE config (CPU by default).

Prints, measured side by side in one run (versions line first):
  - compile time of the step (trace + lower + XLA compile) per objective;
  - tokens/s of the full step (loss tokens and all tokens) per objective;
  - SAT overhead inside the full step, from interleaved repeats of the real
    ``make_train_step``: sat_gspo (sequence proxy, the default) / gspo (target < 1.02),
    sat_gspo with the token proxy / gspo and sat_ppo / ppo_clip (token-level SAT, target
    <= 1.3), as median of medians and median of paired ratios, with "met" / "MISSED".

  PYTHONPATH=. python benchmarks/bench_train_step.py [--batch 16 --length 256 --repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `python benchmarks/<this>.py`: `benchmarks` importable

from benchmarks.machine import print_versions  # noqa: E402
from satjax import parallel  # noqa: E402
from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402
from satjax.train.batch import Batch  # noqa: E402
from satjax.train.state import TrainState, make_optimizer  # noqa: E402
from satjax.train.step import StepOptions, make_train_step  # noqa: E402


def synthetic_batch(cfg: Qwen3MoeConfig, B: int, T: int, group_size: int, seed: int) -> Batch:
    r = np.random.default_rng(seed)
    L, k = len(cfg.moe_layer_indices), cfg.num_experts_per_tok
    prompt = T // 4
    tokens = r.integers(3, cfg.vocab_size, (B, T)).astype(np.int32)
    loss_mask = np.zeros((B, T), np.float32)
    loss_mask[:, prompt:] = 1.0
    blp = (np.log(1.0 / cfg.vocab_size) + 0.2 * r.standard_normal((B, T))).astype(np.float32)
    routes = np.argsort(r.random((B, T, L, cfg.num_experts)), axis=-1)[..., :k].astype(np.int32)
    return Batch(
        tokens=tokens,
        attention_mask=np.ones((B, T), np.int32),
        loss_mask=loss_mask,
        behavior_logprobs=blp * loss_mask,
        rewards=r.standard_normal(B).astype(np.float32),
        group_ids=np.repeat(np.arange(B // group_size), group_size).astype(np.int32),
        policy_versions=np.zeros(B, np.int32),
        routed_experts=routes,
        group_size=group_size,
    )


# name -> (objective, objective_hp): the bases, and SAT with each proxy.
VARIANTS = {
    "gspo": ("gspo", None),
    "sat_gspo": ("sat_gspo", None),
    "sat_gspo[token]": ("sat_gspo", {"proxy": "token"}),
    "ppo_clip": ("ppo_clip", None),
    "sat_ppo": ("sat_ppo", None),
}
# SAT variant -> (its base, target ratio of step times).
PAIRS = {"sat_gspo": ("gspo", 1.02), "sat_gspo[token]": ("gspo", 1.3),
         "sat_ppo": ("ppo_clip", 1.3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--no-replay", action="store_true")
    args = ap.parse_args()

    print_versions()
    cfg = Qwen3MoeConfig.tiny()
    mesh = parallel.make_mesh(parallel.MeshConfig(), devices=jax.devices()[:1])
    batch = synthetic_batch(cfg, args.batch, args.length, args.group_size, seed=0)
    steps, states = {}, {}
    print(
        f"backend={jax.default_backend()} tiny Qwen3-MoE (L={cfg.num_hidden_layers}, "
        f"E={cfg.num_experts}, k={cfg.num_experts_per_tok}), B={args.batch}, T={args.length}, "
        f"replay={not args.no_replay}, grad_accum={args.grad_accum}"
    )
    for name, (objective, hp) in VARIANTS.items():
        model = Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)
        graphdef, state = nnx.split(TrainState(model, make_optimizer(1e-4, max_grad_norm=1.0)))
        step = make_train_step(graphdef, state, mesh=mesh, options=StepOptions(
            objective=objective, objective_hp=hp, replay=not args.no_replay,
            grad_accum=args.grad_accum))
        state = step.place_state(state)
        placed = step.place_batch(batch)
        t0 = time.perf_counter()
        lowered = step.lower(state, placed)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        state, m = compiled(state, placed)  # warm-up call
        jax.block_until_ready(m)
        print(f"{name:15s} compile: trace+lower {t1 - t0:6.2f}s  XLA compile {t2 - t1:6.2f}s")
        steps[name], states[name] = (compiled, placed), state

    names = list(VARIANTS)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(args.repeats):  # interleaved, rotated: machine-load drift hits all alike
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            compiled, placed = steps[name]
            t = time.perf_counter()
            states[name], m = compiled(states[name], placed)
            jax.block_until_ready((states[name], m))
            times[name].append(time.perf_counter() - t)

    loss_tokens = float(np.sum(batch.loss_mask))
    all_tokens = float(np.sum(batch.attention_mask))
    for name in names:
        med = statistics.median(times[name])
        print(
            f"{name:15s} step median {med * 1e3:8.2f} ms  "
            f"{all_tokens / med:10.0f} tokens/s  ({loss_tokens / med:10.0f} loss tokens/s)"
        )
    print("SAT overhead in the full step (median of medians, median of paired ratios):")
    for sat, (base, target) in PAIRS.items():
        ratio = statistics.median(times[sat]) / statistics.median(times[base])
        paired = statistics.median(s / b for s, b in zip(times[sat], times[base], strict=True))
        ok = "met" if ratio <= target else "MISSED"
        print(f"  {sat}/{base} = {ratio:.4f}, {paired:.4f}; target <= {target}: {ok}")


if __name__ == "__main__":
    main()
