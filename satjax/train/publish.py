"""Sharded weight publishing off the critical path: every process writes what it owns.

A version is the per-expert Hugging Face layout (``model-0000i-of-0000N.safetensors`` and
``model.safetensors.index.json``, what vLLM and ``from_pretrained`` read), written into a
staging directory of the shared weights directory and renamed into place once complete
(:class:`satjax.weight_sync.WeightPublisher`).

Who writes what (:func:`plan_publish`, computed once from the global shardings, the same
on every process, so the index needs no communication): each HF tensor is a whole
parameter or one expert of a stacked ``[E, ...]`` parameter. It goes to a process whose
addressable shards hold all of it (a replica under data parallelism, its experts under
expert parallelism), the least loaded one in bytes. A tensor no process holds whole
(``fsdp`` or ``tensor`` split across processes) is first resharded by one jitted
collective: stacked experts to whole experts per device (an all-to-all, each process
receives only its experts), other tensors replicated. No process gathers the model.

Overlap (:class:`ShardedPublisher`): ``publish`` only dispatches jitted work, on every
process in the same order: a device copy of the parameters in HF layout and the published
dtype (transposes done by XLA; a copy, so the next step may donate the state), the
reshard above if any, and the canary forward; then it returns. A background thread copies
this process's pieces to host memory (into buffers of an earlier publish) and writes its
files, ``WRITE_THREADS`` at a time, fsynced. Other processes then drop a ``.done-<p>``
marker into the staging directory (``.failed-<p>`` with the error if they failed);
process 0 waits for all of them, writes ``config.json``, the index and the manifest
(with the canary) and renames.
The background part uses the file system only, never a JAX collective, so it cannot
interleave with the train step's collectives. The next ``publish`` (and ``wait``) first
joins the previous one and raises its error.

Deltas (:mod:`satjax.weight_sync`): every ``keyframe_every``-th version is full, the
others are deltas of the version before. Each process keeps the host copy of its tensors
from the previous publish and writes, per file of the plan, the zstd-compressed XOR of
each changed tensor against it (:func:`write_process_deltas`); who writes what is the
same plan. Process 0 writes the manifest (kind, base), after checking that every process
wrote against the same base.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from satjax.config import TrainConfig
from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM, token_logprobs
from satjax.model.hf_io import (
    HFTensor,
    hf_config,
    hf_layout,
    hf_tensors,
    model_params,
    shard_file_name,
    write_index,
    write_model_files,
    write_safetensors,
)
from satjax.utils import atomic_write
from satjax.weight_sync import (
    WeightPublisher,
    WeightSyncError,
    crc32_digest,
    delta_file_name,
    encode_delta,
)

log = logging.getLogger(__name__)

WRITE_THREADS = 4  # files one process writes at once (conversion of one overlaps another's I/O)
FILE_BYTES = 1 << 30  # a process splits its tensors into files of at most this size
# How long process 0 waits for the other processes' files once its own are written (they
# write equal shares at the same time); also bounds how long a dead peer holds its exit.
PEER_TIMEOUT_S = 120.0

Region = tuple[tuple[int, int], ...]  # [start, stop) per dimension


@dataclasses.dataclass(frozen=True)
class PublishPlan:
    """Which process writes which HF tensor, and into which file.

    ``files``: (file name, writing process, tensor names) in index order; ``shapes``: HF
    shape and dtype of every tensor; ``reshard``: parameter paths no process holds whole,
    resharded (:func:`writable_sharding`) before every snapshot.
    """

    tensors: tuple[HFTensor, ...]
    owner: dict[str, int]
    files: tuple[tuple[str, int, tuple[str, ...]], ...]
    shapes: dict[str, tuple[tuple[int, ...], np.dtype]]
    reshard: tuple[tuple, ...]

    @property
    def weight_map(self) -> dict[str, str]:
        return {name: fname for fname, _, names in self.files for name in names}

    @property
    def total_bytes(self) -> int:
        return sum(math.prod(s) * d.itemsize for s, d in self.shapes.values())

    def bytes_of(self, process: int) -> int:
        return sum(math.prod(self.shapes[n][0]) * self.shapes[n][1].itemsize
                   for n, p in self.owner.items() if p == process)


def _region(t: HFTensor, shape: tuple[int, ...]) -> Region:
    whole = tuple((0, n) for n in shape)
    return whole if t.expert is None else ((t.expert, t.expert + 1), *whole[1:])


def _boxes_by_process(sharding: jax.sharding.Sharding, shape: tuple[int, ...]
                      ) -> dict[int, set[Region]]:
    """The distinct index boxes of an array's shards on each process."""
    out: dict[int, set[Region]] = {}
    for dev, index in sharding.devices_indices_map(shape).items():
        # jax's Device aliases a jaxlib class that mypy cannot see into
        out.setdefault(dev.process_index, set()).add(_box(index, shape))  # type: ignore[attr-defined]
    return out


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Region:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def _overlap(a: Region, b: Region) -> int:
    return math.prod(max(0, min(a1, b1) - max(a0, b0))
                     for (a0, a1), (b0, b1) in zip(a, b, strict=True))


