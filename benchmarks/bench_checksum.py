"""What the per-file checksums of published versions cost (satjax.weight_sync digests).

Publishes a ~120M-parameter MoE as bfloat16 (~240 MB a full version) with the real
publisher (ShardedPublisher, one device) and has a real worker (RolloutWorker, built-in
engine) load each version, full versions and deltas in turn; prints the median seconds of
a publish (publish + wait) and of a worker's load, and, where this tree has them, the
seconds of :func:`satjax.weight_sync.verify_files` alone on the same versions. Run it on
two trees to compare before and after (the same machine, back to back):

  PYTHONPATH=. python benchmarks/bench_checksum.py [--repeats 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

MID = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2048,
           moe_intermediate_size=512, num_hidden_layers=4, num_attention_heads=16,
           num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=4)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to publish (default: a temp dir)")
    args = ap.parse_args(argv)
    import jax
    from flax import nnx

    from satjax import parallel, weight_sync
    from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from satjax.rollout.builtin_engine import BuiltinEngine
    from satjax.rollout.worker import RolloutWorker, WorkerConfig
    from satjax.train.publish import ShardedPublisher

    model = Qwen3MoeForCausalLM(Qwen3MoeConfig.tiny(**MID), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    params = sum(x.size for x in jax.tree.leaves(state))
    mesh = parallel.make_mesh(parallel.MeshConfig(), devices=jax.devices()[:1])
    verify = getattr(weight_sync, "verify_files", None)  # absent before the checksums
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for kind, keyframe_every in (("full", 1), ("delta", 1000)):
            weights = Path(tmp) / kind
            pub = ShardedPublisher(weight_sync.WeightPublisher(weights, keep=2), mesh,
                                   [1, 5, 9, 2], keyframe_every=keyframe_every,
                                   dtype="bfloat16")
            sub = weight_sync.WeightSubscriber(weights)
            worker = RolloutWorker(BuiltinEngine("float32"), None, None, None, sub, iter([]),
                                   WorkerConfig())
            publish_s, load_s, verify_s, sizes = [], [], [], []
            for v in range(args.repeats + 1):
                m = nnx.merge(graphdef, jax.tree.map(lambda x, v=v: x * (1 + 1e-3 * v), state))
                t0 = time.perf_counter()
                pub.publish(m, v)
                pub.wait()
                t1 = time.perf_counter()
                assert worker.maybe_sync() and worker.engine.version == v
                t2 = time.perf_counter()
                p = sub.chain(v)[-1]
                sizes.append(sum(p.manifest["files"].values()))
                if verify is not None:
                    t3 = time.perf_counter()
                    verify(p)
                    verify_s.append(time.perf_counter() - t3)
                if v > 0:  # v0 compiles, and is the keyframe of the delta chain
                    publish_s.append(t1 - t0)
                    load_s.append(t2 - t1)
            med = statistics.median
            line = (f"{kind}: {params / 1e6:.0f}M params, {med(sizes) / 1e6:.1f} MB a version; "
                    f"publish {med(publish_s):.3f} s, worker load {med(load_s):.3f} s")
            if verify_s:
                line += (f"; verify_files alone {med(verify_s[1:]):.4f} s "
                         f"({med(verify_s[1:]) / med(load_s):.2%} of the load)")
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
