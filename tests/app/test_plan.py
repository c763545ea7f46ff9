"""``satjax plan``: TPU topologies, the HLO's collectives, the plan of the tiny run compiled
by the TPU compiler (libtpu, no TPU), and its one-line errors."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from satjax.app import plan
from satjax.app.hlo import collectives
from satjax.config import load_config
from satjax.parallel import parse_topology

# libtpu off a TPU VM, as plan sets it up: a slice type named so that it does not probe
# for one, and no lock on the (absent) chips, so the plan subprocesses load it too
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _with_libtpu(code: str):
    """Runs ``code``, which sets ``out``, in a fresh process with this module importable and
    returns ``out`` (through JSON): libtpu, a runtime of its own, is loaded there, never in
    the long test process whose later XLA:CPU compiles would share a process with it."""
    here = os.path.dirname(os.path.abspath(__file__))
    script = f"import json, sys; sys.path.insert(0, {here!r})\n{code}\nprint(json.dumps(out))"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=600, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_topology_names_parse_and_give_one_device_per_chip():
    assert parse_topology("v5p:4x4x4") == ("v5p", (4, 4, 4))
    assert parse_topology("v6e:8x8") == ("v6e", (8, 8))
    for bad in ("v7:2x2", "v5p", "v5p:", "v5p:4x0x4", "v5p:4xx4", "tpu:2x2"):
        with pytest.raises(ValueError, match="expected GENERATION:AxB"):
            parse_topology(bad)
    out = _with_libtpu(
        "from satjax.parallel import topology_devices\n"
        "v4 = topology_devices('v4:2x2x1')\n"
        "try:\n    topology_devices('v5p:3x3'); refusal = None\n"
        "except ValueError as e:\n    refusal = str(e)\n"
        "out = [[d.platform for d in v4], [d.device_kind for d in v4],\n"
        "       [d.device_kind for d in topology_devices('v5e:2x2')], refusal]")
    platforms, v4_kinds, v5e_kinds, refusal = out
    assert platforms == ["tpu"] * 4  # v4's two cores are one device (megacore)
    assert v4_kinds == ["TPU v4"] * 4 and v5e_kinds == ["TPU v5 lite"] * 4
    assert "not divisible" in refusal and "\n" not in refusal  # libtpu's refusal, one line


def _looped_program(devices):
    """A sharded program with a known communication pattern: one all-gather of a
    [4, 8] float32 shard per device outside a loop, one psum of a [16] float32 shard
    in each of 5 iterations of a fori_loop."""
    mesh = jax.sharding.Mesh(np.array(devices).reshape(len(devices)), ("d",))
    n = len(devices)

    def body(x):
        gathered = jax.lax.all_gather(x, "d", tiled=True)  # [4n, 8]

        def step(i, acc):
            return acc + jax.lax.psum(acc * i.astype(acc.dtype), "d")

        acc = jax.lax.fori_loop(0, 5, step, jnp.ones((16,), jnp.float32))
        return gathered.sum() + acc.sum()

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P(),
                              check_vma=False))
    x = jax.ShapeDtypeStruct((4 * n, 8), jnp.float32, sharding=NamedSharding(mesh, P("d")))
    return f.lower(x).compile(), n


@pytest.mark.parametrize("where", ["tpu", "cpu"])
def test_collectives_are_counted_per_loop_iteration(where):
    if where == "tpu":
        hlo = _with_libtpu("from satjax.parallel import topology_devices\n"
                           "from test_plan import _looped_program\n"
                           "out = _looped_program(topology_devices('v5e:2x2'))[0].as_text()")
        n = 4
    else:
        compiled, n = _looped_program(jax.devices()[:4])
        hlo = compiled.as_text()
    stats = {c.kind: c for c in collectives(hlo, n).by_kind}
    assert stats["all-gather"].count == 1
    assert stats["all-gather"].bytes == 4 * n * 8 * 4  # the gathered [16, 8] float32
    assert stats["all-gather"].traffic == 4 * n * 8 * 4 * (n - 1) // n
    # XLA may unroll or keep the loop; either way the psum runs 5 times
    assert stats["all-reduce"].count == 5
    assert stats["all-reduce"].bytes == 5 * 16 * 4
    assert stats["all-reduce"].traffic == 5 * 2 * (16 * 4 * (n - 1) // n)


def test_collectives_of_a_module_without_entry_is_an_error():
    with pytest.raises(ValueError, match="no ENTRY"):
        collectives("HloModule m\n", 4)


def test_alternatives_go_from_cheap_changes_to_other_splits():
    cfg = load_config(None, ["train.mesh={fsdp: 2, expert: 4}"])
    alternatives = plan._alternatives(cfg, plan_model(cfg))
    # each is the whole set of changes that makes it: remat, then also scan, then also a
    # split of the same 8 chips for every expert count that divides the 8 experts, most
    # experts first, the config's own split left out
    cheap = ["train.remat=full", "model.scan_layers=true"]
    assert [changes for changes, _ in alternatives] == [
        cheap[:1], cheap,
        [*cheap, "train.mesh={fsdp: 1, expert: 8, tensor: 1}"],
        [*cheap, "train.mesh={fsdp: 4, expert: 2, tensor: 1}"],
        [*cheap, "train.mesh={fsdp: 8, expert: 1, tensor: 1}"]]
    last = alternatives[-1][1]
    assert last.train.remat == "full" and last.model.scan_layers
    assert (last.train.mesh.fsdp, last.train.mesh.expert) == (8, 1)


def test_the_first_alternative_that_fits_is_named():
    from satjax.app.memory import StepMemory

    cfg = load_config(None, ["train.mesh={fsdp: 2, expert: 4}"])
    # GiB each alternative needs, in order; libtpu refuses the second outright
    outcomes = iter([9, "refused", 5, 3])
    said = []

    def compile_train(c):
        peak = next(outcomes)
        if peak == "refused":
            raise plan.DoesNotFit("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total "
                                  "memory required for HLO temporaries (35.63G) exceeds "
                                  "available HBM (31.25G).\nmore")
        return StepMemory(arguments=peak << 30, outputs=0, aliased=0, temporaries=0), None

    fits = plan._first_that_fits(cfg, plan_model(cfg), compile_train, 6 << 30, said.append)
    assert fits == ["train.remat=full", "model.scan_layers=true",
                    "train.mesh={fsdp: 1, expert: 8, tensor: 1}"]
    assert said[-1] == ("fits with: --set 'train.remat=full' --set 'model.scan_layers=true' "
                        "--set 'train.mesh={fsdp: 1, expert: 8, tensor: 1}'")
    outcomes = iter([9, 9, 9, 9, 9])
    assert plan._first_that_fits(cfg, plan_model(cfg), compile_train, 6 << 30,
                                 said.append) is None
    assert said[-1] == "no alternative tried fits"


def test_a_compiler_refusal_for_memory_names_its_figures():
    e = plan.DoesNotFit("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
                        "required for HLO temporaries (35.63G) exceeds available HBM "
                        "(31.25G).\n\tdetails")
    assert e.line.endswith("exceeds available HBM (31.25G).")
    assert (e.needed_gib, e.available_gib) == (35.63, 31.25)
    assert plan.DoesNotFit("RESOURCE_EXHAUSTED: no figures").needed_gib is None


def plan_model(cfg):
    from satjax.app.factory import build_tokenizer, model_config

    return model_config(cfg, build_tokenizer(cfg))


def _plan(*args, timeout=60):
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "satjax", "plan", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_a_wrong_topology_or_mesh_is_one_line_exit_2():
    r = _plan("--topology", "v9:4x4")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "satjax plan: topology 'v9:4x4': expected GENERATION:AxB[xC] with a generation of "
        "v4, v5e, v5p, v6e, e.g. v5p:4x4x4"]
    r = _plan("--topology", "v5p:4x4x4")  # the tiny run's mesh is one device
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "satjax plan: train.mesh uses 1 devices, v5p:4x4x4 has 64 chips: "
        "--set 'train.mesh={...}' to use 64"]
    r = _plan("--topology", "v5p:3x3", "--set", "train.mesh={data: 9}")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "not divisible" in r.stderr


@pytest.mark.slow
def test_plan_of_the_tiny_run_on_a_v5e_slice():
    """The tiny run compiled by libtpu for 4 v5e chips (splash attention through Mosaic,
    ragged dispatch): the train step's fields, its gradient all-reduce, and the sampler."""
    r = _plan("--topology", "v5e:2x2", "--seq-len", "128", "--json",
              "--set", "train.mesh={data: 4}", "--set", "rollout.group_size=4",
              "--set", "eval.num_prompts=2", "--set", "eval.k=2",
              "--set", "task.max_prompt_tokens=16", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["compiler"].startswith("libtpu ") and report["chips"] == 4
    assert report["hbm_gib"] == 16 and report["fits"] is True
    assert 0 < report["peak_gib"] < 1 and report["headroom_gib"] == pytest.approx(
        16 - report["peak_gib"])
    assert report["step_flops"] > 0 and report["xla_flops_loop_bodies_once"] > 0
    # data parallelism over 4 chips: the gradients are all-reduced every step
    assert report["collectives"]["all-reduce"]["count"] >= 1
    assert report["collective_bytes"] > 0 and report["step_s_roofline"] > 0
    assert report["tokens_per_s_per_chip"] == pytest.approx(
        128 / report["step_s_roofline"])
    assert set(report["sampler"]) == {"eval_forward", "decode"}
    assert all(s["peak_gib"] > 0 and s["fits"] for s in report["sampler"].values())
    assert "compiling the train step" in r.stderr and "compiling the sampler" in r.stderr


def test_collectives_after_a_custom_call_whose_config_spans_lines_are_counted():
    """A Mosaic kernel's custom call (splash attention) carries a backend config over
    several lines, one of them starting with "}}": the computation goes on after it."""
    hlo = "\n".join([
        "HloModule m",
        "",
        "ENTRY %main (p: f32[8]) -> f32[8] {",
        "  %p = f32[8]{0} parameter(0)",
        '  %k = f32[8]{0} custom-call(%p), custom_call_target="tpu_custom_call", '
        'backend_config={"custom_call_config": {"body": "...',
        '}}, metadata={op_name="pallas_call"}',
        "  ROOT %ar = f32[8]{0} all-reduce(%k), replica_groups={{0,1,2,3}}, to_apply=%add",
        "}",
    ])
    (ar,) = collectives(hlo, 4).by_kind
    assert (ar.kind, ar.count, ar.bytes, ar.traffic) == ("all-reduce", 1, 32, 48)


def test_a_program_the_compiler_cannot_build_is_one_line_exit_1(monkeypatch, capsys):
    def refused(*_):
        raise jax.errors.JaxRuntimeError(
            "INTERNAL: RET_CHECK failure (ragged_all_to_all_emitter.cc:325) Ragged all-to-all "
            "is currently not supported in limited ICI routing settings\nmore lines")

    monkeypatch.setattr(plan, "_plan", refused)
    assert plan.main(["--topology", "v5e:2x2", "--set", "train.mesh={data: 4}"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "satjax plan: the compiler refused the program: INTERNAL: RET_CHECK failure "
        "(ragged_all_to_all_emitter.cc:325) Ragged all-to-all is currently not supported in "
        "limited ICI routing settings"]
