"""orbax's abandoned reads kept off the terminal: a failed restore reports one line, not the tracebacks of the
reads it left behind (:func:`reading`)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def reading(checkpoint: Path) -> Iterator[None]:
    """Let the reads of ``checkpoint`` (one step's folder) that a failed restore abandons end silently.

    orbax reads every array concurrently on an event loop it closes as soon as one read fails. The others
    then end in one of two ways, each of which would print over the one-line error: they complete into the
    closed loop (a ``RuntimeError: Event loop is closed`` traceback, through ``sys.excepthook`` or
    ``sys.unraisablehook`` depending on the thread), or they fail themselves and are collected unread
    (asyncio's "... exception was never retrieved", logged with the failed read, which names its file).
    Only those are dropped: the exact closed-loop error, and unread failures whose error names a file in a
    checkpoint a restore started reading and did not finish (the block raised); every other error is reported
    as before, and a block that ends cleanly read the whole checkpoint, so nothing of it was abandoned.
    """
    READ.add(folder_key(checkpoint))
    logging.getLogger("asyncio").addFilter(reported_unread)  # once: a logger holds a filter once
    if not getattr(sys.excepthook, "_hyperjax_quiet", False):
        quiet_closed_loop()
    yield
    READ.discard(folder_key(checkpoint))


def quiet_closed_loop() -> None:
    """Drop the exact ``RuntimeError: Event loop is closed`` that a read completing into orbax's closed loop
    raises, from ``sys.excepthook`` and ``sys.unraisablehook``; pass every other error on."""
    previous_except, previous_unraisable = sys.excepthook, sys.unraisablehook

    def closed_loop(error: BaseException | None) -> bool:
        return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"

    def excepthook(kind: type, error: BaseException, tb: Any) -> None:
        if not closed_loop(error):
            previous_except(kind, error, tb)

    def unraisablehook(unraisable: Any) -> None:
        if not closed_loop(unraisable.exc_value):
            previous_unraisable(unraisable)

    excepthook._hyperjax_quiet = True  # type: ignore[attr-defined]
    sys.excepthook, sys.unraisablehook = excepthook, unraisablehook


READ: set[str] = set()  # the checkpoints whose restore started and did not finish, as folder paths with a separator
UNREAD = ("Future exception was never retrieved", "Task exception was never retrieved")  # asyncio's words


def folder_key(checkpoint: Path) -> str:
    return os.path.join(str(checkpoint.absolute()), "")


def reported_unread(record: logging.LogRecord) -> bool:
    """False (drop it) for asyncio's report of an unread failure whose error names a file in a checkpoint of
    ``READ``: a read a failed restore abandoned, whose failure the restore's own error already named."""
    error = record.exc_info[1] if record.exc_info else None
    if error is None or not record.getMessage().startswith(UNREAD):
        return True
    text = str(error)
    return not any(folder in text for folder in READ)
