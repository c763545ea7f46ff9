"""The trainer as a library: train state, jitted step, checkpoints, metrics, weight publishing.

:class:`Trainer` owns no processes and no loop: the application (``satjax/app/run.py``)
feeds it trajectories from the queue, or (``satjax/app/lag_sweep.py``) from an in-process
worker, and decides when to publish and checkpoint.
"""

from __future__ import annotations

import logging
from typing import cast

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from satjax import parallel
from satjax.config import Config, train_buckets
from satjax.model import Qwen3MoeForCausalLM
from satjax.run_dir import RunDirs
from satjax.train.batch import Batch, make_batch
from satjax.train.checkpoint import Checkpointer
from satjax.train.lag_control import LagController
from satjax.train.lag_schedule import served_version
from satjax.train.metrics import to_scalars, trajectory_metrics
from satjax.train.publish import ShardedPublisher
from satjax.train.state import TrainState, lr_schedule, make_optimizer
from satjax.train.step import StepOptions, make_train_step
from satjax.weight_sync import WeightPublisher

log = logging.getLogger(__name__)

CANARY_TEXT = "12+34=46"


def run_optimizer(cfg: Config) -> optax.GradientTransformation:
    """The run's optimizer (``train.*``: schedule, clipping, Adam's decays, weight decay)."""
    t = cfg.train
    return make_optimizer(lr_schedule(t), max_grad_norm=t.max_grad_norm, b1=t.adam_b1,
                          b2=t.adam_b2, weight_decay=t.weight_decay)


def run_train_step(cfg: Config, graphdef: nnx.GraphDef, state: nnx.State, mesh: Mesh,
                   reference: nnx.State | None = None):
    """The run's jitted train step for ``nnx.split(TrainState(model, run_optimizer(cfg)))``
    on ``mesh``, with the config's options (:meth:`StepOptions.from_config`); ``state`` may
    be abstract (how benchmarks/bench_memory.py compiles the paper's step without its
    weights). ``reference``: the Param state of the reference policy (needed when
    ``objective.kl_coef > 0``)."""
    return make_train_step(graphdef, state, mesh=mesh, options=StepOptions.from_config(cfg),
                           reference=reference)


