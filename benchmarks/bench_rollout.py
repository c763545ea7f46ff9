"""Rollout engines side by side: built-in JAX sampler vs vLLM (CPU build).

1. generated tokens/s on the same tiny model, same prompts, same sampling parameters
   (no stop tokens, so both generate exactly ``--max-new-tokens`` per prompt), after a
   warm-up call each (JIT compile / vLLM first-call warm-up excluded): the built-in engine,
   the vLLM server over HTTP, and vLLM's offline ``LLM`` API in a child process of the vLLM
   venv on the same checkpoint (engine vs engine, no HTTP);
2. weight-sync seconds versus model size: built-in = ``from_pretrained`` onto the JAX
   device; vLLM = in-place update over ``/collective_rpc`` + prefix-cache reset +
   version stamp (one server per size: the served architecture is fixed at startup).

    SATJAX_VLLM_PYTHON=.venv-vllm/bin/python PYTHONPATH=. python benchmarks/bench_rollout.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import print_versions  # noqa: E402

from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM, save_pretrained  # noqa: E402
from satjax.model.tokenizer import CharTokenizer  # noqa: E402
from satjax.rollout.builtin_engine import BuiltinEngine  # noqa: E402
from satjax.rollout.engine import SamplingParams  # noqa: E402
from satjax.rollout.vllm_engine import VllmEngine  # noqa: E402


def model_config(hidden: int) -> Qwen3MoeConfig:
    tok = CharTokenizer()
    return Qwen3MoeConfig.tiny(
        vocab_size=tok.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=hidden, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id)


def write_versions(cfg: Qwen3MoeConfig, root: Path) -> tuple[list[Path], int]:
    """Two checkpoints with different weights; returns their dirs and the param count."""
    dirs = []
    for seed in (0, 1):
        model = Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(seed), dtype=jnp.float32,
                                    param_dtype=jnp.float32)
        d = root / f"h{cfg.hidden_size}-s{seed}"
        save_pretrained(model, str(d))
        dirs.append(d)
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return dirs, int(n)


def prompts(n: int) -> list[list[int]]:
    tok = CharTokenizer()
    return [[tok.bos_id, *tok.encode(f"{i % 97}+{(7 * i) % 89}=")] for i in range(n)]


def tokens_per_s(engine, ps, sampling: SamplingParams, repeats: int) -> float:
    engine.generate(ps, sampling, seed=0)  # warm-up
    rates = []
    for r in range(repeats):
        t0 = time.perf_counter()
        comps = engine.generate(ps, sampling, seed=r + 1)
        dt = time.perf_counter() - t0
        rates.append(sum(len(c.response_tokens) for c in comps) / dt)
    return statistics.median(rates)


# Run by the vLLM venv's python: argv = checkpoint, JSON {prompts, temperature, max_new_tokens,
# repeats, dtype}; prints the median generated tokens/s after one warm-up call.
OFFLINE_SCRIPT = """
import json, statistics, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
a = json.loads(sys.argv[2])
llm = LLM(model=sys.argv[1], dtype=a["dtype"], enforce_eager=True, max_model_len=256,
          skip_tokenizer_init=True, seed=0)
ps = [TokensPrompt(prompt_token_ids=p) for p in a["prompts"]]
def rate(seed):
    sp = SamplingParams(temperature=a["temperature"], max_tokens=a["max_new_tokens"],
                        ignore_eos=True, seed=seed)
    t0 = time.perf_counter()
    outs = llm.generate(ps, sp, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
rate(0)
print("TOKENS_PER_S", statistics.median(rate(r + 1) for r in range(a["repeats"])))
"""


def vllm_offline_tokens_per_s(python: str, checkpoint: Path, ps, sampling: SamplingParams,
                              repeats: int, dtype: str) -> float:
    """Generated tokens/s of vLLM's offline ``LLM`` API (same CPU settings as the server:
    a 1 GiB KV cache, OpenMP threads unpinned on the shared cores)."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               HF_HUB_OFFLINE="1")
    arg = json.dumps(dict(prompts=ps, temperature=sampling.temperature,
                          max_new_tokens=sampling.max_new_tokens, repeats=repeats, dtype=dtype))
    out = subprocess.run([python, "-c", OFFLINE_SCRIPT, str(checkpoint), arg], env=env,
                         capture_output=True, text=True, timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith("TOKENS_PER_S "):
            return float(line.split()[1])
    raise RuntimeError(f"vLLM offline run failed ({out.returncode}): {out.stderr[-2000:]}")


def builtin_sync_s(dirs: list[Path], dtype: str, repeats: int) -> float:
    eng = BuiltinEngine(dtype)
    times = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        eng.load(dirs[r % 2], r)
        jax.block_until_ready(nnx.state(eng.model))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first load pays one-off tracing


def vllm_sync_s(eng: VllmEngine, dirs: list[Path], repeats: int) -> float:
    times = []
    for r in range(repeats):
        eng.load(dirs[(r + 1) % 2], r + 1)
        times.append(eng.last_sync_s)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", default=os.environ.get("SATJAX_VLLM_PYTHON", ""))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sizes", default="64,256,512", help="hidden sizes; the first is the "
                   "throughput model (64 = the tiny preset)")
    args = p.parse_args()
    print_versions()
    sizes = [int(s) for s in args.sizes.split(",")]
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    ps = prompts(args.prompts)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        for i, hidden in enumerate(sizes):
            dirs, n_params = write_versions(model_config(hidden), Path(tmp))
            b_sync = builtin_sync_s(dirs, args.dtype, args.repeats)
            with VllmEngine(python=args.vllm_python, dtype=args.dtype, max_model_len=256,
                            log_dir=tmp) as eng:
                t0 = time.perf_counter()
                eng.load(dirs[0], 0)
                startup = time.perf_counter() - t0
                if i == 0:
                    builtin = BuiltinEngine(args.dtype)
                    builtin.load(dirs[0], 0)
                    b_tps = tokens_per_s(builtin, ps, sampling, args.repeats)
                    v_tps = tokens_per_s(eng, ps, sampling, args.repeats)
                    print(f"throughput (hidden {hidden}, {args.dtype}, {len(ps)} prompts x "
                          f"{args.max_new_tokens} tokens, T={args.temperature}):")
                    print(f"  built-in {b_tps:8.1f} tok/s   vLLM server (HTTP) {v_tps:8.1f} "
                          f"tok/s   vLLM/built-in = {v_tps / b_tps:.2f}x", flush=True)
            if i == 0:  # after the server is gone: the offline engine gets the cores alone
                o_tps = vllm_offline_tokens_per_s(eng.python, dirs[0], ps, sampling,
                                                  args.repeats, args.dtype)
                print(f"  vLLM offline LLM API {o_tps:8.1f} tok/s   offline vLLM/built-in = "
                      f"{o_tps / b_tps:.2f}x", flush=True)
                v_sync = vllm_sync_s(eng, dirs, args.repeats)
            rows.append((hidden, n_params, b_sync, v_sync, startup))
            print(f"weight sync hidden {hidden:5d} ({n_params / 1e6:6.2f}M params): built-in "
                  f"{b_sync:6.3f}s  vLLM {v_sync:6.3f}s  (vLLM/built-in {v_sync / b_sync:.2f}x;"
                  f" vLLM server startup {startup:.0f}s)", flush=True)
    print("weight sync summary (hidden, params, built-in s, vLLM s, vLLM startup s):")
    for r in rows:
        print(f"  {r[0]:5d} {r[1]:>10,d} {r[2]:8.3f} {r[3]:8.3f} {r[4]:8.0f}")


if __name__ == "__main__":
    main()
