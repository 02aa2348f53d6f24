"""Bring up emulated CPU devices, alone or as one process of a ``jax.distributed`` cluster.

One process holds at most :data:`MAX_DEVICES_PER_PROCESS` CPU devices: above that, XLA's CPU collectives
over sub-groups of the mesh deadlock in their rendezvous. Larger emulated machines are split over several
processes joined by ``jax.distributed`` on this host, or over real hosts.

Across processes, XLA's CPU collectives run over gloo, which keeps one TCP socket per pair of devices that
share a collective group, even inside one process; a collective over every device (a loss average, a
``ppermute``) makes a full mesh. Each emulated device therefore costs about ``devices - 1`` open files, and
the process count is also chosen so that no process passes the open-file limit (``ulimit -n``).
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import re
import resource
import sys

from hyperjax.emulate.launcher import follow_launcher
from hyperjax.errors import EmulationError, integral

MAX_DEVICES_PER_PROCESS = 256
"""The most CPU devices one process may emulate; collectives over sub-groups deadlock above it."""

_FD_RESERVE = 1024  # Python, gRPC, the coordinator and files opened by the program itself
_FDS_PER_PEER = 1.5  # the all-device full mesh plus one context per mesh-axis group shape


_PROCESS_BYTES = 300e6  # resident memory of one emulating process (JAX runtime and its devices), measured


def machine_memory() -> int:
    """Physical memory of this machine in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def open_file_limit() -> int:
    """The open-file limit a process can raise itself to (the hard ``RLIMIT_NOFILE``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if hard == resource.RLIM_INFINITY else hard


def files_per_device(devices: int) -> int:
    """Open files one emulated device needs in a multi-process job of ``devices`` devices (gloo sockets)."""
    return math.ceil(_FDS_PER_PEER * (devices - 1))


def _fits(devices: int, processes: int, fd_limit: int) -> bool:
    per = devices // processes
    if per > MAX_DEVICES_PER_PROCESS:
        return False
    return processes == 1 or per * files_per_device(devices) + _FD_RESERVE <= fd_limit


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """How this process joins a multi-process job.

    Attributes:
      coordinator: ``HOST:PORT`` of process 0's coordinator service.
      num_processes: processes in the job.
      process_id: this process's index, ``0 <= process_id < num_processes``.
    """

    coordinator: str
    num_processes: int
    process_id: int

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[^:\s]+:\d{1,5}", self.coordinator):
            raise EmulationError(
                f"--coordinator {self.coordinator!r} is not HOST:PORT; give e.g. --coordinator 10.0.0.1:1234"
            )
        if self.num_processes < 1:
            raise EmulationError(f"--num-processes {self.num_processes} must be at least 1")
        if not 0 <= self.process_id < self.num_processes:
            raise EmulationError(
                f"--process-id {self.process_id} must be in [0, {self.num_processes}) for "
                f"--num-processes {self.num_processes}"
            )


def plan_processes(devices: int, processes: int | None = None, *, fd_limit: int | None = None) -> int:
    """Choose how many processes emulate ``devices`` CPU devices.

    Args:
      devices: emulated devices in all.
      processes: a requested process count, or ``None`` for the fewest that divide ``devices`` evenly,
        keep each process at or under :data:`MAX_DEVICES_PER_PROCESS` devices and, with several
        processes, under the open-file limit.
      fd_limit: the open-file limit per process (default: this machine's, see :func:`open_file_limit`).

    Returns:
      The process count.

    Raises:
      EmulationError: non-positive counts, a count that does not divide ``devices``, more than
        :data:`MAX_DEVICES_PER_PROCESS` devices in one process, or more open files than the limit.
    """
    if not integral(devices) or devices < 1:
        raise EmulationError(f"devices={devices!r} must be a positive integer (emulate.devices / --devices)")
    devices = int(devices)
    limit = open_file_limit() if fd_limit is None else fd_limit
    if processes is None:
        processes = next((p for p in range(1, devices + 1) if devices % p == 0 and _fits(devices, p, limit)), devices)
        if not _fits(devices, processes, limit):
            raise EmulationError(
                f"{devices} devices cannot be emulated on this machine: even one device per process needs "
                f"{files_per_device(devices) + _FD_RESERVE} open files, above the limit of {limit} (ulimit -n)"
            )
        _check_memory(devices, processes)
        return processes
    if not isinstance(processes, int) or processes < 1:
        raise EmulationError(f"processes={processes!r} must be a positive integer (emulate.processes / --processes)")
    if devices % processes:
        raise EmulationError(
            f"{devices} devices cannot be split evenly over {processes} processes; choose a process count "
            f"that divides {devices} (emulate.processes / --processes)"
        )
    per = devices // processes
    if per > MAX_DEVICES_PER_PROCESS:
        need = plan_processes(devices, fd_limit=limit)
        raise EmulationError(
            f"{per} devices per process ({devices} devices over {_processes(processes)}) exceeds the "
            f"{MAX_DEVICES_PER_PROCESS}-device limit of one process: XLA's CPU collectives over sub-groups "
            f"deadlock above it. Use at least {need} processes (--processes {need}) or leave the count unset."
        )
    if not _fits(devices, processes, limit):
        need = plan_processes(devices, fd_limit=limit)
        raise EmulationError(
            f"{per} devices per process ({devices} devices over {_processes(processes)}) would need about "
            f"{per * files_per_device(devices) + _FD_RESERVE} open files per process (gloo keeps a socket per "
            f"pair of devices in a collective: {files_per_device(devices)} per device), above the limit of "
            f"{limit} (ulimit -n). Use at least {need} processes (--processes {need}) or leave the count unset."
        )
    _check_memory(devices, processes)
    return processes


def _check_memory(devices: int, processes: int) -> None:
    need = processes * _PROCESS_BYTES
    if need > 0.8 * machine_memory():
        raise EmulationError(
            f"{devices} devices need {processes} emulating processes here (open-file limit), about "
            f"{need / 2**30:.0f} GiB of memory, more than this machine's {machine_memory() / 2**30:.0f} GiB allows; "
            "emulate fewer devices or raise the open-file limit (ulimit -n) so fewer processes suffice"
        )


def _processes(n: int) -> str:
    return f"{n} process{'es' if n != 1 else ''}"


def start_devices(local_devices: int, cluster: Cluster | None = None, *, platform: str = "cpu") -> None:
    """Start the JAX backend with ``local_devices`` emulated CPU devices in this process.

    Must run before anything asks JAX for devices. With ``cluster``, joins the distributed job first.

    Args:
      local_devices: CPU devices this process holds (ignored for ``platform="auto"``).
      cluster: the job to join, or ``None`` for a single process.
      platform: ``"cpu"`` to emulate devices, ``"auto"`` to use whatever accelerators the host has.

    Raises:
      EmulationError: the backend already runs with another device count (fewer, in a single process:
        the run then uses the first ``local_devices``), or too many devices.
    """
    import jax

    if platform not in ("cpu", "auto"):
        raise EmulationError(
            f"platform={platform!r} must be 'cpu' (emulated CPU devices) or 'auto' (the host's accelerators)"
        )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if cluster is not None:
        follow_launcher()
        _silence_native_stdout()
    if platform == "cpu":
        plan_processes(local_devices, 1)
        try:
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", local_devices)
        except RuntimeError:
            pass  # backend already started (e.g. inside a test session); the count is checked below
    if cluster is not None:
        if platform == "cpu" and cluster.coordinator.rsplit(":", 1)[0] in ("127.0.0.1", "localhost"):
            _compile_once()  # processes of one host
        jax.distributed.initialize(
            coordinator_address=cluster.coordinator,
            num_processes=cluster.num_processes,
            process_id=cluster.process_id,
        )
    # one process already running more devices (a test session, a notebook) lends a run its first ones
    held = len(jax.local_devices())
    if platform == "cpu" and (held < local_devices if cluster is None else held != local_devices):
        raise EmulationError(
            f"the JAX backend already runs with {held} local devices, not the "
            f"{local_devices} asked for; start the devices before any other JAX call"
        )


def _compile_once() -> None:
    """Compile each program spanning several processes of this host once, in the first of them (the one
    holding its lowest device), which hands the executable to the others through the coordinator (JAX's
    ``jax_share_binary_between_hosts``).

    Without it every emulating process compiles the same program at once on the same cores: 12 processes for
    384 devices. Sharing needs equal cache keys in every process. JAX keys a CPU program by its own process's
    topology, different in each, so the key here hashes the program's devices as the job sees them (id,
    process, kind); the processes share one host, so one machine's CPU features. XLA's own caches are off:
    their folders enter the key (they serve GPUs only). A compilation-cache folder, where one is configured,
    must be the same for every process, as the launcher's children inherit it.
    """
    import jax
    from jax._src import cache_key

    if not hasattr(cache_key, "_hash_accelerator_config"):
        return  # another JAX: every process compiles for itself, as without sharing

    def devices_key(hash_obj, devices) -> None:
        for d in devices.flat:
            cache_key._hash_string(hash_obj, f"{d.id}:{d.process_index}:{d.device_kind}")

    cache_key._hash_accelerator_config = devices_key
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    jax.config.update("jax_share_binary_between_hosts", True)


def _silence_native_stdout() -> None:
    # gloo prints a line per device per communicator to the C++ stdout (thousands at 384 devices), with no
    # switch to turn it off. Python keeps the real stdout on a duplicate; native fd 1 goes to /dev/null.
    sys.stdout.flush()
    keep = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    sys.stdout = io.TextIOWrapper(os.fdopen(keep, "wb", buffering=0), write_through=True, line_buffering=True)