def _covering(boxes: dict[int, set[Region]], region: Region) -> list[int]:
    """Processes whose boxes cover ``region`` entirely. Shards of a ``NamedSharding`` are
    equal or disjoint, so the overlaps of a process's distinct boxes add up."""
    need = math.prod(b - a for a, b in region)
    return [p for p, bs in sorted(boxes.items()) if sum(_overlap(b, region) for b in bs) == need]


def writable_sharding(x: jax.Array, mesh: Mesh, stacked_experts: bool) -> NamedSharding:
    """A sharding of ``x`` under which every HF tensor of it is whole on some process:
    stacked experts split over their leading dim only (over as many mesh axes as divide
    it), anything else replicated."""
    axes: list[str] = []
    if stacked_experts:
        for name, size in mesh.shape.items():
            if size > 1 and x.shape[0] % (math.prod(mesh.shape[a] for a in axes) * size) == 0:
                axes.append(name)
    return NamedSharding(mesh, PartitionSpec(tuple(axes) or None))


def plan_publish(params: dict[tuple, jax.Array], tensors: list[HFTensor], *,
                 mesh: Mesh, process_count: int, file_bytes: int = FILE_BYTES,
                 min_files: int = WRITE_THREADS) -> PublishPlan:
    """Assigns every tensor an owner process and a file (see the module docstring).

    ``params`` are the global arrays in HF layout (:func:`satjax.model.hf_io.hf_layout`;
    every process passes the same shapes and shardings and gets the same plan); expert j
    of a stacked parameter is ``params[path][j]``. A tensor goes to the least loaded (in
    bytes) process that holds it whole. Each process's tensors, in checkpoint order, are split into
    ``max(min_files, ceil(bytes / file_bytes))`` files of about equal size.
    """
    boxes = {p: _boxes_by_process(x.sharding, x.shape) for p, x in params.items()}
    reshard = sorted({t.path for t in tensors
                      if not _covering(boxes[t.path], _region(t, params[t.path].shape))},
                     key=str)
    stacked = {t.path for t in tensors if t.expert is not None}
    for path in reshard:
        x = params[path]
        boxes[path] = _boxes_by_process(writable_sharding(x, mesh, path in stacked), x.shape)
    load = [0] * process_count
    owner: dict[str, int] = {}
    shapes: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    for t in tensors:
        x = params[t.path]
        piece = tuple(x.shape if t.expert is None else x.shape[1:])
        shapes[t.name] = (piece, np.dtype(x.dtype))
        p = min(_covering(boxes[t.path], _region(t, x.shape)), key=lambda q: (load[q], q))
        owner[t.name] = p
        load[p] += math.prod(piece) * np.dtype(x.dtype).itemsize
    per_process: list[list[list[str]]] = []
    for p in range(process_count):
        names = [t.name for t in tensors if owner[t.name] == p]
        nfiles = min(len(names), max(min_files, math.ceil(load[p] / file_bytes)))
        chunks: list[list[str]] = [[] for _ in range(nfiles)]
        done = 0
        for n in names:  # contiguous runs of about load[p] / nfiles bytes each
            chunks[min(nfiles - 1, done * nfiles // max(1, load[p]))].append(n)
            done += math.prod(shapes[n][0]) * shapes[n][1].itemsize
        per_process.append([c for c in chunks if c])
    total = sum(len(c) for c in per_process)
    files, k = [], 0
    for p, chunks in enumerate(per_process):
        for c in chunks:
            k += 1
            files.append((shard_file_name(k, total), p, tuple(c)))
    return PublishPlan(tuple(tensors), owner, tuple(files), shapes, tuple(reshard))


def snapshot(params: dict[tuple, jax.Array], plan: PublishPlan, process: int,
             out: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Host copies of the tensors ``process`` writes, assembled from its addressable shards
    of the HF-layout ``params``, into the arrays of ``out`` where given (the previous
    snapshot's: refilling them skips the page faults of fresh memory, about as costly as
    the copy itself)."""
    out = {} if out is None else out
    path = None
    shards: list[tuple[Region, jax.Array | np.ndarray]] = []
    for t in plan.tensors:
        if plan.owner[t.name] != process:
            continue
        x = params[t.path]
        if t.path != path:  # one device -> host transfer per shard, not per expert
            path, seen, shards = t.path, set(), []
            for shard in x.addressable_shards:
                box = _box(shard.index, x.shape)
                if box not in seen:
                    seen.add(box)
                    shards.append((box, shard.data))
        region = _region(t, x.shape)
        buf = out.get(t.name)
        if buf is None:
            buf = np.empty(plan.shapes[t.name][0], x.dtype)
        piece = buf if t.expert is None else buf[None]  # indexed like ``region``
        for i, (box, data) in enumerate(shards):
            if not _overlap(box, region):
                continue
            if not isinstance(data, np.ndarray):
                data = np.asarray(data)
                shards[i] = (box, data)
            # the intersection, in the shard's and in the piece's coordinates
            both = [(max(a0, b0), min(a1, b1), a0, b0)
                    for (a0, a1), (b0, b1) in zip(box, region, strict=True)]
            piece[tuple(slice(lo - b0, hi - b0) for lo, hi, _, b0 in both)] = \
                data[tuple(slice(lo - a0, hi - a0) for lo, hi, a0, _ in both)]
        out[t.name] = buf
    return out


def write_process_files(staging: Path, plan: PublishPlan, host: dict[str, np.ndarray],
                        process: int, *, threads: int = WRITE_THREADS) -> dict[str, str]:
    """Writes (fsynced) the files ``process`` owns into ``staging``; returns their names
    with their digests (:func:`~satjax.weight_sync.file_digest`)."""
    mine = [(fname, names) for fname, p, names in plan.files if p == process]

    def write(job: tuple[str, tuple[str, ...]]) -> tuple[str, str]:
        fname, names = job
        # mypy cannot infer a lambda with a default argument for a Callable[[], ...]
        crc = write_safetensors(str(staging / fname), [
            (n, plan.shapes[n][1], plan.shapes[n][0], lambda n=n: host[n])  # type: ignore[misc]
            for n in names])
        return fname, crc32_digest(crc)

    with ThreadPoolExecutor(max(1, min(threads, len(mine)))) as pool:
        return dict(pool.map(write, mine))


def write_process_deltas(staging: Path, plan: PublishPlan, host: dict[str, np.ndarray],
                         prev: dict[str, np.ndarray], process: int, *,
                         threads: int = WRITE_THREADS) -> dict[str, str]:
    """Writes (fsynced) the delta files of the tensors ``process`` owns into ``staging``;
    returns their names with their digests. For each file of the plan,
    :func:`~satjax.weight_sync.delta_file_name` of it holds, for every tensor of that file
    whose bytes changed from ``prev`` to ``host``, :func:`~satjax.weight_sync.encode_delta`
    as a ``uint8`` tensor of the same name (a file may hold none)."""
    mine = [(delta_file_name(fname), names) for fname, p, names in plan.files if p == process]

    def write(job: tuple[str, tuple[str, ...]]) -> tuple[str, str]:
        fname, names = job
        deltas = [(n, encode_delta(host[n], prev[n])) for n in names]
        # mypy cannot infer a lambda with a default argument for a Callable[[], ...]
        crc = write_safetensors(str(staging / fname), [
            (n, np.dtype(np.uint8), (len(d),), lambda d=d: np.frombuffer(d, np.uint8))  # type: ignore[misc]
            for n, d in deltas if d is not None])
        return fname, crc32_digest(crc)

    with ThreadPoolExecutor(max(1, min(threads, len(mine)))) as pool:
        return dict(pool.map(write, mine))


def _marker(staging: Path, kind: str, process: int) -> Path:
    return staging / f".{kind}-{process}"


def wait_for_peers(staging: Path, process_count: int, timeout: float = PEER_TIMEOUT_S, *,
                   base: int | None = None) -> dict[str, str]:
    """Process 0: blocks until every other process marked its files done in ``staging``;
    returns the digests of their files. Raises :class:`WeightSyncError` if one failed,
    wrote against another ``base`` (a delta of that version; None: full files) or
    ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    waiting = set(range(1, process_count))
    digests: dict[str, str] = {}
    while waiting:
        for p in sorted(waiting):
            failed = _marker(staging, "failed", p)
            if failed.exists():
                raise WeightSyncError(f"process {p} failed to write its weight files: "
                                      f"{failed.read_text()}")
            done = _marker(staging, "done", p)
            if done.exists():
                marker = json.loads(done.read_text())
                theirs = marker["base"]
                if theirs != base:
                    raise WeightSyncError(
                        f"process {p} wrote {_what(theirs)}, process 0 {_what(base)}")
                digests.update(marker["files"])
                waiting.discard(p)
        if waiting and time.monotonic() > deadline:
            raise WeightSyncError(f"processes {sorted(waiting)} did not write their weight "
                                  f"files into {staging} within {timeout:.0f}s")
        if waiting:
            time.sleep(0.02)
    for p in range(1, process_count):
        _marker(staging, "done", p).unlink()
    return digests


def _what(base: int | None) -> str:
    return "full files" if base is None else f"a delta of version {base}"


@dataclasses.dataclass(frozen=True)
class _Compiled:
    """What the first publish sets up for the model's shapes and shardings: the plan, the
    model config (config.json) and the jitted HF-layout copy, reshard and canary forward."""

    plan: PublishPlan
    config: Qwen3MoeConfig
    convert: Callable
    reshard: Callable
    canary: Callable


class ShardedPublisher:
    """Publishes versions of a sharded model from every process, in the background.

    Args:
      publisher: the weights directory (process 0 renames and moves the pointers).
      mesh: the trainer's mesh (the canary forward is replicated over it).
      canary_tokens: the fixed sequence whose log-probs go into every manifest.
      keyframe_every: every how many versions one is full (``train.keyframe_every``); the
        others are deltas of the version before. 1: every version full. The first publish,
        and the first after a failed one, is full.
      dtype: the dtype versions are published in (``model.dtype``: what the policy
        computes in); None: the parameters' own. The canary is computed from the
        parameters rounded to it, as the workers get them.
      tokenizer: the run's tokenizer; a Hugging Face one's files go into every full
        version with generation_config.json, so a full version directory is a complete
        HF model (``AutoModelForCausalLM``/``AutoTokenizer.from_pretrained``).
    """

    def __init__(self, publisher: WeightPublisher, mesh: Mesh, canary_tokens: list[int], *,
                 keyframe_every: int = TrainConfig().keyframe_every,
                 dtype: str | None = None, tokenizer=None) -> None:
        if keyframe_every < 1:
            raise ValueError(f"keyframe_every: must be >= 1, got {keyframe_every}")
        self.publisher = publisher
        self.mesh = mesh
        self.canary_tokens = list(canary_tokens)
        self.keyframe_every = keyframe_every
        self.tokenizer = tokenizer
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        self.process = jax.process_index()
        self.process_count = jax.process_count()
        nonce = np.random.default_rng().integers(0, 2**62, dtype=np.int64)
        if self.process_count > 1:  # one staging directory name per version on all processes
            nonce = multihost_utils.broadcast_one_to_all(nonce)
        self._nonce = f"{int(nonce):x}"
        self._count = 0
        self._compiled: _Compiled | None = None  # by the first publish()
        self._thread: threading.Thread | None = None
        # host copies of this process's tensors: ``_prev`` of the last version written (the
        # base of the next delta), ``_next`` an older set the next publish refills (with
        # keyframe_every 1 one set, refilled each time)
        self._prev: dict[str, np.ndarray] | None = None
        self._next: dict[str, np.ndarray] | None = None
        self._last: int | None = None  # the version in _prev, if it was written
        self._deltas = 0  # versions since the last full one
        self._error: tuple[int, BaseException] | None = None
        self.last_seconds: float | None = None  # the background part of the last publish
        self.last_files: list[str] = []  # the files this process wrote in the last publish

    @property
    def plan(self) -> PublishPlan | None:
        """Who writes what (None before the first publish)."""
        return None if self._compiled is None else self._compiled.plan

    def _compile(self, model: Qwen3MoeForCausalLM) -> _Compiled:
        tensors = hf_tensors(model.config)
        dtype = self.dtype

        def convert(params):  # copies even where to_hf is the identity (see publish)
            return {p: jnp.copy(x) if dtype is None or x.dtype == dtype else x.astype(dtype)
                    for p, x in hf_layout(tensors, params).items()}

        convert_fn = jax.jit(convert)
        # the plan follows the shardings XLA gives the HF-layout arrays (the same program,
        # so the same shardings, on every process)
        hf = convert_fn(model_params(model))
        plan = plan_publish(hf, tensors, mesh=self.mesh, process_count=self.process_count)
        stacked = {t.path for t in tensors if t.expert is not None}
        out = {p: writable_sharding(hf[p], self.mesh, p in stacked) for p in plan.reshard}
        # the canary runs in float32 whatever the compute dtype, as every engine's does: it
        # checks the weights, not the numerics
        graphdef = nnx.graphdef(model.with_dtype(jnp.float32))
        tokens = np.asarray([self.canary_tokens], np.int32)

        def canary(state):  # float32 log-probs of tokens[1:], like model.canary_logprobs
            if dtype is not None:  # of the weights as published
                state = jax.tree.map(
                    lambda x: x.astype(dtype).astype(x.dtype)
                    if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
            lp, _ = token_logprobs(nnx.merge(graphdef, state), jnp.asarray(tokens))
            return lp[0, 1:]

        return _Compiled(
            plan=plan, config=model.config, convert=convert_fn,
            reshard=jax.jit(lambda xs: xs, out_shardings=out),
            canary=jax.jit(canary, out_shardings=NamedSharding(self.mesh, PartitionSpec())))

    def publish(self, model: Qwen3MoeForCausalLM, version: int, *,
                target_version: int | None = None) -> None:
        """Starts publishing ``model`` as ``version`` and returns at once (after the
        previous publish finished). Every process calls it, in the same order: it
        dispatches jitted collectives (the HF-layout copy, a reshard for tensors no process
        holds whole, the canary forward), never waiting for them. The version is a delta
        of the previous one unless a full one is due (``keyframe_every``) or the previous
        publish failed."""
        self.wait()
        if self._compiled is None:
            self._compiled = self._compile(model)
        c = self._compiled
        # a device copy in HF layout: the next step may donate the state's buffers
        hf = c.convert(model_params(model))
        if c.plan.reshard:
            hf = {**hf, **c.reshard({p: hf[p] for p in c.plan.reshard})}
        with jax.set_mesh(self.mesh):
            canary = c.canary(nnx.state(model))
        self._count += 1
        # the same decision on every process: they see the same calls and, but for a
        # failure (which process 0 then detects in wait_for_peers), the same outcomes
        base = self._last if (self._last is not None and self._last < version
                              and self._deltas + 1 < self.keyframe_every) else None
        staging = self.publisher.staging_dir(version, f"{self._nonce}-{self._count}")
        staging.mkdir(exist_ok=True)
        self._thread = threading.Thread(
            target=self._run, args=(c, version, staging, [hf], canary, target_version, base),
            name=f"publish-v{version}", daemon=False)  # interpreter exit waits for it
        self.last_files = []
        self._thread.start()

    def _run(self, c: _Compiled, version: int, staging: Path,
             hf: list[dict[tuple, jax.Array]], canary: jax.Array,
             target_version: int | None, base: int | None) -> None:
        t0 = time.perf_counter()
        self._last = None  # until this version is written
        try:
            # device -> host (waits for the copy); the device copy is dropped right away
            host = snapshot(hf.pop(), c.plan, self.process, out=self._next)
            prev = self._prev
            if self.keyframe_every > 1:
                self._next, self._prev = prev, host
            else:
                self._next = host
            if self.process == 0:
                self._commit(c, version, staging, host, prev, canary, target_version, base)
            else:
                try:
                    digests = self._write(staging, c.plan, host, prev, base)
                except BaseException as e:
                    atomic_write(_marker(staging, "failed", self.process), repr(e))
                    raise
                self.last_files = list(digests)
                atomic_write(_marker(staging, "done", self.process),
                             json.dumps({"files": digests, "base": base}))
            self._last = version
            self._deltas = 0 if base is None else self._deltas + 1
        except BaseException as e:  # surfaces on the next publish() / wait()
            log.error("publishing version %d failed: %r", version, e)
            self._error = (version, e)
        self.last_seconds = time.perf_counter() - t0

    def _write(self, staging: Path, plan: PublishPlan, host: dict[str, np.ndarray],
               prev: dict[str, np.ndarray] | None, base: int | None) -> dict[str, str]:
        """This process's files (with their digests): full, or its deltas against ``prev``
        (``base``'s)."""
        if base is None:
            return write_process_files(staging, plan, host, self.process)
        assert prev is not None, "a delta needs the previous version's host copy"
        return write_process_deltas(staging, plan, host, prev, self.process)

    def _commit(self, c: _Compiled, version: int, staging: Path, host: dict[str, np.ndarray],
                prev: dict[str, np.ndarray] | None, canary: jax.Array,
                target_version: int | None, base: int | None) -> None:
        plan = c.plan
        # from a timeline a crash discarded, or this very version
        self.publisher.discard_from(version)
        dtypes = {d for _, d in plan.shapes.values()}
        dtype = dtypes.pop() if len(dtypes) == 1 else np.dtype(np.float32)

        def write(d: Path) -> dict[str, str]:
            digests = self._write(d, plan, host, prev, base)
            self.last_files = list(digests)
            digests.update(wait_for_peers(d, self.process_count, base=base))
            if base is None:  # a full version is a complete HF checkpoint
                atomic_write(d / "config.json", json.dumps(
                    hf_config(c.config, dtype), indent=2, sort_keys=True))
                write_index(str(d), plan.weight_map, plan.total_bytes)
                # generation config and tokenizer: a version directory loads as it is
                write_model_files(d, c.config, self.tokenizer)
            return digests  # the small files are hashed by the publisher

        self.publisher.publish(
            version, write, staging=staging, target_version=target_version, base=base,
            canary={"tokens": self.canary_tokens,
                    "logprobs": np.asarray(canary, np.float32).tolist()})

    def wait(self) -> None:
        """Blocks until the publish in flight (if any) is done; raises
        :class:`WeightSyncError` if it failed (once: the next call starts afresh)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            version, e = self._error
            self._error = None
            raise WeightSyncError(f"publishing weights version {version} failed: {e!r}") from e
