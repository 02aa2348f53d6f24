"""``hyperjax train CONFIG``: train a model on the emulated mesh under a HyperShard strategy.

The configuration is resolved (:func:`hyperjax.resolve`) and checked before any device starts. Runs of more than
256 devices go through the launcher transparently: the same command at 8 or 384 devices.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hyperjax.cli.display import check_folder, check_writable, console
from hyperjax.cli.launching import (
    add_join_arguments,
    check_batch_memory,
    check_joined_processes,
    check_state_fits,
    joining,
    run_on_devices,
)
from hyperjax.cli.options import add_command, add_config_arguments, config_from_args, path
from hyperjax.config import Run, load_config
from hyperjax.errors import ConfigError, EmulationError
from hyperjax.files import write_json
from hyperjax.resolver import elastic_overrides, resolve
from hyperjax.train import Prepared, prepare
from hyperjax.train.breakdown import check_profiled
from hyperjax.train.checkpoint import last_progress, saved_steps
from hyperjax.train.data import check_windows
from hyperjax.train.loop import check_resume


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "train",
        usage="CONFIG [--set KEY=VALUE ...] [options]",
        summary="train a model on the emulated mesh",
        description=(
            "Train a model on the emulated mesh under the config's strategy. The config is resolved and checked "
            "before any device starts; runs of more than 256 devices go through the launcher: the same command at"
            " 8 or 384 devices."
        ),
        examples=[
            "hyperjax train configs/quickstart.yaml",
            "hyperjax train configs/quickstart.yaml --set parallel.fsdp=8 --steps 20",
            "hyperjax train configs/quickstart.yaml --plan-only --json   # the resolved run",
            "hyperjax train configs/quickstart.yaml --checkpoint-dir ck --max-restarts 1",
        ],
    )
    add_config_arguments(p, config_help="YAML config, e.g. configs/quickstart.yaml", hardware=False)
    p.add_argument("--steps", type=int, metavar="N", help="override train.steps")
    p.add_argument("--metrics-out", type=path, metavar="FILE", help="write one JSON object per step to FILE (.jsonl)")
    p.add_argument("--out-dir", type=path, metavar="DIR", help="where the loss curve goes (default runs/CONFIG-NAME)")
    p.add_argument("--explain", action="store_true", help="print where every parameter lives, then exit")
    p.add_argument(
        "--plan-only",
        action="store_true",
        help="print the resolved run and exit; no device starts",
    )
    p.add_argument("--json", action="store_true", help="with --plan-only: the run as one JSON object")
    p.add_argument(
        "--profile",
        action="store_true",
        help="time the last step's collectives (collectives.json)",
    )
    ckpt = p.add_argument_group("checkpoints and failures")
    ckpt.add_argument(
        "--checkpoint-dir", type=path, metavar="DIR", help="checkpoint every train.checkpoint_every steps"
    )
    ckpt.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in DIR")
    ckpt.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="restart from the last checkpoint when a process dies",
    )
    ckpt.add_argument(
        "--elastic",
        action="store_true",
        help="re-derive the strategy for a new device count",
    )
    ckpt.add_argument("--devices", type=int, metavar="N", help="run on N devices (overrides emulate.devices)")
    add_join_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    _check_flags(args)
    steps = [] if args.steps is None else [f"train.steps={args.steps}"]
    cfg = config_from_args(args, steps)
    check_joined_processes(args, cfg.emulate.processes, "emulate.processes")
    if args.num_processes is not None:  # a process of a job: the run is resolved for the job's processes
        steps.append(f"emulate.processes={args.num_processes}")
        cfg = config_from_args(args, steps)
    sets = [*args.sets, *steps]  # what children are told
    if cfg.rl is not None:
        from hyperjax.cli import train_rl

        return train_rl.run(args, cfg)
    if args.devices is not None and args.elastic:
        moved, run = elastic_overrides(_loader(args, sets), args.devices)
        sets += moved
    else:
        sets += [] if args.devices is None else [f"emulate.devices={args.devices}"]  # the children's count
        run = resolve(cfg, args.devices)
    ready = prepare(run)  # everything train checks before it starts a device
    if run.config.model.vision is None:  # a decoder reads windows of train.data
        check_windows(run.config.train.data, run.config.model.seq_len)
    if args.plan_only:
        return _print_run(run, json_out=args.json)
    if run.processes is None:
        raise EmulationError(f"{run.emulation_limit}; hyperjax predict still prices this run")
    check_state_fits(run, run.devices if args.num_processes is None else run.devices // args.num_processes)
    t = run.config.train
    check_batch_memory(t.global_batch * (run.config.model.seq_len + 1), f"train.global_batch={t.global_batch}")
    if args.profile:  # before any process starts
        check_profiled(run)
    if args.explain and run.pipelined:  # each stage places its own layers on its own submesh
        split = "mpmd.submeshes" if run.config.mpmd.submeshes else f"parallel.pipeline={run.config.parallel.pipeline}"
        fix = "drop mpmd.submeshes" if run.config.mpmd.submeshes else "set parallel.pipeline=1"
        raise ConfigError(
            f"--explain prints where parameters live in one SPMD program, not in the {len(run.stages)} stages of "
            f"this run ({split}); --plan-only lists each stage's devices and axes, or {fix} to explain one program"
        )
    if args.resume:  # before any folder is made: a checkpoint to continue, of this run and model (its record)
        if not saved_steps(args.checkpoint_dir):
            raise ConfigError(
                f"--resume: no checkpoint in --checkpoint-dir {args.checkpoint_dir!r} to continue from; drop --resume "
                "to start afresh there, or give the folder a run wrote its checkpoints to"
            )
        check_resume(args.checkpoint_dir, run)
    out_dir = args.out_dir or str(Path("runs") / Path(args.config).stem)
    if args.metrics_out:
        check_writable(args.metrics_out, "--metrics-out")
    if not args.explain:  # --explain writes nothing: no folder is made for it
        check_folder(out_dir, "--out-dir")
    if args.checkpoint_dir:
        check_folder(args.checkpoint_dir, "--checkpoint-dir")
        earlier = saved_steps(args.checkpoint_dir)
        if earlier and not args.resume:
            raise ConfigError(
                f"--checkpoint-dir {args.checkpoint_dir!r} already holds checkpoints (steps "
                f"{', '.join(map(str, earlier))}); pass --resume to continue that run, or give an empty folder"
            )

    def child(sets: list[str], processes: int, resume: bool) -> list[str]:
        return [
            "train",
            args.config,
            *(a for s in sets for a in ("--set", s)),
            "--set",
            f"emulate.processes={processes}",
            *([] if args.explain else ["--out-dir", out_dir]),
            *(["--metrics-out", args.metrics_out] if args.metrics_out else []),
            *(["--explain"] if args.explain else []),
            *(["--profile"] if args.profile else []),
            *(["--checkpoint-dir", args.checkpoint_dir] if args.checkpoint_dir else []),
            *(["--resume"] if resume else []),
        ]

    if args.max_restarts == 0 or args.explain:
        return run_on_devices(
            args,
            devices=run.devices,
            processes=run.processes,
            child_args=child(sets, run.processes, args.resume),
            work=lambda: _train(ready, args, out_dir),
        )
    return _supervise(args, run, sets, child)


def _check_flags(args: argparse.Namespace) -> None:
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps {args.steps} must be a positive integer")
    if args.devices is not None and args.devices < 1:
        raise ConfigError(f"--devices {args.devices} must be a positive integer")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts} must be 0 or more")
    needs_dir = [flag for flag, on in (("--resume", args.resume), ("--max-restarts", args.max_restarts)) if on]
    if needs_dir and not args.checkpoint_dir:
        raise ConfigError(
            f"{needs_dir[0]} needs --checkpoint-dir, the folder that holds (or will hold) the checkpoints"
        )
    if args.max_restarts and args.coordinator is not None:
        raise ConfigError("--max-restarts supervises the processes it launches; do not combine it with --coordinator")
    if args.explain and args.plan_only:
        raise ConfigError(
            "--explain prints where every parameter lives on the started devices; --plan-only starts "
            "none: drop one of them"
        )
    writes = {"--metrics-out": args.metrics_out, "--out-dir": args.out_dir, "--checkpoint-dir": args.checkpoint_dir}
    written = [flag for flag, value in writes.items() if value is not None]
    if written and args.plan_only:
        raise ConfigError(
            f"{written[0]} names where training writes, but --plan-only prints the run and trains nothing; "
            "drop one of them"
        )
    training = {"--steps": args.steps is not None, "--resume": args.resume, "--max-restarts": args.max_restarts}
    trained = [flag for flag in writes if writes[flag] is not None] + [flag for flag, on in training.items() if on]
    if trained and args.explain:
        raise ConfigError(
            f"{trained[0]} sets how training runs or where it writes, but --explain prints where every parameter "
            "lives and trains nothing; drop one of them"
        )
    if args.profile and (args.plan_only or args.explain):
        raise ConfigError("--profile times the last training step; it does nothing with --plan-only or --explain")
    if args.platform != "cpu" and args.plan_only:
        raise ConfigError(
            f"--platform {args.platform} chooses the devices a job runs on, but --plan-only prints the run and "
            "starts no device; drop one of them"
        )
    given = joining(args)
    if given and args.plan_only:
        raise ConfigError(
            f"{given[0]} joins a running job, but --plan-only prints the run and starts no device; drop one of them"
        )
    if args.json and not args.plan_only:
        raise ConfigError("--json prints the resolved run; use it with --plan-only")
    if args.elastic and not (args.max_restarts or args.resume or args.devices):
        raise ConfigError(
            "--elastic changes the device count of a restart or a resume; add --max-restarts N or --resume"
        )


def _supervise(args: argparse.Namespace, run: Run, sets: list[str], child) -> int:
    """Run the job in launched processes; when one dies, restart from the latest checkpoint (``--max-restarts``)."""
    from hyperjax.cli.launching import spawn

    devices, processes, resume = run.devices, run.processes, args.resume
    for attempt in range(args.max_restarts + 1):
        ended = spawn(devices=devices, processes=processes, child_args=child(sets, processes, resume))
        if ended.status == 0:
            return 0
        if ended.status == 2:  # a child found a mistake in the input; running it again would not help
            return 2
        if ended.process is None:  # interrupted (Ctrl-C, SIGTERM): the user stops the job, not a failure
            return ended.status
        if attempt == args.max_restarts:
            _say(f"process {ended.process} {ended.cause}; no restarts left (--max-restarts {args.max_restarts})")
            return ended.status
        steps = saved_steps(args.checkpoint_dir)
        latest = steps[-1] if steps else None
        reached = last_progress(args.checkpoint_dir) or 0
        if args.elastic and processes > 1:
            lost = devices // processes
            moved, new_run = elastic_overrides(_loader(args, sets), devices - lost)
            sets = [*sets, *moved]
            devices, processes = new_run.devices, new_run.processes
            where = f"on {devices} devices ({lost} dropped with process {ended.process}; strategy {new_run.describe()})"
        else:
            where = f"on {devices} devices"
        start = "the start" if latest is None else f"the checkpoint of step {latest}"
        replayed = reached - (latest or 0)
        _say(
            f"restart {attempt + 1}/{args.max_restarts}: process {ended.process} {ended.cause} after step {reached}; "
            f"resuming from {start} {where}; {replayed} step(s) replayed"
            + (f" ({(latest or 0) + 1}-{reached})" if replayed > 0 else "")
        )
        resume = latest is not None
    raise AssertionError("unreachable")


def _loader(args: argparse.Namespace, sets: list[str]):
    """``more -> Config``: the run's config file with ``sets``, then ``more`` (for elastic re-planning)."""
    return lambda more: load_config(args.config, [*sets, *more])


