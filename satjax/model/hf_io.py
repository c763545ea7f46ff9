"""Import/export of Hugging Face ``Qwen3MoeForCausalLM`` checkpoints (config + safetensors).

Export writes the classic per-expert hub layout (``mlp.experts.{j}.gate_proj.weight`` ...)
that vLLM loads and transformers 5.x fuses on load. Import accepts both that layout and the
fused transformers-5 layout (``mlp.experts.gate_up_proj`` [E, 2F, D], ``down_proj`` [E, D, F]).
HF linear weights are [out, in]; satjax stores ``x @ W`` kernels, hence the transposes.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from satjax.model.config import Qwen3MoeConfig
from satjax.model.transformer import Qwen3MoeForCausalLM
from satjax.utils import atomic_write, name_file, write_all

Path = tuple  # a path into the NNX graph, e.g. ("layers", 0, "self_attn", "q_proj")
_SHARD_BYTES = 4 * 1024**3
INDEX_FILE = "model.safetensors.index.json"


def _linear_entries(cfg: Qwen3MoeConfig) -> Iterator[tuple[str, Path, Callable, Callable]]:
    """(hf name, satjax path, hf->satjax, satjax->hf) for every non-expert tensor."""
    h, kv, hd, d = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                    cfg.hidden_size)
    ident = (lambda w: w, lambda w: w)
    transpose = (lambda w: w.T, lambda w: w.T)

    def heads(n):  # [n*hd, d] <-> [d, n, hd]
        return (lambda w: w.T.reshape(d, n, hd), lambda w: w.reshape(d, n * hd).T)

    def head_bias(n):
        return (lambda w: w.reshape(n, hd), lambda w: w.reshape(n * hd))

    o_proj = (lambda w: w.T.reshape(h, hd, d), lambda w: w.reshape(h * hd, d).T)
    yield ("model.embed_tokens.weight", ("embed_tokens",), *ident)
    yield ("model.norm.weight", ("norm", "weight"), *ident)
    if not cfg.tie_word_embeddings:
        yield ("lm_head.weight", ("lm_head",), *transpose)
    for i in range(cfg.num_hidden_layers):
        p, lp = f"model.layers.{i}.", ("layers", i)
        yield (p + "input_layernorm.weight", (*lp, "input_layernorm", "weight"), *ident)
        yield (p + "post_attention_layernorm.weight",
               (*lp, "post_attention_layernorm", "weight"), *ident)
        a, ap = p + "self_attn.", (*lp, "self_attn")
        yield (a + "q_proj.weight", (*ap, "q_proj"), *heads(h))
        yield (a + "k_proj.weight", (*ap, "k_proj"), *heads(kv))
        yield (a + "v_proj.weight", (*ap, "v_proj"), *heads(kv))
        yield (a + "o_proj.weight", (*ap, "o_proj"), *o_proj)
        yield (a + "q_norm.weight", (*ap, "q_norm", "weight"), *ident)
        yield (a + "k_norm.weight", (*ap, "k_norm", "weight"), *ident)
        if cfg.attention_bias:
            yield (a + "q_proj.bias", (*ap, "q_bias"), *head_bias(h))
            yield (a + "k_proj.bias", (*ap, "k_bias"), *head_bias(kv))
            yield (a + "v_proj.bias", (*ap, "v_bias"), *head_bias(kv))
            yield (a + "o_proj.bias", (*ap, "o_bias"), *ident)
        m, mp = p + "mlp.", (*lp, "mlp")
        if i in cfg.moe_layer_indices:
            yield (m + "gate.weight", (*mp, "gate"), *transpose)
        else:
            for name in ("gate_proj", "up_proj", "down_proj"):
                yield (m + f"{name}.weight", (*mp, name), *transpose)


def _params_by_path(model: nnx.Module) -> dict[Path, nnx.Param]:
    return {tuple(path): node for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Param)}


class _TensorReader:
    """Lazy reader over every ``*.safetensors`` file of a checkpoint directory."""

    def __init__(self, path: str | os.PathLike[str]):
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ValueError(f"path {path!r} contains no *.safetensors files")
        self._where: dict[str, str] = {}
        for f in files:
            with safe_open(f, framework="flax") as st:
                for key in st.keys():
                    self._where[key] = f
        self.used: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def keys(self) -> set[str]:
        return set(self._where)

    def get(self, key: str) -> jax.Array:
        if key not in self._where:
            raise ValueError(f"checkpoint is missing tensor {key!r}")
        self.used.add(key)
        with safe_open(self._where[key], framework="flax") as st:
            return st.get_tensor(key)


def _load_experts(reader: _TensorReader, cfg: Qwen3MoeConfig, i: int) -> dict[str, jax.Array]:
    """Stacked [E, D, F] gate/up and [E, F, D] down of MoE layer i, either HF layout."""
    p, f = f"model.layers.{i}.mlp.experts.", cfg.moe_intermediate_size
    if p + "gate_up_proj" in reader:  # transformers-5 fused layout
        gate_up = reader.get(p + "gate_up_proj")  # [E, 2F, D]
        down = reader.get(p + "down_proj")  # [E, D, F]
        return {"gate_proj": jnp.swapaxes(gate_up[:, :f], 1, 2),
                "up_proj": jnp.swapaxes(gate_up[:, f:], 1, 2),
                "down_proj": jnp.swapaxes(down, 1, 2)}
    return {name: jnp.stack([reader.get(f"{p}{j}.{name}.weight").T
                             for j in range(cfg.num_experts)])
            for name in ("gate_proj", "up_proj", "down_proj")}


def from_pretrained(path: str | os.PathLike[str], dtype: jnp.dtype = jnp.float32, *,
                    param_dtype: jnp.dtype | None = None, moe_impl: str = "auto",
                    attention: str = "auto", scan_layers: bool = False
                    ) -> Qwen3MoeForCausalLM:
    """Load a local HF Qwen3-MoE (or dense Qwen3: ``model_type`` "qwen3", every layer a
    dense MLP) checkpoint directory (config.json + safetensors shards).

    ``dtype`` is the compute dtype and, unless ``param_dtype`` is given, the storage dtype;
    ``moe_impl``, ``attention`` and ``scan_layers`` as :class:`Qwen3MoeForCausalLM` takes
    them.
    """
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"path {path!r} has no config.json")
    with open(config_file) as fh:
        hf = json.load(fh)
    if hf.get("model_type") not in (None, "qwen3_moe", "qwen3"):
        raise ValueError(f"model_type must be 'qwen3_moe' or 'qwen3' (dense), "
                         f"got {hf.get('model_type')!r}")
    cfg = Qwen3MoeConfig.from_hf_dict(hf)
    param_dtype = param_dtype or dtype
    model = nnx.eval_shape(lambda: Qwen3MoeForCausalLM(
        cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype, moe_impl=moe_impl,
        attention=attention, scan_layers=scan_layers))
    params = _params_by_path(model)
    reader = _TensorReader(path)
    loaded: dict[Path, jax.Array] = {}
    for hf_name, spath, to_jax, _ in _linear_entries(cfg):
        loaded[spath] = to_jax(reader.get(hf_name))
    for i in cfg.moe_layer_indices:
        for name, value in _load_experts(reader, cfg, i).items():
            loaded[("layers", i, "mlp", "experts", name)] = value
    unexpected = reader.keys() - reader.used - ({"lm_head.weight"} if cfg.tie_word_embeddings
                                                 else set())
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensors: {sorted(unexpected)[:10]}")
    missing = set(params) - set(loaded)
    if missing:
        raise ValueError(f"no checkpoint tensor for parameters {sorted(missing)[:10]}")
    for spath, value in loaded.items():
        param = params[spath]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"tensor for {spath} has shape {value.shape}, expected "
                             f"{param.shape}")
        param.set_value(jnp.asarray(value, param_dtype))
    return model


def set_hf_tensors(model: Qwen3MoeForCausalLM, tensors: Mapping[str, np.ndarray],
                   names: Iterable[str]) -> int:
    """Sets the parameters of ``model`` holding any of the HF tensors ``names`` from
    ``tensors`` (HF name -> host array in HF layout, every tensor of the model): a whole
    parameter from its tensor, a stacked ``[E, ...]`` expert parameter from all its
    experts' tensors. Values are cast to each parameter's dtype. Returns how many
    parameters were set."""
    cfg = model.config
    to_jax = {name: (spath, f) for name, spath, f, _ in _linear_entries(cfg)}
    by_path: dict[Path, list[HFTensor]] = {}
    for t in hf_tensors(cfg):
        by_path.setdefault(t.path, []).append(t)
    owner = {t.name: t.path for ts in by_path.values() for t in ts}
    unknown = sorted(set(names) - set(owner))
    if unknown:
        raise ValueError(f"not tensors of this model: {unknown[:10]}")
    params = _params_by_path(model)
    paths = {owner[n] for n in names}
    for path in paths:
        pieces = by_path[path]
        if pieces[0].expert is None:
            value = to_jax[pieces[0].name][1](np.asarray(tensors[pieces[0].name]))
        else:  # hf_tensors lists the experts in index order; HF [out, in] is ours transposed
            value = np.stack([np.asarray(tensors[t.name]).T for t in pieces])
        param = params[path]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"tensor for {path} has shape {value.shape}, expected "
                             f"{param.shape}")
        param.set_value(jnp.asarray(value, param.dtype))
    return len(paths)


def numpy_dtype(tag: str) -> np.dtype:
    """The numpy dtype of safetensors dtype tag ``tag`` (``"BF16"`` -> bfloat16)."""
    names = {t: n for n, t in _ST_DTYPES.items()}
    if tag not in names:
        raise ValueError(f"safetensors dtype must be one of {sorted(names)}, got {tag!r}")
    return np.dtype(jnp.dtype(names[tag]))


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One tensor of the HF checkpoint as a piece of a satjax parameter.

    ``expert`` is None when the tensor is the whole parameter at ``path``, else the index
    into the parameter's leading experts dimension. ``to_hf`` maps that piece (satjax
    layout) to the HF layout; it does not change the number of elements.
    """

    name: str
    path: Path
    expert: int | None
    to_hf: Callable[[Any], Any]  # on numpy arrays (hf_state_dict) and traced jax arrays


