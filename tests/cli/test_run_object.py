"""``predict`` prices the run ``train`` starts: the two print the same resolved run, for every config (and every
shipped config fits its machine)."""

import json
import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyperjax.cli.main import main

CONFIGS = Path(__file__).parents[2] / "configs"
SHIPPED = sorted(p.name for p in CONFIGS.glob("*.yaml"))


def both(capsys, config: str, sets: list[str]) -> tuple[tuple[int, str], tuple[int, str]]:
    args = [a for s in sets for a in ("--set", s)]
    predicted = main(["predict", config, "--json", *args]), capsys.readouterr()
    planned = main(["train", config, "--plan-only", "--json", *args]), capsys.readouterr()
    return (predicted[0], predicted[1].out + predicted[1].err), (planned[0], planned[1].out + planned[1].err)


def test_every_shipped_config_is_priced_as_it_trains(capsys):
    assert len(SHIPPED) >= 5
    for name in SHIPPED:
        (p_code, p_out), (t_code, t_out) = both(capsys, str(CONFIGS / name), [])
        assert p_code == 0 and t_code == 0, (name, p_out[-2000:], t_out[-2000:])
        key = "rl" if "rl" in json.loads(t_out) else "run"  # an rl: config resolves into its two phases
        assert json.loads(p_out)[key] == json.loads(t_out)[key], name
        # a shipped config describes a run its own machine holds, as a user would copy it
        assert json.loads(p_out)["fits"], f"{name}: predicted not to fit its devices' memory"


def test_the_readable_headers_print_the_same_strategy(capsys):
    for name in ("quickstart.yaml", "vlm-tiny-mpmd.yaml"):
        assert main(["predict", str(CONFIGS / name)]) == 0
        predicted = re.search(r"strategy: (.*)", capsys.readouterr().out).group(1).strip()
        assert main(["train", str(CONFIGS / name), "--plan-only"]) == 0
        planned = re.search(r"strategy: (.*)", capsys.readouterr().out).group(1).strip()
        assert predicted == planned, name


def test_the_run_object_has_every_field(capsys):
    assert main(["predict", str(CONFIGS / "quickstart.yaml"), "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["run"]
    assert {
        "devices",
        "processes",
        "parallel",
        "micro_batch",
        "microbatches",
        "stages",
        "schedule",
        "recompute",
    } <= set(run)
    assert run["devices"] == 8 and run["parallel"]["data"] == 4 and run["parallel"]["tensor"] == 2
    assert None not in run["parallel"].values()
    assert set(run["parallel"]) == {
        "data",
        "fsdp",
        "expert",
        "context",
        "tensor",
        "pipeline",
        "virtual_stages",
        "expert_tensor",
    }


def test_plan_only_starts_no_device(tmp_path: Path):
    """``--plan-only`` leaves the JAX backend unstarted (it runs in a fresh process to see that)."""
    import subprocess
    import sys

    code = (
        "import jax, sys\n"
        "from hyperjax.cli.main import main\n"
        f"assert main(['train', {str(CONFIGS / 'gpt-tiny-cm384.yaml')!r}, '--plan-only', '--json']) == 0\n"
        "from jax._src import xla_bridge\n"
        "sys.exit(1 if xla_bridge._backends else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["run"]["devices"] == 384


@st.composite
def run_config(draw):
    """A config near the quickstart's: degrees, pipeline layout, micro-batches and architecture drawn freely."""
    sets = [f"model.family={draw(st.sampled_from(['gpt', 'llama']))}", "train.global_batch=48"]
    sets.append(f"model.block={draw(st.sampled_from(['sequential', 'parallel']))}")
    devices = draw(st.sampled_from([1, 2, 4, 8, 16]))
    sets.append(f"emulate.devices={devices}")
    tensor = draw(st.sampled_from([1, 2, 4]))
    pipeline = draw(st.sampled_from([1, 1, 2, 4]))
    sets += [f"parallel.tensor={tensor}", f"parallel.pipeline={pipeline}"]
    sets.append(f"parallel.fsdp={draw(st.sampled_from([1, 2]))}")
    sets.append(f"parallel.context={draw(st.sampled_from([1, 1, 2]))}")
    if tensor > 1 and draw(st.booleans()):
        sets.append("parallel.sequence_parallel=true")
    if pipeline > 1:
        schedule = draw(st.sampled_from(["gpipe", "1f1b", "zero-bubble", "interleaved"]))
        sets.append(f"parallel.schedule={schedule}")
        if schedule == "interleaved":
            sets.append("parallel.virtual_stages=2")
        if draw(st.booleans()):
            sets.append(f"parallel.stage_devices=[{devices // pipeline + 1},{devices - devices // pipeline - 1}]")
    choice = draw(st.sampled_from(["none", "micro_batch", "microbatches"]))
    if choice == "micro_batch":
        sets.append(f"train.micro_batch={draw(st.sampled_from([1, 2, 3, 6]))}")
    elif choice == "microbatches":
        sets.append(f"train.microbatches={draw(st.sampled_from([1, 2, 4, 8]))}")
    sets.append(f"train.recompute={draw(st.sampled_from(['none', 'selective', 'full']))}")
    return sets


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sets=run_config())
def test_drawn_configs_resolve_alike_in_predict_and_train(capsys, sets):
    """Whatever the config, predict and train agree: both refuse it with the same message, or both accept
    it and print the same run."""
    (p_code, p_out), (t_code, t_out) = both(capsys, str(CONFIGS / "quickstart.yaml"), sets)
    assert p_code == t_code, (sets, p_out[-1500:], t_out[-1500:])
    if p_code == 0:
        assert json.loads(p_out)["run"] == json.loads(t_out)["run"], sets
    else:
        assert p_code == 2 and p_out.split("error: ", 1)[1] == t_out.split("error: ", 1)[1], sets
