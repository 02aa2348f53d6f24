"""Run a command's work on the emulated machine: in this process, as spawned processes, or joining a job.

Commands that need devices (``selftest``, ``train``) share the joining flags and this one decision.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from hyperjax.config import Run
from hyperjax.emulate import Cluster, Exit, free_port, plan_processes, run_job, start_devices
from hyperjax.errors import EmulationError


def add_join_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that make a command join a running job instead of spawning one."""
    join = parser.add_argument_group("joining a running job instead of spawning one")
    join.add_argument("--coordinator", metavar="ADDR", help="process 0's coordinator, HOST:PORT")
    join.add_argument("--num-processes", type=int, metavar="N", help="processes in the job")
    join.add_argument("--process-id", type=int, metavar="I", help="this process's index")
    join.add_argument(
        "--platform",
        choices=("cpu", "auto"),
        default="cpu",
        help="emulated CPU devices, or this host's accelerators",
    )


def joining(args: argparse.Namespace) -> list[str]:
    """The joining flags given on the command line (``--coordinator``, ``--num-processes``, ``--process-id``).

    Raises:
      EmulationError: ``--platform auto`` without them (spawned or single processes emulate CPU devices).
    """
    given = [
        flag
        for flag, value in (
            ("--coordinator", args.coordinator),
            ("--num-processes", args.num_processes),
            ("--process-id", args.process_id),
        )
        if value is not None
    ]
    if args.platform != "cpu" and not given:
        raise EmulationError(
            f"--platform {args.platform} runs on this host's accelerators as a process joining a job, but no "
            "--coordinator, --num-processes and --process-id are given: without them the devices are emulated "
            "CPU devices; drop --platform, or add the joining flags (--num-processes 1 --process-id 0 and a "
            "free --coordinator 127.0.0.1:PORT for one host)"
        )
    return given


def check_joined_processes(args: argparse.Namespace, asked: int | None, key: str) -> None:
    """A job joined with ``--num-processes N`` runs in ``N`` processes: a count ``asked`` elsewhere (``key``)
    must agree.

    Raises:
      EmulationError: naming both counts and the fix.
    """
    if args.num_processes is not None and asked is not None and asked != args.num_processes:
        raise EmulationError(
            f"{key} {asked} asks for {asked} process(es), but --num-processes {args.num_processes} joins a job of "
            f"{args.num_processes}; drop {key}, or make the two agree"
        )


def run_on_devices(
    args: argparse.Namespace,
    *,
    devices: int,
    processes: int,
    child_args: Sequence[str],
    work: Callable[[], int],
) -> int:
    """Start the devices and run ``work``, or spawn ``processes`` children that each do.

    Args:
      args: the parsed command line (its joining flags decide whether this process joins a job).
      devices: devices in the whole job.
      processes: processes to spawn when not joining (1: run here).
      child_args: the ``hyperjax`` command line each spawned child runs (without the joining flags).
      work: what to run once the devices are up; returns the exit status.

    Raises:
      EmulationError: incomplete joining flags, or an impossible device split.
    """
    given = joining(args)
    if given:
        if len(given) < 3:
            raise EmulationError("--coordinator, --num-processes and --process-id must be given together")
        cluster = Cluster(coordinator=args.coordinator, num_processes=args.num_processes, process_id=args.process_id)
        plan_processes(devices, cluster.num_processes)
        start_devices(devices // cluster.num_processes, cluster, platform=args.platform)
        leave(work())
    if processes == 1:
        start_devices(devices)
        return work()
    return spawn(devices=devices, processes=processes, child_args=child_args).status


def leave(status: int) -> NoReturn:
    """End a process of a multi-process job with ``status`` at once: leave the job, flush the output and
    exit without tearing the interpreter down (with a few hundred emulated devices and their gloo
    sockets, the teardown takes seconds per process and does nothing a finished job needs)."""
    import jax

    jax.distributed.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def spawn(*, devices: int, processes: int, child_args: Sequence[str]) -> Exit:
    """Run ``hyperjax CHILD_ARGS`` as ``processes`` supervised processes joined into one job of ``devices``."""
    port = free_port()
    print(
        f"[launcher] {devices} devices in {processes} processes x {devices // processes}, coordinator 127.0.0.1:{port}"
    )
    common = [
        sys.executable,
        "-m",
        "hyperjax",
        *child_args,
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        str(processes),
    ]
    return run_job([[*common, "--process-id", str(i)] for i in range(processes)])


def check_state_fits(run: Run, local: int) -> None:
    """The parameters, gradients and optimizer state of this machine's ``local`` devices fit its memory (each
    device's share as the cost model counts it, the fullest stage's for every device: a bound from above).

    Raises:
      EmulationError: both sizes, and what to do instead.
    """
    from hyperjax.cost import estimate
    from hyperjax.emulate import machine_memory

    gib = estimate(run).memory_per_device_gib
    need = sum(gib[k] for k in ("params", "gradients", "optimizer")) * 2**30 * local
    if need > machine_memory():
        raise EmulationError(
            f"training this model on {local} emulated devices holds about {need / 2**30:,.0f} GiB "
            f"of parameters, gradients and optimizer state ({need / local / 2**30:.2f} GiB a device), more than this "
            f"machine's {machine_memory() / 2**30:.0f} GiB of memory; train a smaller model here (--set "
            "model.layers=..., model.d_model=...), or price this one with hyperjax predict / plan"
        )


BATCH_BYTES_PER_TOKEN = 16
"""Host bytes a step's token windows take per token while they are cut (int64) and split into inputs and
targets (int32)."""


def check_batch_memory(tokens: int, what: str) -> None:
    """A step's ``tokens`` (``what`` sets how many) fit this machine's memory as host token arrays.

    Raises:
      EmulationError: the bytes, the machine's memory and the fix.
    """
    from hyperjax.emulate import machine_memory

    need, have = tokens * BATCH_BYTES_PER_TOKEN, machine_memory()
    if need > have:
        raise EmulationError(
            f"{what}: a step's {tokens:,} tokens take about {need / 2**30:,.0f} GiB as host arrays, more than this "
            f"machine's {have / 2**30:.0f} GiB of memory; train with fewer sequences a step here, or price this run "
            "with hyperjax predict / plan"
        )
