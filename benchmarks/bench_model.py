"""Forward+backward throughput of satjax (jitted JAX) vs HF transformers (torch CPU), same
weights, config and batch, in model FLOP/s next to the machine's jitted fp32 matmul peak
measured in the same run; plus the satjax sampler's decode rate next to its bandwidth bound.

    PYTHONPATH=$PWD python benchmarks/bench_model.py [--configs bench,large --repeats 3]

Model FLOPs per training step (counted analytically, matmuls only; x3 for fwd+bwd):

    per token, per layer:  2 * D * (H + 2 * Hkv) * Dh          q, k, v projections
                         + 2 * H * Dh * D                      o projection
                         + 2 * 2 * T * H * Dh                  scores + values (full T x T)
                         + 2 * D * E + 2 * k * 3 * D * F       router + the k active experts
                           (a dense layer: 2 * 3 * D * I)
    per token:             + 2 * D * V                         LM head
    step FLOPs = 3 * tokens * per-token FLOPs

The causal mask halves the useful score/value work, but both implementations compute the
full T x T product, so it is counted in full. Variants (``--variants``: a ``moe_impl``
dispatch, optionally ``+bf16`` for bfloat16 compute over the same fp32 parameters and
``+scan`` for ``scan_layers``, e.g. ``grouped+bf16+scan``) and HF run interleaved, one
step each per round, and the median over rounds is reported, because the machine is
shared (each after an untimed call, see ``interleaved_median_s``). HF runs in a child
process (``HfProcess``) with ``torch.set_num_threads`` = the CPUs XLA uses.

Decode: tokens/s of the satjax sampler's decode loop (the time of a ``--decode-tokens``
generation minus a 1-token one, so prefill and compile are excluded) next to the bound
``batch * memory bandwidth / parameter bytes`` (each decode step streams every weight once).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import matmul_peak_gflops, memory_bandwidth_gbs, print_versions  # noqa: E402

from satjax.model import (  # noqa: E402
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    save_pretrained,
    token_logprobs,
)
from satjax.model.moe import MOE_IMPLS  # noqa: E402
from satjax.model.sampling import generate  # noqa: E402


@dataclasses.dataclass(frozen=True)
class BenchCase:
    cfg: Qwen3MoeConfig
    batch: int
    seq: int


CASES = {
    "bench": BenchCase(Qwen3MoeConfig.tiny(
        vocab_size=1024, hidden_size=256, moe_intermediate_size=128, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
        num_experts=16, num_experts_per_tok=4), batch=8, seq=128),
    "large": BenchCase(Qwen3MoeConfig.tiny(
        vocab_size=4096, hidden_size=1024, moe_intermediate_size=512, intermediate_size=2048,
        num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        num_experts=32, num_experts_per_tok=4, max_position_embeddings=1024), batch=2, seq=512),
}


def step_flops(cfg: Qwen3MoeConfig, batch: int, seq: int) -> float:
    """Model FLOPs of one fwd+bwd step (module docstring formula)."""
    d, h, kv, dh = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                    cfg.head_dim)
    per_token = 2 * d * cfg.vocab_size
    for i in range(cfg.num_hidden_layers):
        per_token += 2 * d * (h + 2 * kv) * dh + 2 * h * dh * d + 4 * seq * h * dh
        if i in cfg.moe_layer_indices:
            per_token += 2 * d * cfg.num_experts
            per_token += 2 * cfg.num_experts_per_tok * 3 * d * cfg.moe_intermediate_size
        else:
            per_token += 2 * 3 * d * cfg.intermediate_size
    return 3.0 * batch * seq * per_token


def satjax_step(model, ids: np.ndarray):
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, ids):
        def loss(state):  # the trainer's own log-prob function
            lp, _ = token_logprobs(nnx.merge(graphdef, state), ids)
            return -jnp.mean(lp[:, 1:])
        return jax.value_and_grad(loss)(state)

    x = jnp.asarray(ids[:, :-1])

    def run() -> None:
        jax.block_until_ready(step(state, x))

    return run


def hf_step(path: str, ids: np.ndarray):
    import torch
    import transformers

    model = transformers.Qwen3MoeForCausalLM.from_pretrained(
        path, attn_implementation="sdpa", dtype=torch.float32)
    model.train()
    x = torch.from_numpy(ids[:, :-1].astype(np.int64))

    def step():  # the same T-token forward and T-1 next-token log-probs as satjax's
        model.zero_grad(set_to_none=True)
        out = model(input_ids=x)
        lp = torch.log_softmax(out.logits[:, :-1], -1)
        loss = -lp.gather(-1, x[:, 1:, None]).mean()
        loss.backward()

    return step


def hf_server(path: str, ids_file: str, threads: int) -> None:
    """``--hf-server``: one HF step per stdin line, its seconds on stdout.

    HF runs in its own process because torch ran ~10x slower inside a process whose XLA
    runtime had run (measured), which would flatter satjax."""
    import torch

    torch.set_num_threads(threads)
    step = hf_step(path, np.load(ids_file))
    for _ in sys.stdin:
        t0 = time.perf_counter()
        step()
        print(time.perf_counter() - t0, flush=True)


class HfProcess:
    """A callable that runs one HF step in the ``--hf-server`` child."""

    def __init__(self, path: str, ids: np.ndarray, threads: int):
        ids_file = os.path.join(path, "ids.npy")
        np.save(ids_file, ids)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--hf-server", path, ids_file, str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def __call__(self) -> float:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"HF server exited with {self.proc.wait()}")
        return float(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def interleaved_median_s(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each fn over ``repeats`` rounds, one timed call of each per round.

    Each timed call follows an untimed one of the same fn: the previous engine's worker
    threads (XLA's pool, torch's OpenMP team) keep spinning for a while after it returns
    and would otherwise be billed to the next engine.
    """
    for fn in fns.values():
        fn()  # warm-up / compile
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            fn()
            t0 = time.perf_counter()
            inner = fn()  # HfProcess returns the seconds measured in its process
            times[name].append(inner if inner is not None else time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


VARIANT_OPTIONS = {"bf16": {"dtype": jnp.bfloat16}, "scan": {"scan_layers": True}}


def build_variant(cfg: Qwen3MoeConfig, variant: str) -> Qwen3MoeForCausalLM:
    """``impl[+option...]`` (module docstring) -> the model, parameters from seed 0."""
    impl, *options = variant.split("+")
    unknown = [o for o in options if o not in VARIANT_OPTIONS]
    if impl not in MOE_IMPLS or unknown:
        raise ValueError(f"variant {variant!r}: want one of {MOE_IMPLS} followed by any of "
                         f"+{' +'.join(VARIANT_OPTIONS)}")
    kwargs = {k: v for o in options for k, v in VARIANT_OPTIONS[o].items()}
    return Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0), moe_impl=impl, **kwargs)


