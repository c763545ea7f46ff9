"""``satjax plan``: will this run fit the chips it targets, and how fast can its step be?

    satjax plan --config configs/qwen3-30b-a3b.yaml --topology v5p:4x4x4 [--seq-len 32768]
    satjax plan --config configs/qwen3-30b-a3b.yaml --topology h100:64

Compiles the run's own programs for a named TPU slice or H100 cluster on this host, no
accelerator needed (the TPU compiler, libtpu: ``pip install 'satjax[tpu]'``; XLA:GPU for
``h100:N`` GPUs, hosts of 8 beyond 8: ``pip install 'satjax[gpu-plan]'``, which builds for
the packaged target config satjax/gpu_targets/h100_sxm.txtpb or ``--target-config``'s;
``--platform cpu``: XLA:CPU over as many emulated devices instead): the train step
(``satjax.app.memory.compile_step``: the config's objective, replay, remat, mesh, one
``--seq-len`` sequence per chip per micro-step) and the built-in sampler's prefill (the
eval forward over ``eval.num_prompts x eval.k`` prompts) and decode loop. Nothing is
allocated. Printed per chip: XLA's arguments, temporaries and peak against the chip's HBM;
the step's model FLOPs and a roofline step time at ``--mfu``; every collective of the
optimised program (kind, count, bytes per step, loop iterations included) and its time at
the chip's interconnect bandwidth (TPU ICI, GPU NVLink). A step that does not fit is
recompiled with a short list of alternatives (full remat, a scanned layer stack, other
fsdp x expert splits) until one fits, and that one is named.

Model FLOPs are analytic (``satjax.app.memory.model_flops_per_token``: 6 x active
parameters + causal attention per token, plus the forwards the step adds: remat's
recompute, the full-batch log-prob pass when ``grad_accum > 1``, the reference policy's):
XLA's ``cost_analysis()`` counts a loop body once (the scanned layers, the micro-steps),
so its figure is printed beside as what it is (XLA:GPU's deviceless compile has none).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
from typing import Any

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """Per-chip figures of one accelerator generation, as its maker publishes them."""

    name: str
    hbm_gib: float
    bf16_tflops: float     # peak dense bf16
    hbm_gbps: float        # HBM bandwidth, GB/s
    ici_gbps: float | None  # inter-chip interconnect, GB/s per chip, both directions
    source: str
    # a TPU slice of it as Cloud names it (libtpu's TPU_ACCELERATOR_TYPE); None for a GPU
    accelerator_type: str | None = None
    link: str = "ICI"  # the interconnect's name


# Google Cloud's TPU pages (per-chip "key specifications" tables, read 2026-12)
CHIPS: dict[str, Chip] = {
    "v4": Chip("TPU v4", 32, 275, 1200, None, "https://cloud.google.com/tpu/docs/v4", "v4-8"),
    "v5e": Chip("TPU v5e", 16, 197, 819, 400, "https://cloud.google.com/tpu/docs/v5e",
                "v5litepod-4"),
    "v5p": Chip("TPU v5p", 95, 459, 2765, 1200, "https://cloud.google.com/tpu/docs/v5p",
                "v5p-8"),
    "v6e": Chip("TPU v6e", 32, 918, 1638, 800, "https://cloud.google.com/tpu/docs/v6e",
                "v6e-4"),
    # NVIDIA's H100 page, SXM column (dense bf16: half the with-sparsity 1,979), NVLink 4:
    # 900 GB/s per GPU within a host; between hosts InfiniBand is slower (docs/parallel.md)
    "h100": Chip("NVIDIA H100 SXM", 80, 989, 3350, 900,
                 "https://www.nvidia.com/en-us/data-center/h100/", link="NVLink"),
}
DEFAULT_MFU = 0.4  # a well-tuned large MoE step; state your own with --mfu


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="satjax plan", description="Compile a run's train step and sampler for a TPU "
        "slice or H100 cluster (no accelerator needed) and print per-chip memory, FLOPs, "
        "collectives and a roofline step time.")
    ap.add_argument("--config", help="a satjax YAML config (default: the tiny run)")
    ap.add_argument("--topology", required=True,
                    help="TPU slice as JAX names it (v4:2x2x1, v5e:2x2, v5p:4x4x4, v6e:8x8) "
                         "or h100:N, N H100 GPUs (hosts of 8 beyond 8: h100:64)")
    ap.add_argument("--seq-len", type=int, default=0,
                    help="tokens per sequence (default: the bucket of the config's longest "
                         "trajectory)")
    ap.add_argument("--micro-batch", type=int, default=1,
                    help="sequences per chip per micro-step (default: %(default)s)")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="KEY=VALUE", help="override a config key (repeatable)")
    ap.add_argument("--platform", choices=("tpu", "cuda", "cpu"),
                    help="tpu: libtpu's compiler for the slice; cuda: XLA:GPU's for the "
                         "GPUs; cpu: XLA:CPU over as many emulated devices (the older "
                         "estimate); default: the topology's")
    ap.add_argument("--target-config", metavar="FILE",
                    help="XLA:GPU target config (text stream_executor.GpuTargetConfigProto) "
                         "to compile for instead of the packaged H100 SXM one, e.g. one "
                         "dumped on a real GPU (docs/parallel.md)")
    ap.add_argument("--mfu", type=float, default=DEFAULT_MFU,
                    help="model FLOPs utilisation of the roofline (default: %(default)s)")
    ap.add_argument("--no-sampler", action="store_true",
                    help="compile the train step only")
    ap.add_argument("--no-alternatives", action="store_true",
                    help="do not look for a variant that fits when the step does not")
    ap.add_argument("--hlo", metavar="PATH",
                    help="also write the train step's optimised HLO text there")
    ap.add_argument("--json", action="store_true",
                    help="print the train step's figures as one JSON object")
    args = ap.parse_args(argv)
    if args.seq_len < 0 or args.micro_batch < 1 or not 0 < args.mfu <= 1:
        ap.error("--seq-len must be >= 1, --micro-batch >= 1, --mfu in (0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # jax is imported, no device touched
    from satjax.parallel import GPU_TARGET_CONFIGS, parse_topology

    try:
        gen, dims = parse_topology(args.topology)
    except ValueError as e:
        print(f"satjax plan: {e}", file=sys.stderr)
        return 2
    chips = math.prod(dims)
    target = "cuda" if gen in GPU_TARGET_CONFIGS else "tpu"
    args.platform = args.platform or target
    if args.platform not in ("cpu", target):
        print(f"satjax plan: --platform {args.platform}: {args.topology} is compiled by "
              f"--platform {target} (or cpu)", file=sys.stderr)
        return 2
    if args.target_config and target != "cuda":
        print(f"satjax plan: --target-config is for a GPU topology, not {args.topology}",
              file=sys.stderr)
        return 2
    if args.target_config:
        try:
            with open(args.target_config, encoding="utf-8") as fh:
                args.target_config = fh.read()
        except OSError as e:
            print(f"satjax plan: --target-config: {e}", file=sys.stderr)
            return 2
    if args.platform == "cpu":  # before jax is imported: the emulated devices
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={chips}")
    elif args.platform == "tpu":  # off a TPU VM libtpu probes the VM's metadata for these,
        # printing 6 warnings
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", CHIPS[gen].accelerator_type or "")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        # libtpu's lockfile keeps a second process off a host's TPU chips; a compile
        # touches none, so plans may run beside each other (and beside a training run)
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # the compile targets the slice; nothing runs here, so no accelerator is initialised
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from satjax.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, OSError) as e:
        print(f"satjax plan: {e}", file=sys.stderr)
        return 2
    if cfg.train.mesh.size != chips:
        print(f"satjax plan: train.mesh uses {cfg.train.mesh.size} devices, "
              f"{args.topology} has {chips} chips: --set 'train.mesh={{...}}' to use "
              f"{chips}", file=sys.stderr)
        return 2
    import jax

    try:
        return _plan(args, cfg, chips)
    except ValueError as e:  # a topology the compiler refuses, a batch that holds no group
        print(f"satjax plan: {e}", file=sys.stderr)
        return 2
    except jax.errors.JaxRuntimeError as e:
        # a program the compiler cannot build for this slice (libtpu on v5e-256: "Ragged
        # all-to-all is currently not supported in limited ICI routing settings"): its
        # first line is the answer; the traceback is jax's, not the user's
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"satjax plan: the compiler refused the program: {first}", file=sys.stderr)
        return 1


def _devices(args: argparse.Namespace, chips: int) -> list[Any]:
    import jax

    from satjax.parallel import topology_devices

    if args.platform == "cpu":
        return jax.devices()[:chips]
    return topology_devices(args.topology, args.target_config)


def _require_cudnn() -> None:
    """JAX lowers cuDNN attention only with libcudnn loadable on this host, GPU or not."""
    from jax._src.lib import cuda_versions  # the CUDA plugin's version probes

    try:
        if cuda_versions is None:
            raise RuntimeError
        cuda_versions.cudnn_get_version()
    except RuntimeError:
        from satjax.parallel import GPU_PLAN_INSTALL

        raise ValueError(f"attention cudnn: JAX's cuDNN attention needs cuDNN on this host: "
                         f"{GPU_PLAN_INSTALL} (or --set model.attention=blockwise)") from None


def _device_memory(target_config: str) -> int | None:
    """The device memory a GPU target config states (bytes), if it does."""
    m = re.search(r"^\s*device_memory_size:\s*(\d+)", target_config, re.MULTILINE)
    return int(m.group(1)) if m else None


def _plan(args: argparse.Namespace, cfg, chips: int) -> int:
    import jax

    from satjax.app.factory import build_tokenizer, model_config
    from satjax.app.hlo import collectives
    from satjax.app.memory import StepMemory, compile_step
    from satjax.config import max_sequence_tokens, train_buckets
    from satjax.model import DTYPES
    from satjax.model.attention import resolve_attention
    from satjax.parallel import GPU_TARGET_CONFIGS, gpu_target_config

    gen = args.topology.partition(":")[0]
    chip = CHIPS[gen]
    longest = max_sequence_tokens(cfg)
    seq_len = args.seq_len or min(b for b in train_buckets(cfg) if b >= longest)
    tiny = cfg.model.preset == "tiny" and not cfg.model.path
    mcfg = model_config(cfg, build_tokenizer(cfg) if tiny else None)
    devices = _devices(args, chips)  # first: a missing compiler is the first thing to say
    # "auto" choices follow the mesh's devices (satjax.parallel.target_platform): printed
    # as the target resolves them, not as this host would
    attention = resolve_attention(cfg.model.attention, seq_len, devices[0].platform,
                                  dtype=DTYPES[cfg.model.dtype], head_dim=mcfg.head_dim)
    if attention == "cudnn":
        _require_cudnn()
    hbm_gib, hbm_from = chip.hbm_gib, chip.source
    if args.platform == "cuda":
        target_config = args.target_config or gpu_target_config(gen)
        stated = _device_memory(target_config)
        if stated:
            hbm_gib = stated / GIB
            hbm_from = ("--target-config's device_memory_size" if args.target_config else
                        f"satjax/gpu_targets/{GPU_TARGET_CONFIGS[gen]}'s device_memory_size")
    compiler = {
        "tpu": f"libtpu {_version('libtpu')} for {args.topology}",
        "cuda": f"XLA:GPU (jax-cuda12-plugin {_version('jax-cuda12-plugin')}, deviceless: "
                f"no autotuning) for {args.topology}",
        "cpu": f"XLA:CPU over {chips} emulated devices"}[args.platform]
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    say(f"plan: {mcfg.num_hidden_layers} layers, {mcfg.num_experts} experts top-"
        f"{mcfg.num_experts_per_tok}; mesh {_mesh(cfg)}, {args.micro_batch} x {seq_len} "
        f"tokens per chip per micro-step, grad_accum {cfg.train.grad_accum}, remat "
        f"{cfg.train.remat}, attention {attention}, moe {cfg.model.moe_impl}; "
        f"compiler {compiler} (jax {jax.__version__})")

    def compile_train(c) -> tuple[StepMemory, Any]:
        """The step's bytes and program; raises DoesNotFit when the compiler refuses it."""
        t0 = time.perf_counter()
        say(f"compiling the train step (mesh {_mesh(c)}, remat {c.train.remat}, "
            f"scan_layers {c.model.scan_layers}) ...")
        try:
            compiled = compile_step(c, mcfg, micro_batch=args.micro_batch, seq_len=seq_len,
                                    devices=devices)
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            refusal = DoesNotFit(str(e))
            say(f"  refused in {time.perf_counter() - t0:.0f} s: {refusal}")
            raise refusal from None
        mem = StepMemory.of(compiled)
        say(f"  compiled in {time.perf_counter() - t0:.0f} s: {mem.summary()}")
        return mem, compiled

    tokens = args.micro_batch * seq_len * cfg.train.grad_accum  # per chip per step
    flops = tokens * step_flops_per_token(cfg, mcfg, seq_len)
    compute_s = flops / (chip.bf16_tflops * 1e12 * args.mfu)
    try:
        mem, compiled = compile_train(cfg)
    except DoesNotFit as refusal:
        # libtpu refuses a program whose temporaries exceed the chip's HBM: no buffer
        # assignment, no HLO; what it says it needed is a lower bound of the peak
        refused: dict[str, Any] = {"topology": args.topology, "chips": chips, "compiler": compiler,
                  "seq_len": seq_len, "micro_batch": args.micro_batch, "fits": False,
                  "refused": refusal.line, "peak_gib": refusal.needed_gib,
                  "peak_is_lower_bound": True, "hbm_gib": hbm_gib,
                  "compiler_hbm_gib": refusal.available_gib, "step_flops": flops,
                  "collective_bytes": None, "compute_s": compute_s,
                  "step_s_roofline": compute_s, "mfu": args.mfu,
                  "chip_source": chip.source}
        say(f"train step, per chip ({chip.name}, {hbm_gib:g} GiB HBM): DOES NOT FIT "
            f"({refusal.line})")
        if not args.no_alternatives:
            refused["fits_with"] = _first_that_fits(cfg, mcfg, compile_train, hbm_gib * GIB,
                                                    say)
        if args.json:
            print(json.dumps(refused, indent=1))
        return 0
    hlo = compiled.as_text()
    if args.hlo:
        with open(args.hlo, "w") as fh:
            fh.write(hlo)
    coll = collectives(hlo, chips)
    # None where the compiler has no cost model: XLA:GPU's compile-only executable
    cost = compiled.cost_analysis()
    xla_flops = float(cost["flops"]) if cost else None
    comm_s = coll.traffic / (chip.ici_gbps * 1e9) if chip.ici_gbps else None
    step_s = max(compute_s, comm_s or 0.0)
    hbm = hbm_gib * GIB
    fits = mem.peak <= hbm
    report: dict[str, Any] = {
        "topology": args.topology, "chips": chips, "compiler": compiler,
        "seq_len": seq_len, "micro_batch": args.micro_batch,
        "arguments_gib": mem.arguments / GIB, "temporaries_gib": mem.temporaries / GIB,
        "peak_gib": mem.peak / GIB, "hbm_gib": hbm_gib, "hbm_source": hbm_from, "fits": fits,
        "headroom_gib": (hbm - mem.peak) / GIB,
        "step_flops": flops, "xla_flops_loop_bodies_once": xla_flops,
        "xla_bytes_accessed_loop_bodies_once": (float(cost["bytes accessed"]) if cost
                                                else None),
        "collective_bytes": coll.bytes, "collective_traffic_bytes": coll.traffic,
        "collectives": {c.kind: {"count": c.count, "bytes": c.bytes, "traffic": c.traffic}
                        for c in coll.by_kind},
        "loops_of_unknown_trip_count": coll.unknown_loops,
        "compute_s": compute_s, "collective_s": comm_s, "step_s_roofline": step_s,
        "mfu": args.mfu, "tokens_per_s_per_chip": tokens / step_s,
        "chip_source": chip.source,
    }
    say(f"train step, per chip ({chip.name}, {hbm_gib:g} GiB HBM):")
    say(f"  arguments {mem.arguments / GIB:.2f} GiB, outputs {mem.outputs / GIB:.2f} GiB "
        f"(donated {mem.aliased / GIB:.2f}), temporaries {mem.temporaries / GIB:.2f} GiB")
    say(f"  peak {mem.peak / GIB:.2f} GiB of {hbm_gib:g}: "
        + (f"fits, {(hbm - mem.peak) / GIB:.2f} GiB headroom" if fits
           else f"DOES NOT FIT by {(mem.peak - hbm) / GIB:.2f} GiB"))
    say(f"  model FLOPs per step {flops:.4g} ({tokens} tokens; XLA's cost analysis, loop "
        f"bodies once: " + (f"{xla_flops:.4g})" if xla_flops is not None else "n/a)"))
    say("  collectives per step (loop iterations included):")
    for c in coll.by_kind:
        at = (f", {c.traffic / (chip.ici_gbps * 1e9) * 1e3:.1f} ms at {chip.link}"
              if chip.ici_gbps else "")
        say(f"    {c.kind:<20} x{c.count:<6} {_size(c.bytes):>10} buffers, "
            f"{_size(c.traffic):>10} sent{at}")
    if coll.unknown_loops:
        say(f"    ({coll.unknown_loops} loops with a data-dependent trip count counted once)")
    comm = (f"{comm_s:.2f} s" if comm_s is not None
            else f"n/a (no published {chip.link} figure)")
    say(f"  roofline: compute {compute_s:.2f} s at {args.mfu:.0%} of {chip.bf16_tflops:g} "
        f"TFLOP/s, collectives {comm}; step {step_s:.2f} s, "
        f"{tokens / step_s:.0f} tokens/s per chip")
    if not fits and not args.no_alternatives:
        alt = _first_that_fits(cfg, mcfg, compile_train, hbm, say)
        report["fits_with"] = alt
    if not args.no_sampler:
        report["sampler"] = _sampler(cfg, mcfg, devices, hbm, say)
    say(f"chip figures: {chip.source}" + (f"; memory: {hbm_from}" if hbm_from != chip.source
                                          else ""))
    if args.json:
        print(json.dumps(report, indent=1))
    return 0