def _transpose(w):  # an expert's [D, F] <-> HF [F, D]
    return w.T


def hf_tensors(cfg: Qwen3MoeConfig) -> list[HFTensor]:
    """Every tensor of the per-expert HF layout of ``cfg``, in checkpoint order."""
    out = [HFTensor(name, spath, None, to_hf) for name, spath, _, to_hf in _linear_entries(cfg)]
    for i in cfg.moe_layer_indices:
        for name in ("gate_proj", "up_proj", "down_proj"):
            out.extend(HFTensor(f"model.layers.{i}.mlp.experts.{j}.{name}.weight",
                                ("layers", i, "mlp", "experts", name), j, _transpose)
                       for j in range(cfg.num_experts))
    return out


def hf_layout(tensors: Sequence[HFTensor], params: dict[Path, jax.Array]
              ) -> dict[Path, jax.Array]:
    """Every parameter of ``tensors`` in HF layout (jittable): a whole-parameter tensor
    through its ``to_hf``; a stacked-experts parameter [E, ...] through each expert's
    ``to_hf`` (vmapped), so that ``out[path][j]`` is expert j's HF tensor."""
    fns = {t.path: (t.to_hf, t.expert is not None) for t in tensors}
    return {p: (jax.vmap(f) if stacked else f)(params[p]) for p, (f, stacked) in fns.items()}


