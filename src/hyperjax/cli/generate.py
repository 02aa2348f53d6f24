"""``hyperjax generate CONFIG --checkpoint-dir DIR --prompt TEXT --max-new-tokens N``: continue text with a
trained model on the emulated mesh.

The newest checkpoint of a ``train`` run is restored onto the config's strategy (any mesh: another tensor or
data degree, fsdp, another device count), the prompts are prefilled as one batch, and each new token is
decoded with a KV cache laid out like the activations (KV heads over ``tensor``, sequences over the data
axes). Prompts and text are byte-level, as the training corpus is.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import Any

from hyperjax.cli.display import console
from hyperjax.cli.options import (
    add_command,
    add_config_arguments,
    config_from_args,
    path,
    refuse_sets,
    refuse_training_sets,
    without_training,
)
from hyperjax.config.sections import MIN_TEMPERATURE, SEED_LIMIT
from hyperjax.errors import ConfigError, integral
from hyperjax.resolver import resolve


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "generate",
        usage="CONFIG --checkpoint-dir DIR --prompt TEXT\n" + " " * 24 + "--max-new-tokens N [options]",
        summary="continue text with a trained model on the emulated mesh",
        description=(
            "Restore the newest checkpoint of a train run onto the config's strategy (any SPMD layout and device "
            "count) and continue each prompt with a KV cache laid out like the activations. Prompts decode as one"
            " batch; text is byte-level, as the training corpus is."
        ),
        examples=[
            "hyperjax train configs/quickstart.yaml --checkpoint-dir ck",
            "hyperjax generate configs/quickstart.yaml --checkpoint-dir ck \\",
            "    --prompt 'In the beginning' --max-new-tokens 64",
            "hyperjax generate configs/quickstart.yaml --checkpoint-dir ck --prompt A \\",
            "    --prompt B --max-new-tokens 16 --temperature 0.8 --top-k 10 --json",
            "hyperjax generate q3/config.yaml --checkpoint-dir q3/checkpoint \\",
            "    --prompt-ids 1,2,3 --max-new-tokens 16 --json   # imported by import-hf",
        ],
    )
    add_config_arguments(p, config_help="the YAML config the model was trained with", hardware=False)
    p.add_argument(
        "--checkpoint-dir", type=path, metavar="DIR", required=True, help="the folder train wrote checkpoints to"
    )
    p.add_argument("--prompt", action="append", metavar="TEXT", help="text to continue (repeat: one batch)")
    p.add_argument(
        "--prompt-ids",
        action="append",
        metavar="IDS",
        help="token ids to continue, comma-separated, e.g. 1,2,3 (repeat: one batch; any model)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="FILE",
        help="a Hugging Face tokenizer.json for --prompt and the output (default: tokenizer.json beside CONFIG, "
        "else UTF-8 bytes)",
    )
    p.add_argument(
        "--eos-id",
        type=int,
        action="append",
        metavar="ID",
        help="end-of-sequence id to stop after (repeat; default: generation_config.json's beside CONFIG)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="decode past end-of-sequence ids")
    p.add_argument("--max-new-tokens", type=int, required=True, metavar="N", help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (default): greedy; else sample at T")
    p.add_argument("--top-k", type=int, metavar="K", help="sample from the K likeliest tokens only")
    p.add_argument("--seed", type=int, metavar="S", help="sampling seed (0)")
    p.add_argument("--devices", type=int, metavar="N", help="run on N devices (overrides emulate.devices)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    t = args.temperature
    if not (math.isfinite(t) and (t == 0 or t >= MIN_TEMPERATURE)):
        raise ConfigError(
            f"--temperature {t:g} must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g} (below that float32 "
            "sampling is greedy's argmax, or overflows)"
        )
    if args.top_k is not None and args.top_k < 1:
        raise ConfigError(f"--top-k {args.top_k} must be a positive integer")
    if args.seed is not None and not 0 <= args.seed < SEED_LIMIT:
        raise ConfigError(f"--seed {args.seed} must be in [0, 2**63) (it seeds JAX's generator)")
    if t == 0 and (args.top_k is not None or args.seed is not None):
        given = f"--top-k {args.top_k}" if args.top_k is not None else f"--seed {args.seed}"
        raise ConfigError(
            f"{given} shapes sampling, but --temperature 0 decodes greedily; set --temperature >= {MIN_TEMPERATURE:g}"
        )
    refuse_training_sets(args.sets, "generate")
    refuse_sets(
        args.sets,
        ("rl",),
        "generate decodes the model with its own flags (--temperature, --top-k, --max-new-tokens) and reads no "
        "rl: setting, so it would have no effect: drop it",
    )
    cfg = config_from_args(args, [] if args.devices is None else [f"emulate.devices={args.devices}"])
    run = resolve(without_training(cfg, offload=True))
    if args.top_k is not None and args.top_k > run.config.model.vocab:
        raise ConfigError(f"--top-k {args.top_k} is more than model.vocab={run.config.model.vocab}")
    from hyperjax.train.generate import check_generable, encode, prompt_rows

    check_generable(run)
    eos = _eos(args, run.config.model.vocab)
    codec = _codec(args)
    ids = _ids(args.prompt_ids) if args.prompt_ids else None
    if (ids is None) == (args.prompt is None):
        raise ConfigError("give the prompts as --prompt TEXT or as --prompt-ids 1,2,3, one of the two")
    if ids is not None:
        prompt_rows(ids, run, args.max_new_tokens)  # every prompt checked before a device starts
    else:
        encode(args.prompt, run, args.max_new_tokens, codec)
    from hyperjax.emulate import start_devices
    from hyperjax.train.generate import generate_text

    start_devices(run.devices)
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on a read-only folder
    out = generate_text(
        run,
        args.checkpoint_dir,
        args.prompt,
        args.max_new_tokens,
        codec=codec if (ids is None or args.tokenizer or _beside(args.config)) else None,
        ids=ids,
        eos=eos,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed or 0,
    )
    if args.json:
        print(json.dumps(out.to_dict(), indent=2))
        return 0
    text = console()
    for t in out.text if out.text is not None else [",".join(map(str, row)) for row in out.tokens]:
        text.print(t, markup=False, highlight=False)
        text.print("-" * 40, style="dim")
    rate = f"{out.decode_tokens_per_s:,.0f} tokens/s" if out.decode_tokens_per_s else "no decode steps"
    text.print(
        f"checkpoint step {out.step}; {run.devices} emulated devices under {run.describe(serving=True)}; prefill "
        f"{out.prefill_s * 1e3:.1f} ms; decode {rate}",
        style="dim",
        soft_wrap=True,
    )
    return 0


def _folder(config: str) -> Path:
    """The config's folder (where import-hf copies the tokenizer files): a folder given, or the file's."""
    path = Path(config)
    return path if path.is_dir() else path.parent


def _beside(config: str) -> Path | None:
    """``tokenizer.json`` in the config's folder, if there is one."""
    found = _folder(config) / "tokenizer.json"
    return found if found.is_file() else None


