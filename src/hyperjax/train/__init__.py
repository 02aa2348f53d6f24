"""Training on the emulated supernode: configuration, planning, data, the step and the loop."""

from hyperjax.train.config import Config, EmulateConfig, ParallelConfig, TrainConfig, load_config
from hyperjax.train.loop import RunResult, train
from hyperjax.train.plan import Plan, plan_run

__all__ = [
    "Config",
    "EmulateConfig",
    "ParallelConfig",
    "Plan",
    "RunResult",
    "TrainConfig",
    "load_config",
    "plan_run",
    "train",
]