class Trainer:
    """The trainer side of a run, starting from the policy ``model``.

    ``reference``: the frozen reference policy of ``objective.kl_coef`` (None: ``model``
    as given, i.e. the weights RL starts from; unused when ``kl_coef`` is 0).

    Checkpoints go to ``<run_dir>/checkpoints`` and published weights to
    ``<run_dir>/weights``. Without ``resume``, a run directory that already holds
    checkpoints is refused (FileExistsError) rather than overwritten.
    """

    def __init__(self, cfg: Config, model, tokenizer, *, resume: bool = False,
                 reference=None) -> None:
        self.cfg = cfg
        self.dirs = RunDirs(cfg.run_dir)
        ckpt_dir = self.dirs.checkpoints
        if not resume and ckpt_dir.exists() and any(ckpt_dir.iterdir()):
            raise FileExistsError(
                f"run_dir {cfg.run_dir} already has checkpoints; pass --resume to continue "
                f"it or choose another run_dir"
            )
        self.tokenizer = tokenizer
        self.model_config = model.config
        t = cfg.train
        devices = jax.devices()
        if t.mesh.size < len(devices):
            log.warning("train.mesh uses %d of %d devices", t.mesh.size, len(devices))
        self.mesh = parallel.make_mesh(t.mesh, devices[: t.mesh.size])
        # taken (and copied by the step) before any update: the starting weights, also on
        # --resume, where ``model`` is again the warm-up the run started from
        ref_state = (nnx.state(model if reference is None else reference, nnx.Param)
                     if cfg.objective.kl_coef > 0 else None)
        self.graphdef, state = nnx.split(TrainState(model, run_optimizer(cfg)))
        self.step_fn = run_train_step(cfg, self.graphdef, state, self.mesh, ref_state)
        self.state = self.step_fn.place_state(state)
        self.ckpt = Checkpointer(ckpt_dir, save_every=cfg.checkpoint.every,
                                 keep=cfg.checkpoint.keep)
        self.step = 0
        self.queue_cursor = 0
        # the admitted lag follows the measured mismatch (train.mismatch_target), or is
        # train.max_lag throughout (None)
        self.lag_controller = (LagController(max_lag=t.max_lag, target=t.mismatch_target,
                                             window=t.mismatch_window)
                               if t.mismatch_target is not None else None)
        if resume and self.ckpt.latest_step() is not None:
            r = self.ckpt.restore(self.state, self.step_fn.state_shardings)
            self.state, self.step, self.queue_cursor = r.state, r.step, r.queue_cursor
            if self.lag_controller is not None and "lag_controller" in r.loop_state:
                self.lag_controller.load_state_dict(r.loop_state["lag_controller"])
            log.info("resumed at step %d (queue cursor %d)", self.step, self.queue_cursor)
        # the workers' target (exact lag, broadcast interval) is at most that many versions
        # old: keep it, the target before it (a worker may still be loading it), the newest
        keep = max(3, max(t.exact_lag, t.broadcast_every) + 2)
        self.canary_tokens = self.tokenizer.encode(CANARY_TEXT, add_bos=True, add_eos=True)
        # published in the compute dtype: the policy as it runs (bf16 over float32 masters
        # is half the bytes), with deltas between keyframes
        self.publisher = ShardedPublisher(WeightPublisher(self.dirs.weights, keep=keep),
                                          self.mesh, self.canary_tokens,
                                          keyframe_every=t.keyframe_every, dtype=cfg.model.dtype,
                                          tokenizer=tokenizer)

    @property
    def lag_limit(self) -> int:
        """The lag the queue should admit now: the controller's, else ``train.max_lag``."""
        if self.lag_controller is None:
            return self.cfg.train.max_lag
        return self.lag_controller.limit

    def _loop_state(self) -> dict:
        if self.lag_controller is None:
            return {}
        return {"lag_controller": self.lag_controller.state_dict()}

    @property
    def policy_version(self) -> int:
        return int(jax.device_get(self.state["policy_version"][...]))

    def train_state(self) -> TrainState:
        return nnx.merge(self.graphdef, self.state)

    def publish(self) -> None:
        """Publishes the current weights as version ``policy_version`` (idempotent on
        resume: versions beyond a restored checkpoint are deleted first).

        Returns once this process's shards are copied to host memory; writing overlaps
        the next step (``satjax.train.publish``). Every process of a multi-process run
        calls it and writes the tensors it owns; nothing is gathered. The previous
        publish is finished first, and its error, if any, raised here.
        """
        v = self.policy_version
        # the policy given to __init__; TrainState holds any nnx.Module
        model = cast(Qwen3MoeForCausalLM, self.train_state().model)
        self.publisher.publish(model, v, target_version=served_version(v, self.cfg.train,
                                                                      self.lag_limit))

    def wait_published(self) -> None:
        """Blocks until the last :meth:`publish` is visible to workers; raises its error."""
        self.publisher.wait()

    def prepare(self, trajectories) -> Batch:
        """``trajectories`` as the step's input: padded into a :class:`Batch` and placed on
        the mesh. Any thread may call it in a single-process run (a prefetching loop does,
        while the previous step runs); in a multi-process run placing is a collective
        (``jax.device_put`` checks that every process passes the same batch), so there every
        process calls it in the same order, on the thread that runs the step."""
        cfg = self.cfg
        batch = make_batch(
            trajectories, buckets=train_buckets(cfg), pad_id=self.tokenizer.pad_id,
            mask_truncated=cfg.rollout.overlong == "mask",
            num_layers_moe=len(self.model_config.moe_layer_indices),
            top_k=self.model_config.num_experts_per_tok,
            batch_multiple=(parallel.data_parallel_size(self.mesh) * cfg.train.grad_accum
                            * cfg.train.mini_batches),
            # dynamic sampling may train on fewer rows: padded, the step keeps its shape
            min_rows=(cfg.rollout.prompts_per_step * cfg.rollout.group_size
                      if cfg.train.drop_uniform_groups else 0),
        )
        return self.step_fn.place_batch(batch)

    def train_on(self, trajectories, batch: Batch | None = None) -> dict[str, float]:
        """One train step on ``trajectories`` (``train.updates_per_batch`` x
        ``train.mini_batches`` optimizer updates); returns the step's scalar metrics (the
        jitted step's own, then :func:`satjax.train.metrics.trajectory_metrics`).
        ``batch``: their :meth:`prepare`, when made ahead (else made here)."""
        version = self.policy_version
        placed = self.prepare(trajectories) if batch is None else batch
        self.state, metrics = self.step_fn(self.state, placed)
        self.step += 1
        scalars = to_scalars(jax.device_get(metrics))
        if scalars["nonfinite_steps"]:
            log.warning("step %d: loss %s, grad norm %s: not finite, update skipped "
                        "(parameters unchanged)", self.step, scalars["loss"],
                        scalars["grad_norm"])
        if self.lag_controller is not None:
            # the decision for the fetches from now on (the next batch may already be on
            # its way at the previous limit: a prefetching loop asked for it before)
            scalars["lag_limit"] = float(self.lag_controller.update(
                scalars[self.cfg.train.mismatch_metric]))
        return {
            **scalars,
            **trajectory_metrics(trajectories, trainer_version=version),
            "num_compilations": float(self.step_fn.num_compilations),
        }

    def save(self, *, force: bool = False) -> bool:
        """Checkpoints now (``force``) or when due; a checkpoint first waits for the
        publish in flight, so a run that stops after it has published everything."""
        if force or (self.step > 0 and self.step % self.ckpt.save_every == 0):
            self.wait_published()
        if force:
            return self.ckpt.save(self.step, self.state, queue_cursor=self.queue_cursor,
                                  loop_state=self._loop_state())
        return self.ckpt.maybe_save(self.step, self.state, queue_cursor=self.queue_cursor,
                                    loop_state=self._loop_state())

    def close(self) -> None:
        """Waits for the publish and the checkpoint in flight, then releases them."""
        try:
            self.wait_published()
        finally:
            self.ckpt.close()
