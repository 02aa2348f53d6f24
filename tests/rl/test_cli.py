"""``hyperjax train``, ``predict`` and ``plan`` of an rl: config."""

import json
from pathlib import Path

import pytest

from hyperjax.cli.main import main

GRPO = str(Path(__file__).parents[2] / "configs" / "grpo-tiny.yaml")
COLOCATED = ["--set", "rl.placement=colocated", "--set", "rl.rollout.devices=null", "--set", "rl.learner.devices=null"]
COLOCATED += ["--set", "rl.rollout.parallel={tensor: 2, data: 4}", "--set", "rl.learner.parallel.fsdp=8"]


@pytest.mark.slow  # a learning run: the oracle tests hold the fast tier's RL
def test_grpo_tiny_reward_rises(capsys, tmp_path: Path):
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    args = ["train", GRPO, "--steps", "12", "--metrics-out", str(metrics), "--out-dir", str(tmp_path)]
    assert main([*args, "--checkpoint-dir", str(ck)]) == 0
    out = capsys.readouterr().out
    assert "rollout 4 devices (data=2, tensor=2) | learner 4 devices (fsdp=4)" in out and "summary" in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("iteration ")] == [
        f"{i}/12" for i in range(1, 13)
    ]  # the reward of every iteration is printed
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(1, 13))
    keys = {"reward_mean", "reward_std", "kl", "clip_fraction", "rollout_s", "learn_s", "handover_s", "tokens"}
    assert keys <= set(records[0]) and records[0]["tokens"] == 64 * 16
    first, last = records[0]["reward_mean"], sum(r["reward_mean"] for r in records[-3:]) / 3
    assert last > first + 0.15, (first, last)  # letters: from a fifth of the bytes towards all of them
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-7) and records[-1]["kl"] > 0
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the learner's parameters generate like any checkpoint
    assert (
        main(
            ["generate", GRPO, "--checkpoint-dir", str(ck), "--prompt-ids", "65,66", "--max-new-tokens", "4", "--json"]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["step"] == 12
    # and start another run from them: its first rollout is the trained policy's
    again = tmp_path / "again.jsonl"
    init = ["--set", f"rl.init_checkpoint={ck}", "--metrics-out", str(again), "--out-dir", str(tmp_path)]
    assert main(["train", GRPO, "--steps", "1", *init]) == 0
    assert json.loads(again.read_text())["reward_mean"] > first + 0.15


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--set", "rl.reward=nope"], r"rl.reward='nope' is not a built-in reward"),
        (["--set", "rl.rollout.devices=2"], r"rl.rollout.devices=2 \+ rl.learner.devices=4 = 6"),
        (["--resume", "--checkpoint-dir", "x"], r"--resume is not available for an rl: config"),
        (["--set", "train.checkpoint_every=1"], r"train.checkpoint_every=1: an rl: config keeps one checkpoint"),
        (["--set", "train.keep_checkpoints=5"], r"train.keep_checkpoints=5: an rl: config keeps one checkpoint"),
        (["--set", "emulate.processes=2"], r"emulate.processes=2: an rl: config runs its phases in one process"),
        (
            ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0"],
            r"--coordinator joins a job of several processes, but an rl: config runs its iterations in one",
        ),
        (["--set", "rl.init_checkpoint=/no/such/folder"], r"rl.init_checkpoint='/no/such/folder' holds no checkpoint"),
        (["--set", "model.vocab=512", "--set", "train.data=synthetic"], r"model.vocab=512: train of an rl: config"),
        (
            [
                *("--devices", "512", "--set", "rl.rollout.devices=null", "--set", "rl.learner.devices=null"),
                *("--set", "rl.rollout.parallel.data=null", "--set", "rl.prompts_per_step=64"),
            ],
            r"in one process here, which holds at most 256 emulated devices; this job has 512",
        ),
    ],
)
def test_bad_rl_train_exits_2(capsys, args, pattern):
    import re

    assert main(["train", GRPO, *args]) == 2
    assert re.search(pattern, capsys.readouterr().err)


def test_plan_only_prints_both_phases(capsys):
    assert main(["train", GRPO, "--plan-only", "--json"]) == 0
    rl = json.loads(capsys.readouterr().out)["rl"]
    assert rl["rollout"]["parallel"]["tensor"] == 2 and rl["learner"]["parallel"]["fsdp"] == 4
    assert (rl["rollout"]["first_device"], rl["learner"]["first_device"]) == (0, 4)


