"""Expert-parallel MoE dispatch measured by its collectives, with the TPU compiler.

    PYTHONPATH=$PWD python benchmarks/bench_moe_dispatch.py [--tokens 8192] [--topology v5p:2x2x2]

One Qwen3-30B-A3B MoE layer (``SparseMoeBlock``: hidden 2048, 128 experts of width 768,
top-8; bfloat16 compute, float32 parameters), forward and backward (the gradients of the
parameters and of the input), compiled by XLA:TPU for the devices of a TPU topology
(``jax.experimental.topologies``: no TPU is needed, libtpu compiles on this host) over
meshes ``{fsdp, expert}``, with ``--tokens`` tokens per device (one sequence each).
Nothing runs. For each dispatch it prints, per chip and step, the bytes of every kind of
collective in the optimized HLO and ``memory_analysis()``'s temporaries:

* ``ragged``: today's dispatch under a mesh, every device running its own tokens against
  the all-gathered expert weights (``per_batch_shard``);
* ``all_to_all``: the weights stay sharded, the tokens travel (``expert_parallel``) by
  ``ragged-all-to-all``, the local experts by ``ragged_dot`` (the TPU/GPU choice);
* ``all_to_all/padded``: the same with the exchange as XLA:CPU runs it, one all-to-all of
  buffers padded to the worst case (``padded_ragged_all_to_all``), experts by "grouped".

A collective's bytes are the larger of its operand and its result (the whole array a ring
moves (n-1)/n of; all-to-all and collective-permute send what they receive), times the
trips of the while loops around it; a ragged-all-to-all's are the smaller of the two: one
side is the receive buffer, sized for every row of the axis coming to this chip, the other
what the chip sends or gets back, as many rows as it moves on average.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

# compiling only: share libtpu with any other process that holds its lock file
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `python benchmarks/<this>.py`: `benchmarks` importable

from benchmarks.machine import print_versions  # noqa: E402
from satjax.model import Qwen3MoeConfig  # noqa: E402
from satjax.model.moe import SparseMoeBlock  # noqa: E402
from satjax.parallel import MeshConfig, logical_to_spec, make_mesh, state_shardings  # noqa: E402

# dispatch -> (moe_impl, the platform its backend choices are made for)
DISPATCHES = {"ragged": ("ragged", "tpu"), "all_to_all": ("all_to_all", "tpu"),
              "all_to_all/padded": ("all_to_all", "cpu")}
KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
         "collective-permute")
MIB = 1 << 20
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\(([^)]*)\)")
_CALLEES = re.compile(r"\b(?:body|condition|calls|to_apply|branch_computations)="
                      r"\{?(%?[\w.\-]+(?:, %[\w.\-]+)*)\}?")
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONDITION = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = s32\[\][^ ]* constant\((\d+)\)")


def _array_bytes(text: str) -> list[int]:
    """Bytes of each array written in ``text`` (a shape or a tuple of shapes)."""
    sizes = []
    for dtype, dims in _ARRAY.findall(text):
        size = _BYTES[dtype]
        for dim in filter(None, dims.split(",")):
            size *= int(dim)
        sizes.append(size)
    return sizes


def _trips(line: str, computations: dict[str, list[str]]) -> int | None:
    """Trips of the while loop ``line``: XLA's known trip count, else the bound of its
    condition ``i < N`` (lax loops count from 0); None if data-dependent."""
    known = _KNOWN_TRIPS.search(line)
    if known:
        return int(known.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", line)
    body = computations.get(cond.group(1), []) if cond else []
    bounds = [int(m.group(1)) for text in body if (m := _CONDITION.match(text))]
    lt = any("direction=LT" in text for text in body)
    return bounds[0] if len(bounds) == 1 and lt else None


def collective_bytes(hlo: str) -> dict[str, tuple[int, int]]:
    """{kind: (ops run per step, bytes per chip per step)} of an optimized HLO module's
    collectives (module docstring), their async ``-start`` halves counted once."""
    computations: dict[str, list[str]] = {}
    name = ""
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            name = m.group(1)
            computations[name] = []
        elif name:
            computations[name].append(line)
    shapes = {m.group(1): m.group(2) for lines in computations.values() for line in lines
              if (m := _INSTRUCTION.match(line))}
    entry = next(m.group(1) for line in hlo.splitlines()
                 if (m := re.match(r"^ENTRY %?([\w.\-]+)", line)))
    # times each computation runs per step; None inside a loop of data-dependent trips
    runs: dict[str, int | None] = defaultdict(int)

    def visit(comp: str, times: int | None) -> None:
        total = runs[comp]
        runs[comp] = None if times is None or total is None else total + times
        for line in computations.get(comp, ()):
            trips = _trips(line, computations) if re.search(r" while\(", line) else 1
            for callees in _CALLEES.findall(line):
                for callee in callees.split(", "):
                    visit(callee.lstrip("%"), None if times is None or trips is None
                          else times * trips)

    visit(entry, 1)
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for comp, times in runs.items():
        for line in computations.get(comp, ()):
            m = _INSTRUCTION.match(line)
            kind = m.group(3).removesuffix("-start") if m else ""
            if kind not in KINDS:
                continue
            if times is None:
                raise ValueError(f"a collective in a loop of data-dependent trips: {line[:120]}")
            results = _array_bytes(m.group(2))
            # an async start's result holds its operands and results: the largest is one
            result = max(results) if m.group(3).endswith("-start") else sum(results)
            names = re.findall(r"%?([\w.\-]+)", re.sub(r"/\*.*?\*/", "", m.group(4)))
            operand = sum(sum(_array_bytes(shapes[n])) for n in names)
            if kind == "ragged-all-to-all":  # operand, output buffer, offsets and sizes
                operand = sum(_array_bytes(shapes[names[0]]))
            size = min if kind == "ragged-all-to-all" else max
            out[kind][0] += times
            out[kind][1] += times * size(result, operand)
    return {k: (v[0], v[1]) for k, v in out.items()}


def compile_layer(cfg: Qwen3MoeConfig, mesh, tokens: int, impl: str, platform: str):
    """The compiled forward + backward of one MoE layer on ``mesh``'s devices."""
    block = nnx.eval_shape(lambda: SparseMoeBlock(
        cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.float32, moe_impl=impl,
        platform=platform))
    graphdef, state = nnx.split(block)
    state_sh = state_shardings(state, mesh)
    b = mesh.devices.size
    shape = (b, tokens, cfg.hidden_size)
    x_sh = NamedSharding(mesh, logical_to_spec(("batch", None, None), shape, mesh))

    def loss(state, x):
        out, _ = nnx.merge(graphdef, state)(x)
        return jnp.sum(out.astype(jnp.float32))

    abstract = (jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             state, state_sh),
                jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=x_sh))
    step = jax.jit(jax.grad(loss, argnums=(0, 1)), out_shardings=(state_sh, x_sh))
    with jax.set_mesh(mesh):
        return step.lower(*abstract).compile()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per device")
    ap.add_argument("--topology", default="v5p:2x2x2")
    ap.add_argument("--meshes", default="1x8,2x4", help="fsdp x expert, comma-separated")
    ap.add_argument("--dispatches", default=",".join(DISPATCHES))
    args = ap.parse_args()
    print_versions(("satjax", "jax", "jaxlib", "flax", "libtpu"))
    devices = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices
    cfg = Qwen3MoeConfig.tiny(hidden_size=2048, num_experts=128, num_experts_per_tok=8,
                              moe_intermediate_size=768)
    print(f"one MoE layer fwd+bwd, {args.tokens} tokens per device, hidden {cfg.hidden_size}, "
          f"{cfg.num_experts} experts x {cfg.moe_intermediate_size}, top-"
          f"{cfg.num_experts_per_tok}; bf16 compute, f32 params; XLA:TPU for {args.topology} "
          f"({len(devices)} {devices[0].device_kind}); MiB per chip per step")
    for spec in args.meshes.split(","):
        fsdp, expert = map(int, spec.split("x"))
        mesh = make_mesh(MeshConfig(fsdp=fsdp, expert=expert), devices)
        print(f"\nmesh fsdp={fsdp} expert={expert}")
        print(f"{'dispatch':<20}" + "".join(f"{k:>20}" for k in KINDS)
              + f"{'total':>10}{'temp':>10}")
        for name in args.dispatches.split(","):
            compiled = compile_layer(cfg, mesh, args.tokens, *DISPATCHES[name])
            counts = collective_bytes(compiled.as_text())
            cells = [f"{counts[k][1] / MIB:.0f} ({counts[k][0]})" if k in counts else "-"
                     for k in KINDS]
            total = sum(v[1] for v in counts.values()) / MIB
            temp = compiled.memory_analysis().temp_size_in_bytes / MIB
            print(f"{name:<20}" + "".join(f"{c:>20}" for c in cells)
                  + f"{total:>10.0f}{temp:>10.0f}", flush=True)


if __name__ == "__main__":
    main()
