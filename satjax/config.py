"""Run configuration: one typed schema, loaded from YAML, overridable from the CLI.

The dataclass defaults here are THE defaults of the project: ``load_config(None)`` is
``Config()``, ``configs/tiny.yaml`` writes the same values out with comments (a test
checks they are equal), and code that needs one outside a loaded config (a CLI flag's
default, a library argument's) reads it from these classes, e.g. ``QueueConfig().fsync``.
This module imports no jax, so the queue server and other light processes can use it.

Unknown keys, wrong types and values outside a ``Literal`` fail with a message naming the
dotted key, e.g. ``config key 'rollout.engine': must be one of 'builtin', 'vllm', got 'x'``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from satjax.trajectory import ROUTER_FIELDS


class ConfigError(ValueError):
    """A bad configuration key or value; the message names the dotted key."""


Dtype = Literal["float32", "bfloat16"]
# how the model computes (satjax/model: moe.py, attention.py, transformer.py read these)
MoeImpl = Literal["auto", "grouped", "ragged", "dense_einsum", "all_to_all"]
AttentionImpl = Literal["auto", "reference", "blockwise", "cudnn", "splash"]
Remat = Literal["none", "full", "dots"]
FsyncPolicy = Literal["always", "batch", "never"]  # see satjax/queue/store.py
# train.replay: what of the engine's router record the trainer's forward uses (off: its own
# routing; experts: R3, the engine's experts with the trainer's gate weights; gates: the
# engine's experts and gate weights, straight-through). YAML's true/false mean experts/off.
Replay = Literal["off", "experts", "gates"]
REPLAY_MODES: tuple[str, ...] = typing.get_args(Replay)


def replay_mode(value: bool | str) -> Replay:
    """``train.replay`` as one of :data:`REPLAY_MODES` (true: "experts", false: "off")."""
    if value is True or value is False:
        return "experts" if value else "off"
    if value not in REPLAY_MODES:
        raise ValueError(f"replay: must be one of {', '.join(REPLAY_MODES)} (or true/false), "
                         f"got {value!r}")
    return typing.cast(Replay, value)
def _need(section: Any, cond: bool, field: str, what: str) -> None:
    """Raises ConfigError naming ``<section>.<field>`` and its value unless ``cond``: the
    one message shape of every range rule (``section`` a config section, its ``SECTION``
    its key)."""
    if not cond:
        raise ConfigError(f"config key '{section.SECTION}.{field}': must be {what}, "
                          f"got {getattr(section, field)!r}")


MESH_AXES = ("data", "fsdp", "expert", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the four mesh axes; their product must equal the device count."""

    data: int = 1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        for name in MESH_AXES:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MeshConfig.{name}: must be a positive int, got {value!r}")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.data, self.fsdp, self.expert, self.tensor)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def validate(self, num_devices: int) -> None:
        """Raises ValueError unless data*fsdp*expert*tensor == num_devices."""
        if self.size != num_devices:
            raise ValueError(
                f"MeshConfig {dict(zip(MESH_AXES, self.shape, strict=True))} has "
                f"data*fsdp*expert*tensor = {self.size} but there are {num_devices} devices; "
                "the product of the mesh axes must equal the device count"
            )


@dataclasses.dataclass
class ModelConfig:
    SECTION: ClassVar[str] = "model"
    preset: Literal["tiny", ""] = "tiny"  # "": the architecture is `path`'s or `overrides`
    path: str = ""  # local Hugging Face checkpoint directory (config.json + safetensors)
    # Qwen3MoeConfig fields: over the tiny preset; with preset "" the whole architecture
    # (checked against `path`'s config.json when both are given)
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    param_dtype: Dtype = "float32"  # the master weights and the optimizer state
    dtype: Dtype = "float32"  # compute: activations and matmuls (bfloat16 on accelerators)
    # expert dispatch (satjax/model/moe.py); all_to_all: expert parallelism by a token
    # exchange; auto: grouped on CPU, elsewhere all_to_all where it moves fewer bytes than
    # all-gathering the experts (an expert axis over 1, under ~16k tokens per device at
    # Qwen3-30B-A3B's layer), else ragged
    moe_impl: MoeImpl = "auto"
    # full-sequence attention; auto: splash (TPU), cudnn (GPU), reference or blockwise (CPU)
    attention: AttentionImpl = "auto"
    scan_layers: bool = False  # one lax.scan over the layers: compile time flat in depth
    # the frozen reference policy of objective.kl_coef: a local HF checkpoint dir; empty:
    # the policy RL starts from (the warm-up, or `path`)
    ref_path: str = ""

    def check(self) -> None:
        """The ranges of this section's own fields (raises ConfigError); rules
        across sections are :func:`_check_across`'s."""
        _need(self, self.preset != "" or bool(self.path) or bool(self.overrides), "path",
              "set when model.preset is '' and model.overrides does not give the "
              "architecture")



