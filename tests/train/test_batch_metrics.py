"""make_batch (alignment, bucketing, padding, routes), host-side metrics and the logger."""

import json

import numpy as np
import pytest

from satjax.train.batch import make_batch, pick_bucket
from satjax.train.metrics import MetricsLogger, trajectory_metrics
from satjax.trajectory import Trajectory

L, K = 2, 2


def traj(tid, group, P, N, *, routes=True, reward=1.0, version=3):
    r = np.random.default_rng(abs(hash(tid)) % 2**32)
    return Trajectory(
        trajectory_id=tid,
        group_id=group,
        prompt_id=group,
        prompt_tokens=r.integers(3, 40, P).astype(np.int32),
        response_tokens=r.integers(3, 40, N).astype(np.int32),
        behavior_logprobs=-r.random(N).astype(np.float32),
        policy_version=version,
        reward=reward,
        group_size=2,
        routed_experts=r.integers(0, 8, (P + N - 1, L, K)).astype(np.int32) if routes else None,
    )


def test_alignment_and_padding():
    ts = [
        traj("a", "g0", 3, 4),
        traj("b", "g1", 2, 2),
        traj("c", "g0", 5, 1),
        traj("d", "g1", 1, 3),
    ]
    b = make_batch(ts, buckets=(4, 8, 16), batch_multiple=3)
    assert b.tokens.shape == (6, 8)  # T: longest 7 -> bucket 8; B: 4 -> lcm(3, 2) multiple
    assert b.group_size == 2
    # groups contiguous, in first-seen order: a, c (g0) then b, d (g1)
    assert list(b.group_ids) == [0, 0, 1, 1, 2, 2]
    a = ts[0]
    np.testing.assert_array_equal(
        b.tokens[0, :7], np.concatenate([a.prompt_tokens, a.response_tokens])
    )
    assert b.attention_mask[0].tolist() == [1] * 7 + [0]
    assert b.loss_mask[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 0]
    np.testing.assert_array_equal(b.behavior_logprobs[0, 3:7], a.behavior_logprobs)
    np.testing.assert_array_equal(b.routed_experts[0, :6], a.routed_experts)
    assert not b.routed_experts[0, 6:].any()  # last real position and padding zero-filled
    assert np.asarray(b.route_mask())[0].tolist() == [True] * 6 + [False] * 2
    # padding rows fully masked, version -1
    assert not b.attention_mask[4:].any() and not b.loss_mask[4:].any()
    assert b.policy_versions.tolist() == [3, 3, 3, 3, -1, -1]


def test_precomputed_advantages_follow_trajectories():
    ts = [
        traj("a", "g0", 2, 2),
        traj("b", "g1", 2, 2),
        traj("c", "g0", 2, 2),
        traj("d", "g1", 2, 2),
    ]
    b = make_batch(ts, buckets=(8,), advantages=[1.0, 2.0, 3.0, 4.0])
    assert b.advantages.tolist() == [1.0, 3.0, 2.0, 4.0]  # reordered with their rows


def test_errors_name_the_culprit():
    ts = [traj("short", "g", 2, 2), traj("too-long", "g", 10, 10)]
    with pytest.raises(ValueError, match="'too-long' has 20 tokens"):
        make_batch(ts, buckets=(8, 16))
    with pytest.raises(ValueError, match="group 'g' has 1 members"):
        make_batch(ts[:1], buckets=(64,))
    mixed = [traj("x", "g", 2, 2), traj("y", "g", 2, 2, routes=False)]
    with pytest.raises(ValueError, match="'y' has no routed_experts"):
        make_batch(mixed, buckets=(8,))
    bad = traj("z", "h", 2, 2)
    bad.routed_experts = bad.routed_experts[:-1]
    with pytest.raises(ValueError, match="'z': routed_experts shape"):
        make_batch([bad, traj("w", "h", 2, 2)], buckets=(8,))
    assert pick_bucket(65, (64, 128)) == 128 and pick_bucket(129, (64, 128)) is None
    new = [traj("v", "k", 2, 2), traj("u", "k", 2, 2)]
    new[1].policy_version = 2**31  # the queue carries int64; a batch's versions are int32
    with pytest.raises(ValueError, match=r"'u': policy_version must be in \[0, 2147483647\]"):
        make_batch(new, buckets=(8,))


