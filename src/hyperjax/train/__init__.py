"""Training on the emulated supernode: the step, data, checkpoints and the loop."""

from hyperjax.train.checkpoint import Checkpoints, saved_steps
from hyperjax.train.data import Batches, CaptionBatches
from hyperjax.train.loop import RunResult, summary, train
from hyperjax.train.prepare import Prepared, prepare
from hyperjax.train.programs import pipeline_runner
from hyperjax.train.step import TrainStep, build_train_step, compiled_bytes, init_state, make_optimizer

__all__ = [
    "Batches",
    "CaptionBatches",
    "Checkpoints",
    "Prepared",
    "RunResult",
    "TrainStep",
    "build_train_step",
    "compiled_bytes",
    "init_state",
    "make_optimizer",
    "pipeline_runner",
    "prepare",
    "saved_steps",
    "summary",
    "train",
]
