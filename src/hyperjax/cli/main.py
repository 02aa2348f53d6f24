"""The ``hyperjax`` command line: one sub-command per task, user mistakes reported without a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hyperjax.cli import plan, predict, selftest, topology, train
from hyperjax.errors import HyperjaxError


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every sub-command."""
    parser = argparse.ArgumentParser(
        prog="hyperjax", description="A JAX runtime that treats a 384-accelerator supernode as one computer."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    topology.add_parser(sub)
    selftest.add_parser(sub)
    train.add_parser(sub)
    predict.add_parser(sub)
    plan.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a mistake in the input)."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except HyperjaxError as e:
        print(f"hyperjax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"hyperjax {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
