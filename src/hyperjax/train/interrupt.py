"""Ctrl-C while training: the step under way finishes, the run stops there, and what it writes is whole.

An interrupt raised at any point of a step lands wherever the main thread is: inside a jitted call, inside
orbax's wait for a background checkpoint write (which then logs its own traceback, and can leave a half-deleted
older checkpoint behind or hang on the thread it was joining). So the first Ctrl-C only asks the loop to
stop; the loop ends after the step, writes that step's checkpoint, waits for every write and raises
:class:`Interrupted`. A second Ctrl-C stops at once, as Python's default does.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator


class Interrupted(KeyboardInterrupt):
    """Training stopped by Ctrl-C after a whole step (the message says which, and what was written)."""


@contextlib.contextmanager
def stop_on_interrupt(*, single_process: bool) -> Iterator[Callable[[], bool]]:
    """Within it, the first SIGINT sets a flag (read by the function yielded) instead of raising; the next
    raises :class:`KeyboardInterrupt`. Only on the main thread of a single process whose SIGINT is not ignored
    (the processes of a job are stopped by their launcher); elsewhere the flag stays unset."""
    previous = signal.getsignal(signal.SIGINT)
    if not single_process or threading.current_thread() is not threading.main_thread() or previous is signal.SIG_IGN:
        yield lambda: False
        return
    asked: list[bool] = []

    def ask(signum: int, frame: object) -> None:
        if asked:
            raise KeyboardInterrupt
        asked.append(True)
        print("\nstopping after this step (Ctrl-C again stops at once)", file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, ask)
    try:
        yield lambda: bool(asked)
    finally:
        signal.signal(signal.SIGINT, previous)
