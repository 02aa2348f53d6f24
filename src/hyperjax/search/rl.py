"""The layout search of a reinforcement-learning config: the split of the devices between rollout and learning,
and each phase's layout, ranked by the predicted iteration (:func:`hyperjax.cost.rl.estimate_rl`).

- **Splits** (disaggregated): the rollout takes ``k`` blocks of the machine's granule, the learner the rest;
  the granule is the largest power of two that divides the devices and leaves at least eight blocks (32
  devices, a CloudMatrix384 node, on 384). Colocated: both phases on every device.
- **The learner's layout** on its devices: the training search (:func:`hyperjax.search.plan`) restricted to
  one SPMD program, its fastest candidates that fit beside the reference copy.
- **The rollout's layout** on its devices: every tensor degree (and, for a mixture of experts, expert
  degree) with data parallelism over the rest, each with the largest wave of completions decoded together
  (``rl.rollout_batch``, halving from all of them) that fits; the fastest iteration wins.
- **Where state waits**: the reference on the device or in host memory (``rl.reference``) and, colocated,
  the optimizer state kept or sent to the host during rollouts (``rl.offload_optimizer``).

Every answer is an ``rl:`` config resolved by :func:`hyperjax.resolve_rl` and priced on the public path.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Any

from hyperjax.config import Config, ParallelConfig, PhaseConfig, check_key
from hyperjax.config.parallel import MODIFIERS, without_idle_exchange
from hyperjax.cost.rl import RLEstimate, estimate_rl
from hyperjax.errors import ConfigError, HyperjaxError, expect, positive_int
from hyperjax.resolver import (
    check_learner_split,
    check_preset,
    check_rollout_modifiers,
    check_rollout_split,
    learner_config,
    phase_config,
    resolve_rl,
)
from hyperjax.search.answer import NothingFits
from hyperjax.search.planner import plan
from hyperjax.search.strategies import apply, divisors, untried
from hyperjax.topology import Hardware, load_hardware

LEARNER_TRIES = 3
"""The training search's fastest learner layouts tried on each split (the reference copy may not fit the first)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLSearch:
    """What an RL search found.

    Attributes:
      best: the fastest fitting answers, fastest first (each an estimate of a resolved ``rl:`` config).
      splits: the device splits searched.
      priced: iterations priced.
      seconds: wall time of the search.
    """

    best: list[RLEstimate]
    splits: int
    priced: int
    seconds: float