class DoesNotFit(Exception):
    """The compiler refused the program for want of memory (libtpu: "RESOURCE_EXHAUSTED:
    Ran out of memory on HBM, the total memory required for HLO temporaries (35.63G)
    exceeds available HBM (31.25G)"): ``line`` is its first line, ``needed_gib`` and
    ``available_gib`` the figures it names (None where it names none)."""

    def __init__(self, message: str) -> None:
        self.line = message.strip().splitlines()[0] if message.strip() else "out of memory"
        figures = re.findall(r"\(([0-9.]+)G\)", self.line)
        self.needed_gib = float(figures[0]) if figures else None
        self.available_gib = float(figures[1]) if len(figures) > 1 else None
        super().__init__(self.line)


def step_flops_per_token(cfg, mcfg, seq_len: int) -> float:
    """Model FLOPs per trained token of one train step: forward + backward (6 x active
    parameters + causal attention), plus a forward (a third of that) for each of remat's
    recompute ("full"; "dots" recomputes less, counted the same), the full-batch log-prob
    pass of ``grad_accum > 1`` and the reference policy's forward (``kl_coef > 0``)."""
    from satjax.app.memory import active_params, attention_flops_per_token

    train = 6 * active_params(mcfg) + attention_flops_per_token(mcfg, seq_len)
    forwards = ((cfg.train.remat != "none") + (cfg.train.grad_accum > 1)
                + (cfg.objective.kl_coef > 0))
    return train * (1 + forwards / 3)


