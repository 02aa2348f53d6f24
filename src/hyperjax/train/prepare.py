"""What ``train`` needs beyond the resolved run, decided before any device starts.

The run's strategy places every tensor (checked when it was resolved), and under an ``offload`` policy
the placement pass must find a placement that fits a step the train step can apply it to. A run that
passes trains as printed; one that does not fails here, in milliseconds, naming the key and the fix.
Whether this machine can emulate the run's devices is the launcher's question (``Run.processes``).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from hyperjax.config import Run
from hyperjax.errors import ConfigError, article
from hyperjax.offload import OffloadResult, offload_pass
from hyperjax.shard import Strategy, strategy_for


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prepared:
    """A run ready to train.

    Attributes:
      run: the resolved run.
      strategy: the sharding strategy every stage applies on its own submesh.
      offload: the placement the offload pass chose (``None`` under ``offload.policy: none``).
    """

    run: Run
    strategy: Strategy
    offload: OffloadResult | None


def prepare(run: Run) -> Prepared:
    """Check that ``run`` can train, and run the offload pass it asks for.

    Raises:
      ConfigError: an offload policy on a run the step cannot apply it to, a budget no placement fits, or
        FP8 scaling the runtime does not carry (``delayed``).
    """
    if run.offload != "none" and (run.staged or run.config.model.vision is not None):
        raise ConfigError(
            f"offload.policy={run.offload!r}: training applies a placement to one SPMD program of a "
            "decoder-only model, not to a pipeline, MPMD submeshes, paired forwards and backwards "
            "(parallel.overlap: fb-pair) or a vision model; set offload.policy: none (hyperjax predict prices "
            "offload for these too)"
        )
    fp8 = run.config.train.fp8
    if fp8 is not None and fp8.recipe == "delayed":
        raise ConfigError(
            "train.fp8.recipe=delayed takes each scale from an amax history kept across steps, which the "
            "emulated runtime does not carry; train with recipe tensorwise (the same per-tensor FP8 products, "
            "scaled by the current amax), and price delayed scaling with hyperjax predict"
        )
    offload = None
    if run.offload != "none":
        offload = offload_pass(run)
        if not offload.fits:
            raise offload.error()
    strategy = strategy_for(
        sequence_parallel=run.sequence_parallel,
        zero_stage=run.zero_stage,
        expert_tensor=run.expert_tensor_split,
        overrides=run.config.shard,
        fsdp_context=run.config.parallel.fsdp_context,
    )
    return Prepared(run=run, strategy=strategy, offload=offload)


def check_log(log: object, call: str) -> None:
    """``log`` (``call`` 's argument) is None or a text stream progress lines can go to.

    Raises:
      ConfigError: naming the argument and what to pass.
    """
    if log is not None and not all(callable(getattr(log, m, None)) for m in ("write", "flush")):
        raise ConfigError(
            f"{call}(log=): log is {log!r}; pass a text stream with write and flush methods (sys.stderr, an open "
            "file, io.StringIO), or None for stdout"
        )


def check_outputs(
    metrics_out: str | None, out_dir: str | None, checkpoint_dir: str | None = None, *, resume: bool = False
) -> None:
    """Where a run writes can take what it writes, checked before the run starts: ``metrics_out`` a file in a
    folder that exists, ``out_dir`` and ``checkpoint_dir`` folders (made if missing), ``resume`` from a
    ``checkpoint_dir``.

    Raises:
      ConfigError: naming the argument, the path and the fix.
    """
    if resume and checkpoint_dir is None:
        raise ConfigError("resume needs checkpoint_dir (--checkpoint-dir), the folder the run wrote its checkpoints to")
    for key, given in (("metrics_out", metrics_out), ("out_dir", out_dir), ("checkpoint_dir", checkpoint_dir)):
        if given is not None and not isinstance(given, str | os.PathLike):
            raise ConfigError(f"{key}={given!r} is {article(type(given).__name__)}; give a path (a str or a Path)")
    if metrics_out is not None:
        path = Path(metrics_out)
        if path.is_dir():
            raise ConfigError(f"metrics_out={metrics_out!r} is a folder; give the path of a JSON-lines file")
        if not path.parent.is_dir():
            raise ConfigError(f"metrics_out={metrics_out!r}: folder {str(path.parent)!r} does not exist; create it")
    for key, folder in (("out_dir", out_dir), ("checkpoint_dir", checkpoint_dir)):
        if folder is not None and Path(folder).exists() and not Path(folder).is_dir():
            raise ConfigError(f"{key}={folder!r} is a file, not a folder; give a folder's path")