@dataclasses.dataclass
class TaskConfig:
    SECTION: ClassVar[str] = "task"
    name: Literal["arithmetic", "sort", "reverse", "jsonl"] = "arithmetic"
    # arithmetic: digits per operand; sort/reverse: length of the digit string
    min_digits: int = 1
    max_digits: int = 1
    # sort/reverse only: reward "exact" (1 if the whole string is right) or "per_position"
    scoring: Literal["exact", "per_position"] = "exact"
    # sort/reverse only: written between the digits of prompt and answer (e.g. ","), so
    # 16 digits make 32-token answers; per_position then scores the digits
    separator: str = ""
    ops: tuple[Literal["+", "-", "*"], ...] = ("+",)
    jsonl_path: str = ""  # the training rows: a JSONL or Parquet file, or a datasets directory
    # local HF tokenizer dir; empty: model.path if it holds one, else the char tokenizer
    tokenizer_path: str = ""
    # the rows' fields holding the problem and the reference answer (jsonl task)
    question_field: str = "question"
    answer_field: str = "answer"
    # held-out rows (same format), scored whole by `satjax eval` and eval.every; empty:
    # the first 10% of jsonl_path
    eval_path: str = ""
    # "raw": the prompt text as is; "chat": the tokenizer's chat template (one user turn,
    # after system_prompt if set); else a format string over the row's fields, e.g.
    # "Question: {question}\nAnswer:". BOS as the tokenizer adds it, never twice.
    prompt_template: str = "raw"
    system_prompt: str = ""
    # longer prompts are dropped when the data is loaded (counted and logged once); with
    # rollout.max_new_tokens it sets the longest sequence, hence the largest bucket
    max_prompt_tokens: int = 1024
    # "": the task's own (a built-in task's scoring; math_verify for jsonl); "math_verify";
    # "exact"; "module:function", a function (response: str, example) -> float
    reward: str = ""
    # a reward call (task.reward's) that lasts longer stops the process computing it (a
    # worker: then the run) with one line naming the example; .inf: no limit
    reward_timeout_s: float = 60.0

    def check(self) -> None:
        """The ranges of this section's own fields (raises ConfigError); rules
        across sections are :func:`_check_across`'s."""
        need = functools.partial(_need, self)
        need(self.max_prompt_tokens >= 1, "max_prompt_tokens", ">= 1")
        need(bool(self.prompt_template), "prompt_template", "'raw', 'chat' or a format string")
        need(self.reward in ("", "math_verify", "exact") or self.reward.count(":") == 1,
             "reward", "'', 'math_verify', 'exact' or 'module:function'")
        need(self.name == "jsonl" or not self.eval_path, "eval_path",
             "empty unless task.name is 'jsonl' (a built-in task makes its held-out split)")
        need(self.min_digits >= 1, "min_digits", ">= 1")
        need(self.max_digits >= self.min_digits, "max_digits", ">= task.min_digits")
        need(len(self.ops) >= 1, "ops", "a non-empty list")
        need(self.scoring == "exact" or self.name in ("sort", "reverse"), "scoring",
             "'exact' unless task.name is 'sort' or 'reverse'")
        need(not self.separator or self.name in ("sort", "reverse"), "separator",
             "empty unless task.name is 'sort' or 'reverse'")
        need(not any(c.isdigit() or c in "=\n" for c in self.separator), "separator",
             "free of digits, '=' and newlines")
        need(self.reward_timeout_s > 0, "reward_timeout_s", "> 0 seconds")



