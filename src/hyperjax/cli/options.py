"""Command-line options shared by the commands that read a run config (``train``, ``predict``, ``plan``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from hyperjax.config import Config, load_config


def add_config_arguments(parser: argparse.ArgumentParser, *, config_help: str, hardware: bool) -> None:
    """The config file, ``--set`` overrides and (optionally) ``--hardware``."""
    parser.add_argument("config", help=config_help)
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key by its dotted name (repeatable), e.g. --set parallel.tensor=4",
    )
    if hardware:
        parser.add_argument("--hardware", help="hardware preset name or path (default: the config's)")


def config_from_args(args: argparse.Namespace, extra: Sequence[str] = ()) -> Config:
    """Load the config named on the command line with its ``--set`` (and ``--hardware``) overrides.

    Raises:
      ConfigError: as :func:`hyperjax.load_config`.
    """
    sets = [*args.sets, *extra]
    if getattr(args, "hardware", None):
        sets.append(f"hardware={args.hardware}")
    return load_config(args.config, sets)