def model_params(model: nnx.Module) -> dict[Path, jax.Array]:
    """The parameter arrays of ``model`` by NNX path (the ``HFTensor.path`` keys)."""
    return {path: param[...] for path, param in _params_by_path(model).items()}


def hf_state_dict(model: Qwen3MoeForCausalLM) -> dict[str, np.ndarray]:
    """HF per-expert tensor dict (host numpy; bf16 stays bf16 via ml_dtypes)."""
    params = model_params(model)
    host: dict[Path, np.ndarray] = {}
    out: dict[str, np.ndarray] = {}
    for t in hf_tensors(model.config):
        if t.path not in host:
            host[t.path] = np.asarray(jax.device_get(params[t.path]))
        value = host[t.path] if t.expert is None else host[t.path][t.expert]
        out[t.name] = np.ascontiguousarray(t.to_hf(value))
    return out


def hf_config(cfg: Qwen3MoeConfig, dtype: np.dtype) -> dict:
    """The ``config.json`` of a checkpoint whose tensors are stored as ``dtype``."""
    hf_cfg = cfg.to_hf_dict()
    hf_cfg["torch_dtype"] = "bfloat16" if np.dtype(dtype).name == "bfloat16" else "float32"
    return hf_cfg


# numpy dtype name -> safetensors dtype tag (https://github.com/huggingface/safetensors)
_ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
              "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
              "bool": "BOOL"}


