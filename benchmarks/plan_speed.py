"""How fast the strategy search answers, from 1B to 1T parameters and from 8 to 16,384 devices.

Each case runs ``hyperjax plan CONFIG --devices N --json`` as a person would, in a fresh process, and
records the wall time of the whole command (start-up included), the search's own seconds, and how many
strategies it considered (``searched``) and priced (``priced``). GPT shapes (Megatron's sizes, GPT-3) and
Llama shapes (Llama 3) are searched at two global batches each on ``dgx-h100`` (any size), and GPT-3 175B
also on one ``cloudmatrix384`` supernode. Writes ``benchmarks/results/plan_speed.json`` and a log-log
plot of search seconds against strategies searched (``plan_speed.png``).

    python benchmarks/plan_speed.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from hyperjax.files import write_json

RESULTS = Path(__file__).parent / "results"
GPT = {
    "gpt-1.3b": {"layers": 24, "d_model": 2048, "heads": 16, "d_ff": 8192, "vocab": 51200, "seq_len": 2048},
    "gpt-13b": {"layers": 40, "d_model": 5120, "heads": 40, "d_ff": 20480, "vocab": 51200, "seq_len": 2048},
    "gpt3-175b": {"layers": 96, "d_model": 12288, "heads": 96, "d_ff": 49152, "vocab": 51200, "seq_len": 2048},
    "gpt-1t": {"layers": 128, "d_model": 25600, "heads": 160, "d_ff": 102400, "vocab": 51200, "seq_len": 2048},
}
LLAMA = {
    "llama3-8b": {"layers": 32, "d_model": 4096, "heads": 32, "kv_heads": 8, "d_ff": 14336},
    "llama3-70b": {"layers": 80, "d_model": 8192, "heads": 64, "kv_heads": 8, "d_ff": 28672},
    "llama3-405b": {"layers": 126, "d_model": 16384, "heads": 128, "kv_heads": 8, "d_ff": 53248},
}
DEVICES = (8, 64, 512, 2048, 16384)
GPT_BATCHES = (512, 1536)
LLAMA_BATCHES = (1024, 2048)
TARGETS = {  # the cases the search must answer within these seconds (wall time of the command)
    ("gpt3-175b", "cloudmatrix384", 384, 1536): 10.0,
    ("llama3-405b", "dgx-h100", 16384, 2048): 60.0,
}


def config(name: str, hardware: str, batch: int) -> dict:
    if name in GPT:
        model = {"family": "gpt", **GPT[name]}
        train = {"global_batch": batch, "dtype": "bfloat16", "recompute": "selective"}
    else:
        model = {"family": "llama", **LLAMA[name], "vocab": 128256, "seq_len": 8192, "rope_theta": 500000.0}
        train = {"global_batch": batch, "dtype": "bfloat16"}
    return {"hardware": hardware, "model": model, "train": train}


def run(name: str, hardware: str, devices: int, batch: int, folder: Path) -> dict:
    path = folder / f"{name}-{hardware}-{devices}-{batch}.yaml"
    path.write_text(yaml.safe_dump(config(name, hardware, batch)))
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "hyperjax", "plan", str(path), "--devices", str(devices), "--json", "--top", "3"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    wall = time.perf_counter() - start
    row = {"model": name, "hardware": hardware, "devices": devices, "global_batch": batch, "wall_s": wall}
    if proc.returncode not in (0, 2):
        return row | {"error": proc.stderr[-1500:]}
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError:  # a mistake in the input (no valid strategy): the message is on stderr
        return row | {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no output"}
    if proc.returncode == 2:  # nothing fits: the search still ran over every strategy
        return row | {"fits": False, "priced": data.get("priced"), "note": data.get("error", "")[:160]}
    best = data["best"]
    return row | {
        "fits": True,
        "searched": data["searched"],
        "priced": data["priced"],
        "search_s": data["seconds"],
        "step_time_s": best["step_time_s"],
        "mfu": best["mfu"],
        "best": {k: v for k, v in best.items() if "." in k},
    }


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    RESULTS.mkdir(exist_ok=True)
    cases = [("gpt3-175b", "cloudmatrix384", 384, 1536), ("llama3-405b", "dgx-h100", 16384, 2048)]
    cases += [(n, "dgx-h100", d, b) for n in GPT for d in DEVICES for b in GPT_BATCHES]
    cases += [(n, "dgx-h100", d, b) for n in LLAMA for d in DEVICES for b in LLAMA_BATCHES]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in dict.fromkeys(cases):
            row = run(*case, Path(tmp))
            rows.append(row)
            searched, priced = row.get("searched", "-"), row.get("priced", "-")
            print(
                f"{row['model']:12s} {row['hardware']:15s} {row['devices']:6d} dev  batch {row['global_batch']:5d}: "
                f"{row['wall_s']:6.1f} s  searched {searched!s:>7}  priced {priced!s:>6}",
                flush=True,
            )
    console = Console(width=150)
    table = Table(title="hyperjax plan: wall time of the command, strategies searched and priced")
    cols = ("model", "hardware", "devices", "batch", "wall s", "search s", "searched", "priced", "best step s", "MFU")
    for col in cols:
        table.add_column(col, justify="left" if col in ("model", "hardware") else "right")
    for r in rows:
        table.add_row(
            r["model"],
            r["hardware"],
            str(r["devices"]),
            str(r["global_batch"]),
            f"{r['wall_s']:.1f}",
            f"{r['search_s']:.2f}" if "search_s" in r else "-",
            f"{r['searched']:,}" if "searched" in r else "-",
            f"{r['priced']:,}" if r.get("priced") is not None else "-",
            f"{r['step_time_s']:.3g}" if "step_time_s" in r else ("nothing fits" if r.get("fits") is False else "-"),
            f"{r['mfu']:.1%}" if "mfu" in r else "-",
        )
    console.print(table)
    targets = []
    for (name, hw, devices, batch), limit in TARGETS.items():
        r = next(
            r
            for r in rows
            if (r["model"], r["hardware"], r["devices"], r["global_batch"]) == (name, hw, devices, batch)
        )
        targets.append({"case": f"{name} on {devices} {hw}, batch {batch}", "wall_s": r["wall_s"], "limit_s": limit})
        console.print(f"target: {targets[-1]['case']}: {r['wall_s']:.1f} s (limit {limit:g} s)")
    write_json(RESULTS / "plan_speed.json", {"rows": rows, "targets": targets})
    plot(rows, RESULTS / "plan_speed.png")
    print(f"wrote {RESULTS / 'plan_speed.json'} and {RESULTS / 'plan_speed.png'}")
    return 0 if all(t["wall_s"] <= t["limit_s"] for t in targets) else 1


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4), dpi=100)
    for family, marker in (("gpt", "o"), ("llama", "s")):
        pts = [(r["searched"], r["search_s"]) for r in rows if "search_s" in r and r["model"].startswith(family)]
        if pts:
            ax.scatter(*zip(*pts, strict=True), marker=marker, label=family, alpha=0.7)
    ax.set(xscale="log", yscale="log", xlabel="strategies searched", ylabel="search seconds")
    ax.set_title("hyperjax plan: search time against search-space size", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
