"""What a run's train step needs per device, from an ahead-of-time compile (nothing allocated).

:func:`compile_step` builds the train state abstractly from a config (``nnx.eval_shape``),
lowers the trainer's own step (:func:`satjax.train.trainer.run_train_step`) for an
abstract batch and compiles it for the config's mesh; XLA's buffer assignment gives the
per-device bytes (:class:`StepMemory`). :func:`model_flops_per_token` sets XLA's FLOP
count of the model against the analytic one. ``benchmarks/bench_memory.py`` prints both
for the paper's configuration on an emulated CPU mesh; ``scripts/device_check.py`` puts
the same estimate next to an accelerator's measured peak.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from satjax import parallel
from satjax.app.factory import model_options
from satjax.config import Config
from satjax.model import Qwen3MoeConfig, Qwen3MoeForCausalLM, token_logprobs
from satjax.train.batch import Batch
from satjax.train.state import TrainState
from satjax.train.trainer import run_optimizer, run_train_step


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Per-device bytes of one compiled train step (XLA's ``memory_analysis``).

    ``peak`` = arguments + outputs - aliased + temporaries: the train state and the batch
    (arguments; the state is donated, so its outputs alias it), the metrics and any
    output not aliased, and XLA's temporary buffers (activations, gradients, optimizer
    update) at their highest simultaneous use.
    """

    arguments: int
    outputs: int
    aliased: int
    temporaries: int

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries

    @classmethod
    def of(cls, compiled: jax.stages.Compiled) -> StepMemory:
        """The per-device bytes XLA's buffer assignment gave ``compiled``."""
        m = compiled.memory_analysis()
        if m is None:
            raise ValueError("this backend's compiler reports no memory analysis")
        return cls(arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes,
                   aliased=m.alias_size_in_bytes, temporaries=m.temp_size_in_bytes)

    def summary(self) -> str:
        gib = 1 << 30
        return (f"peak {self.peak / gib:.2f} GiB, temporaries {self.temporaries / gib:.2f} "
                f"GiB")

    def extrapolate(self, other: StepMemory, layers: int, other_layers: int,
                    depth: int) -> StepMemory:
        """Each byte count linear in the depth through (``layers``, self) and
        (``other_layers``, other), evaluated at ``depth``."""

        def at(a: int, b: int) -> int:
            slope = (b - a) / (other_layers - layers)
            return int(round(a + slope * (depth - layers)))

        return StepMemory(*(at(getattr(self, f.name), getattr(other, f.name))
                            for f in dataclasses.fields(self)))


def abstract_batch(cfg: Config, mcfg: Qwen3MoeConfig, rows: int, seq_len: int) -> Batch:
    """A :class:`Batch` of ``rows`` x ``seq_len`` shapes and dtypes (no data), with engine
    routes when the run records and replays them. The rest of the router record a real
    batch may carry (gate weights: float16 [rows, seq_len, L, k], 6 MiB per 8k-token
    sequence at the paper's 48 layers x top-8; logits on request) is left out: well under
    the estimates' rounding."""
    def s(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype)

    routes = None
    if cfg.train.replay != "off" and cfg.rollout.record_routes and mcfg.moe_layer_indices:
        routes = s((rows, seq_len, len(mcfg.moe_layer_indices), mcfg.num_experts_per_tok),
                   jnp.int32)
    tokens = (rows, seq_len)
    return Batch(tokens=s(tokens, jnp.int32), attention_mask=s(tokens, jnp.int32),
                 loss_mask=s(tokens, jnp.float32), behavior_logprobs=s(tokens, jnp.float32),
                 rewards=s((rows,), jnp.float32), group_ids=s((rows,), jnp.int32),
                 policy_versions=s((rows,), jnp.int32), routed_experts=routes,
                 group_size=cfg.rollout.group_size)


def compile_step(cfg: Config, mcfg: Qwen3MoeConfig, *, num_layers: int | None = None,
                 micro_batch: int = 1, seq_len: int,
                 devices: Sequence[jax.Device] | None = None) -> jax.stages.Compiled:
    """Compiles the run's train step for ``mcfg`` (at ``num_layers`` deep if given) on the
    config's mesh over ``devices`` (default ``jax.devices()``; or a TPU topology's,
    :func:`satjax.parallel.topology_devices`) with ``micro_batch`` sequences of
    ``seq_len`` tokens per device per micro-step, with the reference policy's parameters
    and forward when ``objective.kl_coef > 0``. Nothing is allocated;
    :meth:`StepMemory.of` reads its per-device bytes.

    The batch holds ``micro_batch x data-parallel size x grad_accum`` rows, as
    ``satjax.train.batch.make_batch`` pads a real one.
    """
    if num_layers is not None:
        mcfg = dataclasses.replace(mcfg, num_hidden_layers=num_layers,
                                   mlp_only_layers=tuple(i for i in mcfg.mlp_only_layers
                                                         if i < num_layers))
    devices = list(jax.devices() if devices is None else devices)
    mesh = parallel.make_mesh(cfg.train.mesh, devices[: cfg.train.mesh.size])
    abstract = nnx.eval_shape(lambda: TrainState(
        Qwen3MoeForCausalLM(mcfg, rngs=nnx.Rngs(0), **model_options(cfg)),
        run_optimizer(cfg)))
    graphdef, state = nnx.split(abstract)
    # objective.kl_coef > 0: the frozen reference policy, a second copy of the parameters
    reference = nnx.state(abstract.model, nnx.Param) if cfg.objective.kl_coef > 0 else None
    step = run_train_step(cfg, graphdef, state, mesh, reference)
    rows = micro_batch * parallel.data_parallel_size(mesh) * cfg.train.grad_accum
    if rows % cfg.rollout.group_size:
        raise ValueError(f"micro_batch: {rows} rows ({micro_batch} per device x data-parallel "
                         f"size x grad_accum) do not hold whole groups of "
                         f"{cfg.rollout.group_size}")
    return step.lower(state, abstract_batch(cfg, mcfg, rows, seq_len)).compile()


