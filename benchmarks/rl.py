"""GRPO on one supernode: predicted iteration time colocated against disaggregated, at the planner's best split.

The setting (stated, not measured): GRPO with group size 16, 1,024 prompts per iteration (16,384 completions),
512 prompt and 4,096 completion tokens, one optimizer update per iteration, BF16, on 384 devices of
``cloudmatrix384`` (one unified bus), ``ascend910c-cluster`` (the same NPUs in 8-device nodes on a scale-out
network) and ``dgx-h100`` (384 H100s). Models: the shapes of Qwen3-235B-A22B and DeepSeek-V3 (671B), from
their configs in ``configs/``. For each machine and placement the RL search (:func:`hyperjax.plan_rl`) picks the
split of the devices, each phase's layout and the rollout's wave; a row per answer gives the iteration and its
parts. Then, for the best disaggregated answer of each machine, the same run with the rollout's tensor
parallelism widened to 16 (beyond an 8-device node; experts over the rest of its devices, the largest wave
that fits) shows what the unified bus changes for wide decoding.

Writes ``benchmarks/results/rl.json``.

    python benchmarks/rl.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

import hyperjax

HERE = Path(__file__).parent
CONFIGS = HERE.parent / "configs"
MODELS = {"Qwen3-235B-A22B": "qwen3-235b-a22b.yaml", "DeepSeek-V3": "deepseek-v3-671b.yaml"}
MACHINES = ("cloudmatrix384", "ascend910c-cluster", "dgx-h100")
DEVICES = 384
SETTING = {"group_size": 16, "prompts_per_step": 1024, "prompt_len": 512, "max_new_tokens": 4096}


PUBLISHED = [  # NeMo RL 0.6.0 performance summary (docs.nvidia.com/nemo/rl/0.6.0/about/performance-summary.html)
    {
        "model": "Qwen3-235B-A22B",
        "gpus": 128,
        "measured_step_s": 395,
        "average_sequence": 5698,
        "their_layout": "generation TP 16; training TP 2, CP 2, EP 16, PP 8",
        "generation_tensor": 16,
    },
    {
        "model": "DeepSeek-V3",
        "gpus": 256,
        "measured_step_s": 134,
        "average_sequence": 701,
        "their_layout": "generation TP 32; training EP 16, PP 16",
        "generation_tensor": 32,
    },
]
"""Measured on-policy (colocated) GRPO steps on H100, BF16, 512 completions per step (G-GBS = T-GBS = 512: one
update). Not published, so assumed: 32 prompts x 16 completions, 256 prompt tokens, and every completion as
long as the average sequence less the prompt (the runs' completions vary in length up to the maximum)."""
PUBLISHED_PROMPT = 256


def rl_config(model_file: str, machine: str, placement: str, setting: dict | None = None) -> hyperjax.Config:
    """The model of ``model_file`` under GRPO in ``setting`` (default :data:`SETTING`), on ``machine``, its
    layouts left to the search (the config's own training layout cleared)."""
    setting = setting or SETTING
    seq = setting["prompt_len"] + setting["max_new_tokens"]
    sets = [
        "parallel=null",
        "emulate=null",
        "mpmd=null",
        f"hardware={machine}",
        f"model.seq_len={seq}",
        f"train.global_batch={setting['prompts_per_step'] * setting['group_size']}",  # an rl: config's own batch
        "train.micro_batch=1",
        "train.dtype=bfloat16",
        "train.recompute=none",
        "train.recompute_modules=null",
        "train.fp8=null",
        "train.steps=1",
        f"rl.placement={placement}",
        *(f"rl.{k}={v}" for k, v in setting.items()),
    ]
    return hyperjax.load_config(CONFIGS / model_file, sets)


def published() -> list[dict]:
    """The cost model at the settings of :data:`PUBLISHED` (colocated, the search's layouts) against the
    measured steps."""
    out = []
    for p in PUBLISHED:
        setting = {
            "group_size": 16,
            "prompts_per_step": 32,
            "prompt_len": PUBLISHED_PROMPT,
            "max_new_tokens": p["average_sequence"] - PUBLISHED_PROMPT,
        }
        cfg = rl_config(MODELS[p["model"]], "dgx-h100", "colocated", setting)
        try:
            est = hyperjax.plan_rl(cfg, p["gpus"], keep=1).best[0]
        except hyperjax.ConfigError as e:
            out.append({**p, "predicted_step_s": None, "note": str(e).split(";")[0]})
            continue
        theirs = at_tensor(est, p["generation_tensor"], expert=1)
        out.append(
            {
                **p,
                "predicted_step_s": est.iteration_s,
                "predicted_at_their_generation_s": None if theirs is None else theirs.iteration_s,
                "error": est.iteration_s / p["measured_step_s"] - 1,
                "predicted_rollout_s": est.rollout_s,
                "predicted_learn_s": est.learn_s,
                "our_layout": est.rl.describe(),
            }
        )
    return out


def row(model: str, machine: str, placement: str, est: hyperjax.RLEstimate | None, note: str = "") -> dict:
    if est is None:
        return {"model": model, "machine": machine, "placement": placement, "fits": False, "note": note}
    rl = est.rl
    return {
        "model": model,
        "machine": machine,
        "placement": placement,
        "rollout": f"{rl.rollout.devices}: {rl.rollout.describe(serving=True)}",
        "learner": f"{rl.learner.devices}: {rl.learner.describe()}",
        "rollout_tensor": rl.rollout.parallel["tensor"],
        "wave": rl.wave,
        "decode_ms_per_token": est.rollout.decode_s_per_token * 1e3,
        "iteration_s": est.iteration_s,
        "rollout_s": est.rollout_s,
        "learn_s": est.learn_s,
        "handover_s": est.handover_s,
        "idle_fraction": est.idle_fraction,
        "tokens_per_s_per_device": est.tokens_per_s / rl.devices,
        "peak_gib": est.memory_gib["peak"],
        "fits": est.fits,
        "note": note,
    }


def at_tensor(est: hyperjax.RLEstimate, tensor: int, expert: int | None = None) -> hyperjax.RLEstimate | None:
    """``est``'s run with the rollout's tensor degree set to ``tensor`` (``expert`` ways over experts, default
    the rest of its devices; data the rest), at the largest wave that fits: what wide tensor parallelism costs
    a rollout on each machine."""
    rl = est.rl
    p = rl.config.rl.rollout.parallel
    expert = rl.rollout.devices // tensor if expert is None else expert
    rollout = dataclasses.replace(
        rl.config.rl.rollout, parallel=dataclasses.replace(p, tensor=tensor, expert=expert, data=None)
    )
    lean = {"reference": "host"} | ({"offload_optimizer": True} if rl.colocated else {})
    wave = rl.sequences
    while wave >= 1:
        for waits in ({}, lean):  # as the search answered, then with the reference (and optimizer) on the host
            changed = dataclasses.replace(rl.config.rl, rollout=rollout, rollout_batch=wave, **waits)
            try:
                wide = hyperjax.estimate_rl(hyperjax.resolve_rl(dataclasses.replace(rl.config, rl=changed)))
            except hyperjax.HyperjaxError:
                continue
            if wide.fits:
                return wide
        wave //= 2
    return None


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    rows: list[dict] = []
    started = time.perf_counter()
    for model, file in MODELS.items():
        for machine in MACHINES:
            best_apart = None
            for placement in ("colocated", "disaggregated"):
                cfg = rl_config(file, machine, placement)  # outside the try: a config error is no "does not fit"
                try:
                    found = hyperjax.plan_rl(cfg, DEVICES, keep=1)
                except hyperjax.ConfigError as e:
                    rows.append(row(model, machine, placement, None, note=str(e).split(";")[0]))
                    continue
                rows.append(row(model, machine, placement, found.best[0], note="planner's best"))
                if placement == "disaggregated":
                    best_apart = found.best[0]
            if best_apart is not None and best_apart.rl.rollout.parallel["tensor"] < 16:
                wide = at_tensor(best_apart, 16)
                rows.append(row(model, machine, "disaggregated", wide, note="the rollout at tensor 16, beyond a node"))
    table = Table(title=f"GRPO iteration on {DEVICES} devices (predicted): {SETTING}")
    for col in (
        "model",
        "machine",
        "placement",
        "rollout",
        "learner",
        "wave",
        "rollout s",
        "learn s",
        "hand-over s",
        "iteration s",
        "idle",
        "note",
    ):
        table.add_column(
            col, justify="left" if col in ("model", "machine", "placement", "rollout", "learner", "note") else "right"
        )
    for r in rows:
        if not r["fits"]:
            table.add_row(
                r["model"], r["machine"], r["placement"], "-", "-", "-", "-", "-", "-", "does not fit", "-", r["note"]
            )
            continue
        table.add_row(
            r["model"],
            r["machine"],
            r["placement"],
            r["rollout"],
            r["learner"],
            str(r["wave"]),
            f"{r['rollout_s']:.0f}",
            f"{r['learn_s']:.0f}",
            f"{r['handover_s']:.3g}",
            f"{r['iteration_s']:.0f}",
            f"{r['idle_fraction']:.0%}",
            r["note"],
        )
    console = Console(width=250)
    console.print(table)
    against = published()
    table = Table(title="against NeMo RL's published on-policy GRPO steps on H100 (colocated, BF16, 512 completions)")
    for col in (
        "model",
        "GPUs",
        "avg sequence",
        "measured s",
        "predicted s",
        "error",
        "at their generation TP",
        "their layout",
        "searched layout",
    ):
        table.add_column(col, justify="left" if "layout" in col or col == "model" else "right")
    for p in against:
        predicted = p["predicted_step_s"]
        table.add_row(
            p["model"],
            str(p["gpus"]),
            str(p["average_sequence"]),
            f"{p['measured_step_s']:.0f}",
            "does not fit" if predicted is None else f"{predicted:.0f}",
            "-" if predicted is None else f"{p['error']:+.0%}",
            "-" if p.get("predicted_at_their_generation_s") is None else f"{p['predicted_at_their_generation_s']:.0f}",
            p["their_layout"],
            p.get("our_layout", p.get("note", "")),
        )
    console.print(table)
    out = {
        "setting": SETTING,
        "devices": DEVICES,
        "rows": rows,
        "published": against,
        "seconds": time.perf_counter() - started,
    }
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "rl.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {HERE / 'results' / 'rl.json'} ({out['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
