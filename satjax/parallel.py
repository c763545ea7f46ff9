"""Device mesh, logical-axis rules and shardings for the trainer.

The mesh has four named axes (``MESH_AXES``):

- ``data``   plain data parallelism (replicated parameters);
- ``fsdp``   data parallelism with parameters sharded over their ``embed`` dimension;
- ``expert`` expert parallelism: MoE expert weights sharded over their ``experts``
  dimension, the batch sharded over it too so no device idles;
- ``tensor`` tensor parallelism over heads / MLP / vocabulary.

Model parameters carry *logical* axis names in their Flax NNX ``out_sharding`` metadata.
``LOGICAL_RULES`` maps each logical name to mesh axes. A dimension
whose size is not divisible by the mesh axes it maps to drops axes from the end of its
rule until it is (down to full replication), so odd shapes never crash sharding.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from satjax.config import MESH_AXES, MeshConfig  # re-exported: the schema lives in the config

log = logging.getLogger(__name__)

__all__ = [
    "LOGICAL_RULES",
    "MESH_AXES",
    "MeshConfig",
    "batch_sharding",
    "constrain",
    "data_parallel_size",
    "gpu_target_config",
    "init_distributed",
    "logical_to_spec",
    "make_mesh",
    "parse_topology",
    "state_shardings",
    "target_platform",
    "topology_devices",
]

LogicalRules = tuple[tuple[str, tuple[str, ...]], ...]

# logical name -> mesh axes it is sharded over (in order of preference; empty = replicated)
LOGICAL_RULES: LogicalRules = (
    ("batch", ("data", "fsdp", "expert")),
    ("length", ()),
    ("vocab", ("tensor",)),
    ("embed", ("fsdp",)),
    ("q_heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("head_dim", ()),
    ("mlp", ("tensor",)),
    ("experts", ("expert",)),
    ("expert_mlp", ("tensor",)),
)


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds a ``Mesh`` with axes ("data", "fsdp", "expert", "tensor").

    Axes are ``Auto`` (GSPMD propagates shardings), so model code needs no explicit
    sharding annotations.
    """
    if devices is None:
        devices = jax.devices()
    devices = list(devices)
    cfg.validate(len(devices))
    try:  # topology-aware device order on TPU/GPU; falls back to the given order
        grid = mesh_utils.create_device_mesh(cfg.shape, devices=devices)
    except Exception:  # noqa: BLE001 - any failure just means "use the plain order"
        grid = np.asarray(devices, dtype=object).reshape(cfg.shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


# TPU generations as JAX's topology names spell them (``v5p:4x4x4``: chips along each
# torus axis), with libtpu's per-generation options: v4's two TensorCores per chip are one
# JAX device ("megacore"), as on a v4 VM.
TPU_TOPOLOGY_OPTIONS: dict[str, dict[str, str]] = {
    "v4": {"chip_config_name": "megacore"}, "v5e": {}, "v5p": {}, "v6e": {}}


# GPUs as ``satjax plan --topology`` names them (``h100:N``: N GPUs, hosts of 8 beyond 8):
# the XLA:GPU target config (package data: satjax/gpu_targets) the compiler builds for.
GPU_TARGET_CONFIGS: dict[str, str] = {"h100": "h100_sxm.txtpb"}
GPUS_PER_HOST = 8
# what a deviceless XLA:GPU compile needs: JAX's CUDA plugin and, for its cuDNN attention
# lowering, libcudnn
GPU_PLAN_INSTALL = "pip install 'satjax[gpu-plan]'"


def parse_topology(topology: str) -> tuple[str, tuple[int, ...]]:
    """``"v5p:4x4x4"`` -> ``("v5p", (4, 4, 4))``: the generation and the chips along each
    axis; ``"h100:64"`` -> ``("h100", (64,))``: 64 GPUs. Raises ValueError (one line) for
    anything else, a GPU count above 8 that is not whole hosts of 8 included."""
    gen, _, shape = topology.partition(":")
    if gen in GPU_TARGET_CONFIGS:
        n = int(shape) if shape.isdigit() else 0
        if n < 1 or (n > GPUS_PER_HOST and n % GPUS_PER_HOST):
            raise ValueError(f"topology {topology!r}: expected {gen}:N with N <= "
                             f"{GPUS_PER_HOST} GPUs (one host) or a multiple of "
                             f"{GPUS_PER_HOST} (hosts of {GPUS_PER_HOST}), e.g. {gen}:64")
        return gen, (n,)
    dims = shape.split("x")
    if gen not in TPU_TOPOLOGY_OPTIONS or not all(d.isdigit() and int(d) > 0 for d in dims):
        raise ValueError(f"topology {topology!r}: expected GENERATION:AxB[xC] with a "
                         f"generation of {', '.join(TPU_TOPOLOGY_OPTIONS)}, e.g. v5p:4x4x4")
    return gen, tuple(int(d) for d in dims)


def gpu_target_config(gen: str) -> str:
    """The packaged XLA:GPU target config (text ``stream_executor.GpuTargetConfigProto``) of
    a GPU generation of :data:`GPU_TARGET_CONFIGS`."""
    return (importlib.resources.files("satjax") / "gpu_targets"
            / GPU_TARGET_CONFIGS[gen]).read_text(encoding="utf-8")


def topology_devices(topology: str, target_config: str | None = None) -> list[jax.Device]:
    """The devices of a named TPU slice (``"v5p:4x4x4"``, ``"v5e:2x2"``, ``"v6e:8x8"``,
    ``"v4:2x2x1"``) or GPU cluster (``"h100:8"``, ``"h100:64"``: 8 hosts of 8): one per
    chip, for an ahead-of-time compile on any host, no accelerator needed, by the TPU
    compiler (libtpu, the ``tpu`` extra) or XLA:GPU (the CUDA plugin and cuDNN, the
    ``gpu-plan`` extra; ``target_config``: another GPU's text
    ``stream_executor.GpuTargetConfigProto`` instead of the packaged one);
    ``jax.experimental.topologies``. :func:`make_mesh` builds a mesh over them; arrays
    cannot be placed on them.

    Raises ValueError (one line) for an unknown generation or shape, or without the
    compiler.
    """
    from jax.experimental import topologies

    gen, dims = parse_topology(topology)
    if gen in GPU_TARGET_CONFIGS:
        (n,) = dims
        if importlib.util.find_spec("jax_cuda12_plugin") is None:
            raise ValueError(f"topology {topology!r}: needs the XLA:GPU compiler (JAX's CUDA "
                             f"plugin): {GPU_PLAN_INSTALL}")
        platform = "cuda"
        # "<partitions>x<hosts>x<devices per host>" (XLA's TopologySizes)
        hosts = max(n // GPUS_PER_HOST, 1)
        kwargs = {"target_config": target_config or gpu_target_config(gen),
                  "topology": f"1x{hosts}x{n // hosts}"}
    else:
        if importlib.util.find_spec("libtpu") is None:
            raise ValueError(f"topology {topology!r}: needs the TPU compiler (libtpu): "
                             f"pip install 'satjax[tpu]'")
        platform = "tpu"
        kwargs = {"topology_name": topology, **TPU_TOPOLOGY_OPTIONS[gen]}
    try:
        desc = topologies.get_topology_desc(platform=platform, **kwargs)
    except Exception as e:  # noqa: BLE001 - the compilers' errors are many lines; keep one
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"topology {topology!r}: {first}") from None
    return list(desc.devices)


def target_platform() -> str:
    """The platform the program being traced compiles for: the current mesh's devices'
    (``jax.set_mesh``; a TPU topology's when compiling for one from a CPU host), else JAX's
    default backend. Backend-dependent choices ("auto" attention and MoE dispatch) ask
    this, so an ahead-of-time compile for other chips makes their choices."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh is None or mesh.empty else mesh.abstract_device
    return device.platform if device is not None else jax.default_backend()


def _rule_table(rules: LogicalRules) -> dict[str, tuple[str, ...]]:
    table: dict[str, tuple[str, ...]] = {}
    for name, axes in rules:
        table[name] = (axes,) if isinstance(axes, str) else tuple(axes)
    return table


def logical_to_spec(
    names: Sequence[str | None] | None,
    shape: Sequence[int],
    mesh: Mesh | AbstractMesh,
    rules: LogicalRules = LOGICAL_RULES,
) -> PartitionSpec:
    """PartitionSpec for an array of ``shape`` whose dims have logical ``names``.

    Per dim: take the rule's mesh axes, skip size-1 axes, axes the mesh lacks and axes
    already used by an earlier dim, then drop axes from the end until the dim size is
    divisible by their product (replicating the dim if none fit). Unknown logical names
    raise ValueError.
    """
    if not names:
        return PartitionSpec()
    if len(names) != len(shape):
        raise ValueError(f"names {tuple(names)} do not match shape {tuple(shape)} in rank")
    table = _rule_table(rules)
    used: set[str] = set()
    spec: list[Any] = []
    for name, size in zip(names, shape, strict=True):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ValueError(f"unknown logical axis name {name!r}; known: {sorted(table)}")
        wanted = [a for a in table[name] if mesh.shape.get(a, 1) > 1 and a not in used]
        axes = list(wanted)
        while axes and size % math.prod(mesh.shape[a] for a in axes) != 0:
            axes.pop()
        if axes != wanted:
            log.debug("dim %r of size %d: %s not divisible, using %s", name, size, wanted, axes)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def constrain(x: jax.Array, names: Sequence[str | None],
              rules: LogicalRules = LOGICAL_RULES) -> jax.Array:
    """``with_sharding_constraint`` of an activation by logical names under the current mesh
    (``jax.set_mesh``); the identity without one, so model code runs unsharded unchanged.

    Pinning activations at layer boundaries keeps GSPMD from propagating a parameter's
    layout into the batch (which forces full rematerialisations of whole activations).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, mesh, rules))