def _say(message: str) -> None:
    import sys

    print(f"[launcher] {message}", file=sys.stderr, flush=True)


def _print_run(run: Run, *, json_out: bool) -> int:
    """``--plan-only``: the run train would start, as ``predict`` prints it."""
    if json_out:
        print(json.dumps({"run": run.to_dict()}, indent=2))
        return 0
    out = console()
    where = f"{run.processes} process(es)" if run.processes else f"not emulated here: {run.emulation_limit}"
    out.print(
        f"plan only: {run.config.model.family} on {run.devices} emulated {run.hardware.name} devices "
        f"({where}); strategy: {run.describe()}",
        soft_wrap=True,
    )
    for stage in run.stages:
        last = stage.first_device + stage.devices - 1
        out.print(f"  {stage.name}: {stage.describe()} (devices {stage.first_device}-{last})")
    return 0


def _train(ready: Prepared, args: argparse.Namespace, out_dir: str) -> int:
    import jax
    from flax import nnx

    from hyperjax.models import build_model
    from hyperjax.topology import make_mesh
    from hyperjax.train import summary, train

    out = console()
    lead = jax.process_index() == 0
    run, t = ready.run, ready.run.config.train
    if args.explain:
        mesh = make_mesh(run.hardware, run.axes, devices=jax.devices()[: run.devices])
        state = nnx.state(nnx.eval_shape(lambda: build_model(run.config.model, seed=t.seed)))
        if lead:
            out.print(ready.strategy.explain(state, mesh).table(f"parameters under {run.describe()}"))
        return 0
    if lead:
        out.print(
            f"training {run.config.model.family} on {run.devices} emulated {run.hardware.name} devices "
            f"({jax.process_count()} process(es)); strategy: {run.describe()}",
            soft_wrap=True,
        )
    if lead and ready.offload is not None:
        from hyperjax.cli.predict import print_offload

        print_offload(ready.offload)
    result = train(
        ready,
        metrics_out=args.metrics_out,
        out_dir=out_dir,
        checkpoint_dir=args.checkpoint_dir,
        resume=args.resume,
        profile=args.profile,
    )
    if lead:
        s = summary(run, result)
        meshes = [",".join(f"{k}={v}" for k, v in stage["mesh"].items()) for stage in s["stages"]]
        where = (
            f"mesh {meshes[0]}"
            if len(meshes) == 1
            else "meshes "
            + " | ".join(f"{stage['name']} {mesh}" for stage, mesh in zip(s["stages"], meshes, strict=True))
        )
        out.print(f"[bold]summary[/bold]: {s['params']:,} parameters; strategy {s['strategy']}; {where}")
        out.print(f"  loss {s['first_loss']:.4f} -> {s['final_loss']:.4f} over {len(result.losses)} steps")
        held = (  # a schedule of per-chunk programs is measured by the state it holds, not its activations
            "held state (parameters, gradient accumulators, optimizer state; activations not measured)"
            if run.staged
            else "compiled step"
        )
        out.print(f"  per-device memory of the {held}: {s['memory_per_device_bytes'] / 2**20:.1f} MiB")
        out.print(f"  emulated step time: {s['emulated_step_time_s'] * 1e3:.1f} ms (median after compilation)")
        out.print(f"  loss curve: {out_dir}/loss.png")
        if result.expert_load is not None:
            out.print(expert_load_table(run, result))
        if result.collectives:
            out.print(collectives_table(result))
            write_json(Path(out_dir) / "collectives.json", s)
            out.print(f"  collectives of the last step: {out_dir}/collectives.json")
        _print_prediction(ready)
    return 0


