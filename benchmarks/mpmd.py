"""Pipeline bubbles on the emulated supernode, per schedule, against theory.

For each schedule and size, the quickstart model's layer shape (16 layers here, so that each of four
stages holds four layers, or two chunks of two, and the head weighs little beside them) trains
pipelined on 8 emulated devices. Nine steps are run with every task timed on its own (each waited
for, the Python collector paused), which gives each task's measured duration (its fastest over the
nine: noise on a shared 2-core host only ever adds); the step's timeline is then rebuilt from those
durations and the grid the runtime executed (each task starts when its stage is free and its inputs
have arrived). The bubble fraction of that timeline is compared with theory:

- GPipe and 1F1B: ``(p-1)/(m+p-1)``; interleaved 1F1B: ``(p-1)/(v*m+p-1)``; zero-bubble (ZB-H1):
  ``(p-1)/(3m+p-1)`` with the three task kinds equal, and in general ``(p-1)(F+B-W)`` idle per stage
  against ``m(F+B+W)`` of work, evaluated at the measured mean ``F``, ``B`` and ``W`` ("theory at F/B/W").

The timeline is rebuilt rather than read off the wall clock because this machine has 2 cores: 8
emulated devices cannot run 4 stages at once, so wall-clock overlap would measure the host, not the
schedule. Theory assumes equal stages. The "at stage medians" column replays the same grid with each
task at its stage's median for its kind: the bubble these stage costs imply, without per-task timing
noise. The gap column is measured minus theory at the measured F/B/W (for every schedule but
zero-bubble, the textbook figure).

Second, the predicted step time on ``cloudmatrix384`` of ``configs/vlm-8b-cm384.yaml`` (ViT-L/14 encoder,
Llama-8B-shaped language model, 384 devices) under one SPMD program (the best single strategy for both
modules, and the conventional tensor=8 one) and under MPMD with the best split into submeshes, each with
its own tensor degree: all found by the strategy search (``hyperjax.plan``), every candidate priced as
one resolved run.

Writes ``benchmarks/results/mpmd.json``, a Perfetto trace and a Gantt chart per 4-stage schedule.

    python benchmarks/mpmd.py [--vlm-only]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from pathlib import Path

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import hyperjax  # noqa: E402
from hyperjax.cost import stage_metadata, task_events  # noqa: E402
from hyperjax.files import write_json  # noqa: E402
from hyperjax.mpmd import (  # noqa: E402
    Task,
    replay,
    replayed_bubble,
    theory_bubble,
    uniform_bubble,
)
from hyperjax.train import Batches, pipeline_runner, prepare  # noqa: E402

RESULTS = Path(__file__).parent / "results"
REPEATS = 9
LAYERS = 16
CONFIG = Path(__file__).parents[1] / "configs" / "quickstart.yaml"
CASES = [
    ("gpipe", 2, 8, 1),
    ("1f1b", 2, 8, 1),
    ("gpipe", 4, 8, 1),
    ("1f1b", 4, 8, 1),
    ("interleaved", 4, 8, 2),
    ("zero-bubble", 4, 8, 1),
]


def measure(schedule: str, p: int, m: int, v: int) -> dict:
    sets = [f"model.layers={LAYERS}", "parallel.tensor=1", f"parallel.pipeline={p}", f"train.microbatches={m}"]
    sets += [f"parallel.schedule={schedule}", f"parallel.virtual_stages={v}", "train.global_batch=64"]
    run = hyperjax.resolve(hyperjax.load_config(CONFIG, sets))
    t = run.config.train
    runner = pipeline_runner(prepare(run), hyperjax.build_model(run.config.model, seed=t.seed))
    state = runner.init_state()
    data = Batches(source=t.data, global_batch=t.global_batch, seq_len=run.config.model.seq_len, vocab=256, seed=0)
    for i in range(2):  # compile every program
        state, _ = runner.step(state, data.batch(i))
    runs = []
    gc.collect()
    gc.disable()  # no collector pauses inside a timed task
    try:
        for i in range(REPEATS):  # each task's duration: its fastest over repeated steps (host noise only adds)
            timeline: list = []
            state, _ = runner.step(state, data.batch(2 + i), timeline=timeline)
            runs.append({task: end - start for _, task, start, end in timeline})
    finally:
        gc.enable()
    seconds = {task: min(run[task] for run in runs) for task in runs[0]}
    sched = runner.sched
    # the same grid with every task at its stage's median for its kind: the schedule's own bubble for
    # these stage costs, free of per-task timing noise
    stage_of = {task: s for s, task, _, _ in timeline}
    medians = {
        (s, k): statistics.median([d for tk, d in seconds.items() if stage_of[tk] == s and tk.kind == k])
        for s in range(p)
        for k in {tk.kind for tk in seconds}
    }
    smooth = {task: medians[(stage_of[task], task.kind)] for task in seconds}
    mean = {k: _mean([d for tk, d in seconds.items() if tk.kind == k]) for k in "FBW"}
    # the same run priced by the cost model on its hardware preset, replayed on the same grid
    est = hyperjax.estimate(run)
    predicted_sched, predicted = est.schedule()
    return {
        "schedule": schedule,
        "stages": p,
        "microbatches": m,
        "virtual_stages": v,
        "layout": run.describe(),
        "grid_bubble": sched.bubble_fraction(),
        "theory_bubble": theory_bubble(schedule, p, m, v),
        "theory_bubble_at_measured_costs": theory_bubble(schedule, p, m, v, (mean["F"], mean["B"], mean["W"])),
        "measured_kind_bubble": uniform_bubble(schedule, p, m, v, mean["F"], mean["B"], mean["W"]),
        "measured_bubble": replayed_bubble(sched, seconds),
        "stage_cost_bubble": replayed_bubble(sched, smooth),
        "mean_task_ms": {k: 1e3 * x for k, x in mean.items()},
        "stage_task_ms": {f"{k}{s}": 1e3 * x for (s, k), x in sorted(medians.items()) if x == x},
        "timeline": _timeline(replay(sched, seconds)),
        "predicted": {
            "hardware": run.hardware.name,
            "step_time_s": est.step_time_s,
            "bubble": replayed_bubble(predicted_sched, predicted),
            "task_ms": {k: 1e3 * x for k, x in est.details()["task_s"].items()},
            "timeline": _timeline(replay(predicted_sched, predicted)),
        },
    }


def _timeline(times: dict[Task, tuple[int, float, float]]) -> list[dict]:
    return [
        {"stage": s, "task": str(task), "kind": task.kind, "start_s": a, "end_s": b}
        for task, (s, a, b) in sorted(times.items(), key=lambda kv: kv[1][1])
    ]


def _times(timeline: list[dict]) -> dict[Task, tuple[int, float, float]]:
    return {
        Task(e["kind"], *map(int, e["task"][1:].split("."))): (e["stage"], e["start_s"], e["end_s"]) for e in timeline
    }


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def write_trace(row: dict, path: Path) -> None:
    """The emulated step and the predicted one in one Perfetto trace: one process per stage each."""
    p, hw = row["stages"], row["predicted"]["hardware"]
    data = {
        "traceEvents": stage_metadata(p, label="emulated (CPU), stage")
        + task_events(_times(row["timeline"]))
        + stage_metadata(p, pid=p, label=f"predicted ({hw}), stage")
        + task_events(_times(row["predicted"]["timeline"]), pid=p),
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": row["schedule"],
            "emulated_bubble": row["measured_bubble"],
            "predicted_bubble": row["predicted"]["bubble"],
            "predicted_step_time_s": row["predicted"]["step_time_s"],
        },
    }
    write_json(path, data, indent=None)


def write_gantt(row: dict, path: Path) -> None:
    """Gantt charts of the emulated step (top) and the predicted one (bottom), each on its own time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}
    p = row["stages"]
    fig, axes = plt.subplots(2, 1, figsize=(11, 1.2 * p + 2.4), dpi=100)
    panels = (
        (row["timeline"], f"emulated on CPU, bubble {row['measured_bubble']:.1%}"),
        (
            row["predicted"]["timeline"],
            f"predicted on {row['predicted']['hardware']}, bubble {row['predicted']['bubble']:.1%}",
        ),
    )
    for ax, (timeline, label) in zip(axes, panels, strict=True):
        for e in timeline:
            ax.broken_barh(
                [(e["start_s"] * 1e3, (e["end_s"] - e["start_s"]) * 1e3)],
                (e["stage"] - 0.4, 0.8),
                color=colours[e["kind"]],
                edgecolor="white",
            )
        ax.set(xlabel="ms", ylabel="stage", yticks=range(p))
        ax.invert_yaxis()
        ax.set_title(f"{row['schedule']} (p={p}, m={row['microbatches']}): {label}", fontsize=10)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(path)


