"""Spawn and supervise the processes of an emulated multi-process machine.

The launcher starts one child per process on a free 127.0.0.1 port, streams every child's output with a
``[pN]`` prefix, and watches them: when any child dies, it stops the others and returns non-zero within
seconds, naming the process and how it ended. It never waits on a hung collective: a child whose peer
died is killed, not waited for.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

_POLL_S = 0.1
_GRACE_S = 3.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(returncode: int) -> str:
    """Say how a process ended, e.g. ``"was killed by SIGKILL"`` or ``"exited with status 3"``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


LAUNCHER_PID_ENV = "HYPERJAX_LAUNCHER_PID"


def follow_launcher() -> None:
    """In a launched child: die with the launcher, even when it is killed outright.

    Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, set by the child itself (a ``preexec_fn`` would make
    ``subprocess`` fork a multithreaded JAX process instead of spawning).
    """
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    if os.getppid() != int(launcher):  # the launcher died before the signal was armed
        os._exit(1)


def _stream(proc: subprocess.Popen, prefix: str, lock: threading.Lock) -> None:
    assert proc.stdout is not None  # set by Popen(stdout=PIPE)
    with proc.stdout:
        for line in iter(proc.stdout.readline, b""):
            with lock:
                sys.stdout.write(f"{prefix}{line.decode(errors='replace')}")
                sys.stdout.flush()


@dataclasses.dataclass(frozen=True)
class Exit:
    """How a launched job ended.

    Attributes:
      status: 0 when every child exited 0; otherwise the failed child's status, or 128 + its signal.
      process: the index of the child that failed first (``None`` when none did).
      cause: how it ended, e.g. ``"was killed by SIGKILL"`` (empty when none failed).
    """

    status: int
    process: int | None = None
    cause: str = ""


def launch(
    child_args: Sequence[Sequence[str]],
    *,
    exit_timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
) -> int:
    """Run one child process per argument list and supervise them until all end.

    Args:
      child_args: the command line of each child, in process order.
      exit_timeout_s: once one child has finished successfully, how long the others may take to finish
        before they are killed as hung.
      env: extra environment variables for every child.

    Returns:
      0 when every child exited 0; otherwise non-zero (the failed child's status, or 128 + its signal).
    """
    return run_job(child_args, exit_timeout_s=exit_timeout_s, env=env).status


def run_job(
    child_args: Sequence[Sequence[str]],
    *,
    exit_timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
) -> Exit:
    """:func:`launch`, saying which child failed and how."""
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", LAUNCHER_PID_ENV: str(os.getpid()), **(env or {})}
    lock = threading.Lock()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_exit) if main_thread else None
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    try:
        for args in child_args:
            procs.append(
                subprocess.Popen(
                    list(args),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=child_env,
                )
            )
        _note(lock, "started " + ", ".join(f"process {i} (pid {p.pid})" for i, p in enumerate(procs)))
        threads += [
            threading.Thread(target=_stream, args=(p, f"[p{i}] ", lock), daemon=True) for i, p in enumerate(procs)
        ]
        for t in threads:
            t.start()
        status = _supervise(procs, lock, exit_timeout_s)
        for t in threads:
            t.join(timeout=_GRACE_S)
        return status
    except KeyboardInterrupt:
        _note(lock, "interrupted; stopping all processes")
        _stop(procs)
        return Exit(130, None, "interrupted")
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        _stop(procs)
        for p in procs:
            if p.stdout is not None and not p.stdout.closed and not any(t.is_alive() for t in threads):
                p.stdout.close()


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through launch()'s finally, which stops the children


def _supervise(procs: list[subprocess.Popen], lock: threading.Lock, exit_timeout_s: float) -> Exit:
    first_done: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        for i, code in enumerate(codes):
            if code not in (None, 0):
                others = [j for j, c in enumerate(codes) if c is None]
                _note(
                    lock,
                    f"emulated process {i} (pid {procs[i].pid}) {describe_exit(code)}; "
                    f"stopping the other {len(others)} running process(es)",
                    error=True,
                )
                _stop(procs)
                return Exit(code if code > 0 else 128 - code, i, describe_exit(code))
        if all(c == 0 for c in codes):
            return Exit(0)
        now = time.monotonic()
        if first_done is None and any(c == 0 for c in codes):
            first_done = now
        if first_done is not None and now - first_done > exit_timeout_s:
            hung = [i for i, c in enumerate(codes) if c is None]
            _note(
                lock,
                f"process(es) {hung} still running {exit_timeout_s:.0f} s after another finished; "
                "stopping them as hung",
                error=True,
            )
            _stop(procs)
            return Exit(1, hung[0], f"hung {exit_timeout_s:.0f} s after another process finished")
        time.sleep(_POLL_S)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        if p.poll() is None:
            p.kill()
            p.wait()


def _note(lock: threading.Lock, message: str, *, error: bool = False) -> None:
    with lock:
        stream = sys.stderr if error else sys.stdout
        stream.write(f"[launcher] {message}\n")
        stream.flush()