def test_metrics_logger_writes_jsonl_and_tensorboard(tmp_path):
    with MetricsLogger(tmp_path) as log:
        written = log.log(1, {"loss": np.float32(0.5), "vec": np.zeros(3), "bad": float("nan")})
        log.log(2, {"loss": 0.25})
    assert set(written) == {"loss", "bad"}
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    assert lines[0]["loss"] == 0.5 and lines[0]["bad"] == "nan" and lines[1]["loss"] == 0.25
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())


def test_trajectory_metrics_are_the_host_side_extras():
    ts = [traj("a", "g", 2, 3, reward=0.0, version=5), traj("b", "g", 2, 1, reward=1.0, version=4),
          traj("c", "g", 2, 2, reward=0.5, version=4)]
    ts[0].finish_reason = "stop"  # the others were cut at max_new_tokens ("length")
    ts.append(traj("d", "h", 2, 5, version=5))  # a second group: its longest is 5
    for t, seconds in zip(ts, (0.5, 0.25, 0.25, 1.0), strict=True):
        t.generation_seconds = seconds
    m = trajectory_metrics(ts, trainer_version=6)
    assert m == {"reward_max": 1.0, "response_len_mean": 11 / 4, "truncated_frac": 3 / 4,
                 "lag_hist/1": 2.0, "lag_hist/2": 2.0, "partial_frac": 0.0,
                 "lag_token_mean": (3 * 1 + 1 * 2 + 2 * 2 + 5 * 1) / 11,
                 # the staleness model's inputs: mean of each group's longest (3 and 5), and
                 # response tokens over generation seconds
                 "response_len_group_max_mean": 4.0, "rollout_tokens_per_s": 11 / 2.0}
    # the jitted step owns reward_mean and lag_mean/lag_max; they are not recomputed here
    assert not {"reward_mean", "lag_mean", "lag_max"} & set(m)


def test_metrics_logger_after_resume_keeps_one_record_per_step(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        for step in range(1, 6):
            log.log(step, {"loss": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # torn by a crash mid-write
    # the checkpoint restored is step 3: steps 4..6 are re-run and logged again
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=3) as log:
        for step in range(4, 8):
            log.log(step, {"loss": 10.0 * step})
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["loss"] for r in records] == [1.0, 2.0, 3.0, 40.0, 50.0, 60.0, 70.0]


def test_partial_rollout_metrics_count_each_token_at_its_own_version():
    """A trajectory whose tokens span versions counts as partial; its lag is its oldest
    token's (policy_version) and lag_token_mean averages every token's own lag."""
    ts = [traj("a", "g", 2, 4, version=3), traj("b", "g", 2, 2, version=4)]
    ts[0].token_versions = np.asarray([3, 3, 5, 5], np.int32)
    m = trajectory_metrics(ts, trainer_version=6)
    assert m["partial_frac"] == 0.5 and m["lag_hist/3"] == 1.0 and m["lag_hist/2"] == 1.0
    assert m["lag_token_mean"] == (3 + 3 + 1 + 1 + 2 + 2) / 6


def test_gates_and_router_logits_are_padded_like_routes():
    ts = [traj("a", "g0", 3, 4), traj("b", "g0", 2, 2)]
    for t in ts:
        rows = t.routed_experts.shape[0]
        t.routed_gates = np.full((rows, L, K), 0.5, np.float16)
        t.router_logits = np.arange(rows * L * 8, dtype=np.float16).reshape(rows, L, 8)
    b = make_batch(ts, buckets=[8], num_layers_moe=L, top_k=K)
    assert b.routed_gates.dtype == np.float16 and b.routed_gates.shape == (2, 8, L, K)
    assert b.router_logits.shape == (2, 8, L, 8)
    np.testing.assert_array_equal(b.router_logits[0, :6], ts[0].router_logits)
    np.testing.assert_array_equal(b.routed_gates[1, :3], 0.5)
    assert not b.routed_gates[1, 3:].any() and not b.router_logits[1, 3:].any()
    ts[1].routed_gates = None
    with pytest.raises(ValueError, match="'b' has no routed_gates"):
        make_batch(ts, buckets=[8])
