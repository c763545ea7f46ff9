"""Validation of the router record (routes, gates, logits) and of per-token versions,
called directly on protobuf messages (the server runs the same ``validate``)."""

import numpy as np
import pytest

from satjax.queue.validation import Limits, validate

ROWS, N = 6 + 5 - 1, 5  # make_traj's defaults: P=6, N=5, L=2, k=2, E=8


def _gates(m, values, dtype="float16", shape=(ROWS, 2, 2)):
    m.routed_gates.Clear()
    m.routed_gates.data = np.asarray(values, np.float64).astype(dtype).tobytes()
    m.routed_gates.dtype = dtype
    m.routed_gates.shape.extend(shape)


def _versions(m, values):
    m.token_versions = np.asarray(values, np.int32).tobytes()


CASES = {
    "gates without routes": (lambda m: m.ClearField("routed_experts"), "routed_gates"),
    "gates dtype": (lambda m: _gates(m, np.full((ROWS, 2, 2), 0.5), "float32"),
                    "routed_gates"),
    "gates rows": (lambda m: _gates(m, np.full((ROWS - 1, 2, 2), 0.5),
                                    shape=(ROWS - 1, 2, 2)), "routed_gates"),
    "gates k != routes k": (lambda m: _gates(m, np.full((ROWS, 2, 1), 0.5),
                                             shape=(ROWS, 2, 1)), "routed_gates"),
    "gates data size": (lambda m: setattr(m.routed_gates, "data", b"\x00" * 6),
                        "routed_gates"),
    "gates nan": (lambda m: _gates(m, np.where(np.arange(ROWS * 4).reshape(ROWS, 2, 2) == 3,
                                               np.nan, 0.5)), "routed_gates"),
    "gates inf": (lambda m: _gates(m, np.full((ROWS, 2, 2), np.inf)), "routed_gates"),
    "gate above 1": (lambda m: _gates(m, np.full((ROWS, 2, 2), 1.5)), "routed_gates"),
    "negative gate": (lambda m: _gates(m, np.full((ROWS, 2, 2), -0.1)), "routed_gates"),
    "logits inf": (lambda m: setattr(m.router_logits, "data", np.full(
        (ROWS, 2, 8), np.inf, np.float16).tobytes()), "router_logits"),
    "versions count": (lambda m: _versions(m, [3] * (N - 1)), "token_versions"),
    "versions ragged bytes": (lambda m: setattr(m, "token_versions", b"\x03\x00"),
                              "token_versions"),
    "versions decreasing": (lambda m: _versions(m, [3, 4, 4, 3, 4]), "token_versions"),
    "oldest version != policy_version": (lambda m: _versions(m, [4, 4, 5, 5, 5]),
                                         "token_versions"),
}


@pytest.fixture
def good(make_traj, to_proto):
    def make():
        return to_proto(make_traj("t", "g", version=3, logits=True, gates=True,
                                  versions=True), num_experts=8)
    return make


def test_limits_bound_the_version_and_require_router_fields(good):
    msg = good()
    # make_traj's token versions: 3, 3, 4, 4, 5
    assert validate(msg, Limits(max_version=5, required=("routed_experts", "routed_gates",
                                                         "router_logits"))) is None
    bad = validate(msg, Limits(max_version=2))
    assert bad is not None and bad.field == "policy_version" and "[0, 2]" in bad.message
    msg.ClearField("router_logits")
    bad = validate(msg, Limits(required=("router_logits",)))
    assert bad is not None and bad.field == "router_logits" and "must be present" in bad.message
    with pytest.raises(ValueError, match="required: must name fields"):
        Limits(required=("routes",))


def test_limits_refuse_router_fields_the_run_does_not_record(good):
    msg = good()
    bad = validate(msg, Limits(refused=("router_logits",)))
    assert bad is not None and bad.field == "router_logits" and "must be absent" in bad.message
    msg.ClearField("router_logits")
    assert validate(msg, Limits(refused=("router_logits",))) is None
    with pytest.raises(ValueError, match="refused: must not name a required field"):
        Limits(required=("router_logits",), refused=("router_logits",))


def test_every_token_version_is_bounded_by_max_version(good):
    """Forged token versions (3, 3, 4, 1000, 2^30 under policy_version 3) used to pass, and
    the trainer logged lag_token_mean -2.15e8: each token's version is bounded, not only
    the oldest."""
    msg = good()
    _versions(msg, [3, 3, 4, 1000, 2**30])
    bad = validate(msg, Limits(max_version=10**6))
    assert bad is not None and bad.field == "token_versions"
    assert "[0, 1000000]" in bad.message and str(2**30) in bad.message
    assert validate(msg, Limits(max_version=2**30)) is None


def test_a_full_record_is_valid(good):
    assert validate(good(), Limits(num_experts=8, moe_layers=2, top_k=2)) is None


@pytest.mark.parametrize("case", list(CASES))
def test_each_bad_record_names_its_field(good, case):
    change, field = CASES[case]
    msg = good()
    change(msg)
    problem = validate(msg, Limits(num_experts=8, moe_layers=2, top_k=2))
    assert problem is not None and problem.field == field, problem
    assert field in problem.message
