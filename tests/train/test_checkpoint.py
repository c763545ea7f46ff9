"""Orbax checkpoints: exact resume, restore onto another mesh, retention, queue cursor."""

import jax
import numpy as np
import pytest
from flax import nnx

from satjax import parallel
from satjax.train.checkpoint import Checkpointer


@pytest.fixture(scope="module")
def train(cached_step):
    def run(state, batches):
        step = cached_step((1, 1, 1, 1))
        for b in batches:
            state, _ = step(state, step.place_batch(b))
        return state

    return run


@pytest.fixture
def fresh_state(cached_step, make_state):
    return lambda: cached_step((1, 1, 1, 1)).place_state(nnx.split(make_state(0))[1])


@pytest.fixture
def abstract_state(make_state):
    return lambda: nnx.split(nnx.eval_shape(lambda: make_state(0)))[1]


@pytest.mark.slow
def test_resume_is_bit_identical(tmp_path, train, fresh_state, abstract_state, host, mesh_of,
                                 synthetic_batch):
    BATCHES = [synthetic_batch(100 + i, routed=True) for i in range(20)]  # noqa: N806
    straight = host(train(fresh_state(), BATCHES))

    half = train(fresh_state(), BATCHES[:10])
    with Checkpointer(tmp_path, save_every=5, keep=2) as ckpt:
        ckpt.save(10, half, queue_cursor=123)
    del half

    mesh = mesh_of((1, 1, 1, 1))
    template = abstract_state()
    with Checkpointer(tmp_path) as ckpt:
        restored = ckpt.restore(template, parallel.state_shardings(template, mesh))
    assert restored.step == 10 and restored.queue_cursor == 123
    assert int(restored.state["step"][...]) == 10
    resumed = host(train(restored.state, BATCHES[10:]))
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_restore_onto_a_different_mesh(tmp_path, make_state, mesh_of, abstract_state):
    src_mesh = mesh_of((8, 1, 1, 1))
    state = nnx.split(make_state(3))[1]
    state = jax.device_put(state, parallel.state_shardings(state, src_mesh))
    with Checkpointer(tmp_path, async_save=True) as ckpt:
        ckpt.save(7, state, queue_cursor=9)

    dst_mesh = mesh_of((2, 1, 4, 1))
    template = abstract_state()
    with Checkpointer(tmp_path) as ckpt:
        restored = ckpt.restore(template, parallel.state_shardings(template, dst_mesh))
    assert restored.step == 7 and restored.queue_cursor == 9
    for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding.mesh == dst_mesh
    experts = [
        v.get_value()
        for _, v in nnx.to_flat_state(restored.state["model"])
        if (v.get_metadata().get("out_sharding") or (None,))[0] == "experts"
    ]
    assert experts and all(x.sharding.spec[0] == "expert" for x in experts)


def test_save_policy_and_retention(tmp_path, make_state):
    state = nnx.split(make_state(0))[1]
    with Checkpointer(tmp_path, save_every=5, keep=2) as ckpt:
        saved = [s for s in range(1, 21) if ckpt.maybe_save(s, state)]
        ckpt.wait()
        assert saved == [5, 10, 15, 20]
        assert ckpt.all_steps() == [15, 20]
        assert ckpt.latest_step() == 20


def test_restore_errors_and_arguments(tmp_path, abstract_state):
    with pytest.raises(ValueError, match="save_every"):
        Checkpointer(tmp_path, save_every=0)
    with Checkpointer(tmp_path / "empty") as ckpt, pytest.raises(FileNotFoundError):
        ckpt.restore(abstract_state(), None)
