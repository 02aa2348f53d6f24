"""What the strategy search answers: each candidate with its prediction, the search's tallies, and the error
that says no strategy fits (carrying ``plan --json``'s ``fits: false`` report)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hyperjax.config import Run
from hyperjax.cost import Estimate, unpriced_overrides
from hyperjax.errors import ConfigError


def plain(overrides: dict[str, Any]) -> dict[str, Any]:
    """Config overrides as JSON values: an MPMD candidate's submeshes as mappings."""
    return {k: [dataclasses.asdict(s) for s in v] if k == "mpmd.submeshes" else v for k, v in overrides.items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One strategy and its prediction.

    Attributes:
      overrides: the config keys that select it (``parallel.*``, ``train.micro_batch``, ``train.recompute``),
        with the config's modifiers whose feature it turns off reset (:func:`~hyperjax.search.strategies.selected`).
      estimate: its predicted step (its ``run`` is the resolved candidate).
      offload: the placement that makes it fit, as ``--json`` prints it, when it needs one.
    """

    overrides: dict[str, Any]
    estimate: Estimate
    offload: dict[str, Any] | None = None

    @property
    def run(self) -> Run:
        """The candidate, resolved."""
        return self.estimate.run

    def to_dict(self) -> dict[str, Any]:
        """The candidate as JSON-ready data: its overrides, the rows of each micro-batch and their count as
        the step runs them (``micro_batch_rows``, ``microbatches``), the headline predictions, and the
        config's ``shard`` overrides they do not price (``unpriced``, see
        :func:`hyperjax.cost.unpriced_overrides`)."""
        e = self.estimate
        out = {
            **plain(self.overrides),
            "micro_batch_rows": e.run.micro_batch,
            "microbatches": e.run.microbatches,
            "step_time_s": e.step_time_s,
            "mfu": e.mfu,
            "peak_gib": e.memory_per_device_gib["peak"],
            "fits": e.fits,
            "unpriced": list(unpriced_overrides(e.run)),
        }
        return out | ({"offload": self.offload} if self.offload is not None else {})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Search:
    """What a search found.

    Attributes:
      best: the fastest strategies that fit, fastest first.
      searched: strategies considered (every valid combination of degrees and options).
      priced: estimates computed (a strategy is priced once per recomputation setting tried).
      fitting: strategies priced that fit.
      seconds: wall time of the search.
    """

    best: list[Candidate]
    searched: int
    priced: int
    fitting: int
    seconds: float


class NothingFits(ConfigError):
    """No strategy fits the device-memory budget; ``report`` is the ``fits: false`` answer of ``plan --json``."""

    def __init__(self, message: str, report: dict[str, Any]) -> None:
        super().__init__(message)
        self.report = report