def splits(devices: int, placement: str) -> list[int]:
    """The rollout's device counts searched (see the module's docstring)."""
    if placement == "colocated":
        return [devices]
    granule = 1
    while devices % (granule * 2) == 0 and devices // (granule * 2) >= 8:
        granule *= 2
    return [k * granule for k in range(1, devices // granule)]


RUNTIME = (*MODIFIERS, "dispatcher", "dispatcher_sms", "dp_overlap", "gradient_buckets")
"""The ``parallel.*`` keys that say how the framework runs a layout, not the layout: a phase keeps its own
through the search, which chooses the degrees (a learner candidate's overrides reset a modifier whose feature
it turns off; the rollout sets none)."""


def runtime_parallel(own: ParallelConfig, **degrees: Any) -> ParallelConfig:
    """A phase's layout: ``degrees`` over the defaults, with ``own``'s :data:`RUNTIME` settings."""
    return dataclasses.replace(ParallelConfig(), **({k: getattr(own, k) for k in RUNTIME} | degrees))


def with_layouts(
    cfg: Config, rollout: tuple[int, dict[str, Any]], learner: tuple[int, dict[str, Any]], wave: int | None = None
) -> Config:
    """``cfg`` with each phase's devices and ``parallel.*`` overrides (a learner candidate may also set
    ``train.*`` keys), and the rollout's wave (``rl.rollout_batch``; ``None``: all of an iteration's at once)."""
    r = cfg.rl
    colocated = r.placement == "colocated"

    def phase(n: int, overrides: dict[str, Any], own: ParallelConfig) -> PhaseConfig:
        degrees = {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith("parallel.")}
        # a dispatcher where the degrees exchange no tokens resets, as a candidate's does
        p = without_idle_exchange(runtime_parallel(own, **degrees), keep=tuple(degrees))
        return PhaseConfig(devices=None if colocated else n, parallel=p)

    trains = {k.split(".", 1)[1]: v for k, v in learner[1].items() if k.startswith("train.")}  # fp8.all_gather too
    rl = dataclasses.replace(
        r, rollout=phase(*rollout, r.rollout.parallel), learner=phase(*learner, r.learner.parallel)
    )
    rl = dataclasses.replace(rl, rollout_batch=wave)
    devices = rollout[0] if colocated else rollout[0] + learner[0]
    return dataclasses.replace(
        cfg,
        rl=rl,
        train=apply(cfg.train, trains),
        emulate=dataclasses.replace(cfg.emulate, devices=devices, processes=None),
    )


def rollout_layouts(cfg: Config, devices: int) -> list[dict[str, Any]]:
    """Every tensor degree (and expert degree of a mixture of experts) on ``devices``, data over the rest."""
    m = cfg.model
    out = []
    for t in divisors(devices):
        if t > m.heads:
            continue
        experts = [e for e in divisors(devices // t) if m.moe.experts % e == 0] if m.moe is not None else [1]
        out += [{"parallel.tensor": t, "parallel.expert": e} for e in experts]
    return out


def waves(cfg: Config, replicas: int = 1) -> list[int | None]:
    """The rollout's waves searched, largest first: ``rl.rollout_batch`` when the config sets it, else all of
    an iteration's completions at once (``None``) and every halving, each rounded up to a multiple of the
    rollout's ``replicas`` (those that round up to all of them are ``None``)."""
    r = cfg.rl
    if r.rollout_batch is not None:
        return [r.rollout_batch]
    every = r.prompts_per_step * r.group_size
    out: list[int | None] = [None]
    n = every // 2
    while n >= 1:
        rounded = -(-n // replicas) * replicas
        out.append(None if rounded >= every else rounded)
        if n % 2:
            break
        n //= 2
    return list(dict.fromkeys(out))


def residences(cfg: Config) -> list[dict[str, Any]]:
    """Where the reference and (colocated) the optimizer state wait: the config's choice, and the host for
    each where the config keeps it on the device (each adds host-link time and saves device memory)."""
    r = cfg.rl
    references = [r.reference] + (["host"] if r.reference == "device" and r.kl_coef > 0 else [])
    optimizers = [r.offload_optimizer] + ([True] if r.placement == "colocated" and not r.offload_optimizer else [])
    return [{"reference": a, "offload_optimizer": b} for a in references for b in optimizers]


ROLLOUT_HELD = ("tensor", "expert", "data")
"""The rollout's degrees a search can hold: those its layouts vary, and data (the rest)."""


def held_split(cfg: Config, devices: int, held: Mapping[str, Any]) -> list[int]:
    """The rollout's device counts searched: :func:`splits`, or the one ``held`` gives (``rl.rollout.devices``,
    or what ``rl.learner.devices`` leaves).

    Raises:
      ConfigError: held counts that do not make up ``devices``, or that a colocated run has no use for.
    """
    given = {k: v for k, v in held.items() if k in ("rl.rollout.devices", "rl.learner.devices")}
    if not given:
        return splits(devices, cfg.rl.placement)
    named = ", ".join(f"{k}={v}" for k, v in given.items())
    if cfg.rl.placement == "colocated":
        raise ConfigError(f"{named}: rl.placement=colocated runs both phases on every device; drop it")
    rollout = given.get("rl.rollout.devices", devices - given.get("rl.learner.devices", 0))
    if not 0 < rollout < devices or devices - rollout != given.get("rl.learner.devices", devices - rollout):
        raise ConfigError(f"{named} do not split --devices {devices} into two phases of a device or more; fix them")
    return [rollout]


def plan_rl(
    cfg: Config,
    devices: int,
    *,
    keep: int = 5,
    hardware: Hardware | str | None = None,
    held: Mapping[str, Any] | None = None,
) -> RLSearch:
    """Rank the splits and layouts of ``cfg``'s ``rl:`` section on ``devices`` devices by predicted iteration.
    ``held`` (dotted keys, as ``plan --set`` gives them) fixes a phase's devices (``rl.rollout.devices``,
    ``rl.learner.devices``), the learner's searched degrees (``rl.learner.parallel.tensor``, ...) and the
    rollout's :data:`ROLLOUT_HELD` degrees.

    Raises:
      ConfigError: no split and layouts fit (naming the leanest tried), or none has the ``held`` settings.
    """
    start = time.perf_counter()
    expect(cfg, Config, "plan_rl(cfg): cfg", "pass hyperjax.load_config(path)")
    if cfg.rl is None:
        raise ConfigError("this config has no rl: section; plan its training with hyperjax.plan")
    devices = positive_int(devices, "plan_rl(cfg, devices): devices")
    keep = positive_int(keep, "plan_rl(keep=)")
    if held is not None and not isinstance(held, Mapping):
        raise ConfigError(
            f"plan_rl(held=): held is {held!r}; pass a mapping of dotted keys to values, e.g. "
            "{'rl.learner.parallel.tensor': 2}"
        )
    held = {key: check_key(key, "plan_rl(held=)", value) for key, value in (held or {}).items()}
    if cfg.rl.placement == "disaggregated" and devices < 2:
        raise ConfigError(
            f"--devices {devices}: rl.placement=disaggregated gives each phase devices of its own, so it needs 2 "
            "or more; plan with more devices or rl.placement: colocated"
        )
    learner_held = {
        f"parallel.{k.rsplit('.', 1)[1]}": v for k, v in held.items() if k.startswith("rl.learner.parallel.")
    }
    rollout_held = {k.rsplit(".", 1)[1]: v for k, v in held.items() if k.startswith("rl.rollout.parallel.")}
    unset = ParallelConfig()  # what every rollout layout searched has apart from its held degrees
    rollout_held = {k: v for k, v in rollout_held.items() if k in ROLLOUT_HELD or v != getattr(unset, k)}
    if set(rollout_held) - set(ROLLOUT_HELD):
        key = sorted(set(rollout_held) - set(ROLLOUT_HELD))[0]
        raise ConfigError(
            f"rl.rollout.parallel.{key}: the rollout's layouts searched vary its {' and '.join(ROLLOUT_HELD[:2])} "
            f"degrees with data over the rest, so {key} cannot be held; drop it, or price that layout with predict"
        )
    hw = load_hardware(cfg.hardware if hardware is None else hardware)
    base = learner_config(cfg)  # the learner searched as it will run: its own phase's runtime settings
    base = dataclasses.replace(base, parallel=runtime_parallel(cfg.rl.learner.parallel))
    check_preset(base, hw)  # what the config asks of the device, named before any split is tried
    check_rollout_modifiers(cfg.rl.rollout.parallel)  # refused by every rollout: named, not a lost candidate
    check_rollout_split(cfg.rl.rollout.parallel)
    check_learner_split(cfg.rl.learner.parallel)
    for name in ("rollout", "learner"):  # what a held degree asks of the model (experts to spread), named
        phase_config(base, name, getattr(cfg.rl, name).parallel)
    tried = held_split(cfg, devices, held)
    if rollout_held and not any(_holds(layout, n, rollout_held) for n in tried for layout in rollout_layouts(cfg, n)):
        raise _rollout_degree_refused(cfg, devices, tried, rollout_held, ", ".join(f"{k}={v}" for k, v in held.items()))
    found: list[RLEstimate] = []
    priced = 0
    refused: HyperjaxError | None = None  # the last reason a candidate did not resolve
    learners_refused: dict[int, HyperjaxError] = {}  # by the learner's devices: no layout of one program there
    for n_rollout in tried:
        n_learner = devices if cfg.rl.placement == "colocated" else devices - n_rollout
        try:  # one program, accumulating micro-batches
            learners = plan(
                base, n_learner, keep=LEARNER_TRIES, hardware=hw, where=learner_held, accumulate=True, one_program=True
            ).best
        except HyperjaxError as e:
            learners_refused[n_learner] = e
            fits = isinstance(e, NothingFits)
            refused = ConfigError(
                f"the learner's {n_learner} devices: no layout of one program the training search tries "
                + ("fits there" if fits else f"is valid there (the batch, heads and layers must split over them): {e}")
            )
            continue
        for learner in learners:
            best: RLEstimate | None = None
            for layout in rollout_layouts(cfg, n_rollout):
                if not _holds(layout, n_rollout, rollout_held):
                    continue
                replicas = n_rollout // layout["parallel.tensor"]  # data x expert
                for wave in waves(cfg, replicas):
                    fitted = False
                    for waits in residences(cfg):
                        try:
                            chosen = with_layouts(cfg, (n_rollout, layout), (n_learner, learner.overrides), wave)
                            est = estimate_rl(
                                resolve_rl(
                                    dataclasses.replace(chosen, rl=dataclasses.replace(chosen.rl, **waits)), hardware=hw
                                )
                            )
                        except HyperjaxError as e:
                            refused = e
                            continue
                        priced += 1
                        if est.fits:
                            fitted = True
                            best = est if best is None or est.iteration_s < best.iteration_s else best
                    if fitted:  # smaller waves decode the same tokens slower
                        break
            if best is not None:
                found.append(best)
                break  # the learner's faster layouts came first
    named = ", ".join(f"{k}={v}" for k, v in held.items())
    every = len(learners_refused) == len(tried)  # every split's learner search was refused
    full = [n for n, e in learners_refused.items() if isinstance(e, NothingFits)]
    if not found and every and full:  # the learner lays out, but fits nowhere
        raise ConfigError(
            f"no split of {devices} devices fits the learner{f' with {named}' if held else ''}: its layouts of one "
            f"program (on {', '.join(map(str, sorted(full)))} devices) exceed the device memory; "
            f"{'drop them to search them all, or use' if held else 'use'} more devices or a smaller "
            "rl.prompts_per_step x rl.group_size"
        )
    if not found and learner_held and every and all(untried(base, n, learner_held) for n in learners_refused):
        raise _learner_degree_refused(base, devices, named, learner_held, sorted(learners_refused))
    if not found and held and not priced:
        why = f" (the last one tried: {refused})" if refused is not None else ""
        raise ConfigError(
            f"no split of {devices} devices and layouts the search tries has {named}{why}; drop them to search "
            "them all, or give values among those it tries (hyperjax plan --json lists each candidate's layouts)"
        )
    if not found and not priced and refused is not None:
        raise ConfigError(f"no split of {devices} devices between rollout and learning resolves: {refused}")
    if not found:
        raise ConfigError(
            f"no split of {devices} devices between rollout and learning fits the device memory "
            f"({len(tried)} splits, {priced} layouts priced); use more devices or a smaller rl.prompts_per_step "
            "x rl.group_size"
        )
    found.sort(key=lambda e: e.iteration_s)
    return RLSearch(best=found[:keep], splits=len(tried), priced=priced, seconds=time.perf_counter() - start)


def _holds(layout: Mapping[str, int], devices: int, held: Mapping[str, Any]) -> bool:
    """Whether a rollout ``layout`` on ``devices`` devices has the ``held`` degrees (data over the rest)."""
    degrees = {"tensor": layout["parallel.tensor"], "expert": layout["parallel.expert"]}
    degrees["data"] = devices // degrees["tensor"] // degrees["expert"]
    return all(degrees[k] == v for k, v in held.items())


def _rollout_degree_refused(
    cfg: Config, devices: int, tried: list[int], held: Mapping[str, Any], named: str
) -> ConfigError:
    """The refusal of held rollout degrees (``held``) that no rollout layout on the device counts ``tried`` has:
    what the model bounds them by, else the device counts they must make up (``named``: every held setting)."""
    m = cfg.model
    tensor, expert = held.get("tensor"), held.get("expert")
    if isinstance(tensor, int) and tensor > m.heads:
        why = f"rl.rollout.parallel.tensor={tensor} splits the heads, and the model has model.heads={m.heads}"
    elif isinstance(expert, int) and m.moe is not None and m.moe.experts % expert:
        why = f"rl.rollout.parallel.expert={expert} must divide model.moe.experts={m.moe.experts}"
    else:
        keys = [k for k in ROLLOUT_HELD if isinstance(held.get(k), int)]
        product = math.prod(held[k] for k in keys)
        counts = ", ".join(map(str, tried))
        whole = len(keys) == len(ROLLOUT_HELD)
        why = (
            f"{' x '.join(f'rl.rollout.parallel.{k}' for k in keys)} = {product} "
            + ("must be" if whole else "must divide")
            + f" the rollout's devices, searched on {counts}"
            + ("" if cfg.rl.placement == "colocated" else f" (the learner keeps the rest of the {devices})")
        )
    return ConfigError(
        f"no split of {devices} devices gives the rollout a layout with {named}: {why}; drop them to search them "
        "all, or give values among those the search tries (hyperjax plan --json lists each candidate's layouts)"
    )


def _learner_degree_refused(
    base: Config, devices: int, named: str, learner_held: dict[str, Any], counts: list[int]
) -> ConfigError:
    """The refusal of held learner degrees (``learner_held``) that no learner device count ``counts`` tried can
    have: the model sizes they must divide, else the device counts (``named``: every held setting)."""
    split = {
        k: v for k, v in learner_held.items() if k in ("parallel.tensor", "parallel.context") and isinstance(v, int)
    }
    product = math.prod(split.values())
    model = untried(base, product, learner_held)  # on a device count the degrees divide: what the model refuses
    if model is not None:
        why = model.replace("parallel.", "rl.learner.parallel.")
    else:
        keys = " x ".join(f"rl.learner.{k}" for k in split)
        value = f"{keys}={product}" if len(split) == 1 else f"{keys} = {product}"
        why = (
            f"the learner was searched on {counts[0]} devices, which {value} does not divide"
            if len(counts) == 1
            else f"the learner was searched on {', '.join(map(str, counts))} devices, none of which {value} divides"
        )
    return ConfigError(
        f"no split of {devices} devices leaves the learner a layout of one program with {named}: {why}; drop them "
        "to search them all, or give values among those the search tries (hyperjax plan --json lists each "
        "candidate's layouts)"
    )