@dataclasses.dataclass
class RolloutConfig:
    SECTION: ClassVar[str] = "rollout"
    engine: Literal["builtin", "vllm"] = "builtin"
    num_workers: int = 1
    group_size: int = 8
    prompts_per_step: int = 8
    temperature: float = 1.0
    top_p: float = 1.0  # must stay 1 and top_k 0 (see check: no truncated sampling)
    top_k: int = 0
    max_new_tokens: int = 4
    sample_dtype: Dtype = "bfloat16"
    record_routes: bool = True  # each token's routed experts and their gate weights
    # also the full router logits (float16 [tokens, L, E], 16x the ids at 128 experts):
    # the trainer logs router_kl from them
    record_router_logits: bool = False
    # partial rollouts: a worker that gets new weights mid-batch goes on with them (the
    # built-in sampler keeps its KV cache, vLLM resubmits prompt + prefix); every token
    # records its version
    partial: bool = False
    # how long a worker waits for a queue it cannot reach (restarted, a network blip),
    # keeping the group it holds and retrying with backoff, before it exits (code 1)
    queue_retry_s: float = 300.0
    vllm_python: str = ""  # interpreter of the venv where vLLM is installed
    # extra stop strings (the tokenizer's EOS and generation_config eos ids always stop)
    stop: tuple[str, ...] = ()
    # responses cut at max_new_tokens (truncated): "keep" trains on them as scored;
    # "mask" leaves them out of the loss (DAPO's overlong filtering); "penalty" adds DAPO's
    # soft overlong punishment to the reward (overlong_buffer, overlong_penalty)
    overlong: Literal["keep", "mask", "penalty"] = "keep"
    overlong_buffer: int = 0  # the last this-many tokens before max_new_tokens ramp to it
    overlong_penalty: float = 1.0

    def check(self) -> None:
        """The ranges of this section's own fields (raises ConfigError); rules
        across sections are :func:`_check_across`'s."""
        need = functools.partial(_need, self)
        need(self.group_size >= 2, "group_size", ">= 2 (the group baseline)")
        need(self.prompts_per_step >= 1, "prompts_per_step", ">= 1")
        need(0 <= self.queue_retry_s < math.inf, "queue_retry_s",
             "a finite number of seconds >= 0 (0: a worker exits as soon as the queue is "
             "unreachable)")
        need(self.max_new_tokens >= 1, "max_new_tokens", ">= 1")
        need(self.temperature >= 0, "temperature", ">= 0")
        # The trainer recomputes log-probs of the temperature-scaled distribution only; a
        # truncated sampler (top-p / top-k) samples from another distribution, so every
        # ratio pi/mu would be off by the truncation's renormalisation, silently.
        need(self.top_p == 1.0, "top_p",
             "1.0 during RL (the trainer's log-probs do not apply top-p truncation)")
        need(self.top_k == 0, "top_k",
             "0 during RL (the trainer's log-probs do not apply top-k truncation)")
        need(0 <= self.overlong_buffer < self.max_new_tokens, "overlong_buffer",
             ">= 0 and < rollout.max_new_tokens")
        need(self.overlong_penalty >= 0, "overlong_penalty", ">= 0")
        need(self.record_routes or not self.record_router_logits, "record_router_logits",
             "off unless rollout.record_routes is on (the logits travel with the routes "
             "they chose)")



@dataclasses.dataclass
class QueueConfig:
    SECTION: ClassVar[str] = "queue"
    address: str = ""  # empty: start a local queue server subprocess
    data_dir: str = ""  # empty: <run_dir>/queue
    token: str = ""  # empty: a random token for the local server
    fsync: FsyncPolicy = "batch"
    # how long satjax train waits for the queue (queue.address, or the server it starts)
    ready_timeout_s: float = 60.0
    # the queue's capacity Q in trajectories (serve-queue --max-pending): past it, puts are
    # refused and workers pause (back-pressure); None: the server's own default
    max_pending: int | None = None

    def check(self) -> None:
        """The ranges of this section's own fields (raises ConfigError); rules
        across sections are :func:`_check_across`'s."""
        _need(self, self.ready_timeout_s > 0, "ready_timeout_s", "> 0 seconds")
        _need(self, self.max_pending is None or self.max_pending >= 1, "max_pending",
              ">= 1 trajectories (or null: the queue server's default)")



