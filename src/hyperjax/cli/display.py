"""Terminal output shared by the commands: one rich console, sized for logs as well as terminals."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from rich.console import Console

from hyperjax.errors import HyperjaxError
from hyperjax.files import cannot_make


def console() -> Console:
    """A console at least 120 columns wide, so tables stay intact when output goes to a file or pipe."""
    return Console(width=max(120, shutil.get_terminal_size((120, 24)).columns), highlight=False, soft_wrap=False)


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_axes(axes: dict[str, int]) -> str:
    """``{"data": 12, "tensor": 32}`` -> ``"data=12,tensor=32"`` (the form ``--axes`` takes)."""
    return ",".join(f"{k}={v}" for k, v in axes.items())


def check_writable(path: str, flag: str) -> None:
    """Fail early, before any work, when ``path`` cannot be written.

    Raises:
      HyperjaxError: the folder does not exist or is not writable, or ``path`` is a folder or another
        file that is not a regular one (a device, pipe or socket, which the rename would replace).
    """
    target = Path(os.path.realpath(path))  # written through a symbolic link, to the file it names
    folder = target.parent
    if target.is_dir():
        raise HyperjaxError(f"{flag} {path!r} is a folder; give a file path")
    if target.exists() and not target.is_file():
        raise HyperjaxError(f"{flag} {path!r} is not a regular file (a device, pipe or socket); give a file path")
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise HyperjaxError(f"{flag} {path!r}: folder {str(folder)!r} does not exist or is not writable")
    why = cannot_make(folder)  # the file is written beside its target, then renamed over it
    if why:
        raise HyperjaxError(f"{flag} {path!r}: {why}")


def check_folder(path: str, flag: str) -> None:
    """Fail early, before any work, when files cannot be written in folder ``path``; the run makes it when it
    first writes there, so a run refused or failed before that leaves no empty folder behind.

    Raises:
      HyperjaxError: ``path`` is a file, or it (or the nearest of its parents that exists) cannot be written.
    """
    if Path(path).exists() and not Path(path).is_dir():
        raise HyperjaxError(f"{flag} {path!r} is a file; give a folder (it is created if missing)")
    why = cannot_make(path)
    if why:
        raise HyperjaxError(f"{flag} {path!r} cannot be written ({why}); choose a folder you can write")


def fmt_count(n: float) -> str:
    """``3.26e6`` -> ``"3.26 M"``, ``1.75e11`` -> ``"175.00 B"``."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def print_unpriced(*rows: tuple[str, ...]) -> None:
    """The ``shard`` overrides a run honours and its estimate does not price, if any; given the overrides of
    each row of a table, the rows they concern when not all."""
    named = list(dict.fromkeys(k for row in rows for k in row))
    if not named:
        return
    flagged = [str(i) for i, row in enumerate(rows, 1) if row]
    which = f" (rows {', '.join(flagged)})" if len(flagged) < len(rows) else ""
    console().print(
        f"  [yellow]not priced[/yellow]{which}: {', '.join(named)}; the estimate places every tensor by the "
        "standard sharding rules, which these overrides change (a run places them as set)",
        soft_wrap=True,
    )
