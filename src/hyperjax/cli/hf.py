"""``hyperjax import-hf HF_DIR --out DIR`` and ``hyperjax export-hf CONFIG --checkpoint-dir DIR --out HF_DIR``:
Hugging Face model folders in and out (:mod:`hyperjax.hf.convert`)."""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path

from hyperjax.cli.display import console
from hyperjax.cli.options import (
    add_command,
    add_config_arguments,
    add_set_argument,
    config_from_args,
    path,
    refuse_training_sets,
    without_training,
)
from hyperjax.errors import ConfigError


def add_import_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "import-hf",
        usage="HF_DIR --out DIR [options]",
        summary="a Hugging Face model folder as a hyperjax config and checkpoint",
        description=(
            "Read HF_DIR/config.json (llama, qwen2, qwen3, mixtral, qwen3_moe, deepseek_v3, gpt2) into "
            "DIR/config.yaml, the "
            "architecture exactly and the rest defaulted (or as --set says); with safetensors weights, write "
            "DIR/checkpoint/, read block by block into each device's shard of the config's layout; copy the "
            "tokenizer files. A config.json field hyperjax cannot honour is an error naming it."
        ),
        examples=[
            "hyperjax import-hf ./Qwen3-0.6B --out q3",
            "hyperjax generate q3/config.yaml --checkpoint-dir q3/checkpoint \\",
            "    --prompt 'Hello' --max-new-tokens 16",
            "hyperjax import-hf ./llama --out l --set parallel.fsdp=8 --devices 8",
        ],
    )
    p.add_argument("hf_dir", metavar="HF_DIR", help="a folder with config.json (and safetensors weights)")
    p.add_argument(
        "--out",
        type=path,
        required=True,
        metavar="DIR",
        help="the folder to write: new, empty, or an earlier import's (replaced whole)",
    )
    add_set_argument(p)
    p.add_argument("--devices", type=int, metavar="N", help="read the weights onto N devices (emulate.devices)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run_import)


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "export-hf",
        usage="CONFIG --checkpoint-dir DIR --out HF_DIR [options]",
        summary="a hyperjax checkpoint as a Hugging Face model folder",
        description=(
            "Restore the newest checkpoint of --checkpoint-dir and write HF_DIR/config.json and safetensors "
            "(sharded with an index above --max-shard-gib) that transformers' from_pretrained loads as the same "
            "model; tokenizer files beside CONFIG are copied."
        ),
        examples=[
            "hyperjax export-hf q3/config.yaml --checkpoint-dir q3/checkpoint --out q3-hf",
            "hyperjax export-hf configs/quickstart.yaml --checkpoint-dir ck \\",
            "    --out gpt-hf --dtype bfloat16",
        ],
    )
    add_config_arguments(p, config_help="the YAML config (or config.json) of the checkpoint's model", hardware=False)
    p.add_argument(
        "--checkpoint-dir", type=path, required=True, metavar="DIR", help="the folder train or import-hf wrote"
    )
    p.add_argument(
        "--out",
        type=path,
        required=True,
        metavar="HF_DIR",
        help="the folder to write: new, empty, or an earlier export's (replaced whole)",
    )
    p.add_argument("--max-shard-gib", type=float, default=5.0, metavar="G", help="largest safetensors file (5)")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="stored dtype (float32)"
    )
    p.add_argument("--devices", type=int, metavar="N", help="restore onto N devices (emulate.devices)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run_export)


def _start(devices: int, processes: int | None) -> None:
    from hyperjax.emulate import start_devices

    if processes != 1:
        raise ConfigError(
            f"import-hf and export-hf run in one process; this run's {devices} devices need more: pass --devices "
            "with 256 or fewer"
        )
    start_devices(devices)
    logging.getLogger("absl").setLevel(logging.ERROR)


def run_import(args: argparse.Namespace) -> int:
    from hyperjax.hf.convert import import_hf, imported_config
    from hyperjax.resolver import resolve

    sets = [*args.sets, *([] if args.devices is None else [f"emulate.devices={args.devices}"])]
    run = resolve(imported_config(args.hf_dir, sets)[1])  # every config.json field checked before a device starts
    _start(run.devices, run.processes)
    out = import_hf(args.hf_dir, args.out, sets)
    if args.json:
        print(json.dumps(out.to_dict(), indent=2))
        return 0
    text = console()
    text.print(f"wrote {out.config}", highlight=False)
    if out.checkpoint:
        text.print(f"wrote {out.checkpoint} ({out.tensors} tensors, {run.devices} devices, {run.describe()})")
    else:
        text.print("no safetensors weights in the folder: config only", style="dim")
    if out.copied:
        text.print(f"copied {', '.join(out.copied)}", style="dim")
    if out.not_applied:
        text.print(f"not applied (training settings hyperjax lacks): {', '.join(out.not_applied)}", style="yellow")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from hyperjax.hf.convert import export_hf
    from hyperjax.resolver import resolve

    if not 0 < args.max_shard_gib < math.inf:
        raise ConfigError(f"--max-shard-gib {args.max_shard_gib} must be a finite number > 0 (GiB per file)")
    refuse_training_sets(args.sets, "export-hf")
    extra = [] if args.devices is None else [f"emulate.devices={args.devices}"]
    run = resolve(without_training(config_from_args(args, extra), offload=True))
    from hyperjax.config.hf_export import hf_from_model

    hf_from_model(run.config.model)  # a model no Hugging Face type describes is refused before a device starts
    _start(run.devices, run.processes)
    files = export_hf(
        run,
        args.checkpoint_dir,
        args.out,
        config_path=Path(args.config),
        max_shard_bytes=int(args.max_shard_gib * 2**30),
        dtype=args.dtype,
    )
    m = run.config.model
    positions = m.seq_len  # what the file's max_position_embeddings (gpt2: n_positions) says
    if args.json:
        print(json.dumps({"out": str(Path(args.out).absolute()), "files": files, "positions": positions}, indent=2))
    else:
        text = console()
        text.print(f"wrote {args.out}: {', '.join(files)}", highlight=False)
        learned = m.positions == "learned"  # a table of seq_len rows, which another seq_len would not restore into
        field = "n_positions" if learned else "max_position_embeddings"
        other = "" if learned else "; --set model.seq_len=N writes another"
        text.print(
            f"{field} {positions} (model.seq_len), the longest context a server such as vLLM will admit{other}",
            style="dim",
        )
    return 0