def residuals_per_sequence(cfg: Config, mcfg: Qwen3MoeConfig, seq_len: int) -> int:
    """Bytes the model's forward keeps for its backward per sequence of ``seq_len`` tokens,
    as the program states them (the residuals of ``jax.vjp`` of the token log-probs, with
    the config's model options, remat and replayed routes), before any compiler: the
    part of the activations that grows with depth, without a backend's copies or its
    one-layer working set. Abstract (``jax.eval_shape``): nothing is computed."""
    model = nnx.eval_shape(lambda: Qwen3MoeForCausalLM(mcfg, rngs=nnx.Rngs(0),
                                                       **model_options(cfg)))
    # flax annotates split as (graphdef, state, *states); two filters give three
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
    replay = (cfg.train.replay != "off" and cfg.rollout.record_routes
              and bool(mcfg.moe_layer_indices))

    def saved(rows: int) -> int:
        ids = jax.ShapeDtypeStruct((rows, seq_len), jnp.int32)
        routes = jax.ShapeDtypeStruct(
            (rows, seq_len, len(mcfg.moe_layer_indices), mcfg.num_experts_per_tok),
            jnp.int32) if replay else None

        def logprobs(p, ids, routes):
            return token_logprobs(nnx.merge(graphdef, p, rest), ids, routed_experts=routes,
                                  remat=cfg.train.remat)[0]

        # the vjp closure is a pytree holding exactly the residuals
        vjp = jax.eval_shape(lambda *a: jax.vjp(logprobs, *a)[1], params, ids, routes)
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(vjp))

    return saved(2) - saved(1)


def active_params(mcfg: Qwen3MoeConfig) -> int:
    """Parameters one token's forward multiplies by (embedding lookup excluded, LM head
    included): attention projections, the router, the k routed experts or the dense MLP."""
    d = mcfg.hidden_size
    attn = d * mcfg.head_dim * (2 * mcfg.num_attention_heads + 2 * mcfg.num_key_value_heads)
    moe = d * mcfg.num_experts + 3 * d * mcfg.moe_intermediate_size * mcfg.num_experts_per_tok
    dense = 3 * d * mcfg.intermediate_size
    n_moe = len(mcfg.moe_layer_indices)
    return (mcfg.num_hidden_layers * attn + n_moe * moe
            + (mcfg.num_hidden_layers - n_moe) * dense + d * mcfg.vocab_size)


def attention_flops_per_token(mcfg: Qwen3MoeConfig, seq_len: int,
                              computed_fraction: float = 0.5) -> float:
    """Forward + backward FLOPs per token of the attention products: QK and PV, 2 FLOPs per
    multiply-add, x3 for forward and backward, over ``computed_fraction`` of the T keys
    (1/2: causal; the reference attention computes ``(blocks + 1) / (2 blocks)``)."""
    return (12 * computed_fraction * mcfg.num_hidden_layers * mcfg.num_attention_heads
            * mcfg.head_dim * seq_len)


def model_flops_per_token(cfg: Config, mcfg: Qwen3MoeConfig, seq_len: int
                          ) -> tuple[float, float]:
    """(XLA's, analytic) FLOPs per token of the model's forward + backward at ``seq_len``.

    Analytic: ``6 x active_params`` plus causal attention
    (:func:`attention_flops_per_token`, ``6 L H Dh T``).

    XLA's count is that of the model's gradient compiled for one device with the layers
    unrolled and the LM head in one chunk, because XLA's cost analysis counts a loop body
    once (a scanned layer stack, the grouped dispatch's per-expert loops, blockwise
    attention's block loops, the chunked head's scan): so it is
    compiled with the dense ``dense_einsum`` dispatch over ``num_experts_per_tok``
    experts (the FLOPs of the k routed experts; the router then has k outputs instead of
    E, < 0.1% at the paper's shape), the reference attention (4 causal query blocks, so
    5/8 of the T x T products rather than 1/2) and no remat (model FLOPs exclude
    recomputation), at 1 and 2 layers, extrapolated linearly to the model's depth.
    """
    dense = dataclasses.replace(mcfg, num_experts=mcfg.num_experts_per_tok)
    opts = {**model_options(cfg), "moe_impl": "dense_einsum", "attention": "reference",
            "scan_layers": False}
    flops = []
    for layers in (1, 2):
        shape = dataclasses.replace(dense, num_hidden_layers=layers, mlp_only_layers=())
        model = nnx.eval_shape(lambda s=shape: Qwen3MoeForCausalLM(s, rngs=nnx.Rngs(0),
                                                                   **opts))
        # flax annotates split as (graphdef, state, *states); two filters give three
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]

        def loss(p, ids, graphdef=graphdef, rest=rest):
            # one chunk: the chunked head's scan would be counted once too
            lp, _ = token_logprobs(nnx.merge(graphdef, p, rest), ids, chunk=seq_len)
            return jnp.sum(lp)

        compiled = jax.jit(jax.grad(loss)).lower(
            params, jax.ShapeDtypeStruct((1, seq_len), jnp.int32)).compile()
        cost = compiled.cost_analysis()
        assert cost is not None  # XLA:CPU always has one
        flops.append(float(cost["flops"]) / seq_len)
    xla = flops[0] + (flops[1] - flops[0]) * (mcfg.num_hidden_layers - 1)
    return xla, 6 * active_params(mcfg) + attention_flops_per_token(mcfg, seq_len)
