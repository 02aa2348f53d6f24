"""The emulated supernode: CPU devices in one or several processes, and a collective selftest."""

from hyperjax.emulate.launcher import Exit, describe_exit, free_port, launch, run_job
from hyperjax.emulate.runtime import MAX_DEVICES_PER_PROCESS, Cluster, machine_memory, plan_processes, start_devices

__all__ = [
    "MAX_DEVICES_PER_PROCESS",
    "Cluster",
    "Exit",
    "describe_exit",
    "free_port",
    "launch",
    "machine_memory",
    "plan_processes",
    "run_job",
    "start_devices",
]
