"""What a run asks for (:class:`Config`, read from YAML) and what it resolves to (:class:`Run`).

The bottom floor of the package: plain frozen data and the closed vocabularies, checked when a config
is read. :func:`hyperjax.resolve` turns a ``Config`` into a ``Run``.
"""

from hyperjax.config.load import apply_override, build, load_config
from hyperjax.config.model import FAMILY_PARTS, ModelConfig, MoEConfig, VisionConfig
from hyperjax.config.run import Run, Stage
from hyperjax.config.sections import (
    Config,
    EmulateConfig,
    MPMDConfig,
    OffloadConfig,
    ParallelConfig,
    SubmeshConfig,
    TrainConfig,
)
from hyperjax.config.types import (
    ACTIVATIONS,
    GATED,
    Activation,
    AttentionKernel,
    AttentionKind,
    Balance,
    BlockLayout,
    DataSource,
    DType,
    Family,
    MLPKind,
    ModuleName,
    Norm,
    OffloadOption,
    OffloadPolicy,
    Overlap,
    Positions,
    Recompute,
    Router,
    ScheduleName,
    TaskKind,
    choices,
)

__all__ = [
    "ACTIVATIONS",
    "FAMILY_PARTS",
    "GATED",
    "Activation",
    "AttentionKernel",
    "AttentionKind",
    "Balance",
    "BlockLayout",
    "Config",
    "DType",
    "DataSource",
    "EmulateConfig",
    "Family",
    "MLPKind",
    "MPMDConfig",
    "MoEConfig",
    "ModelConfig",
    "ModuleName",
    "Norm",
    "OffloadConfig",
    "OffloadOption",
    "OffloadPolicy",
    "Overlap",
    "ParallelConfig",
    "Positions",
    "Recompute",
    "Router",
    "Run",
    "ScheduleName",
    "Stage",
    "SubmeshConfig",
    "TaskKind",
    "TrainConfig",
    "VisionConfig",
    "apply_override",
    "build",
    "choices",
    "load_config",
]
