"""``hyperjax train CONFIG`` of a config with an ``rl:`` section: rollouts and learning on their own submeshes.

The phases are resolved (:func:`hyperjax.resolve_rl`) and the reward loaded before any device starts; the job
runs in one process (up to 256 emulated devices). ``--checkpoint-dir`` keeps the learner's parameters after
the last iteration, which ``generate`` and ``export-hf`` read as any checkpoint.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hyperjax.cli.display import check_folder, check_writable, console
from hyperjax.cli.launching import check_batch_memory, run_on_devices
from hyperjax.config import Config, RLRun, TrainConfig
from hyperjax.errors import ConfigError, EmulationError
from hyperjax.resolver import resolve_rl
from hyperjax.rl.rewards import load_reward
from hyperjax.train import prepare
from hyperjax.train.checkpoint import saved_steps
from hyperjax.train.data import check_windows
from hyperjax.train.saved_model import model_record

UNSUPPORTED = ("resume", "max_restarts", "elastic", "profile", "explain")


def run(args: argparse.Namespace, cfg: Config) -> int:
    """Train ``cfg``'s ``rl:`` section (``args``: the parsed ``train`` command line)."""
    for flag in UNSUPPORTED:
        if getattr(args, flag):
            name = "--" + flag.replace("_", "-")
            raise ConfigError(
                f"{name} is not available for an rl: config, which runs its iterations in one process from the "
                "start; drop it (--checkpoint-dir keeps the learner's parameters after the last iteration)"
            )
    for flag in ("coordinator", "num_processes", "process_id"):
        if getattr(args, flag) is not None:
            raise ConfigError(
                f"--{flag.replace('_', '-')} joins a job of several processes, but an rl: config runs its "
                "iterations in one process; drop --coordinator, --num-processes and --process-id"
            )
    for key in ("checkpoint_every", "keep_checkpoints"):
        if getattr(cfg.train, key) != getattr(TrainConfig(), key):
            raise ConfigError(
                f"train.{key}={getattr(cfg.train, key)}: an rl: config keeps one checkpoint, the learner's "
                f"parameters after the last iteration (--checkpoint-dir); drop train.{key}"
            )
    rl = resolve_rl(cfg, args.devices)
    if cfg.model.vocab != 256:  # predict and plan price any vocabulary; the emulated run reads bytes
        raise ConfigError(
            f"model.vocab={cfg.model.vocab}: train of an rl: config samples from byte-level windows of the corpus "
            "and rewards read completions as UTF-8 bytes, so it needs model.vocab: 256 (predict and plan price "
            "any vocabulary)"
        )
    init = cfg.rl.init_checkpoint
    if init is not None and not saved_steps(init):
        raise ConfigError(
            f"rl.init_checkpoint={init!r} holds no checkpoint; give the folder a train, rl or import-hf run wrote "
            "its checkpoints to, or null to start from train.seed"
        )
    prepare(rl.learner)  # the learner's offload pass and checks, before any device starts
    check_windows(cfg.train.data, rl.prompt_len, "rl.prompt_len")  # the prompts are windows of train.data
    load_reward(cfg.rl.reward)
    if args.plan_only:
        return _print_plan(rl, json_out=args.json)
    if rl.processes is None:
        raise EmulationError(f"{rl.emulation_limit}; hyperjax predict still prices this run")
    r = cfg.rl  # an iteration's sequences, each a whole window of model.seq_len tokens
    check_batch_memory(
        r.prompts_per_step * r.group_size * (cfg.model.seq_len + 1),
        f"rl.prompts_per_step={r.prompts_per_step} x rl.group_size={r.group_size}",
    )
    out_dir = args.out_dir or str(Path("runs") / Path(args.config).stem)
    if args.metrics_out:
        check_writable(args.metrics_out, "--metrics-out")
    check_folder(out_dir, "--out-dir")
    if args.checkpoint_dir:
        check_folder(args.checkpoint_dir, "--checkpoint-dir")
        if saved_steps(args.checkpoint_dir):
            raise ConfigError(
                f"--checkpoint-dir {args.checkpoint_dir!r} already holds checkpoints; give an empty folder (start "
                "from earlier weights with rl.init_checkpoint)"
            )
    return run_on_devices(args, devices=rl.devices, processes=1, child_args=[], work=lambda: _train(rl, args, out_dir))


def _print_plan(rl: RLRun, *, json_out: bool) -> int:
    if json_out:
        print(json.dumps({"rl": rl.to_dict()}, indent=2))
        return 0
    out = console()
    where = f"{rl.processes} process" if rl.processes else f"not emulated here: {rl.emulation_limit}"
    out.print(
        f"plan only: {rl.config.model.family} on {rl.devices} emulated {rl.hardware.name} devices ({where}); "
        f"{rl.describe()}",
        soft_wrap=True,
    )
    phases = (("rollout", rl.rollout, rl.rollout_first, True), ("learner", rl.learner, rl.learner_first, False))
    for name, phase, first, serving in phases:
        out.print(f"  {name}: {phase.describe(serving=serving)} (devices {first}-{first + phase.devices - 1})")
    return 0


def _train(rl: RLRun, args: argparse.Namespace, out_dir: str) -> int:
    from hyperjax.rl import train_rl
    from hyperjax.train.checkpoint import Checkpoints

    out = console()
    r = rl.rl
    out.print(
        f"reinforcement learning of {rl.config.model.family} on {rl.devices} emulated {rl.hardware.name} devices: "
        f"{rl.describe()}; {r.prompts_per_step} prompts x {r.group_size} completions of {r.max_new_tokens} tokens "
        f"per iteration, reward {r.reward}",
        soft_wrap=True,
    )
    result = train_rl(rl, metrics_out=args.metrics_out, out_dir=out_dir, init_checkpoint=r.init_checkpoint)
    if args.checkpoint_dir:
        steps = len(result.records)
        ckpt = Checkpoints(args.checkpoint_dir, keep=1)
        try:
            meta = {"step": steps, "rl": rl.to_dict(), "records": result.records, "devices": rl.devices}
            meta["strategy"] = rl.learner.describe()
            meta["model"] = model_record(rl.learner.config.model)
            ckpt.save(steps, {"params": result.params}, meta)
        finally:
            ckpt.close()
    first, final = result.records[0], result.records[-1]
    mean = lambda key: sum(x[key] for x in result.records[1:] or result.records) / max(len(result.records) - 1, 1)
    out.print(
        f"[bold]summary[/bold]: reward {first['reward_mean']:.3f} -> {final['reward_mean']:.3f} over "
        f"{len(result.records)} iterations; kl {final['kl']:.4f}"
    )
    out.print(
        f"  per iteration after the first: rollout {mean('rollout_s'):.3f} s, learning {mean('learn_s'):.3f} s, "
        f"hand-over {mean('handover_s') * 1e3:.1f} ms"
    )
    out.print(f"  a completion of the last iteration: {result.completions[0]!r}")
    out.print(f"  loss and reward curves: {out_dir}/loss.png")
    if args.checkpoint_dir:
        out.print(f"  the learner's parameters: {args.checkpoint_dir}/{len(result.records)}")
    return 0
