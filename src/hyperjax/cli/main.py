"""The ``hyperjax`` command line: one sub-command per task, user mistakes reported without a traceback."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from importlib.metadata import version

from hyperjax.errors import HyperjaxError

COMMANDS = {
    "topology": "topology",
    "selftest": "selftest",
    "train": "train",
    "generate": "generate",
    "predict": "predict",
    "plan": "plan",
    "import-hf": "hf:add_import_parser",
    "export-hf": "hf:add_export_parser",
}
"""The sub-commands: the module of :mod:`hyperjax.cli` that adds each (its ``add_parser``, or the function
after the colon) and sets the ``run`` it calls."""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser for every sub-command, or for ``only`` that one (a command then loads only what it
    needs: each emulated process of a 384-device job starts faster)."""
    parser = argparse.ArgumentParser(
        prog="hyperjax",
        description="A JAX runtime that treats a 384-accelerator supernode as one computer.",
        epilog="Each command has its own --help, with examples: hyperjax train --help.",
    )
    parser.add_argument("--version", action="version", version=f"hyperjax {version('hyperjax')}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS if only is None else (only,):
        module, _, adder = COMMANDS[name].partition(":")
        getattr(importlib.import_module(f"hyperjax.cli.{module}"), adder or "add_parser")(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a mistake in the input)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv[0] if argv and argv[0] in COMMANDS else None).parse_args(argv)
    try:
        return args.run(args)
    except HyperjaxError as e:
        print(f"hyperjax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader of stdout (``| head``) stopped early: not an error of the command's
        _quiet_stdout()  # what Python would flush into the closed pipe at exit goes nowhere
        return 141  # as a command killed by SIGPIPE ends in a shell
    except KeyboardInterrupt as e:  # a training run stopped after a whole step says which (Interrupted)
        print(f"hyperjax {args.command}: interrupted{f' {e}' if str(e) else ''}", file=sys.stderr)
        return 130


def _quiet_stdout() -> None:
    """Point stdout at the null device (where it is a file descriptor)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced stream (a test's capture) has none
        return
    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)


if __name__ == "__main__":
    sys.exit(main())