@dataclasses.dataclass
class ObjectiveConfig:
    SECTION: ClassVar[str] = "objective"
    name: str = "sat_gspo"
    # GSPO's paper radius (3e-4/4e-4) is sized for ~1000-token responses; the tiny task's
    # answers are 2-3 tokens, so its sequence ratio moves like a token ratio and needs a
    # token-sized radius. ``objective.hparams={}`` restores the objective's own defaults.
    hparams: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"eps_low": 0.05, "eps_high": 0.07})
    # + kl_coef * KL(policy || reference): the estimator (k1 | k2 | k3 | low_var_kl, verl's
    # clamped k3) per token, token mean (kl_level token); or of each row's length-normalised
    # log-ratio, row mean (sequence: our reading of the SAT page's "sequence-level KL")
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    kl_level: Literal["token", "sequence"] = "token"
    entropy_coef: float = 0.0  # - entropy_coef * token entropy (token mean)

    def check(self) -> None:
        """The ranges of this section's own fields (raises ConfigError); rules
        across sections are :func:`_check_across`'s."""
        _need(self, self.kl_coef >= 0, "kl_coef", ">= 0")
        _need(self, self.entropy_coef >= 0, "entropy_coef", ">= 0")
        _check_objective(self)



@dataclasses.dataclass
class TrainConfig:
    SECTION: ClassVar[str] = "train"
    # -- the optimizer: Adam(W) with a linear warm-up, then a constant rate (the SAT
    # paper's recipe: b1 0.9, b2 0.98, constant lr 1e-6)
    steps: int = 200
    learning_rate: float = 3e-4
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    max_grad_norm: float = 1.0
    # -- each rollout batch: mini_batches optimizer steps per pass, updates_per_batch
    # passes, each optimizer step in grad_accum micro-steps, sequences padded to a bucket
    updates_per_batch: int = 1
    mini_batches: int = 1
    grad_accum: int = 1
    buckets: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # padded lengths
    # dynamic sampling: drop groups whose rewards are all equal, refill from the queue, and
    # after max_fetches fetches (each asks for what is missing) train on what the batch has
    drop_uniform_groups: bool = False
    max_fetches: int = 8
    # -- the step's model and devices
    remat: Remat = "none"  # per decoder layer: full keeps only its input, dots also matmuls
    # off | experts (R3) | gates: see Replay above; true/false are read as experts/off
    replay: Literal["off", "experts", "gates", True, False] = "experts"
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    # -- lag: how stale the trajectories it trains on may be
    max_lag: int = 2  # the queue drops trajectories staler than this
    exact_lag: int = -1  # >= 0: workers generate with weights exactly this many versions old
    # > 0: weights broadcast every N versions, the rollout one step ahead (slime's
    # --update-weights-interval): the served lag cycles 1..N (satjax/train/lag_schedule.py)
    broadcast_every: int = 0
    # lag bounded by measured mismatch: the lag the queue admits (0..max_lag) is lowered
    # while mismatch_metric over the last mismatch_window batches exceeds the target and
    # raised while it stays under it; None: always max_lag. With exact_lag or
    # broadcast_every, a scheduled version older than the limit is moved up to it
    mismatch_target: float | None = None
    mismatch_metric: Literal["kl_k3", "token_gate_frac"] = "kl_k3"
    mismatch_window: int = 4
    # -- weights out and preemption
    # published weights: every Nth version full, the others XOR deltas of the one before
    keyframe_every: int = 10
    preempt_grace_s: float = 25.0  # SIGTERM (preemption) -> checkpointed and exited within it

    def __post_init__(self) -> None:
        self.replay = replay_mode(self.replay)

    def check(self) -> None:
        """The ranges of this section's own fields (raises ConfigError); rules
        across sections are :func:`_check_across`'s."""
        need = functools.partial(_need, self)
        need(self.steps >= 0, "steps", ">= 0")
        need(self.learning_rate > 0, "learning_rate", "> 0")
        need(self.warmup_steps >= 0, "warmup_steps", ">= 0")
        need(self.weight_decay >= 0, "weight_decay", ">= 0")
        need(0 <= self.adam_b1 < 1, "adam_b1", ">= 0 and < 1")
        need(0 <= self.adam_b2 < 1, "adam_b2", ">= 0 and < 1")
        need(self.max_grad_norm > 0, "max_grad_norm", "> 0")
        need(self.updates_per_batch >= 1, "updates_per_batch", ">= 1")
        need(self.mini_batches >= 1, "mini_batches", ">= 1")
        need(self.grad_accum >= 1, "grad_accum", ">= 1")
        buckets = self.buckets
        need(len(buckets) >= 1 and min(buckets) >= 1 and list(buckets) == sorted(set(buckets)),
             "buckets", "a non-empty, increasing list of positive lengths")
        need(self.max_fetches >= 1, "max_fetches", ">= 1")
        need(self.max_lag >= 0, "max_lag", ">= 0")
        need(self.exact_lag < 0 or self.exact_lag <= self.max_lag, "exact_lag",
             "<= train.max_lag (or -1 for free-running workers)")
        need(self.broadcast_every >= 0, "broadcast_every", ">= 0 (0: off)")
        need(self.broadcast_every == 0 or self.exact_lag < 0, "broadcast_every",
             "0 when train.exact_lag >= 0 (one lag schedule: exact lag or broadcast interval)")
        need(self.broadcast_every <= self.max_lag, "broadcast_every",
             "<= train.max_lag (the lag it serves reaches broadcast_every)")
        need(self.mismatch_target is None or self.mismatch_target > 0, "mismatch_target",
             "> 0 (or null: off)")
        need(self.mismatch_window >= 1, "mismatch_window", ">= 1")
        need(self.keyframe_every >= 1, "keyframe_every", ">= 1 (1: every version full)")
        need(self.preempt_grace_s > 0, "preempt_grace_s", "> 0 seconds")



