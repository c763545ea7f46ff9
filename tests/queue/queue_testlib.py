"""Shared by the queue tests (through ``conftest.py`` fixtures) and ``producer.py``.

Holds the protobuf reference codec (``to_proto`` / ``from_proto``): the oracle that the
product's hand-written codec (``satjax.queue.codec``) is checked against. The product
never uses it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from satjax.queue._proto import pb2
from satjax.queue.codec import (
    GATE_DTYPES,
    LOGIT_DTYPES,
    LOGPROB_DTYPE,
    ROUTE_DTYPES,
    SCHEMA_VERSION,
    TOKEN_DTYPE,
    VERSION_DTYPE,
    route_dtype_name,
)
from satjax.trajectory import Trajectory

TOKEN = "test-token-0123456789"


def make_traj(tid: str, group: str, *, version: int = 0, group_size: int = 1, p: int = 6,
              n: int = 5, layers: int = 2, k: int = 2, experts: int = 8, seed: int = 0,
              routes: bool = True, logits: bool = False, gates: bool = False,
              versions: bool = False) -> Trajectory:
    """A valid trajectory with random content (routes rows = p + n - 1); ``gates``: with
    routed gates (normalised, float16); ``versions``: token versions from ``version`` up."""
    rng = np.random.default_rng(seed)
    rows = p + n - 1
    g = rng.random((rows, layers, k)) + 0.1
    return Trajectory(
        trajectory_id=tid, group_id=group, prompt_id="prompt-" + group,
        prompt_tokens=rng.integers(0, 1000, p, dtype=np.int32),
        response_tokens=rng.integers(0, 1000, n, dtype=np.int32),
        behavior_logprobs=-rng.random(n, dtype=np.float32) * 3,
        policy_version=version, reward=float(rng.normal()), group_size=group_size,
        routed_experts=(rng.integers(0, experts, (rows, layers, k), dtype=np.int32)
                        if routes else None),
        router_logits=(rng.normal(size=(rows, layers, experts)).astype(np.float16)
                       if logits else None),
        routed_gates=(g / g.sum(-1, keepdims=True)).astype(np.float16) if gates else None,
        token_versions=(version + np.arange(n, dtype=np.int32) // max(n // 2, 1)
                        if versions else None),
    )


def full_traj(experts: int) -> Trajectory:
    """Every field set to a non-default value (routes and logits for ``experts`` experts)."""
    t = make_traj("traj-ü", "group-1", version=17, group_size=4, p=9, n=13, layers=3, k=2,
                  experts=experts, seed=3, logits=True, gates=True, versions=True)
    return dataclasses.replace(
        t, reward=-0.625, reward_details={"format": 1.0, "correct": -0.5},
        finish_reason="stop", engine="vllm-0.11", created_unix=1.7e9 + 0.25,
        generation_seconds=3.5)


def assert_same(a: Trajectory, b: Trajectory) -> None:
    for f in dataclasses.fields(Trajectory):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert x is not None and y is not None, f.name
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f.name)
            assert np.asarray(y).shape == np.asarray(x).shape, f.name
        else:
            assert x == y, f.name


# -- the protobuf reference codec ---------------------------------------------------------
def to_proto(traj: Trajectory, *, num_experts: int | None = None) -> pb2.Trajectory:
    """``traj`` as a protobuf message, built field by field through the generated class."""
    if num_experts is None and traj.router_logits is not None:
        num_experts = int(np.shape(traj.router_logits)[-1])
    msg = pb2.Trajectory(
        schema_version=SCHEMA_VERSION,
        trajectory_id=traj.trajectory_id,
        group_id=traj.group_id,
        prompt_id=traj.prompt_id,
        group_size=int(traj.group_size),
        prompt_tokens=np.ascontiguousarray(traj.prompt_tokens, TOKEN_DTYPE).tobytes(),
        response_tokens=np.ascontiguousarray(traj.response_tokens, TOKEN_DTYPE).tobytes(),
        behavior_logprobs=np.ascontiguousarray(traj.behavior_logprobs, LOGPROB_DTYPE).tobytes(),
        policy_version=int(traj.policy_version),
        reward=float(traj.reward),
        finish_reason=traj.finish_reason,
        engine=traj.engine,
        timing=pb2.Timing(created_unix=float(traj.created_unix),
                          generation_seconds=float(traj.generation_seconds)),
    )
    for key, value in traj.reward_details.items():
        msg.reward_details[key] = float(value)
    if traj.routed_experts is not None:
        routes = np.asarray(traj.routed_experts)
        if routes.ndim != 3:
            raise ValueError(f"routed_experts: must have shape [rows, L, k], got {routes.shape}")
        name = route_dtype_name(routes, num_experts)
        msg.routed_experts.data = np.ascontiguousarray(routes, ROUTE_DTYPES[name]).tobytes()
        msg.routed_experts.dtype = name
        msg.routed_experts.shape.extend(int(s) for s in routes.shape)
        msg.routed_experts.num_experts = int(num_experts or 0)
    if traj.router_logits is not None:
        logits = np.asarray(traj.router_logits)
        msg.router_logits.data = np.ascontiguousarray(logits, LOGIT_DTYPES["float16"]).tobytes()
        msg.router_logits.dtype = "float16"
        msg.router_logits.shape.extend(int(s) for s in logits.shape)
    if traj.routed_gates is not None:
        gates = np.asarray(traj.routed_gates)
        msg.routed_gates.data = np.ascontiguousarray(gates, GATE_DTYPES["float16"]).tobytes()
        msg.routed_gates.dtype = "float16"
        msg.routed_gates.shape.extend(int(s) for s in gates.shape)
    if traj.token_versions is not None:
        msg.token_versions = np.ascontiguousarray(traj.token_versions, VERSION_DTYPE).tobytes()
    return msg


def _array(data: bytes, dtype: np.dtype, shape: tuple[int, ...] | None = None) -> np.ndarray:
    arr = np.frombuffer(data, dtype=dtype)
    if shape is not None:
        arr = arr.reshape(shape)
    return arr.astype(dtype.newbyteorder("="), copy=True)  # native, writable


def from_proto(msg: pb2.Trajectory) -> Trajectory:
    """Inverse of :func:`to_proto`; routes come back as int32, router logits as float16."""
    if msg.schema_version != SCHEMA_VERSION:
        raise ValueError(f"schema_version: must be {SCHEMA_VERSION}, "
                         f"got {msg.schema_version!r}")
    routes = logits = gates = None
    if msg.HasField("routed_experts"):
        r = msg.routed_experts
        routes = _array(r.data, ROUTE_DTYPES[r.dtype], tuple(r.shape)).astype(np.int32)
    if msg.HasField("router_logits"):
        lg = msg.router_logits
        logits = _array(lg.data, LOGIT_DTYPES[lg.dtype], tuple(lg.shape))
    if msg.HasField("routed_gates"):
        gt = msg.routed_gates
        gates = _array(gt.data, GATE_DTYPES[gt.dtype], tuple(gt.shape))
    versions = _array(msg.token_versions, VERSION_DTYPE) if msg.token_versions else None
    return Trajectory(
        trajectory_id=msg.trajectory_id, group_id=msg.group_id, prompt_id=msg.prompt_id,
        prompt_tokens=_array(msg.prompt_tokens, TOKEN_DTYPE),
        response_tokens=_array(msg.response_tokens, TOKEN_DTYPE),
        behavior_logprobs=_array(msg.behavior_logprobs, LOGPROB_DTYPE),
        policy_version=int(msg.policy_version), reward=float(msg.reward),
        group_size=int(msg.group_size), reward_details=dict(msg.reward_details),
        finish_reason=msg.finish_reason, routed_experts=routes, routed_gates=gates,
        router_logits=logits, token_versions=versions, engine=msg.engine,
        created_unix=float(msg.timing.created_unix),
        generation_seconds=float(msg.timing.generation_seconds))


def stop(proc) -> None:
    """Kills a subprocess the test started (by its Popen) and reaps it."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def one_line(stderr: str) -> str:
    """The single line a refusing command printed (fails on a traceback or more lines)."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]