def _logical_names(var: nnx.Variable) -> tuple[str | None, ...] | None:
    meta = var.get_metadata()
    names = meta.get("out_sharding")
    if names is None:
        return None
    if isinstance(names, PartitionSpec):
        names = tuple(names)
    return tuple(names)


def state_shardings(tree: Any, mesh: Mesh, rules: LogicalRules = LOGICAL_RULES) -> Any:
    """NamedShardings for every array in an NNX State / Module (params, optimizer state, ...).

    Returns a tree of the same structure as ``nnx.state(tree)`` (Variables keep their
    metadata, their value becomes a ``NamedSharding``) usable as ``jax.jit`` in/out
    shardings. Variables without logical names, and plain arrays, are replicated.
    """
    if isinstance(tree, nnx.Module | nnx.Pytree):
        tree = nnx.state(tree)

    def one(x: Any) -> Any:
        if isinstance(x, nnx.Variable):
            value = x.get_value()
            names = _logical_names(x)
            shape = getattr(value, "shape", ())
            if names is not None and len(names) != len(shape):
                names = None  # e.g. a scalar optimizer count that inherited metadata
            return x.replace(NamedSharding(mesh, logical_to_spec(names, shape, mesh, rules)))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, batch: Any, rules: LogicalRules = LOGICAL_RULES) -> Any:
    """NamedShardings for a batch pytree: leading dim over the batch axes, rest replicated.

    ``batch`` may be a ``satjax.train.Batch``, a dict, or any pytree of arrays; an array
    whose batch size does not divide the batch axes falls back to fewer axes / replication.
    """

    def one(x: Any) -> NamedSharding:
        shape = np.shape(x)
        if not shape:
            return NamedSharding(mesh, PartitionSpec())
        names = ("batch",) + (None,) * (len(shape) - 1)
        return NamedSharding(mesh, logical_to_spec(names, shape, mesh, rules))

    return jax.tree.map(one, batch)