@dataclasses.dataclass
class SftConfig:
    SECTION: ClassVar[str] = "sft"
    # "auto": the tiny preset is warmed up, a model.path checkpoint is not; "always"; "never"
    mode: Literal["auto", "always", "never"] = "auto"
    steps: int = 100
    learning_rate: float = 3e-3
    batch_size: int = 64

    def check(self) -> None:
        """The ranges of this section's own fields (raises ConfigError); rules
        across sections are :func:`_check_across`'s."""
        _need(self, self.steps >= 0, "steps", ">= 0")
        _need(self, self.batch_size >= 1, "batch_size", ">= 1")
        _need(self, self.learning_rate > 0, "learning_rate", "> 0")



@dataclasses.dataclass
class CheckpointConfig:
    SECTION: ClassVar[str] = "checkpoint"
    every: int = 20
    keep: int = 3

    def check(self) -> None:
        """The ranges of this section's own fields (raises ConfigError); rules
        across sections are :func:`_check_across`'s."""
        _need(self, self.every >= 1, "every", ">= 1")
        _need(self, self.keep >= 1, "keep", ">= 1")



@dataclasses.dataclass
class EvalConfig:
    SECTION: ClassVar[str] = "eval"
    every: int = 0  # during training, evaluate every this many steps (0: never)
    num_prompts: int = 64  # held-out prompts (a task.eval_path file is scored whole)
    k: int = 4
    temperature: float = 1.0

    def check(self) -> None:
        """The ranges of this section's own fields (raises ConfigError); rules
        across sections are :func:`_check_across`'s."""
        need = functools.partial(_need, self)
        need(self.every >= 0, "every", ">= 0 (0: no evaluation during training)")
        need(self.num_prompts >= 1, "num_prompts", ">= 1")
        need(self.k >= 1, "k", ">= 1")
        need(self.temperature >= 0, "temperature", ">= 0")



