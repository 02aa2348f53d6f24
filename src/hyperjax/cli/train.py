"""``hyperjax train CONFIG``: train a model on the emulated mesh under a HyperShard strategy.

The configuration is parsed and the whole plan validated before any device starts. Runs of more than
256 devices go through the launcher transparently: the same command at 8 or 384 devices.
"""

from __future__ import annotations

import argparse

from hyperjax.cli.display import check_writable, console
from hyperjax.cli.launching import add_join_arguments, run_on_devices
from hyperjax.cli.options import add_config_arguments, config_from_args
from hyperjax.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model on the emulated mesh", description=__doc__)
    add_config_arguments(p, config_help="YAML config, e.g. configs/quickstart.yaml", hardware=False)
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--metrics-out", metavar="FILE.jsonl", help="write one JSON object per step")
    p.add_argument("--out-dir", metavar="DIR", help="where the loss curve goes (default: runs/CONFIG-NAME)")
    p.add_argument("--explain", action="store_true", help="print where every parameter lives, then exit")
    add_join_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hyperjax.train.plan import plan_run

    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps {args.steps} must be a positive integer")
    extra = [] if args.steps is None else [f"train.steps={args.steps}"]
    cfg = config_from_args(args, extra)
    sets = [*args.sets, *extra]  # what spawned processes are told
    plan = plan_run(cfg)
    out_dir = args.out_dir or str(Path("runs") / Path(args.config).stem)
    if args.metrics_out:
        check_writable(args.metrics_out, "--metrics-out")
    child = [
        "train",
        args.config,
        *(a for s in sets for a in ("--set", s)),
        "--set",
        f"emulate.processes={plan.processes}",
        "--out-dir",
        out_dir,
        *(["--metrics-out", args.metrics_out] if args.metrics_out else []),
        *(["--explain"] if args.explain else []),
    ]
    return run_on_devices(
        args, devices=plan.devices, processes=plan.processes, child_args=child, work=lambda: _train(plan, args, out_dir)
    )


def _train(plan, args: argparse.Namespace, out_dir: str) -> int:
    import jax
    from flax import nnx

    from hyperjax.models import build_model
    from hyperjax.topology import make_mesh
    from hyperjax.train.loop import summary, train

    out = console()
    lead = jax.process_index() == 0
    t = plan.config.train
    if args.explain:
        mesh = make_mesh(plan.hardware, plan.axes)
        state = nnx.state(nnx.eval_shape(lambda: build_model(plan.config.model, seed=t.seed)))
        if lead:
            out.print(plan.strategy.explain(state, mesh).table(f"parameters under {plan.describe()}"))
        return 0
    if lead:
        out.print(
            f"training {plan.config.model.family} on {plan.devices} emulated {plan.hardware.name} devices "
            f"({jax.process_count()} process(es)); strategy: {plan.describe()}"
        )
    if lead and plan.offload is not None:
        from hyperjax.cli.predict import print_offload

        print_offload(plan.offload)
    result = train(plan, metrics_out=args.metrics_out, out_dir=out_dir)
    if lead:
        s = summary(plan, result)
        out.print(
            f"[bold]summary[/bold]: {s['params']:,} parameters; strategy {s['strategy']}; mesh "
            + ",".join(f"{k}={v}" for k, v in s["mesh"].items())
        )
        out.print(f"  loss {s['first_loss']:.4f} -> {s['final_loss']:.4f} over {len(result.losses)} steps")
        out.print(f"  per-device memory of the compiled step: {s['memory_per_device_bytes'] / 2**20:.1f} MiB")
        out.print(f"  emulated step time: {s['emulated_step_time_s'] * 1e3:.1f} ms (median after compilation)")
        out.print(f"  loss curve: {out_dir}/loss.png")
        _print_prediction(plan)
    return 0


def _print_prediction(plan) -> None:
    """The cost model's prediction for the same run on the real machine of its preset."""
    import dataclasses

    from hyperjax.cli.predict import print_estimate
    from hyperjax.cost import estimate

    cfg = plan.config
    if cfg.model.vision is not None:
        print("  prediction: a vision-language model is priced by hyperjax.cost.mpmd (python benchmarks/mpmd.py)")
        return
    same = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, data=plan.axes["data"]))
    if plan.offload is not None:
        from hyperjax.offload.plan import with_offload

        print_estimate(with_offload(plan.offload), plan.hardware.name)
        return
    print_estimate(estimate(same, plan.hardware), plan.hardware.name)
