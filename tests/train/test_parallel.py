"""Mesh construction, logical-axis rules (with divisibility fallback) and shardings."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from satjax import parallel
from satjax.parallel import MeshConfig, logical_to_spec, make_mesh
from satjax.train.step import StepOptions, make_train_step


def test_mesh_config_validates_device_count():
    with pytest.raises(ValueError, match="product of the mesh axes"):
        make_mesh(MeshConfig(data=2, expert=2))  # 4 != 8 devices
    with pytest.raises(ValueError, match="MeshConfig.tensor"):
        MeshConfig(tensor=0)


@pytest.mark.parametrize("shape", [(8, 1, 1, 1), (2, 1, 4, 1), (1, 2, 2, 2)])
def test_make_mesh_axes(shape):
    mesh = make_mesh(MeshConfig(*shape))
    assert mesh.axis_names == ("data", "fsdp", "expert", "tensor")
    assert tuple(mesh.shape.values()) == shape
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_logical_rules_map_names_to_axes():
    mesh = make_mesh(MeshConfig(1, 2, 2, 2))
    assert logical_to_spec(("experts", "embed", "expert_mlp"), (8, 64, 32), mesh) == P(
        "expert", "fsdp", "tensor"
    )
    assert logical_to_spec(("vocab", "embed"), (48, 64), mesh) == P("tensor", "fsdp")
    assert logical_to_spec(("embed", None), (64, 8), mesh) == P("fsdp")
    assert logical_to_spec(("batch", "length"), (8, 16), mesh) == P(("fsdp", "expert"))
    assert logical_to_spec(None, (3, 3), mesh) == P()


def test_indivisible_dim_falls_back_to_replication():
    mesh = make_mesh(MeshConfig(1, 2, 2, 2))
    # 3 experts cannot be split 2 ways -> replicated; other dims still sharded
    assert logical_to_spec(("experts", "embed", "expert_mlp"), (3, 64, 32), mesh) == P(
        None, "fsdp", "tensor"
    )
    # batch of 2 fits ("fsdp",) but not ("fsdp","expert"): drops axes from the end
    assert logical_to_spec(("batch",), (2,), mesh) == P("fsdp")
    assert logical_to_spec(("batch",), (1,), mesh) == P()
    # and actually placing such an array works
    x = jax.device_put(np.zeros((3, 64, 32)), jax.sharding.NamedSharding(mesh, P(None, "fsdp")))
    assert x.sharding.shard_shape(x.shape) == (3, 32, 32)


def test_axis_used_once_per_array():
    mesh = make_mesh(MeshConfig(1, 1, 1, 8))
    # q_heads and mlp both want "tensor": only the first dim gets it
    assert logical_to_spec(("q_heads", "mlp"), (8, 16), mesh) == P("tensor")


def test_unknown_logical_name_raises():
    mesh = make_mesh(MeshConfig(8, 1, 1, 1))
    with pytest.raises(ValueError, match="unknown logical axis name 'heads'"):
        logical_to_spec(("heads",), (8,), mesh)


def test_model_params_sharded_as_rules_say(tiny_model):
    mesh = make_mesh(MeshConfig(2, 1, 4, 1))
    model = tiny_model()
    state = nnx.state(model)
    placed = jax.device_put(state, parallel.state_shardings(state, mesh))
    flat = dict(nnx.to_flat_state(placed))
    expert_like = [
        (path, v)
        for path, v in flat.items()
        if (v.get_metadata().get("out_sharding") or (None,))[0] == "experts"
    ]
    assert expert_like, "tiny model has no expert weights?"
    for path, v in expert_like:
        arr = v.get_value()
        assert arr.sharding.spec[0] == "expert", path
        assert arr.sharding.shard_shape(arr.shape)[0] == arr.shape[0] // 4, path
    # un-annotated / norm params are replicated
    for v in flat.values():
        names = v.get_metadata().get("out_sharding")
        if not names or all(n is None for n in names):
            assert v.get_value().sharding.is_fully_replicated


def test_optimizer_state_follows_params(make_state):
    mesh = make_mesh(MeshConfig(2, 1, 4, 1))
    ts = make_state()
    sh = parallel.state_shardings(nnx.state(ts.optimizer), mesh)
    specs = [
        v.get_value().spec
        for _, v in nnx.to_flat_state(sh)
        if (v.get_metadata().get("out_sharding") or (None,))[0] == "experts"
    ]
    assert specs and all(s[0] == "expert" for s in specs)


def test_batch_sharding_with_fallback(synthetic_batch):
    mesh = make_mesh(MeshConfig(2, 1, 4, 1))
    batch = synthetic_batch(0, B=8, routed=True)
    sh = parallel.batch_sharding(mesh, batch)
    assert sh.tokens.spec == P(("data", "expert"))
    assert sh.routed_experts.spec == P(("data", "expert"))
    odd = synthetic_batch(0, B=6, group_size=2)
    sh_odd = parallel.batch_sharding(mesh, odd)
    assert sh_odd.tokens.spec == P("data")  # 6 % 8 != 0, 6 % 2 == 0
    placed = jax.device_put(odd, sh_odd)
    assert placed.tokens.sharding.shard_shape((6, 16)) == (3, 16)
    assert parallel.data_parallel_size(mesh) == 8


def test_init_distributed_arguments_and_environment():
    calls = []
    init = lambda **kw: calls.append(kw)  # noqa: E731
    assert parallel.init_distributed("host0:1234", 2, 1, initialize=init, environ={})
    assert calls[-1] == {"coordinator_address": "host0:1234", "num_processes": 2,
                         "process_id": 1, "heartbeat_timeout_seconds": 10}
    env = {"SATJAX_COORDINATOR": "h:1", "SATJAX_NUM_PROCESSES": "4", "SATJAX_PROCESS_ID": "3"}
    assert parallel.init_distributed(initialize=init, environ=env)
    assert calls[-1]["coordinator_address"] == "h:1" and calls[-1]["process_id"] == 3
    assert parallel.init_distributed(auto=True, initialize=init, environ={})
    assert set(calls[-1]) == {"heartbeat_timeout_seconds"}  # JAX detects the cluster
    n = len(calls)
    assert not parallel.init_distributed(initialize=init, environ={})  # single process
    assert not parallel.init_distributed(num_processes=1, initialize=init, environ={})
    assert len(calls) == n
    with pytest.raises(ValueError, match="process count"):
        parallel.init_distributed("h:1", initialize=init, environ={})
    with pytest.raises(ValueError, match=r"process_id: must be in \[0, 2\)"):
        parallel.init_distributed("h:1", 2, 2, initialize=init, environ={})
    with pytest.raises(ValueError, match="SATJAX_PROCESS_ID: must be an integer"):
        parallel.init_distributed(initialize=init, environ={**env, "SATJAX_PROCESS_ID": "x"})


@pytest.mark.slow
def test_sharded_step_compiles_without_full_rematerialization(capfd, make_state, mesh_of,
                                                              synthetic_batch):
    """Activation constraints at layer boundaries keep GSPMD from resharding whole tensors
    through a replicated copy on the full (data, fsdp, expert, tensor) = (1, 2, 2, 2) mesh."""
    graphdef, state = nnx.split(make_state(0))
    step = make_train_step(graphdef, state, mesh=mesh_of((1, 2, 2, 2)),
                           options=StepOptions(donate=False))
    state = step.place_state(state)
    capfd.readouterr()
    step.lower(state, step.place_batch(synthetic_batch(0, routed=True))).compile()
    err = capfd.readouterr().err
    assert "Involuntary full rematerialization" not in err
