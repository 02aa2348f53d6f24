"""Command-line options shared by the commands: a sub-command's help page, and the options of the commands
that read a run config (``train``, ``predict``, ``plan``, ``generate``)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from hyperjax.config import Config, load_config
from hyperjax.errors import ConfigError


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's own, but the examples keep their lines."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def add_command(
    sub: argparse._SubParsersAction,
    name: str,
    *,
    usage: str,
    summary: str,
    description: str,
    examples: Sequence[str],
) -> argparse.ArgumentParser:
    """A sub-command whose ``--help`` fits a screen: one paragraph, the options, then examples.

    Args:
      sub: the parent parser's sub-parsers.
      name: the command's name.
      usage: what follows ``hyperjax NAME`` on its usage line: the required arguments, then ``[options]``.
      summary: its line in ``hyperjax --help``.
      description: a paragraph of what it does.
      examples: command lines shown at the end, each with a ``#`` comment where it helps.
    """
    return sub.add_parser(
        name,
        usage=f"hyperjax {name} {usage}",
        help=summary,
        description=description,
        epilog="examples:\n" + "\n".join(f"  {e}" for e in examples),
        formatter_class=_HelpFormatter,
    )


def add_config_arguments(parser: argparse.ArgumentParser, *, config_help: str, hardware: bool) -> None:
    """The config file, ``--set`` overrides and (optionally) ``--hardware``."""
    parser.add_argument("config", help=config_help)
    add_set_argument(parser)
    if hardware:
        parser.add_argument("--hardware", help="a preset name or path (default: the config's)")


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE`` (repeatable): a config key overridden by its dotted name."""
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (repeat; a key given again takes the later value), e.g. parallel.tensor=4",
    )


def path(value: str) -> str:
    """An argparse ``type`` for a file or folder flag: an empty or blank path names nothing, so it is refused
    (argparse then exits 2 naming the flag) rather than read as the flag not given."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"{value!r} names no file or folder; give a path")
    return value


def refuse_sets(sets: Sequence[str], keys: Sequence[str], why: str) -> None:
    """Refuse a ``--set`` of one of ``keys`` (or of a key inside one), saying ``why`` and the fix.

    Raises:
      ConfigError: naming the key.
    """
    for item in sets:
        key, equals, _ = item.partition("=")
        key = key.strip()
        if equals and any(key == k or key.startswith(f"{k}.") for k in keys):
            raise ConfigError(f"--set {key}: {why}")


def refuse_serve_sets(sets: Sequence[str], command: str, also: str = "") -> None:
    """Refuse a ``--set serve...`` that ``command`` would not read: ``serve:`` is the workload ``predict
    --inference`` prices, and nothing else reads it (an ``rl:`` rollout's is derived from ``rl:``). ``also``
    ends the message (another fix).

    Raises:
      ConfigError: naming the key and the fix.
    """
    refuse_sets(
        sets,
        ("serve",),
        f"serve: is the serving workload predict --inference prices; {command} does not read it, so the setting "
        f"would have no effect: drop it{also}",
    )


def refuse_training_sets(sets: Sequence[str], command: str) -> None:
    """Refuse a ``--set`` of a training setting ``command`` does not read (:data:`TRAINING_ONLY`: the optimizer,
    the backward, recomputation, the gradient reduction), or of ``offload:``, which places training state and
    ``predict --inference``'s serving: it would have no effect.

    Raises:
      ConfigError: naming the key and the fix.
    """
    from hyperjax.cost.inference import TRAINING_ONLY

    refuse_sets(
        sets,
        (*TRAINING_ONLY, "offload"),
        f"{command} does not read this setting (it shapes training, or the placement train and predict choose), "
        "so it would have no effect: drop it",
    )


def without_training(cfg: Config, *, offload: bool) -> Config:
    """``cfg`` with the training settings a forward pass does not read (:data:`TRAINING_ONLY`), and with
    ``offload`` its ``offload:`` section, at their defaults: a command that serves, generates or exports a
    model is neither refused for them (a modifier whose feature its layout turns off, a bucketed gradient
    reduction without replicas) nor told to change them, which ``--set`` refuses there."""
    from hyperjax.config import OffloadConfig, ParallelConfig, TrainConfig
    from hyperjax.cost.inference import TRAINING_ONLY

    keys = [k.split(".") for k in TRAINING_ONLY]
    unset = {"train": TrainConfig(), "parallel": ParallelConfig()}
    reset = {
        section: dataclasses.replace(
            getattr(cfg, section), **{k: getattr(unset[section], k) for s, k in keys if s == section}
        )
        for section in unset
    }
    return dataclasses.replace(cfg, **reset, **({"offload": OffloadConfig()} if offload else {}))


def config_from_args(args: argparse.Namespace, extra: Sequence[str] = (), *, serving: bool = False) -> Config:
    """Load the config named on the command line with its ``--set`` (and ``--hardware``) overrides.

    Args:
      args: the parsed command line (``args.sets``, ``args.hardware``, ``args.command``).
      extra: more overrides, after the command line's.
      serving: whether the command reads ``serve:`` (or checks it itself); if not, ``--set serve...`` is refused.

    Raises:
      ConfigError: as :func:`hyperjax.load_config`, or an override the command does not read.
    """
    if not serving:
        refuse_serve_sets(args.sets, args.command)
    sets = [*args.sets, *extra]
    hardware = getattr(args, "hardware", None)
    if hardware is not None and not hardware.strip():
        raise ConfigError(
            f"--hardware {hardware!r} names no preset; give a preset name (hyperjax topology lists them) or a path"
        )
    if hardware:
        sets.append(f"hardware={hardware}")
    return load_config(args.config, sets)
