"""The jitted, mesh-sharded RL train step.

One step: recompute the batch's token log-probs under the current weights (replaying the
engine's experts, or its experts and gate weights, as ``replay`` says), compute group
advantages, apply the configured objective (SAT-GSPO by default), take the gradient, apply
the optimizer (whose Optax chain clips by global norm, see ``state.make_optimizer``). A step
whose loss or gradient global norm is not finite leaves the parameters and optimizer state
unchanged (``nonfinite_steps`` = 1), and so does a batch without an active token (its
``loss_mask`` all 0; ``empty_steps`` = 1).

Gradient accumulation (``grad_accum`` micro-batches, :mod:`satjax.train.grad_accum`) is
exact for every objective, including those with batch-level statistics: SAT's gate is taken
per micro-batch as the authors take it (the objective gets ``microbatches=grad_accum``;
``scope="batch"`` takes one gate over the whole batch instead), over the very rows each
micro-step holds.

Every option of the step is a field of :class:`StepOptions`; :meth:`StepOptions.from_config`
gives a run's.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from satjax import losses, objectives, parallel
from satjax.config import Config, ObjectiveConfig, Replay, replay_mode
from satjax.model import REMAT_POLICIES
from satjax.model.logprobs import (
    router_gate_stats,
    router_mismatch,
    token_logprobs,
    token_logprobs_entropy,
)
from satjax.train import grad_accum
from satjax.train.batch import Batch
from satjax.train.state import lr_schedule

log = logging.getLogger(__name__)

Metrics = dict[str, jax.Array]


def batch_advantages(batch: Batch, *, normalize_std: bool = True) -> jax.Array:
    """[B] advantages: precomputed ones if present, else group-normalised rewards."""
    if batch.advantages is not None:
        return batch.advantages.astype(jnp.float32)
    return losses.group_advantages(
        batch.rewards.astype(jnp.float32), batch.group_size, normalize_std=normalize_std
    )


# F(tau)'s threshold: a token whose ratio pi/mu is outside [1/2, 2] counts as extreme.
EXTREME_LOG_RATIO = math.log(2.0)


def staleness_metrics(logprobs: jax.Array, behavior_logprobs: jax.Array,
                      mask: jax.Array) -> Metrics:
    """Token-level staleness diagnostics of a batch, for every objective alike.

    With ``d = lp - mu`` per token ([B, T]), ``d_i`` its mean over row i's valid tokens
    (SAT-GSPO's sequence proxy) and ``q`` SAT-GSPO's default gate, the lower empirical
    ``SatKernelHParams().quantile`` (0.9) quantile of ``|d_i|`` over the valid tokens
    (each row's ``|d_i|`` once per valid token: the paper's broadcast proxy), whole batch:

    * ``token_gate_frac``: fraction of valid tokens with ``|d| > q`` (0 when ``q == 0``):
      how many single tokens stray past the gate the sequence-level objective applies;
    * ``token_extreme_frac``: ``F(tau)``, the fraction of valid tokens with
      ``|d| > tau = log 2`` (:data:`EXTREME_LOG_RATIO`), a fixed, batch-free threshold.

    ``k3`` KL and the gradient norm are logged by the objective and the step themselves.
    Inputs are [B, T] (``mask`` 0/1 or bool); outputs are float32 scalars, detached.
    """
    valid = jnp.asarray(mask) > 0
    vf = valid.astype(jnp.float32)
    d = jnp.where(valid, jax.lax.stop_gradient(logprobs).astype(jnp.float32)
                  - behavior_logprobs.astype(jnp.float32), 0.0)
    lengths = jnp.sum(vf, axis=1)
    d_seq = jnp.sum(d, axis=1) / jnp.maximum(lengths, 1.0)
    # SAT-GSPO's default gate: the sequence proxy broadcast to its tokens, lower quantile
    gate = losses.masked_quantile(jnp.abs(d_seq)[:, None] * vf,
                                  losses.SatKernelHParams().quantile, valid,
                                  method="inverted_cdf")
    return {
        "token_gate_frac": losses.masked_mean(((jnp.abs(d) > gate) & (gate > 0))
                                              .astype(jnp.float32), valid),
        "token_extreme_frac": losses.masked_mean((jnp.abs(d) > EXTREME_LOG_RATIO)
                                                 .astype(jnp.float32), valid),
    }


def _route_metrics(router_topk: jax.Array, experts_used: jax.Array, gate_stats: Metrics,
                   batch: Batch) -> Metrics:
    """Engine-vs-trainer routing mismatch (empty when the batch has no engine routes) and
    the means of the per-token gate statistics over the routed positions."""
    if batch.routed_experts is None:
        return {}
    mask = batch.route_mask()
    out = router_mismatch(router_topk, experts_used, batch.routed_experts, mask)
    out.update({k: losses.masked_mean(v, mask) for k, v in gate_stats.items()})
    return out


# Metrics of one optimizer update that the rollout batch reports from its last update
# rather than as the mean over its updates: how much the trust region binds at the end.
LAST_UPDATE_METRICS = ("clip_frac_low", "clip_frac_high")
# Counts of skipped updates, summed over the rollout batch's updates.
SKIPPED_UPDATE_METRICS = ("nonfinite_steps", "empty_steps")


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How :func:`make_train_step` trains: every option of the step besides the mesh and
    the reference policy's parameters, each default written here once. A run's come from
    its config (:meth:`from_config`); a test or benchmark states what it changes:
    ``StepOptions(grad_accum=2)``."""

    objective: str = "sat_gspo"
    """The objective's name: ``satjax.objectives.make(objective, microbatches=grad_accum,
    **objective_hp)``."""

    objective_hp: Mapping[str, Any] | None = None
    """The objective's hyperparameters (None: its defaults). SAT objectives take their
    statistics per micro-batch (``scope="microbatch"``, the default) or over the batch
    (``"batch"``)."""

    replay: Replay | bool = "experts"
    """What of the batch's engine router record the forward uses
    (``satjax.config.REPLAY_MODES``; true/false are read as "experts"/"off"): "off" the
    trainer's own routing; "experts" (R3) the engine's experts, weighted by the trainer
    router's gates of them; "gates" the engine's experts and gate weights, straight-through
    so the router still gets a gradient (``satjax.model.moe.route``; needs
    ``routed_gates``). Metrics beside ``router_mismatch*`` when the batch has gates:
    ``router_gate_diff``, ``router_gate_diff_applied`` and, with router logits,
    ``router_kl`` (``satjax.model.logprobs.router_gate_stats``)."""

    grad_accum: int = 1
    """Micro-batches per optimizer update (rows m, m + A, ...; the batch's rows must be
    divisible by it), accumulated exactly (:mod:`satjax.train.grad_accum`)."""

    temperature: float = 1.0
    """Sampling temperature of the behaviour policy (> 0): the log-probs' logits are divided
    by it."""

    lr_schedule: optax.Schedule | None = None
    """The optimizer's schedule, logged as ``learning_rate`` (None: not logged). Only read:
    the optimizer in the train state applies its own."""

    normalize_adv_std: bool = True
    """Divide group-centred rewards by the group's std (batches without precomputed
    advantages)."""

    donate: bool = True
    """Donate the input state's buffers to the output state."""

    remat: str = "none"
    """What each decoder layer keeps for the backward: "none", "full" (only its input; the
    layer is recomputed) or "dots" (also its weight-matmul outputs); the gradients are the
    same (``satjax.model.transformer.REMAT_POLICIES``)."""

    updates_per_batch: int = 1
    """Passes over the rollout batch's mini-batches, one optimizer update per mini-batch.
    With ``mini_batches``: the ratio is clipped against the log-probs of the policy before
    the first update (``old_logprobs``), SAT's proxy and the IS corrections stay against the
    behaviour's. 1, 1: one update, no ``old_logprobs``, except with
    ``is_correction="tis"``: then ``old_logprobs`` are the detached current log-probs (the
    policy at the step's start), so the TIS weight is ``min(pi_start / mu, C)`` and the
    clipped ratio ``pi / pi_start`` (1 in value: the clip, SAT's contraction of it included,
    does not bind in that single update). ``policy_version`` advances once per call whatever
    the number of updates; the state's ``step`` counts updates."""

    mini_batches: int = 1
    """Mini-batches the rollout batch is split into (rows j, j + M, ...), one optimizer
    update each (``updates_per_batch``)."""

    kl_coef: float = 0.0
    """Adds ``kl_coef * reference_kl(lp, ref_lp, estimator=kl_estimator, level=kl_level)``
    (``satjax.losses.reference_kl``), ``ref_lp`` the log-probs of the reference policy
    given to :func:`make_train_step` (copied and sharded like the policy's parameters, not
    optimised), computed in the step. > 0 logs ``policy_loss`` (the objective's) and
    ``kl_ref``."""

    kl_estimator: str = ObjectiveConfig.kl_estimator
    """The KL estimator per token (``satjax.losses.KL_ESTIMATORS``)."""

    kl_level: str = ObjectiveConfig.kl_level
    """"token": the estimator's mean over the valid tokens; "sequence": of each row's
    length-normalised log-ratio, mean over the valid rows (``satjax.losses.KL_LEVELS``)."""

    entropy_coef: float = 0.0
    """Subtracts ``entropy_coef * mean(token entropy)`` over the valid tokens
    (``satjax.model.logprobs.chunked_logprobs_entropy``). > 0 logs ``policy_loss`` and
    ``entropy``."""

    def __post_init__(self) -> None:
        # one spelling of the replay mode from here on (a frozen dataclass sets it so)
        object.__setattr__(self, "replay", replay_mode(self.replay))
        if self.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {self.grad_accum}")
        if self.updates_per_batch < 1 or self.mini_batches < 1:
            raise ValueError(f"updates_per_batch, mini_batches: must be >= 1, got "
                             f"{self.updates_per_batch}, {self.mini_batches}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {tuple(REMAT_POLICIES)}, got "
                             f"{self.remat!r}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(f"kl_coef, entropy_coef: must be >= 0, got {self.kl_coef}, "
                             f"{self.entropy_coef}")
        if self.kl_estimator not in losses.KL_ESTIMATORS:
            raise ValueError(f"kl_estimator: must be one of {losses.KL_ESTIMATORS}, got "
                             f"{self.kl_estimator!r}")
        if self.kl_level not in losses.KL_LEVELS:
            raise ValueError(f"kl_level: must be one of {losses.KL_LEVELS}, got "
                             f"{self.kl_level!r}")

    @classmethod
    def from_config(cls, cfg: Config) -> StepOptions:
        """A run's step options: ``objective.*``, ``train.*`` and the rollout's temperature;
        the advantages normalised and the state donated (the defaults)."""
        t, o = cfg.train, cfg.objective
        return cls(
            objective=o.name, objective_hp=o.hparams, replay=t.replay,
            grad_accum=t.grad_accum,
            # greedy rollouts (temperature 0) are scored at the smallest temperature the
            # logits can be divided by
            temperature=max(cfg.rollout.temperature, 1e-6), lr_schedule=lr_schedule(t),
            remat=t.remat, updates_per_batch=t.updates_per_batch, mini_batches=t.mini_batches,
            kl_coef=o.kl_coef, kl_estimator=o.kl_estimator, kl_level=o.kl_level,
            entropy_coef=o.entropy_coef)


class _TrainStep:
    """Callable ``(state, batch) -> (state, metrics)``; ``state`` is donated.

    ``state`` is ``nnx.split(train_state)[1]`` laid out with ``state_shardings``; use
    ``place_state`` / ``place_batch`` to put host values on the mesh. One jitted function
    is built per distinct batch layout; ``num_compilations`` counts traces (each new
    (B, T) shape or batch structure traces and compiles once).
    """

    def __init__(self, graphdef: nnx.GraphDef, state: nnx.State, *, mesh: Mesh,
                 options: StepOptions, reference: nnx.State | None) -> None:
        # built by make_train_step only, which documents the arguments
        if options.kl_coef > 0 and reference is None:
            raise ValueError("reference: kl_coef > 0 needs the reference policy's parameters")
        self.graphdef = graphdef
        self.mesh = mesh
        self.options = options
        # SAT's statistics per gradient-accumulation micro-batch (scope "microbatch"): the
        # objective's strided groups are grad_accum.split_micro's micro-batches
        self.objective_fn = objectives.make(options.objective, microbatches=options.grad_accum,
                                            **dict(options.objective_hp or {}))
        # TIS weights by pi_prox / mu and so needs the proximal policy pi_prox (the
        # objective refuses a batch without it, see satjax/objectives.py)
        self.needs_proximal = objectives.hparams(
            options.objective, options.objective_hp).is_correction == "tis"
        self.state_shardings = parallel.state_shardings(state, mesh)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        # The frozen reference policy: its own copy of the parameters (the policy's are
        # donated and updated in place), sharded like the policy's, not in the optimizer.
        self.reference_shardings = None
        self.reference = None
        if options.kl_coef > 0:
            assert reference is not None  # checked above
            self.reference_shardings = parallel.state_shardings(reference, mesh)
            # abstract (ShapeDtypeStructs: a step compiled without weights, as
            # satjax.app.memory.compile_step does) it stays abstract; lower() takes it
            abstract = all(isinstance(x, jax.ShapeDtypeStruct)
                           for x in jax.tree.leaves(reference))
            self.reference = reference if abstract else jax.device_put(
                jax.tree.map(jnp.copy, reference), self.reference_shardings)
        self.num_compilations = 0
        self.traced_shapes: list[tuple[int, ...]] = []
        self._jitted: dict[Any, jax.stages.Wrapped] = {}

    # -- placement ------------------------------------------------------------------
    def place_state(self, state: nnx.State) -> nnx.State:
        return jax.device_put(state, self.state_shardings)

    def batch_shardings(self, batch: Batch) -> Any:
        return parallel.batch_sharding(self.mesh, batch)

    def place_batch(self, batch: Batch) -> Batch:
        return jax.device_put(batch, self.batch_shardings(batch))

    # -- the step ---------------------------------------------------------------------
    def _logprobs_fn(self, gdm: nnx.GraphDef, rest: nnx.State, entropy: bool):
        """``(params, batch) -> (log-probs [B, T], entropy [B, T] or None, router_topk,
        experts_used [B, T, L, k], per-token gate statistics {name: [B, T]})`` of the model
        ``gdm`` with ``params`` and ``rest`` (``router_gate_stats``; empty without engine
        gates). The statistics are reduced per micro-batch, so the router logits [B, T, L,
        E] never leave it."""

        def logprobs_of(p: nnx.State, mb: Batch):
            experts = mb.routed_experts if self.options.replay != "off" else None
            gates = None
            if self.options.replay == "gates":
                if mb.routed_experts is None or mb.routed_gates is None:
                    raise ValueError("train.replay 'gates': the batch has no routed_gates "
                                     "(rollout.record_routes must be on and the engine must "
                                     "record gate weights)")
                gates = mb.routed_gates
            model = nnx.merge(gdm, p, rest)
            kw: dict[str, Any] = dict(temperature=self.options.temperature, routed_experts=experts,
                                      routed_gates=gates, remat=self.options.remat)
            if entropy:
                lp, ent, out = token_logprobs_entropy(model, mb.tokens, mb.attention_mask, **kw)
            else:
                lp, out = token_logprobs(model, mb.tokens, mb.attention_mask, **kw)
                ent = None
            stats: Metrics = {}
            if mb.routed_experts is not None and mb.routed_gates is not None:
                stats = jax.lax.stop_gradient(router_gate_stats(
                    out.router_logits, out.experts_used, out.gate_weights, mb.routed_experts,
                    mb.routed_gates, norm_topk_prob=model.config.norm_topk_prob,
                    engine_logits=mb.router_logits))
            return lp, ent, out.router_topk, out.experts_used, stats

        return logprobs_of

    def _forward(self, logprobs_of, params: nnx.State, batch: Batch) -> jax.Array:
        """Detached log-probs [B, T] of ``batch`` under ``params``, ``grad_accum`` micro-
        batches at a time (the proximal policy's before the updates, the reference's)."""
        A = self.options.grad_accum
        if A == 1:
            lp = logprobs_of(params, batch)[0]
        else:
            lp = grad_accum.micro_map(lambda mb: logprobs_of(params, mb)[0], batch, A)
        return jax.lax.stop_gradient(lp)

    def _grads(
        self, model: nnx.Module, batch: Batch, advantages: jax.Array,
        reference: nnx.State | None,
    ) -> tuple[Any, jax.Array, Metrics, Metrics]:
        """(grads over nnx.Param, loss, objective aux, router aux)."""
        # flax annotates split as (graphdef, state, *states); two filters give exactly three
        gdm, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
        obj_batch = {
            "behavior_logprobs": batch.behavior_logprobs.astype(jnp.float32),
            "advantages": advantages,
            "mask": batch.loss_mask.astype(jnp.float32),
        }
        if batch.old_logprobs is not None:
            obj_batch["old_logprobs"] = batch.old_logprobs.astype(jnp.float32)
        with_entropy = self.options.entropy_coef > 0
        logprobs_of = self._logprobs_fn(gdm, rest, with_entropy)
        ref_lp = (self._forward(logprobs_of, reference, batch)
                  if self.options.kl_coef > 0 and reference is not None else None)

        def total_loss(lp: jax.Array, ent: jax.Array | None) -> tuple[jax.Array, Metrics]:
            """The objective plus the KL and entropy terms, each logged."""
            ob = obj_batch
            if self.needs_proximal and "old_logprobs" not in ob:
                # One update per batch: the proximal policy is the policy at the step's
                # start, whose log-probs are lp's values (lp is taken under those weights).
                ob = {**ob, "old_logprobs": jax.lax.stop_gradient(lp)}
            loss, oaux = self.objective_fn(lp, ob)
            if ref_lp is None and ent is None:
                return loss, oaux
            terms = {"policy_loss": loss}
            if ref_lp is not None:
                kl = losses.reference_kl(lp, ref_lp, obj_batch["mask"],
                                         estimator=self.options.kl_estimator,
                                         level=self.options.kl_level)
                loss = loss + self.options.kl_coef * kl
                terms["kl_ref"] = kl
            if ent is not None:
                h = losses.masked_mean(ent, obj_batch["mask"] > 0)
                loss = loss - self.options.entropy_coef * h
                terms["entropy"] = h
            return loss, {**oaux, **jax.lax.stop_gradient(terms)}

        A = self.options.grad_accum
        if A == 1:

            def loss_fn(p: nnx.State) -> tuple[jax.Array, tuple[Metrics, Metrics]]:
                lp, ent, topk, used, stats = logprobs_of(p, batch)
                loss, oaux = total_loss(lp, ent)
                oaux = {**oaux, **staleness_metrics(lp, obj_batch["behavior_logprobs"],
                                                    obj_batch["mask"])}
                return loss, (oaux, _route_metrics(topk, used, stats, batch))

            (loss, (oaux, raux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            return grads, loss, oaux, raux

        B = batch.tokens.shape[0]
        if B % A:
            raise ValueError(f"batch size {B} is not divisible by grad_accum={A}")

        def forward(p: nnx.State, mb: Batch):
            # differentiated: the log-probs and entropies; carried: the routing record
            lp, ent, topk, used, stats = logprobs_of(p, mb)
            return (lp, ent), (topk, used, stats)

        (loss, oaux), ((lp, _), (topk, used, stats)), grads = grad_accum.value_and_grad(
            forward, lambda y: total_loss(*y), params, batch, A)
        oaux = {**oaux, **staleness_metrics(lp, obj_batch["behavior_logprobs"],
                                            obj_batch["mask"])}
        return grads, loss, oaux, _route_metrics(topk, used, stats, batch)

    def _update(self, state: nnx.State, batch: Batch, advantages: jax.Array,
                reference: nnx.State | None) -> tuple[nnx.State, Metrics]:
        """One optimizer update on ``batch``: (state, that update's metrics)."""
        old = jax.tree.leaves(state)  # the arrays, before the update below mutates ts in place
        ts = nnx.merge(self.graphdef, state)
        grads, loss, oaux, raux = self._grads(ts.model, batch, advantages, reference)

        grad_norm = optax.tree.norm(grads)  # before the optimizer's clipping
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # No token to learn from (every group dropped or masked): the gradient is 0, yet
        # Adam's moments would decay, its count advance and momentum or weight decay move
        # the weights. Such an update is skipped too.
        active = jnp.any(batch.loss_mask > 0)
        opt_step = ts.optimizer.step[...]
        ts.optimizer.update(ts.model, grads)
        # A non-finite loss or gradient (a poisoned reward, an overflow) would turn every
        # parameter NaN at once: keep the old parameters and optimizer state instead. The
        # step and version still advance, so the batch counts as consumed and the run goes on.
        new, treedef = jax.tree.flatten(nnx.state(ts))
        kept = [jnp.where(finite & active, n, o) for n, o in zip(new, old, strict=True)]
        ts = nnx.merge(self.graphdef, jax.tree.unflatten(treedef, kept))
        ts.step[...] += 1
        metrics: Metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            # 1: this update was skipped, for a non-finite loss or gradient / no active token
            "nonfinite_steps": (active & ~finite).astype(jnp.float32),
            "empty_steps": 1.0 - active.astype(jnp.float32),
        }
        if self.options.lr_schedule is not None:
            metrics["learning_rate"] = jnp.asarray(self.options.lr_schedule(opt_step), jnp.float32)
        metrics.update({k: jnp.asarray(v, jnp.float32) for k, v in oaux.items()})
        metrics.update(raux)
        return nnx.state(ts), metrics

    def _updates(self, state: nnx.State, batch: Batch, advantages: jax.Array,
                 reference: nnx.State | None) -> tuple[nnx.State, Metrics]:
        """``updates_per_batch`` passes over ``mini_batches`` mini-batches, one update each.

        The proximal log-probs (the policy before the first update) are computed once and
        every update's ratio is clipped against them (``old_logprobs``), while SAT's proxy
        and the IS corrections stay against the behaviour log-probs. Mini-batch j holds rows
        j, j+M, ... (strided, as the micro-batches). Metrics: the mean over the updates,
        the last update's clip fractions, ``nonfinite_steps`` and ``empty_steps`` summed
        (updates skipped).
        """
        M, U = self.options.mini_batches, self.options.updates_per_batch
        B = batch.tokens.shape[0]
        if B % (M * self.options.grad_accum):
            raise ValueError(f"batch size {B} is not divisible by mini_batches * grad_accum "
                             f"= {M} * {self.options.grad_accum}")
        model = nnx.merge(self.graphdef, state).model
        gdm, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
        old_lp = self._forward(self._logprobs_fn(gdm, rest, False), params, batch)
        full = dataclasses.replace(batch, advantages=advantages, old_logprobs=old_lp)
        minis = jax.tree.map(lambda x: grad_accum.split_micro(x, M), full)

        def one_update(st: nnx.State, mb: Batch) -> tuple[nnx.State, Metrics]:
            assert mb.advantages is not None  # set on ``full`` above
            return self._update(st, mb, mb.advantages, reference)

        def one_pass(st: nnx.State, _: None) -> tuple[nnx.State, Metrics]:
            return jax.lax.scan(one_update, st, minis)

        state, per_update = jax.lax.scan(one_pass, state, None, length=U)  # leaves [U, M]
        metrics = {k: jnp.mean(v) for k, v in per_update.items()}
        metrics.update({k: per_update[k][-1, -1] for k in LAST_UPDATE_METRICS
                        if k in per_update})
        for key in SKIPPED_UPDATE_METRICS:
            metrics[key] = jnp.sum(per_update[key])
        return state, metrics

    def _step(self, state: nnx.State, batch: Batch,
              reference: nnx.State | None) -> tuple[nnx.State, Metrics]:
        # Python side effect: runs once per trace, i.e. once per compilation.
        self.num_compilations += 1
        self.traced_shapes.append(tuple(batch.tokens.shape))
        log.info(
            "train step compile #%d for batch shape %s", self.num_compilations, batch.tokens.shape
        )
        advantages = batch_advantages(batch, normalize_std=self.options.normalize_adv_std)
        if self.options.updates_per_batch * self.options.mini_batches == 1:
            state, update_metrics = self._update(state, batch, advantages, reference)
        else:
            state, update_metrics = self._updates(state, batch, advantages, reference)
        ts = nnx.merge(self.graphdef, state)
        ts.policy_version[...] += 1  # once per rollout batch: the version workers see

        valid_rows = jnp.any(batch.loss_mask > 0, axis=-1)
        n_rows = jnp.maximum(jnp.sum(valid_rows), 1)
        lag = (ts.policy_version[...] - 1 - batch.policy_versions).astype(jnp.float32)
        metrics: Metrics = {
            "loss": update_metrics.pop("loss"),
            "grad_norm": update_metrics.pop("grad_norm"),
            **{k: update_metrics.pop(k) for k in SKIPPED_UPDATE_METRICS},
            "tokens": jnp.sum(batch.loss_mask).astype(jnp.float32),
            "sequences": jnp.sum(valid_rows).astype(jnp.float32),
            "reward_mean": jnp.sum(batch.rewards * valid_rows) / n_rows,
            "advantage_abs_mean": jnp.sum(jnp.abs(advantages) * valid_rows) / n_rows,
            "lag_mean": jnp.sum(lag * valid_rows) / n_rows,
            # 0, not -inf, for a batch with no valid row (every group dropped or masked):
            # -inf is no JSON number
            "lag_max": jnp.where(jnp.any(valid_rows),
                                 jnp.max(jnp.where(valid_rows, lag, -jnp.inf)), 0.0),
        }
        metrics.update(update_metrics)
        return nnx.state(ts), metrics

    def _compiled_for(self, batch: Batch) -> jax.stages.Wrapped:
        bsh = self.batch_shardings(batch)
        key = (jax.tree.structure(batch), tuple(jax.tree.leaves(bsh)))
        fn = self._jitted.get(key)
        if fn is None:
            fn = jax.jit(
                self._step,
                in_shardings=(self.state_shardings, bsh, self.reference_shardings),
                out_shardings=(self.state_shardings, self.replicated),
                donate_argnums=(0,) if self.options.donate else (),
            )
            self._jitted[key] = fn
        return fn

    def __call__(self, state: nnx.State, batch: Batch) -> tuple[nnx.State, Metrics]:
        fn = self._compiled_for(batch)
        with jax.set_mesh(self.mesh):
            return fn(state, batch, self.reference)

    def lower(self, state: nnx.State, batch: Batch) -> Any:
        """``jax.jit(...).lower`` for the batch's layout (for compile-time measurement)."""
        with jax.set_mesh(self.mesh):
            return self._compiled_for(batch).lower(state, batch, self.reference)


def make_train_step(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    *,
    mesh: Mesh,
    options: StepOptions | None = None,
    reference: nnx.State | None = None,
) -> _TrainStep:
    """Builds the jitted train step for ``graphdef, state = nnx.split(TrainState(...))``.

    Args:
      graphdef, state: the split ``TrainState``; ``state`` (concrete or abstract) fixes
        the parameter / optimizer shardings via ``parallel.state_shardings``. Gradient
        clipping is part of the state's optimizer (``make_optimizer(max_grad_norm=...)``);
        the logged ``grad_norm`` is the global norm before it.
      mesh: the device mesh (``parallel.make_mesh``).
      options: how the step trains (:class:`StepOptions`; None: its defaults).
      reference: the Param state of the frozen reference policy (same structure as the
        policy's), needed when ``options.kl_coef > 0``.
    """
    return _TrainStep(graphdef, state, mesh=mesh,
                      options=StepOptions() if options is None else options,
                      reference=reference)