def _eos(args: argparse.Namespace, vocab: int) -> tuple[int, ...]:
    """The end-of-sequence ids a continuation stops at: ``--eos-id``, else ``eos_token_id`` of a
    ``generation_config.json`` beside the config (an id or a list of them), else of the Hugging Face config
    the model came from (an import's ``source_config.json``, or a ``config.json`` beside it); none with
    ``--ignore-eos``.

    Raises:
      ConfigError: both flags, an id outside the vocabulary, or a generation_config.json that cannot be read.
    """
    if args.ignore_eos and args.eos_id:
        raise ConfigError(
            f"--eos-id {args.eos_id[0]} names a token to stop at, but --ignore-eos generates past it; give one"
        )
    if args.ignore_eos:
        return ()
    if args.eos_id:
        given, where = args.eos_id, "--eos-id"
    else:
        from hyperjax.config.hf import read_hf_config
        from hyperjax.hf.convert import source_config

        file = _folder(args.config) / "generation_config.json"
        if file.is_file():
            try:
                given = read_hf_config(file).get("eos_token_id")
            except ConfigError as e:
                raise ConfigError(f"{e}; fix it, or give --eos-id or --ignore-eos") from None
        elif (found := source_config(_folder(args.config))) is not None:  # as transformers derives it
            file, given = found[0], found[1].get("eos_token_id")
        else:
            return ()
        given, where = ([] if given is None else given if isinstance(given, list) else [given]), f"{str(file)!r}"
    for token in given:
        if not integral(token) or not 0 <= token < vocab:
            raise ConfigError(
                f"{where}: end-of-sequence id {token!r} is not a token of model.vocab={vocab}; give an id in "
                f"[0, {vocab}) (--eos-id), or --ignore-eos"
            )
    return tuple(given)


def _codec(args: argparse.Namespace) -> Any:
    """How text becomes tokens: ``--tokenizer``, else a ``tokenizer.json`` beside the config, else bytes."""
    from hyperjax.train.generate import Bytes, Tokenizer

    path = args.tokenizer or _beside(args.config)
    if args.tokenizer and not Path(args.tokenizer).is_file():
        what = "is a folder" if Path(args.tokenizer).is_dir() else "does not exist"
        raise ConfigError(f"--tokenizer {args.tokenizer!r} {what}; give the path of a tokenizer.json")
    if path is None and args.prompt:  # a model's own tokenizer in a form not read: bytes would be another text
        other = [n for n in ("vocab.json", "merges.txt", "tokenizer.model") if (_folder(args.config) / n).is_file()]
        if other:
            raise ConfigError(
                f"--prompt: the model's tokenizer beside CONFIG is {', '.join(other)}, which generate does not read "
                "(it reads a tokenizer.json), and UTF-8 bytes would be other tokens; give its tokenizer.json "
                "(--tokenizer FILE), or the token ids (--prompt-ids 1,2,3)"
            )
    return Tokenizer(path) if path else Bytes()


def _ids(items: list[str]) -> list[list[int]]:
    """``--prompt-ids`` values as token rows."""
    rows = []
    for item in items:
        try:
            rows.append([int(x) for x in item.replace(" ", "").split(",")])  # "1,,2" and "1,2," are errors
        except ValueError:
            raise ConfigError(f"--prompt-ids {item!r} must be comma-separated integers, e.g. 1,2,3") from None
    return rows
