"""Forward+backward throughput of satjax (jitted JAX) vs HF transformers (torch CPU), same
weights, config and batch, printed as a ratio; plus the satjax sampler's decode rate.

    PYTHONPATH=$PWD python benchmarks/bench_model.py [--batch 8 --seq 128 --iters 5]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM, save_pretrained
from satjax.model.sampling import generate


def bench_config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig.tiny(vocab_size=1024, hidden_size=256, moe_intermediate_size=128,
                               intermediate_size=512, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                               num_experts=16, num_experts_per_tok=4)


def _time(fn, iters: int) -> float:
    fn()  # warm-up / compile
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def satjax_train_step_seconds(model, ids: np.ndarray, iters: int) -> float:
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, ids):
        def loss(state):
            logits = nnx.merge(graphdef, state)(ids[:, :-1]).logits
            lp = jax.nn.log_softmax(logits)
            return -jnp.mean(jnp.take_along_axis(lp, ids[:, 1:, None], -1))
        return jax.value_and_grad(loss)(state)

    x = jnp.asarray(ids)
    return _time(lambda: jax.block_until_ready(step(state, x)), iters)


def hf_train_step_seconds(path: str, ids: np.ndarray, iters: int) -> float:
    import torch
    import transformers

    model = transformers.Qwen3MoeForCausalLM.from_pretrained(
        path, attn_implementation="sdpa", dtype=torch.float32)
    model.train()
    x = torch.from_numpy(ids.astype(np.int64))

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=x[:, :-1], labels=x[:, :-1].clone())
        lp = torch.log_softmax(out.logits, -1)
        loss = -lp.gather(-1, x[:, 1:, None]).mean()
        loss.backward()

    return _time(step, iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=64)
    args = parser.parse_args()
    cfg = bench_config()
    model = Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0))
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, (args.batch, args.seq + 1))
    tokens = args.batch * args.seq
    print(f"config: hidden {cfg.hidden_size}, layers {cfg.num_hidden_layers}, experts "
          f"{cfg.num_experts} top-{cfg.num_experts_per_tok}; batch {args.batch} x {args.seq}")
    sj = satjax_train_step_seconds(model, ids, args.iters)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        hf = hf_train_step_seconds(tmp, ids, args.iters)
    print(f"forward+backward satjax (jit):       {tokens / sj:10.0f} tokens/s")
    print(f"forward+backward HF transformers:    {tokens / hf:10.0f} tokens/s")
    print(f"ratio satjax / HF: {hf / sj:.2f}x (target >= 2x)")

    prompts = [list(range(3, 3 + 16 + i)) for i in range(args.batch)]
    run = lambda: generate(model, prompts, temperature=1.0, top_k=0, top_p=1.0,  # noqa: E731
                           max_new_tokens=args.decode_tokens, stop_token_ids=(),
                           rng=jax.random.key(0))
    secs = _time(run, 2)
    print(f"sampler: batch {args.batch}, {args.decode_tokens} new tokens each: "
          f"{args.batch * args.decode_tokens / secs:10.0f} generated tokens/s "
          f"(incl. prefill of {len(prompts[-1])}-token prompts)")


if __name__ == "__main__":
    main()