def _mesh(cfg) -> str:
    from satjax.config import MESH_AXES

    return "{" + ", ".join(f"{a}: {n}" for a, n in zip(MESH_AXES, cfg.train.mesh.shape,
                                                       strict=True) if n > 1) + "}"


def _alternatives(cfg, mcfg) -> list[tuple[list[str], Any]]:
    """What to try when the step does not fit, cheapest change first, each as the
    ``--set`` lines that make it and its config: full remat, then also a scanned layer
    stack, then also each other fsdp x expert split of the same chips (most experts
    first: the expert weights stay the most sharded)."""
    out: list[tuple[list[str], Any]] = []
    changes: list[str] = []
    if cfg.train.remat != "full":
        changes = [*changes, "train.remat=full"]
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, remat="full"))
        out.append((changes, cfg))
    if not cfg.model.scan_layers:
        changes = [*changes, "model.scan_layers=true"]
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=True))
        out.append((changes, cfg))
    m = cfg.train.mesh
    n = m.size // m.tensor
    for expert in sorted((e for e in range(1, n + 1) if n % e == 0
                          and mcfg.num_experts % e == 0), reverse=True):
        fsdp = n // expert
        if (fsdp, expert) == (m.fsdp * m.data, m.expert):
            continue
        mesh = dataclasses.replace(m, data=1, fsdp=fsdp, expert=expert)
        out.append(([*changes, f"train.mesh={{fsdp: {fsdp}, expert: {expert}, "
                                f"tensor: {m.tensor}}}"],
                    dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, mesh=mesh))))
    return out


