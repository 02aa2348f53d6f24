"""Elastic re-resolution: the same run (model, optimizer, global batch) on another device count."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hyperjax.config import Config, ParallelConfig, Run
from hyperjax.config.parallel import MODIFIERS, modifier_value
from hyperjax.errors import ConfigError, HyperjaxError, written
from hyperjax.resolver.checks import IDLE_DEFAULTS, idle_settings
from hyperjax.resolver.resolve import resolve

# what an elastic restart may change, tried in order until a run resolves on the new device count; the
# global batch, the model and the optimizer stay as configured, so the run continues the same training
_ELASTIC_STEPS: tuple[tuple[str, ...], ...] = (
    ("parallel.data=null", "emulate.processes=null"),
    ("parallel.stage_devices=null",),
    ("train.micro_batch=null",),
    (
        "parallel.fsdp=1",
        "parallel.tensor=1",
        "parallel.sequence_parallel=false",
        "parallel.context=1",
        "parallel.expert_tensor=null",  # with tensor 1, the experts' layout has no tensor axis to choose
        # the modifiers of the features those turn off, at their defaults (a run without them refuses them set)
        *(f"parallel.{k}={modifier_value(getattr(ParallelConfig(), k))}" for k in MODIFIERS),
    ),
    # then the experts on every device, and no all-to-all to hide (a pipeline's stages stay: its state is
    # saved stage by stage, so a checkpoint resumes only on the same stages)
    ("parallel.expert=1", "parallel.overlap=none"),
)


def elastic_overrides(load: Callable[[Sequence[str]], Config], devices: int) -> tuple[list[str], Run]:
    """The ``--set`` items that re-derive a run's strategy for ``devices`` devices, and the run they give.

    Args:
      load: ``overrides -> Config`` (the run's config file with its own ``--set`` items, then these).
      devices: the new device count.

    Raises:
      ConfigError: no strategy the steps above reach fits ``devices`` (the last reason is quoted).
    """
    sets = [f"emulate.devices={devices}"]
    reason = ""
    paired = load([]).parallel.overlap == "fb-pair"
    for step in _ELASTIC_STEPS:
        if paired and "parallel.overlap=none" in step:  # its state is saved as a one-stage pipeline's
            reason = (
                "parallel.overlap=fb-pair saves the run's state stage by stage, as a pipeline's, so it resumes "
                "only with its forwards and backwards paired, which needs experts spread over devices "
                "(parallel.expert > 1)"
            )
            break
        sets = [*sets, *step]
        try:
            # a mixture of experts' dispatcher, FP8 weight gathers: reset where the step turned their feature off
            sets += [f"{k}={written(IDLE_DEFAULTS[k])}" for k in idle_settings(load(sets))]
            return sets, resolve(load(sets))
        except HyperjaxError as e:
            reason = str(e)
    raise ConfigError(
        f"--elastic: no strategy fits {devices} devices while keeping the model and the global batch "
        f"(last reason: {reason}); give --devices a count the global batch and model divide"
    )
