"""Wire bytes of the router record per token, measured by encoding trajectories.

    PYTHONPATH=$PWD python benchmarks/record_sizes.py [--layers 48 --experts 128 --top-k 8]

Encodes one trajectory of P prompt + N response tokens with the real codec
(``satjax.queue.codec.encode``) with and without each part of the record and prints each
part's bytes per token: the difference of the two encodings divided by the rows the part
has (P + N - 1 router rows; N response tokens for ``token_versions``). The defaults are the
paper's shape (Qwen3-30B-A3B: 48 MoE layers, 128 experts, top-8). Not a timing: the
figures depend only on the shape and the wire format.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
from machine import print_versions

from satjax.queue.codec import encode
from satjax.trajectory import Trajectory


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--response", type=int, default=1024)
    a = p.parse_args()
    print_versions()
    rng = np.random.default_rng(0)
    rows, n = a.prompt + a.response - 1, a.response
    shape = (rows, a.layers, a.top_k)
    bare = Trajectory(
        trajectory_id="t", group_id="g", prompt_id="p",
        prompt_tokens=rng.integers(0, 150_000, a.prompt, dtype=np.int32),
        response_tokens=rng.integers(0, 150_000, n, dtype=np.int32),
        behavior_logprobs=-rng.random(n, dtype=np.float32), policy_version=7, reward=1.0)
    parts = {
        "routed_experts": dict(routed_experts=rng.integers(0, a.experts, shape, np.int32)),
        "routed_gates": dict(routed_gates=rng.random(shape).astype(np.float16)),
        "router_logits": dict(router_logits=rng.normal(
            size=(rows, a.layers, a.experts)).astype(np.float16)),
        "token_versions": dict(token_versions=np.full(n, 7, np.int32)),
    }
    base = len(encode(bare, num_experts=a.experts))
    print(f"shape: {a.layers} MoE layers, {a.experts} experts, top-{a.top_k}; "
          f"P={a.prompt}, N={a.response}")
    print(f"tokens, log-probs and the rest (no router record): {base / (rows + 1):.1f} B/token")
    per_token = {}
    for name, fields in parts.items():
        size = len(encode(dataclasses.replace(bare, **fields), num_experts=a.experts)) - base
        count = n if name == "token_versions" else rows
        per_token[name] = size / count
        print(f"{name:15s} {size / count:9.1f} B/token ({size / 2**20:.2f} MiB for this "
              f"trajectory)")
    default = per_token["routed_experts"] + per_token["routed_gates"]
    print(f"record_routes (experts + gates): {default:.1f} B/token; with "
          f"record_router_logits: {default + per_token['router_logits']:.1f} B/token "
          f"(logits alone {per_token['router_logits'] / per_token['routed_experts']:.0f}x "
          f"the expert ids)")


if __name__ == "__main__":
    main()