def write_safetensors(path: str, tensors: Sequence[tuple[str, np.dtype, tuple[int, ...],
                                                         Callable[[], np.ndarray]]],
                      *, metadata: dict[str, str] | None = None) -> int:
    """Streams ``tensors`` (name, dtype, shape, producer) into one safetensors file, fsynced.

    The header is written from the declared dtypes and shapes first, then each producer is
    called in turn and its bytes written, so a file never needs all its tensors in memory
    at once (the format: 8-byte little-endian header size, a JSON header of
    ``{name: {dtype, shape, data_offsets}}`` padded to 8 bytes, then the raw data).
    Returns the CRC-32 of the file's bytes (``zlib.crc32``), computed from the bytes as they
    are written: a published version records it so that readers find damage without the
    writer reading the file back.
    """
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, dtype, shape, _ in tensors:
        dtype = np.dtype(dtype)
        if dtype.name not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r}: dtype must be one of {sorted(_ST_DTYPES)}, "
                             f"got {dtype.name}")
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype.name], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        first = len(head).to_bytes(8, "little") + head
        write_all(fd, first)
        crc = zlib.crc32(first)
        for name, dtype, shape, produce in tensors:
            value = np.ascontiguousarray(produce())
            if value.dtype != np.dtype(dtype) or tuple(value.shape) != tuple(shape):
                raise ValueError(f"tensor {name!r}: produced {value.dtype}{value.shape}, "
                                 f"declared {np.dtype(dtype)}{tuple(shape)}")
            # numpy's stubs give ndarray __buffer__ only for Python >= 3.12
            data = memoryview(value.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
            write_all(fd, data)
            crc = zlib.crc32(data, crc)
        os.fsync(fd)
    except OSError as e:
        name_file(e, path)
        raise
    finally:
        os.close(fd)
    return crc


def write_index(path: str, weight_map: dict[str, str], total_size: int) -> None:
    """``model.safetensors.index.json``: which file holds each tensor (HF sharded layout)."""
    index = {"metadata": {"total_size": int(total_size)}, "weight_map": weight_map}
    atomic_write(os.path.join(path, INDEX_FILE), json.dumps(index, indent=2))


def shard_file_name(n: int, total: int) -> str:
    """HF name of shard ``n`` (1-based) of ``total``: ``model-00001-of-00003.safetensors``."""
    return f"model-{n:05d}-of-{total:05d}.safetensors"


def write_model_files(path: str | os.PathLike[str], cfg: Qwen3MoeConfig, tokenizer=None
                      ) -> list[str]:
    """What makes a directory of weights and config.json a complete HF model besides
    them: generation_config.json (the special token ids, so ``generate`` stops at EOS)
    and, for a Hugging Face tokenizer (one with ``save_pretrained``), its files. Returns
    the names written."""
    eos = cfg.eos_token_ids
    gen = {"bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id,
           "eos_token_id": list(eos) if len(eos) > 1 else eos[0] if eos else None}
    atomic_write(os.path.join(path, "generation_config.json"),
                 json.dumps(gen, indent=2, sort_keys=True))
    before = set(os.listdir(path))
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(os.fspath(path))
    return ["generation_config.json", *sorted(set(os.listdir(path)) - before)]


def save_pretrained(model: Qwen3MoeForCausalLM, path: str, *,
                    max_shard_bytes: int = _SHARD_BYTES, tokenizer=None) -> None:
    """Write config.json + model.safetensors (or index-json shards) loadable by HF/vLLM,
    with :func:`write_model_files` (generation config, ``tokenizer``'s files)."""
    os.makedirs(path, exist_ok=True)
    write_model_files(path, model.config, tokenizer)
    tensors = hf_state_dict(model)
    dtypes = {v.dtype for v in tensors.values()}
    dtype = dtypes.pop() if len(dtypes) == 1 else np.dtype(np.float32)
    atomic_write(os.path.join(path, "config.json"),
                 json.dumps(hf_config(model.config, dtype), indent=2, sort_keys=True))
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in tensors.items():
        if shards[-1] and size + value.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes

    def entries(shard):
        return [(k, v.dtype, v.shape, lambda v=v: v) for k, v in shard.items()]

    if len(shards) == 1:
        write_safetensors(os.path.join(path, "model.safetensors"), entries(shards[0]))
        return
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        fname = shard_file_name(n, len(shards))
        write_safetensors(os.path.join(path, fname), entries(shard))
        weight_map.update(dict.fromkeys(shard, fname))
    write_index(path, weight_map, sum(v.nbytes for v in tensors.values()))