def _first_that_fits(cfg, mcfg, compile_train, hbm: float, say) -> list[str] | None:
    """The ``--set`` lines of the first alternative (:func:`_alternatives`) whose step
    fits ``hbm`` bytes, or None."""
    for changes, alt in _alternatives(cfg, mcfg):
        try:
            mem, _ = compile_train(alt)
        except DoesNotFit:
            continue
        except ValueError as e:  # e.g. a split whose batch holds no whole group
            say(f"  {changes[-1]}: {e}")
            continue
        if mem.peak <= hbm:
            say("fits with: " + " ".join(f"--set '{c}'" for c in changes))
            return changes
    say("no alternative tried fits")
    return None


def _sampler(cfg, mcfg, devices, hbm: float, say) -> dict[str, Any]:
    """The built-in sampler on the trainer's mesh, as eval runs it: ``eval.num_prompts x
    eval.k`` rows (rounded up to the data-parallel size) of ``task.max_prompt_tokens``,
    ``rollout.max_new_tokens`` generated, in ``rollout.sample_dtype``."""
    import jax
    from flax import nnx

    from satjax import parallel
    from satjax.app.factory import model_options
    from satjax.app.memory import StepMemory
    from satjax.model import DTYPES, Qwen3MoeForCausalLM
    from satjax.model.sampling import compile_sampler

    mesh = parallel.make_mesh(cfg.train.mesh, devices)
    dp = parallel.data_parallel_size(mesh)
    rows = -(-cfg.eval.num_prompts * cfg.eval.k // dp) * dp
    prompt = -(-cfg.task.max_prompt_tokens // 16) * 16
    model = nnx.eval_shape(lambda: Qwen3MoeForCausalLM(mcfg, rngs=nnx.Rngs(0),
                                                       **model_options(cfg)))
    graphdef, state = nnx.split(model)
    shardings = parallel.state_shardings(state, mesh)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         state, shardings)
    model = nnx.merge(graphdef, state)
    batch = jax.sharding.NamedSharding(mesh, parallel.logical_to_spec(
        ("batch", None), (rows, prompt), mesh))
    t0 = time.perf_counter()
    say(f"compiling the sampler: {rows} rows x {prompt} prompt tokens + "
        f"{cfg.rollout.max_new_tokens} generated ...")
    with jax.set_mesh(mesh):
        prefill, decode = compile_sampler(
            model, rows, prompt, max_new_tokens=cfg.rollout.max_new_tokens,
            dtype=DTYPES[cfg.rollout.sample_dtype],
            record_logits=cfg.rollout.record_router_logits, batch_sharding=batch)
    out = {}
    for name, compiled in (("eval_forward", prefill), ("decode", decode)):
        mem = StepMemory.of(compiled)
        out[name] = {"peak_gib": mem.peak / GIB, "temporaries_gib": mem.temporaries / GIB,
                     "fits": mem.peak <= hbm}
        say(f"  {name.replace('_', ' ')}: peak {mem.peak / GIB:.2f} GiB per chip "
            f"(temporaries {mem.temporaries / GIB:.2f}): "
            + ("fits" if mem.peak <= hbm else "DOES NOT FIT"))
    say(f"  compiled in {time.perf_counter() - t0:.0f} s")
    return out


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.2f} GiB"


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"