def collectives_table(result: Any) -> Any:
    """Where the last step's collectives spent their time on process 0's devices, slowest first."""
    from rich.table import Table

    step = result.step_times_s[-1]
    table = Table(title=f"collectives of the last step ({step:.2f} s, profiled on process 0)")
    for name in (
        "collective",
        "devices per group",
        "processes per group",
        "count",
        "arrays",
        "MiB",
        "seconds",
        "share",
    ):
        table.add_column(name, justify="left" if name == "collective" else "right")
    for c in result.collectives:
        share = f"{c.seconds / step:.1%}"
        table.add_row(
            c.kind,
            str(c.participants),
            str(c.processes),
            str(c.count),
            str(c.arrays),
            f"{c.bytes / 2**20:.2f}",
            f"{c.seconds:.3f}",
            share,
        )
    return table


def expert_load_table(run: Run, result: Any) -> Any:
    """The last step's routed copies per expert, per MoE layer: least and most loaded, max over mean."""
    from rich.table import Table

    m = run.config.model
    layers = [i for i in range(m.layers) if m.is_moe(i)]
    table = Table(title=f"expert load in the last step ({m.moe.experts} experts, top-{m.moe.top_k})")
    for name in ("layer", "min", "mean", "max", "max / mean", "busiest expert"):
        table.add_column(name, justify="right")
    for layer, row in zip(layers, result.expert_load, strict=True):
        mean = sum(row) / len(row)
        busiest = max(range(len(row)), key=row.__getitem__)
        table.add_row(
            str(layer), f"{min(row):,.0f}", f"{mean:,.1f}", f"{max(row):,.0f}", f"{max(row) / mean:.2f}", str(busiest)
        )
    last = result.records[-1] if result.records else {}
    if "dropped_fraction" in last:
        table.caption = f"dropped for capacity: {last['dropped_fraction']:.2%} of routed copies"
    return table


def _print_prediction(ready: Prepared) -> None:
    """The cost model's prediction for the same run on the real machine of its preset."""
    from hyperjax.cli.predict import print_estimate
    from hyperjax.cost import estimate
    from hyperjax.offload import with_offload

    print_estimate(with_offload(ready.offload) if ready.offload is not None else estimate(ready.run))
