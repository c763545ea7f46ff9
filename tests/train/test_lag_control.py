"""The lag controller of ``train.mismatch_target`` on scripted mismatch sequences."""

import json
import math

import numpy as np
import pytest
from flax import nnx

from satjax import parallel
from satjax.train.checkpoint import Checkpointer
from satjax.train.lag_control import LagController


def test_scripted_sequence_lowers_at_once_and_raises_after_a_window():
    c = LagController(max_lag=3, target=0.02, window=3)
    script = [  # (kl_k3 of the batch, the limit after it, why)
        (0.010, 3, "under, window 1/3"),
        (0.015, 3, "under, window 2/3"),
        (0.050, 2, "mean of the window 0.025 > target: lower"),
        (0.080, 1, "over again: lower"),
        (0.030, 0, "over: lower"),
        (0.040, 0, "over, already 0: stays (the trainer waits for fresh data)"),
        (0.005, 0, "under, window 1/3"),
        (0.006, 0, "under, window 2/3"),
        (0.007, 1, "3 batches under: raise"),
        (0.001, 1, "window 1/3"),
        (0.001, 1, "window 2/3"),
        (0.001, 2, "raise"),
        (0.001, 2, ""), (0.001, 2, ""), (0.001, 3, "raise to max_lag"),
        (0.001, 3, ""), (0.001, 3, ""), (0.001, 3, "under for a window: max_lag is the cap"),
        (float("nan"), 2, "a non-finite measurement counts as over"),
    ]
    for i, (m, want, why) in enumerate(script):
        assert c.update(m) == want, (i, why)


def test_limit_stays_in_bounds_and_state_round_trips():
    r = np.random.default_rng(0)
    seq = r.lognormal(mean=math.log(0.02), sigma=1.0, size=300)
    a = LagController(max_lag=4, target=0.02, window=2)
    limits = [a.update(float(m)) for m in seq[:150]]
    assert set(limits) == {0, 1, 2, 3, 4}  # the sequence moves it over the whole range
    # a resume: the state through JSON (the checkpoint's extra item) into a fresh one
    b = LagController(max_lag=4, target=0.02, window=2)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for m in seq[150:]:
        assert a.update(float(m)) == b.update(float(m))
    small = LagController(max_lag=1, target=0.02, window=2)  # resumed with a smaller max_lag
    small.load_state_dict({"limit": 4, "recent": ["inf"]})
    assert small.limit == 1 and small.recent == [math.inf]


def test_bad_arguments():
    for kw in ({"max_lag": -1}, {"target": 0.0}, {"window": 0}):
        with pytest.raises(ValueError):
            LagController(**{"max_lag": 2, "target": 0.1, "window": 1, **kw})


def test_checkpoint_keeps_the_loop_state(tmp_path, make_state, mesh_of):
    state = nnx.split(make_state(0))[1]
    c = LagController(max_lag=2, target=0.1, window=3)
    for m in (0.5, 0.01, float("inf")):
        c.update(m)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, state, queue_cursor=7, loop_state={"lag_controller": c.state_dict()})
        ckpt.wait()
        restored = ckpt.restore(state, parallel.state_shardings(state, mesh_of((1, 1, 1, 1))))
    assert restored.loop_state == {"lag_controller": c.state_dict()}
    assert restored.queue_cursor == 7