@dataclasses.dataclass
class Config:
    run_dir: str = "runs/tiny"
    seed: int = 0
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    queue: QueueConfig = dataclasses.field(default_factory=QueueConfig)
    objective: ObjectiveConfig = dataclasses.field(default_factory=ObjectiveConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    sft: SftConfig = dataclasses.field(default_factory=SftConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _coerce(value: Any, typ: Any, key: str) -> Any:
    origin = typing.get_origin(typ)
    if dataclasses.is_dataclass(typ):
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key {key!r}: expected a mapping, got {value!r}")
        return _build(typ, value, key)
    if typ is Any:
        return value
    if origin is Literal:
        allowed = typing.get_args(typ)
        if not any(type(value) is type(a) and value == a for a in allowed):
            choices = ", ".join(repr(a) for a in allowed)
            raise ConfigError(f"config key {key!r}: must be one of {choices}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        if value is None and type(None) in args:
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), key)
    if origin is tuple:
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise ConfigError(f"config key {key!r}: expected a list, got {value!r}")
        (elem, *_) = typing.get_args(typ)
        return tuple(_coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key {key!r}: expected a mapping, got {value!r}")
        return dict(value)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is float and isinstance(value, str):
        try:  # YAML 1.1 reads "1e-3" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if typ is bool and not isinstance(value, bool):
        raise ConfigError(f"config key {key!r}: expected true/false, got {value!r}")
    if typ is int and isinstance(value, bool):
        raise ConfigError(f"config key {key!r}: expected int, got {value!r}")
    if not isinstance(value, typ):
        raise ConfigError(f"config key {key!r}: expected {typ.__name__}, got {value!r}")
    return value


def _build(cls: Any, data: Mapping[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            raise ConfigError(f"unknown config key {key!r}; known: {', '.join(sorted(names))}")
        kwargs[k] = _coerce(v, hints[k], key)
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section's own check, e.g. MeshConfig's positive sizes
        raise ConfigError(f"config key {prefix or cls.__name__!r}: {e}") from None


def _plain(x: Any) -> Any:
    """Tuples as lists, recursively: the form YAML reads and writes."""
    if isinstance(x, tuple | list):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _merge_sections(base: dict[str, Any], update: Mapping[str, Any], cls: Any) -> None:
    """``update`` into ``base``, recursing into config sections only (a dict-typed field such
    as ``objective.hparams`` is replaced whole). Unknown keys are left to ``_build``."""
    hints = typing.get_type_hints(cls)
    for k, v in update.items():
        typ = hints.get(k)
        if typ is not None and dataclasses.is_dataclass(typ) and isinstance(v, Mapping) \
                and isinstance(base.get(k), dict):
            _merge_sections(base[k], v, typ)
        else:
            base[k] = v


def _apply_override(data: dict[str, Any], assignment: str) -> None:
    if "=" not in assignment:
        raise ConfigError(f"--set expects key=value, got {assignment!r}")
    dotted, raw = assignment.split("=", 1)
    parts = dotted.strip().split(".")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config key {dotted!r}: {p!r} is not a section")
    node[parts[-1]] = _parse_yaml(raw, f"config key {dotted.strip()!r}")


def _parse_yaml(text: str, what: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:  # one line: where YAML stopped, not its multi-line report
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(f"{what}: must be valid YAML, got {problem}{where}") from None


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Loads ``path`` (YAML) over the defaults and applies ``key=value`` overrides.

    The file and the overrides both apply over ``Config()``'s values, so e.g.
    ``--set objective.hparams.lam=0.5`` adds to the default hparams whether or not a file
    was given; a mapping-valued key given in full (``hparams: {...}``) replaces its default.
    """
    data: dict[str, Any] = _plain(Config().to_dict())
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"config file {str(path)!r}: cannot be read ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {str(path)!r}: must be UTF-8 text, got byte "
                              f"0x{e.object[e.start]:02x} at offset {e.start}") from None
        loaded = _parse_yaml(text, f"config file {str(path)!r}") or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r}: must be a mapping at the top level, "
                              f"got {type(loaded).__name__}")
        _merge_sections(data, loaded, Config)
    for assignment in overrides:
        _apply_override(data, assignment)
    cfg = _build(Config, data)
    _check_values(cfg)
    return cfg


def _check_values(cfg: Config) -> None:
    """Each section's own ranges (its ``check``), then the rules across sections (types and
    Literal choices were checked while loading)."""
    for field in dataclasses.fields(cfg):
        section = getattr(cfg, field.name)
        if hasattr(section, "check"):
            section.check()
    _check_across(cfg)


def _check_across(cfg: Config) -> None:
    """The rules that tie one section's value to another's."""
    _need(cfg.rollout, cfg.rollout.num_workers >= (0 if cfg.queue.address else 1),
          "num_workers",
          ">= 1 (0 only with queue.address set: workers started separately feed that queue)")
    _need(cfg.train, cfg.train.broadcast_every == 0 or not cfg.rollout.partial,
          "broadcast_every", "0 with rollout.partial (a broadcast waits for the rollout in "
          "flight)")
    _need(cfg.train, cfg.train.replay != "gates" or cfg.rollout.record_routes, "replay",
          "'off' or 'experts' unless rollout.record_routes is on (gate replay needs the "
          "engine's experts and gate weights)")


def _check_objective(obj: ObjectiveConfig) -> None:
    """Objective name and hyperparameters, checked by the objectives' own typed dataclasses
    (the one place their defaults and ranges are written)."""
    from satjax import objectives  # imports jax: only when a run is configured, not at import

    if obj.name not in objectives.NAMES:
        raise ConfigError(f"config key 'objective.name': must be one of "
                          f"{', '.join(objectives.NAMES)}, got {obj.name!r}")
    cls = type(objectives.hparams(obj.name))
    allowed = [f.name for f in dataclasses.fields(cls)]
    for key in obj.hparams:
        if key not in allowed:
            raise ConfigError(f"config key 'objective.hparams.{key}': must be a hyperparameter "
                              f"of {obj.name} ({', '.join(allowed)}), got unknown {key!r} "
                              "(objective.hparams={} keeps only the objective's defaults)")
    hints = typing.get_type_hints(cls)
    obj.hparams = {k: _coerce(v, hints[k], f"objective.hparams.{k}")
                   for k, v in obj.hparams.items()}
    try:
        cls(**obj.hparams)
    except ValueError as e:  # the dataclass names the field: "{field}: must be ..., got ..."
        field, _, what = str(e).partition(": ")
        key = f"objective.hparams.{field}" if field in allowed else "objective.hparams"
        raise ConfigError(f"config key {key!r}: {what or e}") from None


def max_sequence_tokens(cfg: Config) -> int:
    """The longest trajectory a run makes: ``task.max_prompt_tokens`` prompt tokens (longer
    prompts are dropped at load) plus ``rollout.max_new_tokens`` response tokens."""
    return cfg.task.max_prompt_tokens + cfg.rollout.max_new_tokens


def recorded_router_fields(cfg: Config) -> tuple[str, ...]:
    """The fields of :data:`~satjax.trajectory.ROUTER_FIELDS` every trajectory of the run
    carries, with either engine: the experts and their gate weights when
    ``rollout.record_routes``, the full router logits too when
    ``rollout.record_router_logits`` (for an MoE model)."""
    if not cfg.rollout.record_routes:
        return ()
    return ROUTER_FIELDS if cfg.rollout.record_router_logits else ROUTER_FIELDS[:2]


def train_buckets(cfg: Config) -> tuple[int, ...]:
    """The padded lengths the trainer uses: ``train.buckets``, with
    :func:`max_sequence_tokens` added when it is longer than all of them, so every
    trajectory a worker makes fits one (the queue's ``--max-seq-len`` is the last)."""
    limit = max_sequence_tokens(cfg)
    buckets = cfg.train.buckets
    return buckets if max(buckets) >= limit else (*buckets, limit)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(_plain(cfg.to_dict()), sort_keys=False)


def config_digest(cfg: Config) -> str:
    """SHA-256 (hex) of what the run *is*: ``cfg`` as :func:`dump_config` writes it, without
    ``run_dir`` (a run may move) and ``queue.token`` (never written). Formatting and
    comments do not change it; any value does. :func:`file_digest` of the written file is
    the same."""
    return _data_digest(_plain(cfg.to_dict()))


def file_digest(path: str | Path) -> str:
    """:func:`config_digest` of a config file as it is written: of the values it holds,
    without the defaults of keys it lacks filled in, so that a key a later satjax adds
    (and fills with its default on load) does not change the digest of a run written
    before. Raises ConfigError when the file cannot be read as YAML."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"config file {str(path)!r}: cannot be read ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r}: must be a mapping at the top level")
    return _data_digest(data)


def _data_digest(data: dict[str, Any]) -> str:
    data = {**data, "queue": {**(data.get("queue") or {})}}
    data.pop("run_dir", None)
    data["queue"].pop("token", None)
    return hashlib.sha256(yaml.safe_dump(data, sort_keys=True).encode()).hexdigest()