def vlm() -> dict:
    """The vision-language model on all 384 devices: the best SPMD program, the usual tensor=8 one, and the
    best MPMD split (each submesh with its own tensor degree), all found and priced by the same search."""
    cfg = hyperjax.load_config(CONFIG.parent / "vlm-8b-cm384.yaml")
    search = hyperjax.plan(cfg, 384, keep=100_000)
    found, priced = search.best, search.priced
    spmd = next(c for c in found if not c.overrides.get("mpmd.submeshes"))
    mpmd = next(c for c in found if c.overrides.get("mpmd.submeshes"))
    conventional = {"parallel.data": 48, "parallel.tensor": 8, "parallel.sequence_parallel": True}
    tensor8 = next(c for c in found if all(c.overrides.get(k) == v for k, v in conventional.items()))

    def row(c: hyperjax.Candidate) -> dict:
        est, m = c.estimate, c.run.microbatches
        busy = {}  # each module's busy time in the step: its stage's, or its share of the one stage
        for s in est.stages:
            for p in s.parts:
                busy[p.module] = busy.get(p.module, 0.0) + m * (
                    p.layers * (p.layer.forward_s + p.layer.backward_s + p.layer.recompute_s) + p.head_s
                )
        return {
            "step_time_s": est.step_time_s,
            "strategy": c.run.describe(),
            "recompute": c.run.recompute,
            "module_busy_s": busy,
            "devices": {s.modules[0] if len(s.modules) == 1 else "both": s.devices for s in c.run.stages},
            "peak_gib": est.memory_per_device_gib["peak"],
        }

    return {
        "config": "configs/vlm-8b-cm384.yaml",
        "priced": priced,
        "spmd_best": row(spmd),
        "spmd_tensor8": row(tensor8),
        "mpmd": row(mpmd),
        "speedup_vs_spmd_best": spmd.estimate.step_time_s / mpmd.estimate.step_time_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--vlm-only",
        action="store_true",
        help="price the VLM comparison again and keep the bubbles measured by the last run (results/mpmd.json)",
    )
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "mpmd.json"
    previous = json.loads(out.read_text()) if out.exists() else {}
    if args.vlm_only and not previous.get("bubbles"):
        parser.error(f"--vlm-only keeps the bubbles measured in {out}, which holds none; run without it")
    v = vlm()
    console = Console(width=140)
    table = Table(title="VLM on cloudmatrix384 (384 devices), predicted step time")
    for col in ("program", "step (s)", "encoder busy (s)", "language model busy (s)", "devices", "strategy"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for name, key in (("SPMD, best", "spmd_best"), ("SPMD, tensor=8", "spmd_tensor8"), ("MPMD, best", "mpmd")):
        row = v[key]
        busy = row["module_busy_s"]
        table.add_row(
            name,
            f"{row['step_time_s']:.3f}",
            f"{busy['encoder']:.3f}",
            f"{busy['language_model']:.3f}",
            " + ".join(str(n) for n in row["devices"].values()),
            f"{row['strategy']}; {row['recompute']}",
        )
    console.print(table)
    print(f"MPMD vs best SPMD: {v['speedup_vs_spmd_best']:.2f}x")
    rows = previous["bubbles"] if args.vlm_only else [measure(*case) for case in CASES]
    table = Table(title="pipeline bubble fraction: measured task times on the executed grid vs theory")
    cols = ("schedule", "p", "m", "v", "theory", "theory at F/B/W", "at mean F/B/W", "at stage medians")
    cols += ("measured", "gap (points)", "F/B/W ms", "predicted")
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        ms = r["mean_task_ms"]
        table.add_row(
            r["schedule"],
            str(r["stages"]),
            str(r["microbatches"]),
            str(r["virtual_stages"]),
            f"{r['theory_bubble']:.1%}",
            f"{r['theory_bubble_at_measured_costs']:.1%}",
            f"{r['measured_kind_bubble']:.1%}",
            f"{r['stage_cost_bubble']:.1%}",
            f"{r['measured_bubble']:.1%}",
            f"{100 * (r['measured_bubble'] - r['theory_bubble_at_measured_costs']):+.1f}",
            f"{ms['F']:.0f}/{ms['B']:.0f}/{ms['W']:.0f}",
            f"{r['predicted']['bubble']:.1%}",
        )
        if r["stages"] == 4:
            stem = f"mpmd-{r['schedule']}"
            write_trace(r, RESULTS / f"{stem}.trace.json")
            write_gantt(r, RESULTS / f"{stem}.png")
    console.print(table)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps({"bubbles": rows, "vlm": v}, indent=1))
    tmp.replace(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