def bench_train(name: str, case: BenchCase, variants: list[str], repeats: int,
                peak: float, threads: int) -> None:
    cfg = case.cfg
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, (case.batch, case.seq + 1))
    flops = step_flops(cfg, case.batch, case.seq)
    print(f"[{name}] hidden {cfg.hidden_size}, layers {cfg.num_hidden_layers}, experts "
          f"{cfg.num_experts} top-{cfg.num_experts_per_tok}, vocab {cfg.vocab_size}; batch "
          f"{case.batch} x seq {case.seq}; {flops / 1e9:.1f} model GFLOP per step", flush=True)
    fns = {f"satjax {v}": satjax_step(build_variant(cfg, v), ids) for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0)), tmp)
        hf_proc = HfProcess(tmp, ids, threads)
        fns["HF transformers"] = hf_proc
        try:
            secs = interleaved_median_s(fns, repeats)
        finally:
            hf_proc.close()
    tokens = case.batch * case.seq
    hf = secs["HF transformers"]
    for label, s in secs.items():
        ratio = "" if label == "HF transformers" else f"  {hf / s:5.2f}x HF (target >= 1.5x)"
        print(f"  {label:22s} {tokens / s:8.0f} tok/s  {flops / s / 1e9:6.1f} GFLOP/s = "
              f"{100 * flops / s / 1e9 / peak:4.1f}% of matmul peak (target >= 35%){ratio}",
              flush=True)


def bench_decode(case: BenchCase, new_tokens: int, bandwidth: float) -> None:
    cfg = case.cfg
    model = Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0))
    prompts = [list(range(3, 3 + 16 + i)) for i in range(case.batch)]

    def run(n):
        generate(model, prompts, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=n,
                 stop_token_ids=(), rng=jax.random.key(0))

    secs = interleaved_median_s({"n": lambda: run(new_tokens), "1": lambda: run(1)}, 3)
    rate = case.batch * (new_tokens - 1) / (secs["n"] - secs["1"])
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    bound = case.batch * bandwidth * 1e9 / param_bytes
    print(f"sampler decode (batch {case.batch}, {new_tokens} new tokens, fp32): {rate:8.0f} "
          f"tok/s; bandwidth bound {bound:8.0f} tok/s ({param_bytes / 1e6:.1f} MB of "
          f"parameters per step at {bandwidth:.1f} GB/s) = {100 * rate / bound:.1f}% of it")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="bench,large", help=f"of {sorted(CASES)}")
    parser.add_argument("--variants", default="grouped,grouped+bf16,grouped+scan",
                        help="satjax variants to time, interleaved with HF: a moe_impl, "
                             "optionally +bf16 and/or +scan")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--hf-server", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_server:
        hf_server(args.hf_server[0], args.hf_server[1], int(args.hf_server[2]))
        return
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CASES]
    if unknown:
        print(f"--configs: must be among {sorted(CASES)}, got {unknown[0]!r}", file=sys.stderr)
        raise SystemExit(2)
    variants = args.variants.split(",")
    try:  # checked before minutes of measuring
        [build_variant(Qwen3MoeConfig.tiny(), v) for v in variants]
    except ValueError as e:
        print(f"--variants: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    threads = len(os.sched_getaffinity(0))  # XLA:CPU sizes its intra-op pool to these
    print_versions()
    peak = matmul_peak_gflops()
    bandwidth = memory_bandwidth_gbs()
    print(f"threads: XLA {threads} CPUs, torch.set_num_threads({threads}); jitted fp32 matmul "
          f"peak {peak:.0f} GFLOP/s; memory copy bandwidth {bandwidth:.1f} GB/s", flush=True)
    for name in configs:
        bench_train(name, CASES[name], variants, args.repeats, peak, threads)
    bench_decode(CASES["bench"], args.decode_tokens, bandwidth)


if __name__ == "__main__":
    main()
