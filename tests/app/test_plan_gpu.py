"""``satjax plan --topology h100:N``: GPU topology names, the packaged H100 target config, the
one-line errors without JAX's CUDA plugin or cuDNN (what CI sees: it installs neither), and,
where the plugin is installed (``pip install 'satjax[gpu-plan]'``), the tiny run compiled by
XLA:GPU for 8 H100s with no GPU."""

import json
import os
import subprocess
import sys

import pytest

from satjax.app import plan
from satjax.parallel import gpu_target_config, parse_topology, topology_devices

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GIB = 1 << 30


def test_gpu_topology_names_are_one_host_up_to_8_then_hosts_of_8():
    assert parse_topology("h100:1") == ("h100", (1,))
    assert parse_topology("h100:8") == ("h100", (8,))
    assert parse_topology("h100:64") == ("h100", (64,))
    for bad in ("h100:12", "h100:0", "h100:", "h100", "h100:2x4", "h100:-8"):
        with pytest.raises(ValueError, match=r"expected h100:N with N <= 8 GPUs \(one host\) "
                                             r"or a multiple of 8"):
            parse_topology(bad)
    assert parse_topology("v5p:4x4x4") == ("v5p", (4, 4, 4))  # TPU names unchanged


def test_the_packaged_h100_target_config_states_its_memory():
    text = gpu_target_config("h100")
    assert "core_count: 132" in text and "major: 9" in text
    assert plan._device_memory(text) == 80 * GIB
    assert plan._device_memory("gpu_device_info { core_count: 1 }") is None


def test_without_the_cuda_plugin_a_gpu_topology_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax_cuda12_plugin", None)  # find_spec: not installed
    with pytest.raises(ValueError) as e:
        topology_devices("h100:8")
    assert str(e.value) == ("topology 'h100:8': needs the XLA:GPU compiler (JAX's CUDA "
                            "plugin): pip install 'satjax[gpu-plan]'")


def test_without_cudnn_cudnn_attention_says_what_to_install(monkeypatch):
    from jax._src import lib

    monkeypatch.setattr(lib, "cuda_versions", None)
    with pytest.raises(ValueError, match=r"^attention cudnn: JAX's cuDNN attention needs "
                                         r"cuDNN on this host: pip install "
                                         r"'satjax\[gpu-plan\]' \(or --set "):
        plan._require_cudnn()


def _plan(*args, block_plugin=False, timeout=60):
    """``satjax plan`` in a subprocess; ``block_plugin``: as if JAX's CUDA plugin were not
    installed (a None in sys.modules makes find_spec say so)."""
    code = ("import sys; " + ("sys.modules['jax_cuda12_plugin'] = None; " if block_plugin
                              else "")
            + "from satjax.app.plan import main; sys.exit(main(sys.argv[1:]))")
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def test_plan_gpu_errors_are_one_line_exit_2():
    # the paper's config (bf16: cuDNN attention) hears of the plugin first, not of cuDNN
    for args in (("--set", "train.mesh={data: 8}"), ("--config", "configs/qwen3-30b-a3b.yaml",
                                                     "--set", "train.mesh={expert: 8}")):
        r = _plan("--topology", "h100:8", *args, block_plugin=True)
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip().splitlines() == [
            "satjax plan: topology 'h100:8': needs the XLA:GPU compiler (JAX's CUDA plugin): "
            "pip install 'satjax[gpu-plan]'"]
    for args, line in [
            (("--topology", "h100:12"),
             "satjax plan: topology 'h100:12': expected h100:N with N <= 8 GPUs (one host) "
             "or a multiple of 8 (hosts of 8), e.g. h100:64"),
            (("--topology", "h100:8", "--platform", "tpu"),
             "satjax plan: --platform tpu: h100:8 is compiled by --platform cuda (or cpu)"),
            (("--topology", "v5e:2x2", "--target-config", "x.txtpb"),
             "satjax plan: --target-config is for a GPU topology, not v5e:2x2")]:
        r = _plan(*args)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [line], r.stderr


@pytest.mark.slow
def test_plan_of_the_tiny_run_on_8_h100s_with_the_cuda_plugin(tmp_path):
    """The tiny run in bf16 compiled by XLA:GPU for 8 H100s, no GPU (cuDNN attention, fsdp
    over 8), for a target config that states 40 GiB: the fits check reads the config's
    memory; XLA:GPU's compile-only executable has no cost analysis."""
    pytest.importorskip("jax_cuda12_plugin", reason="JAX's CUDA plugin: satjax[gpu-plan]")
    devices = topology_devices("h100:64")  # 8 hosts of 8
    assert len(devices) == 64 and devices[0].device_kind == "NVIDIA H100 80GB HBM3"
    assert sorted({d.process_index for d in devices}) == list(range(8))
    config = tmp_path / "h100_40g.txtpb"
    config.write_text(gpu_target_config("h100").replace(
        f"device_memory_size: {80 * GIB}", f"device_memory_size: {40 * GIB}"))
    r = _plan("--topology", "h100:8", "--target-config", str(config), "--seq-len", "128",
              "--json", "--set", "train.mesh={fsdp: 8}", "--set", "model.dtype=bfloat16",
              "--set", "rollout.group_size=8", "--set", "eval.num_prompts=2",
              "--set", "eval.k=4", "--set", "task.max_prompt_tokens=16", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["compiler"].startswith("XLA:GPU ") and report["chips"] == 8
    assert "attention cudnn," in r.stderr
    assert report["hbm_gib"] == 40 and report["hbm_source"] == (
        "--target-config's device_memory_size")
    assert report["fits"] is True and 0 < report["peak_gib"] < 1
    assert report["xla_flops_loop_bodies_once"] is None and report["step_flops"] > 0
    # fsdp: the parameters are gathered and the gradients reduce-scattered every step
    assert {"all-gather", "reduce-scatter"} <= set(report["collectives"])
    assert "at NVLink" in r.stderr
    assert set(report["sampler"]) == {"eval_forward", "decode"}
    assert all(s["peak_gib"] > 0 and s["fits"] for s in report["sampler"].values())