def data_parallel_size(mesh: Mesh, rules: LogicalRules = LOGICAL_RULES) -> int:
    """How many ways the batch dimension is split (B should be a multiple of this)."""
    return math.prod(mesh.shape[a] for a in _rule_table(rules)["batch"])


# Environment fallbacks of ``satjax train --coordinator/--num-processes/--process-id``.
DISTRIBUTED_ENV = ("SATJAX_COORDINATOR", "SATJAX_NUM_PROCESSES", "SATJAX_PROCESS_ID")
# A process whose peer stopped heart-beating for this long aborts (jax.distributed's own
# failure detection): one dead host stops the whole job within seconds instead of leaving
# the others blocked in a collective. jax's default (100 s) is tuned for huge pods.
HEARTBEAT_TIMEOUT_S = 10


def init_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
    heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
    environ: dict[str, str] | None = None,
    initialize: Callable[..., None] | None = None,
) -> bool:
    """Joins this process to a multi-process JAX job; returns whether it is one.

    A thin wrapper around ``jax.distributed.initialize`` (the multi-controller runtime:
    every process runs the same program on its local devices of one global mesh).
    Arguments not given are read from ``SATJAX_COORDINATOR``, ``SATJAX_NUM_PROCESSES``
    and ``SATJAX_PROCESS_ID``. With none of them and ``auto``, JAX detects the cluster
    itself (TPU VM slices, SLURM, Open MPI). With none and not ``auto`` (or one process)
    nothing happens: a single-process run. On CPU the collectives go through gloo.

    Must run before anything touches a JAX device. See docs/parallel.md for launch
    recipes.
    """
    env = os.environ if environ is None else environ
    coord = coordinator_address or env.get(DISTRIBUTED_ENV[0]) or None
    n = num_processes if num_processes is not None else _env_int(env, DISTRIBUTED_ENV[1])
    pid = process_id if process_id is not None else _env_int(env, DISTRIBUTED_ENV[2])
    if n == 1 or (coord is None and n is None and pid is None and not auto):
        return False
    if coord is not None and (n is None or pid is None):
        raise ValueError("init_distributed: a coordinator needs the process count and this "
                         f"process's id, got num_processes={n!r}, process_id={pid!r}")
    if pid is not None and n is not None and not 0 <= pid < n:
        raise ValueError(f"process_id: must be in [0, {n}), got {pid!r}")
    init = initialize or jax.distributed.initialize
    if initialize is None:  # XLA:CPU has no cross-process collectives of its own
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs: dict[str, Any] = {"heartbeat_timeout_seconds": int(heartbeat_timeout_s)}
    if coord is not None:
        kwargs["coordinator_address"] = coord
    if n is not None:
        kwargs["num_processes"] = n
    if pid is not None:
        kwargs["process_id"] = pid
    init(**kwargs)
    log.info("jax.distributed initialised: process %d of %d, %d global devices",
             jax.process_index(), jax.process_count(), jax.device_count())
    return True


def _env_int(env: dict[str, str] | os._Environ, name: str) -> int | None:
    value = env.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: must be an integer, got {value!r}") from None
