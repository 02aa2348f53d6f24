"""``resolve_rl(config)``: an ``rl:`` config decided into its two phases, each an ordinary resolved run.

The rollout's run is the model laid out by ``rl.rollout.parallel`` on its devices, serving
``prompts_per_step x group_size`` completions (its ``serve`` section says so, for the cost model); the
learner's is the model laid out by ``rl.learner.parallel`` on its devices, training on those completions
(``train.global_batch``), ``rl.updates`` optimizer steps per iteration. Both go through
:func:`hyperjax.resolve`, so every check a run gets, each phase gets, its errors naming the phase's keys.
"""

from __future__ import annotations

import dataclasses

from hyperjax.config import Config, EmulateConfig, ParallelConfig, RLRun, Run, ServeConfig
from hyperjax.config.parallel import FEATURES, MODIFIERS, TRAINING_ONLY, modifier_value, set_modifiers
from hyperjax.emulate import plan_processes
from hyperjax.errors import ConfigError, EmulationError, HyperjaxError, expect, positive_int, rekeyed
from hyperjax.resolver.resolve import DEFAULT_DEVICES, resolve
from hyperjax.topology import Hardware, load_hardware


def resolve_rl(config: Config, devices: int | None = None, *, hardware: Hardware | str | None = None) -> RLRun:
    """Resolve the ``rl:`` section of ``config`` into its phases.

    Args:
      config: a config with an ``rl:`` section.
      devices: the job's devices (``--devices``); default ``emulate.devices``, else what the phases' devices
        add up to (disaggregated), else 8.
      hardware: the machine, loaded or a preset's name or path (default: ``config.hardware``'s preset).

    Raises:
      ConfigError: devices that do not add up, a prompt and completion longer than ``model.seq_len``, a
        rollout layout generation cannot run, a learner layout the RL step cannot train, or any error
        of either phase's run (naming ``rl.rollout.*`` or ``rl.learner.*``).
    """
    expect(config, Config, "resolve_rl(config): config", "pass hyperjax.load_config(path)")
    r = config.rl
    if r is None:
        raise ConfigError(
            "this config has no rl: section; hyperjax train runs it as supervised training (hyperjax.resolve)"
        )
    if devices is not None:
        devices = positive_int(devices, "devices")
    hw = load_hardware(config.hardware if hardware is None else hardware)
    m = config.model
    if r.top_k is not None and r.top_k > m.vocab:
        raise ConfigError(f"rl.top_k={r.top_k} is more than model.vocab={m.vocab}; use at most {m.vocab}, or null")
    prompt_len = r.prompt_len if r.prompt_len is not None else m.seq_len - r.max_new_tokens
    if prompt_len < 1 or prompt_len + r.max_new_tokens > m.seq_len:
        raise ConfigError(
            f"rl.prompt_len={prompt_len} + rl.max_new_tokens={r.max_new_tokens} = {prompt_len + r.max_new_tokens} "
            f"tokens must fit model.seq_len={m.seq_len} with at least one prompt token; shorten them or raise "
            "model.seq_len"
        )
    if config.offload.policy != "none":
        raise ConfigError(
            f"offload.policy={config.offload.policy!r}: an rl: config's phases keep their weights, optimizer "
            "state, reference and cache on the device; set offload.policy: none"
        )
    if config.emulate.processes not in (None, 1):
        raise ConfigError(
            f"emulate.processes={config.emulate.processes}: an rl: config runs its phases in one process, which "
            "hands the learner's weights to the rollout's layout; drop emulate.processes"
        )
    total, sizes = _devices(config, devices)
    batch = r.prompts_per_step * r.group_size
    base = learner_config(config)
    check_learner_split(r.learner.parallel)
    learner = _phase(base, "learner", r.learner.parallel, sizes[1], hw)
    if r.rollout_batch is not None and r.rollout_batch > batch:
        raise ConfigError(
            f"rl.rollout_batch={r.rollout_batch} is more than the {batch} completions of an iteration "
            "(rl.prompts_per_step x rl.group_size); use at most that, or null"
        )
    wave = r.rollout_batch or batch
    dp = _rollout_replicas(config, r.rollout.parallel, sizes[0])
    padded = -(-wave // dp) * dp  # all of an iteration's completions (null) are padded to the replicas
    capacity = config.model.moe and config.model.moe.capacity_factor
    if capacity is not None and padded != wave:
        raise ConfigError(
            f"model.moe.capacity_factor={capacity}: a wave's tokens compete for the experts' capacity, and the "
            f"{batch} completions of an iteration padded to {padded} for the rollout's {dp} data-parallel replicas "
            f"would route {padded - wave} copies of the last prompt beside them, so completions would change with "
            f"the layout; set rl.rollout_batch to a multiple of {dp} (every layout then decodes the same waves), "
            "or lay the rollout out over fewer replicas"
        )
    serve = ServeConfig(batch=padded, prompt_len=prompt_len, new_tokens=r.max_new_tokens)
    # the rollout generates: FSDP's FP8 gathers, the learner's, are not its (it holds no FSDP shards)
    fp8 = base.train.fp8 and dataclasses.replace(base.train.fp8, all_gather=False)
    generating = dataclasses.replace(base.train, global_batch=padded, micro_batch=None, microbatches=None, fp8=fp8)
    check_rollout_modifiers(r.rollout.parallel)
    check_rollout_split(r.rollout.parallel)  # before the degrees are resolved: this, not their product, is the fault
    rollout = _phase(
        dataclasses.replace(base, serve=serve, train=generating), "rollout", r.rollout.parallel, sizes[0], hw
    )
    _check_rollout(rollout, r.rollout_batch)
    try:
        processes, limit = plan_processes(total, 1), None
    except EmulationError:
        processes = None
        limit = (
            f"reinforcement learning runs its phases in one process here, which holds at most 256 emulated "
            f"devices; this job has {total}"
        )
    return RLRun(
        config=config,
        devices=total,
        rollout=rollout,
        learner=learner,
        rollout_first=0,
        learner_first=0 if r.placement == "colocated" else sizes[0],
        prompt_len=prompt_len,
        processes=processes,
        emulation_limit=limit,
    )


def learner_config(config: Config) -> Config:
    """``config``'s learning as a supervised config: ``train.global_batch`` the completions of an iteration,
    ``train.steps`` its optimizer steps (iterations x ``rl.updates``), no ``rl:`` section (what ``plan``
    searches the learner's layout on)."""
    r, t = config.rl, config.train
    train = dataclasses.replace(
        t,
        global_batch=r.prompts_per_step * r.group_size,
        steps=t.steps * r.updates,
        warmup_steps=None if t.warmup_steps is None else t.warmup_steps * r.updates,
    )
    return dataclasses.replace(config, rl=None, train=train)


def _devices(config: Config, devices: int | None) -> tuple[int, tuple[int, int]]:
    """The job's devices and each phase's (rollout, learner)."""
    r = config.rl
    a, b = r.rollout.devices, r.learner.devices
    total = devices if devices is not None else config.emulate.devices
    if r.placement == "colocated":
        total = total or a or b or DEFAULT_DEVICES
        for name, n in (("rollout", a), ("learner", b)):
            if n is not None and n != total:
                raise ConfigError(
                    f"rl.{name}.devices={n}, but rl.placement=colocated runs both phases on all {total} devices; "
                    f"drop rl.{name}.devices, set it to {total}, or set rl.placement: disaggregated"
                )
        return total, (total, total)
    if total is None:
        total = a + b if a is not None and b is not None else DEFAULT_DEVICES
    if a is None and b is None:
        a = total // 2
    a = total - b if a is None else a
    b = total - a if b is None else b
    if a < 1 or b < 1 or a + b != total:
        raise ConfigError(
            f"rl.rollout.devices={a} + rl.learner.devices={b} = {a + b}, but the job has {total} devices "
            "(--devices, emulate.devices); make the phases' devices add up to it, each at least 1"
        )
    return total, (a, b)


def _phase(base: Config, name: str, parallel: ParallelConfig, devices: int, hw: Hardware) -> Run:
    """The run of phase ``name`` laid out by ``parallel`` on ``devices`` devices, its errors naming its keys."""
    if parallel.gradient_buckets is None:  # the phases run in one process: XLA's reductions, not buckets
        parallel = dataclasses.replace(parallel, gradient_buckets=False)
    cfg = phase_config(base, name, parallel, devices)
    try:
        return resolve(cfg, hardware=hw)
    except HyperjaxError as e:
        raise _named(e, name) from None


def phase_config(base: Config, name: str, parallel: ParallelConfig, devices: int | None = None) -> Config:
    """``base`` laid out by phase ``name``'s ``parallel`` (on ``devices`` devices, else ``base``'s), checked
    as a config: what the layout asks of the model (experts to spread, heads to split), its errors naming
    ``rl.<name>.*`` keys.

    Raises:
      ConfigError: the layout refused for the model, naming the phase's key.
    """
    emulate = base.emulate if devices is None else EmulateConfig(devices=devices)
    try:
        return dataclasses.replace(base, parallel=parallel, emulate=emulate)
    except HyperjaxError as e:
        raise _named(e, name) from None


def _named(e: HyperjaxError, name: str) -> HyperjaxError:
    """``e`` with the phase's keys for the run's (``parallel.tensor`` as ``rl.<name>.parallel.tensor``)."""
    message = rekeyed(str(e), "parallel", f"rl.{name}.parallel.")
    message = message.replace("emulate.devices", f"rl.{name}.devices")
    message = message.replace("train.global_batch", "rl.prompts_per_step x rl.group_size (train.global_batch)")
    return type(e)(f"rl.{name}: {message}")


def check_rollout_modifiers(p: ParallelConfig) -> None:
    """The rollout sets no key of :data:`~hyperjax.config.parallel.MODIFIERS` nor another of training's
    (:data:`~hyperjax.config.parallel.TRAINING_ONLY`): each says how training runs a feature, and generation
    reads none of them (its collectives are not overlapped, its weights not gathered by FSDP's schedule, its
    sequence not split, it has no optimizer or gradients)."""
    for key, value in set_modifiers(p).items():
        raise ConfigError(
            f"rl.rollout.parallel.{key}={modifier_value(value)} says how training runs {FEATURES[MODIFIERS[key]]}, "
            f"but the rollout only generates, which reads none of these settings; remove rl.rollout.parallel.{key}"
        )
    unset = ParallelConfig()
    for key in (k for k in TRAINING_ONLY if k not in MODIFIERS and getattr(p, k) != getattr(unset, k)):
        raise ConfigError(
            f"rl.rollout.parallel.{key}={modifier_value(getattr(p, key))} is a training setting (how a training step "
            "shards its optimizer, reduces its gradients or overlaps its work), but the rollout only generates, "
            f"which reads none of them: it would have no effect; remove rl.rollout.parallel.{key}"
        )


def _rollout_replicas(config: Config, p: ParallelConfig, devices: int) -> int:
    """The rollout's data-parallel replicas (data x fsdp x expert) on ``devices`` (1 where the degrees do not
    fit them: resolving the phase then says so)."""
    rest = p.fsdp * p.expert * p.context * p.tensor * p.pipeline
    data = p.data if p.data is not None else max(devices // rest, 1)
    return data * p.fsdp * p.expert


def check_rollout_split(p: ParallelConfig) -> None:
    """The rollout's ``parallel`` sets no layout generation cannot run (:attr:`ParallelConfig.decode_split`)."""
    split = p.decode_split
    if split is not None:
        raise ConfigError(
            f"rl.rollout.parallel.{split[0]}={split[1]}: rollouts are generated by one SPMD program decoding a token "
            "at a time, which a pipeline, a context split or sequence parallelism does not run; lay the rollout out "
            "with data, fsdp, tensor and expert"
        )


def _check_rollout(run: Run, wave: int | None) -> None:
    """A rollout layout generation runs (one SPMD program, no context split: :func:`check_rollout_split`,
    before it is resolved), a wave its replicas divide (all of an iteration's completions, ``wave`` null, are
    padded to a multiple of them)."""
    if run.config.model.vision is not None:
        raise ConfigError("rl: covers language models; this config has a model.vision encoder")
    dp = run.stages[0].data_parallel
    if wave is not None and wave % dp:
        raise ConfigError(
            f"rl.rollout_batch={wave} completions decoded together are split over the rollout's {dp} data-parallel "
            f"replicas (rl.rollout.parallel data x fsdp x expert), which do not divide them; use a multiple of "
            f"{dp}, or null"
        )


def check_learner_split(p: ParallelConfig) -> None:
    """The learner's ``parallel`` is one SPMD program per update: no pipeline, no paired forward and backward
    programs (checked before the degrees are resolved: this, not their product, is the fault)."""
    if p.pipeline > 1:
        raise ConfigError(
            f"rl.learner.parallel.pipeline={p.pipeline}: the learner runs one SPMD program per update; lay it out "
            "with data, fsdp, tensor, context and expert (pipelines are priced by predict for supervised runs)"
        )
    if p.overlap == "fb-pair":
        raise ConfigError(
            "rl.learner.parallel.overlap=fb-pair: the learner runs one SPMD program per update, not paired "
            "forward and backward programs; set it to none or two-microbatch"
        )
