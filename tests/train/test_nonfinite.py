"""A poisoned batch (reward 1e308 is inf in float32, NaN log-probs) never reaches the
parameters: the step is skipped, counted, and the next good batch trains as usual. A batch
without an active token is skipped the same way."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from satjax.train.batch import make_batch
from satjax.trajectory import Trajectory


def _poison(batch, how):
    if how == "reward_1e308":
        rewards = np.array(batch.rewards, np.float64)
        rewards[0] = 1e308  # what a float64 producer can send: inf once cast to float32
        with np.errstate(over="ignore"):
            return dataclasses.replace(batch, rewards=rewards.astype(np.float32))
    blp = np.array(batch.behavior_logprobs)
    blp[1, 5] = np.nan
    return dataclasses.replace(batch, behavior_logprobs=blp)


def _leaves(state):
    """[(dotted path, numpy array)] of a host state."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    return [(".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path),
             np.asarray(x)) for path, x in flat]


@pytest.mark.parametrize("how", ["reward_1e308", "nan_logprob"])
@pytest.mark.slow
def test_nonfinite_batch_leaves_params_unchanged_and_is_counted(
        how, cached_step, make_state, synthetic_batch, host):
    step = cached_step()
    state = step.place_state(nnx.split(make_state(0))[1])
    before = host(state)
    poisoned = _poison(synthetic_batch(0), how)
    state, m = step(state, step.place_batch(poisoned))
    after = host(state)
    assert float(m["nonfinite_steps"]) == 1.0
    assert not np.isfinite(float(m["loss"])) or not np.isfinite(float(m["grad_norm"]))
    for (path, a), (_, b) in zip(_leaves(before), _leaves(after), strict=True):
        if path in ("step.value", "policy_version.value"):
            assert int(b) == int(a) + 1, path  # the batch still counts as consumed
        else:
            np.testing.assert_array_equal(a, b, err_msg=path)

    # the run goes on: a good batch after it updates the parameters, all finite
    state, m = step(state, step.place_batch(synthetic_batch(1)))
    assert float(m["nonfinite_steps"]) == 0.0
    trained = _leaves(host(state))
    assert all(np.isfinite(x).all() for _, x in trained if np.issubdtype(x.dtype, np.floating))
    pairs = zip(_leaves(before), trained, strict=True)
    assert any(not np.array_equal(a, b) for (p, a), (_, b) in pairs if p.startswith("model"))


@pytest.mark.slow
def test_a_batch_without_active_tokens_skips_the_update(cached_step, make_state,
                                                        synthetic_batch, host):
    """loss_mask all 0: parameters and optimizer state (momentum, the schedule's count)
    bit-identical, empty_steps = 1; after a good batch the momentum alone would have moved
    the weights, so the test can tell."""
    step = cached_step()
    state = step.place_state(nnx.split(make_state(0))[1])
    state, m = step(state, step.place_batch(synthetic_batch(0)))
    assert float(m["empty_steps"]) == 0.0
    before = host(state)
    empty = synthetic_batch(1)
    empty = dataclasses.replace(empty, loss_mask=np.zeros_like(empty.loss_mask))
    state, m = step(state, step.place_batch(empty))
    after = host(state)
    assert (float(m["empty_steps"]), float(m["nonfinite_steps"])) == (1.0, 0.0)
    for (path, a), (_, b) in zip(_leaves(before), _leaves(after), strict=True):
        if path in ("step.value", "policy_version.value"):
            assert int(b) == int(a) + 1, path  # the batch still counts as consumed
        else:
            np.testing.assert_array_equal(a, b, err_msg=path)

    state, m = step(state, step.place_batch(synthetic_batch(2)))
    assert float(m["empty_steps"]) == 0.0
    moved = _leaves(host(state))
    for prefix in ("model", "optimizer"):
        assert any(not np.array_equal(a, b) for (p, a), (_, b)
                   in zip(_leaves(after), moved, strict=True) if p.startswith(prefix)), prefix


@pytest.mark.slow
def test_a_batch_whose_rows_are_all_masked_as_overlong_reports_lag_max_0(cached_step,
                                                                         make_state, host):
    """``rollout.overlong: mask`` with every response cut at max_new_tokens: make_batch
    masks every row, and the step reports ``lag_max`` 0 (a max over no row was -inf, no
    JSON number), with the update skipped as for any batch without an active token."""
    r = np.random.default_rng(0)
    trajs = [Trajectory(trajectory_id=f"t{i}", group_id=f"g{i // 4}", prompt_id=f"p{i // 4}",
                        prompt_tokens=r.integers(3, 50, 4).astype(np.int32),
                        response_tokens=r.integers(3, 50, 6).astype(np.int32),
                        behavior_logprobs=np.full(6, -2.0, np.float32), policy_version=0,
                        reward=float(i % 2), group_size=4, finish_reason="length")
             for i in range(8)]
    batch = make_batch(trajs, buckets=[16], mask_truncated=True)
    assert not batch.loss_mask.any()
    step = cached_step()
    state = step.place_state(nnx.split(make_state(0))[1])
    _, m = step(state, step.place_batch(batch))
    assert float(m["empty_steps"]) == 1.0
    assert float(m["lag_max"]) == 0.0 and float(m["lag_mean"]) == 0.0