def predicted(capsys, *args: str) -> dict:
    assert main(["predict", GRPO, "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_predict_prices_an_iteration(capsys):
    apart = predicted(capsys)
    parts = apart["rollout_s"] + apart["learn_s"] + apart["handover_s"]
    assert apart["iteration_s"] == pytest.approx(parts)
    assert apart["rollout_s"] == pytest.approx(apart["prefill_s"] + 16 * apart["decode_s_per_token"])
    assert apart["learn_s"] == pytest.approx(apart["score_s"] + 2 * apart["update_s"])
    assert 0.3 < apart["idle_fraction"] < 0.7  # each half of the machine waits while the other works
    busy = 4 * apart["rollout_s"] + 4 * apart["learn_s"] + 8 * apart["handover_s"]
    assert apart["idle_fraction"] == pytest.approx(1 - busy / (8 * apart["iteration_s"]))
    assert apart["fits"] and apart["handover_s"] > 0
    stale = predicted(capsys, "--set", "rl.max_staleness=1")
    assert stale["iteration_s"] == pytest.approx(max(stale["rollout_s"], stale["learn_s"] + stale["handover_s"]))
    assert stale["iteration_s"] < apart["iteration_s"]
    together = predicted(capsys, *COLOCATED)
    assert together["idle_fraction"] == 0 and together["rl"]["learner"]["devices"] == 8
    waves = predicted(capsys, "--set", "rl.rollout_batch=16")
    assert waves["rollout_s"] == pytest.approx(waves["prefill_s"] + 4 * 16 * waves["decode_s_per_token"])  # 4 waves
    assert waves["rl"]["rollout_batch"] == 16 and waves["rollout_s"] > apart["rollout_s"]


def test_predict_of_rl_refuses_inference(capsys):
    assert main(["predict", GRPO, "--inference"]) == 2
    assert "an rl: config is priced per iteration" in capsys.readouterr().err


def test_plan_searches_the_split(capsys):
    assert main(["plan", GRPO, "--devices", "8", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["splits"] == 7 and found["best"]["fits"]
    times = [c["iteration_s"] for c in found["candidates"]]
    assert times == sorted(times)
    best = found["best"]["rl"]
    assert best["rollout"]["devices"] + best["learner"]["devices"] == 8
    assert main(["plan", GRPO, "--devices", "8"]) == 0
    assert "fastest iterations that fit" in capsys.readouterr().out


def test_plan_of_rl_names_a_preset_it_cannot_honour(capsys):
    """train.fp8 on a device without FP8 products: exit 2 naming the key and its fix, no search run."""
    fp8 = ["--set", "hardware=dgx-a100-80g", "--set", "train.fp8.recipe=tensorwise"]
    assert main(["plan", GRPO, "--devices", "8", *fp8]) == 2
    err = capsys.readouterr().err
    assert "train.fp8 (recipe tensorwise) multiplies in FP8" in err and "set train.fp8: null" in err
    assert "Traceback" not in err


def test_predict_prices_where_state_waits(capsys):
    plain = predicted(capsys, *COLOCATED)
    host = predicted(capsys, *COLOCATED, "--set", "rl.reference=host")
    assert host["memory_per_device_gib"]["learner"] < plain["memory_per_device_gib"]["learner"]
    assert host["score_s"] > plain["score_s"]  # the reference crosses the host link for its pass
    parked = predicted(capsys, *COLOCATED, "--set", "rl.offload_optimizer=true")
    assert parked["memory_per_device_gib"]["rollout"] < plain["memory_per_device_gib"]["rollout"]
    assert parked["offload_s"] > 0 and parked["iteration_s"] == pytest.approx(
        plain["iteration_s"] + parked["offload_s"]
    )
    alone = predicted(capsys, *COLOCATED, "--set", "rl.kl_coef=0")
    assert alone["score_s"] == pytest.approx(plain["score_s"] / 2)  # no reference to score
    assert alone["rl"]["reference"] is None


def test_more_sequences_than_the_machine_holds_exit_2_before_any_device(tmp_path, capsys):
    """An iteration's token windows are host arrays: far more than memory holds was a NumPy MemoryError from
    inside the loop (and an empty metrics file); now it is refused naming the keys, nothing written."""
    metrics = tmp_path / "m.jsonl"
    args = ["train", str(GRPO), "--set", "rl.prompts_per_step=100000000000", "--out-dir", str(tmp_path / "o")]
    assert main([*args, "--metrics-out", str(metrics)]) == 2
    err = capsys.readouterr().err
    assert "rl.prompts_per_step=100000000000 x rl.group_size=8: a step's" in err and "Traceback" not in err
    assert not metrics.exists()


@pytest.mark.slow  # an iteration of learning
def test_without_a_reference_kl_reads_the_drift_of_the_iterations_updates(tmp_path):
    """With kl_coef 0 no reference is kept: the recorded kl is the last update's against the iteration's start
    (it was the first update's, against the same weights: 0 always)."""
    metrics = tmp_path / "m.jsonl"
    args = ["train", GRPO, "--steps", "1", "--set", "rl.kl_coef=0", "--set", "rl.updates=3"]
    assert main([*args, "--metrics-out", str(metrics), "--out-dir", str(tmp_path / "o")]) == 0
    [record] = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert record["kl"] > 1e-7


@pytest.mark.slow  # a rollout before the reward fails
def test_a_reward_that_fails_leaves_no_metrics_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "short.py").write_text("def wrong(p, c):\n    return [0.0] * (len(c) - 1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    metrics = tmp_path / "m.jsonl"
    args = ["train", GRPO, "--steps", "2", "--set", "rl.reward=short:wrong", "--out-dir", str(tmp_path / "o")]
    assert main([*args, "--metrics-out", str(metrics)]) == 2
    assert "returned 63 values for 64 completions" in capsys.readouterr().err
    assert not metrics.exists()
