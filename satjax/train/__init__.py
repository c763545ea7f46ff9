"""Trainer: batches, train state, the jitted sharded step, checkpoints, metrics."""

from satjax.train.batch import Batch, make_batch, pick_bucket
from satjax.train.state import TrainState, make_optimizer
from satjax.train.step import StepOptions, make_train_step

__all__ = [
    "Batch",
    "StepOptions",
    "TrainState",
    "make_batch",
    "make_optimizer",
    "make_train_step",
    "pick_bucket",
]
