"""Pipeline training gives the losses of one SPMD program (fp32, 1e-4), for every schedule and split."""

import io
import math
import re
from pathlib import Path

import numpy as np
import pytest

from hyperjax import ConfigError, HyperjaxError, load_config, resolve, train
from hyperjax.config import ModelConfig
from hyperjax.mpmd.transfer import split_devices
from hyperjax.resolver import balance_layers

QUICKSTART = Path(__file__).parents[2] / "configs" / "quickstart.yaml"
STEPS = 3
BASE = [f"train.steps={STEPS}", "parallel.tensor=1"]  # quickstart's global batch: 32


def losses(sets: list[str]) -> list[float]:
    return train(resolve(load_config(QUICKSTART, [*BASE, *sets])), log=io.StringIO()).losses


@pytest.fixture(scope="module")
def spmd() -> list[float]:
    return losses(["parallel.data=8"])


@pytest.fixture(scope="module")
def spmd48() -> list[float]:
    return losses(["parallel.data=8", "train.global_batch=48"])


@pytest.fixture(scope="module")
def spmd_deep() -> list[float]:
    return losses(["parallel.data=8", "model.layers=8"])


SLOW = pytest.mark.slow  # the rest of a sweep: `pytest -m slow`
FAST = {("1f1b", 4, 4), ("zero-bubble", 2, 4)}  # a split and an unsplit backward, both stage counts
CASES = [
    pytest.param(
        [f"parallel.pipeline={p}", f"train.microbatches={m}", f"parallel.schedule={s}"],
        marks=() if (s, p, m) in FAST else SLOW,
    )
    for s in ("gpipe", "1f1b", "zero-bubble")
    for p in (2, 4)
    for m in (4, 8)
]
CASES += [
    pytest.param(
        [
            "parallel.pipeline=2",
            f"train.microbatches={m}",
            "parallel.schedule=interleaved",
            "parallel.virtual_stages=2",
        ],
        marks=SLOW,
    )
    for m in (4, 8)
]
CASES += [  # tensor parallel inside stages (the fast tier's with sequence parallelism and buckets, next)
    pytest.param(["parallel.pipeline=2", "parallel.tensor=2", "train.microbatches=4"], marks=SLOW)
]
# each stage's data replicas accumulate their own gradients, summed once per step (gradient buckets)
BUCKETS = "parallel.gradient_buckets=true"
CASES += [
    ["parallel.pipeline=2", "parallel.tensor=2", "train.microbatches=4", "parallel.sequence_parallel=true", BUCKETS]
]
CASES += [
    pytest.param(["parallel.pipeline=2", "train.microbatches=4", f"parallel.schedule={s}", *more, BUCKETS], marks=SLOW)
    for s, more in (
        ("zero-bubble", ()),
        ("zero-bubble", ("train.recompute=full",)),  # a split backward without taps
        ("interleaved", ("parallel.virtual_stages=2",)),
        ("1f1b", ("parallel.fsdp=2", "parallel.zero_stage=1")),
    )
]


@pytest.mark.parametrize("sets", CASES, ids=lambda s: ",".join(x.split("=")[-1] for x in s))
def test_pipeline_matches_spmd(spmd, sets):
    assert resolve(load_config(QUICKSTART, [*BASE, *sets])).pipelined
    np.testing.assert_allclose(losses(sets), spmd, rtol=1e-4, atol=0)


@pytest.mark.parametrize(
    "zero, share",
    # per device: the weights (P), their gradient accumulator (P, or P / 4 at stage 2) and Adam's two
    # moments (2 P, or P / 2 split 4 ways), against 4 P without ZeRO
    [(1, (1 + 1 + 2 / 4) / 4), pytest.param(2, (1 + 1 / 4 + 2 / 4) / 4, marks=SLOW)],
)
def test_a_pipeline_splits_its_optimizer_state_under_zero(spmd, zero, share):
    # 2 stages of 4 devices: data 4 on each
    sets = ["parallel.pipeline=2", "train.microbatches=4"]
    run = lambda *more: train(resolve(load_config(QUICKSTART, [*BASE, *sets, *more])), log=io.StringIO())
    whole, split = run(), run(f"parallel.zero_stage={zero}")
    np.testing.assert_allclose(split.losses, spmd, rtol=1e-4, atol=0)
    assert split.memory_per_device / whole.memory_per_device == pytest.approx(share, rel=1e-3)


@pytest.mark.parametrize(
    "sets",
    [
        ["parallel.schedule=1f1b"],  # the plain backward adds to the accumulator
        pytest.param(["parallel.schedule=zero-bubble"], marks=SLOW),  # B (tapped) and W add to it
        pytest.param(["parallel.schedule=zero-bubble", "train.recompute=full"], marks=SLOW),  # W re-runs B
        pytest.param(["parallel.schedule=interleaved", "parallel.virtual_stages=2"], marks=SLOW),
        pytest.param(["parallel.schedule=1f1b", BUCKETS], marks=SLOW),  # each replica's own, summed once a step
    ],
    ids=["1f1b", "zero-bubble", "zero-bubble-remat", "interleaved", "buckets"],
)
def test_zero_2_accumulates_a_pipelines_gradients_split(monkeypatch, spmd, sets):
    """At ``zero_stage: 2`` a stage's gradient accumulator is split over its 4 data replicas, as the cost model
    prices it, and the losses are one SPMD program's. With gradient buckets each replica accumulates its own
    gradients whole and the once-a-step sum leaves them split."""
    import jax

    from hyperjax.mpmd import runner as runner_module

    seen: list[tuple[float, float]] = []  # per gradient: (accumulator, summed) bytes on one device / its size
    real = runner_module.replica_sum

    def watched(param_sh, grad_sh, mesh, manual):
        zeros, reduce = real(param_sh, grad_sh, mesh, manual)

        def summed(acc):
            out = reduce(acc)
            for a, g in zip(jax.tree.leaves(acc), jax.tree.leaves(out), strict=True):
                seen.append(
                    (a.addressable_shards[0].data.nbytes / g.nbytes, g.addressable_shards[0].data.nbytes / g.nbytes)
                )
            return out

        return zeros, summed

    monkeypatch.setattr(runner_module, "replica_sum", watched)
    sets = ["parallel.pipeline=2", "train.microbatches=4", "parallel.zero_stage=2", *sets]
    np.testing.assert_allclose(losses(sets), spmd, rtol=1e-4, atol=0)
    accumulated = 1.0 if BUCKETS in sets else 0.25
    assert seen and set(seen) == {(accumulated, 0.25)}


@pytest.mark.parametrize("recompute", [pytest.param("selective", marks=SLOW), pytest.param("full", marks=SLOW)])
def test_zero_bubble_over_rematerialised_blocks_matches_spmd(spmd, recompute):
    # remat'd blocks keep the plain split (their residuals live inside the rematerialised region)
    sets = ["parallel.pipeline=2", "train.microbatches=4", "parallel.schedule=zero-bubble"]
    np.testing.assert_allclose(losses([*sets, f"train.recompute={recompute}"]), spmd, rtol=1e-4, atol=0)


@pytest.mark.parametrize(
    "schedule", [pytest.param(s, marks=SLOW) for s in ("gpipe", "1f1b", "zero-bubble", "1f1b+buckets")]
)
def test_unequal_stages_match_spmd(spmd48, schedule):
    # 2 + 6 devices: micro-batches of 12 sequences split 2 and 6 ways
    sets = ["train.global_batch=48", "parallel.pipeline=2", "parallel.stage_devices=[2,6]", "train.microbatches=4"]
    schedule, *more = schedule.split("+")  # buckets: replicas of 2 and 6 ways summed once per step
    sets += [f"parallel.schedule={schedule}", *([BUCKETS] if more else [])]
    np.testing.assert_allclose(losses(sets), spmd48, rtol=1e-4, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("m", [4, 8])
def test_interleaved_four_stages_matches_spmd(spmd_deep, m):
    # four stages of two chunks each need eight layers
    sets = ["model.layers=8", "parallel.pipeline=4", f"train.microbatches={m}", "parallel.schedule=interleaved"]
    sets.append("parallel.virtual_stages=2")
    np.testing.assert_allclose(losses(sets), spmd_deep, rtol=1e-4, atol=0)


def test_end_chunks_of_no_blocks_match_spmd(spmd):
    """Megatron's account_for_embedding/loss split: the first chunk embeds alone, the last computes the loss."""
    sets = ["parallel.pipeline=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2"]
    sets += ["train.microbatches=4", "parallel.stage_layers=[0,2,2,0]"]
    run = resolve(load_config(QUICKSTART, [*BASE, *sets]))
    assert run.chunk_layers() == (0, 2, 2, 0)
    np.testing.assert_allclose(losses(sets), spmd, rtol=1e-4, atol=0)


def test_unequal_stages_get_layers_by_their_devices():
    sets = ["train.global_batch=48", "parallel.pipeline=2", "parallel.stage_devices=[2,6]"]
    run = resolve(load_config(QUICKSTART, [*BASE, *sets]))
    assert [s.devices for s in run.stages] == [2, 6]
    assert run.chunk_layers() == (1, 3)
    assert [s.axes["data"] for s in run.stages] == [2, 6]


def test_balance_weighs_the_output_layer():
    cfg = ModelConfig(layers=8, d_model=64, heads=4, d_ff=256, vocab=50000, seq_len=64)
    counts = balance_layers(cfg, [4, 4])
    assert sum(counts) == 8 and counts[0] > counts[1]  # the big vocabulary makes the last stage heavy
    assert balance_layers(cfg, [4, 4], stage_layers=[4, 4]) == [4, 4]


def test_submeshes_are_consecutive_slices():
    groups = split_devices(list(range(8)), [2, 6])
    assert groups == [[0, 1], [2, 3, 4, 5, 6, 7]]
    with pytest.raises(ConfigError, match="sum to 7"):
        split_devices(list(range(8)), [2, 5])


@pytest.mark.parametrize(
    ("sets", "match"),
    [
        (["parallel.pipeline=8"], r"8 chunks, but model.layers=4; .* or a deeper model$"),
        (
            ["parallel.pipeline=2", "parallel.virtual_stages=3", "parallel.schedule=interleaved"],
            r"6 chunks, but model.layers=4; .* or give parallel.stage_layers=\[0, 1, 1, 1, 1, 0\]",
        ),
        (  # one chunk too many: only the last is left without a block
            ["parallel.pipeline=2", "parallel.virtual_stages=2", "parallel.schedule=interleaved", "model.layers=3"],
            r"4 chunks, but model.layers=3; .* or give parallel.stage_layers=\[1, 1, 1, 0\]",
        ),
        (["parallel.pipeline=2", "parallel.stage_devices=[2,5]"], "sum to 7"),
        (["parallel.pipeline=2", "parallel.stage_devices=[2,2,4]"], "names 3 stages"),
        (["parallel.pipeline=2", "parallel.stage_devices=[2,6]"], "multiple of 24"),
        (["parallel.pipeline=2", "parallel.stage_layers=[1,1]"], "sums to 2 layers, but model.layers=4"),
        (
            [
                "parallel.pipeline=2",
                "parallel.virtual_stages=2",
                "parallel.schedule=interleaved",
                "parallel.stage_layers=[2,0,2,0]",
            ],
            "positive but for the first and the last chunk",
        ),
        (["parallel.pipeline=2", "parallel.stage_layers=[-1,5]"], "must be integers >= 0"),
        (["parallel.pipeline=2", "parallel.stage_layers=[0,4]"], "leaves pipeline stage 0 no block"),
        (["parallel.pipeline=2", "parallel.schedule=pipedream"], "parallel.schedule"),
        (["parallel.pipeline=3"], "does not divide the 8 devices"),
    ],
)
def test_invalid_splits_name_the_key(sets, match):
    with pytest.raises(HyperjaxError, match=match):
        resolve(load_config(QUICKSTART, [*BASE, *sets]))


def test_split_backward_leaves_w_the_weight_gemms():
    """Zero-bubble's W is the weight GEMMs alone; B + W cost what the fused backward does."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hyperjax.models import build_model
    from hyperjax.models.layers import no_constraint
    from hyperjax.mpmd import model_chunks
    from hyperjax.mpmd.programs import chunk_programs

    sets = ["parallel.pipeline=2", "parallel.schedule=zero-bubble", "train.microbatches=4", "model.family=llama"]
    run = resolve(load_config(QUICKSTART, [*BASE, *sets]))
    chunk = model_chunks(build_model(run.config.model), run)[0][1]  # the last: blocks, head, loss
    graphdef, state = nnx.split(chunk)
    params = nnx.to_pure_dict(state)
    x = jnp.ones((4, 128, 256), jnp.float32)
    fed = {"targets": jnp.zeros((4, 128), jnp.int32)}
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # fresh each time: the programs donate it
    acc = zeros()

    def flops(fn, *args):
        return fn.lower(*args).compile().cost_analysis()["flops"]

    split = chunk_programs(graphdef, no_constraint, first=False, last=True, m=4, taps=True)
    plain = chunk_programs(graphdef, no_constraint, first=False, last=True, m=4, taps=False)
    _, res, _ = split.forward(params, x, fed)
    _, pullback, _ = plain.forward(params, x, fed)
    pull, kept = res
    b = flops(split.inputs, pull, None, acc)
    acc_b, _, douts = split.inputs(pull, None, zeros())
    w = flops(split.weights, params, kept, x, douts, fed, acc)
    fused = flops(plain.backward, pullback, None, acc)
    w_plain = flops(plain.weights, pullback, None, acc)
    assert w < 0.6 * w_plain  # the plain W re-ran the activation-gradient chain
    assert b + w < 1.1 * fused
    # the gradients are the fused backward's
    g_split = split.weights(params, kept, x, douts, fed, acc_b)
    g_plain = plain.backward(pullback, None, zeros())[0]
    jax.tree.map(lambda a, c: np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-7), g_split, g_plain)


INTERLEAVED = ["model.layers=4", "parallel.schedule=interleaved", "parallel.virtual_stages=2"]
ONE_STAGE = ["model.layers=2", "parallel.pipeline=1"]


@pytest.mark.slow  # the pairs' losses are held in the fast tier by tests/train/test_moe_oracle.py
@pytest.mark.parametrize(
    "schedule", [["model.layers=2"], INTERLEAVED, ONE_STAGE], ids=["1f1b", "interleaved", "one-stage"]
)
def test_paired_tasks_run_as_one_program_in_the_grids_order(schedule):
    """What the emulation can show of F-B pairing: each pair runs as one program (its two tasks share one
    interval of the timeline) and the tasks run in the grid's order; the timing of a real overlap it cannot.
    Interleaved, a pair may join two of a stage's chunks; without a pipeline, each forward the previous
    micro-batch's backward."""
    from hyperjax import build_model
    from hyperjax.mpmd.schedules import Task
    from hyperjax.train import Batches, pipeline_runner, prepare

    pipeline = [] if schedule == ONE_STAGE else ["parallel.pipeline=2"]
    sets = [*schedule, "parallel.expert=2", *pipeline, "train.microbatches=4"]
    run = resolve(load_config(QUICKSTART.parent / "moe-tiny.yaml", [*sets, "parallel.overlap=fb-pair"]))
    t = run.config.train
    runner = pipeline_runner(prepare(run), build_model(run.config.model, seed=t.seed, overlap=run.overlap))
    data = Batches(source=t.data, global_batch=t.global_batch, seq_len=run.config.model.seq_len, vocab=256, seed=0)
    timeline: list = []
    runner.step(runner.init_state(), data.batch(0), timeline=timeline)
    sched = runner.sched
    # after a warm-up of 2(stages - s) - 1 forwards, every forward pairs with a backward: 1 on stage 0, 3 on 1;
    # interleaved, of 2(p - s - 1) + (v - 1) p + 1: 3 on stage 0 and 5 on stage 1, some across chunks
    if schedule == INTERLEAVED:
        assert len(sched.pairs) == 8 and any(f.chunk != b.chunk for f, b in sched.pairs)
    elif schedule == ONE_STAGE:
        assert not run.pipelined and sched.pairs == tuple((Task("F", i + 1, 0), Task("B", i, 0)) for i in range(3))
    else:
        assert len(sched.pairs) == 4
    spans = {task: (start, end) for _, task, start, end in timeline}
    assert set(spans) == {task for _, _, task in sched.starts()}
    for f, b in sched.pairs:
        assert spans[f] == spans[b]
    later = {b for _, b in sched.pairs}  # a pair's backward runs with its forward, at the forward's place
    ran = [task for _, task, _, _ in timeline if task not in later]
    assert ran == [task for _, _, task in sched.starts() if task not in later]


@pytest.mark.parametrize("buckets", [True, False])
def test_gradient_buckets_sum_a_stages_replicas_once_per_step(buckets):
    """With buckets, no backward program reduces over the data replicas; one sum per step does, of every
    gradient at once. Without, every micro-batch's backward reduces each gradient."""
    import jax
    import jax.numpy as jnp

    from hyperjax import build_model
    from hyperjax.shard import place
    from hyperjax.train import Batches, pipeline_runner, prepare

    sets = ["parallel.pipeline=2", "train.microbatches=4", f"parallel.gradient_buckets={str(buckets).lower()}"]
    run = resolve(load_config(QUICKSTART, [*BASE, *sets]))
    runner = pipeline_runner(prepare(run), build_model(run.config.model, seed=0))
    t = run.config.train
    data = Batches(source=t.data, global_batch=t.global_batch, seq_len=run.config.model.seq_len, vocab=256, seed=0)
    params = runner.init_state()["params"][0]
    ch = runner.chunks[0]
    assert ch.manual == (("data",) if buckets else ())
    tokens = data.batch(0)["inputs"][: t.global_batch // 4]
    y, pullback, _ = ch.programs.forward(params, place(tokens, runner._batch_sharding(0, 2)), {})
    dy = jax.device_put(jnp.ones_like(y), ch.act_sh)
    acc = ch.zeros(params)
    backward = reductions(ch.programs.backward, pullback, dy, acc)
    if buckets:
        assert backward == []
        assert jax.tree.leaves(acc)[0].shape[0] == 4  # one accumulator per replica, each on its own devices
        assert reductions(ch.reduce, acc) == [1]  # every gradient of the chunk in one flat buffer
    else:  # XLA combines them into one instruction, which its CPU backend runs one tensor at a time
        assert backward == [len(jax.tree.leaves(params))]


def reductions(fn, *args) -> list[int]:
    """The tensors each all-reduce of ``fn``'s compiled program sums over more than one device."""
    found = []
    for line in fn.lower(*args).compile().as_text().splitlines():
        match = re.search(r"= (\(.*?\)|\S+) all-reduce\(.*?replica_groups=(\{\{.*?\}\}|mesh\[.*?\] \{.*?\})", line)
        if match is None:
            continue
        groups = match.group(2)
        if groups.startswith("mesh"):  # mesh['axis_0'=4,...] {'axis_0'}: groups along the named axes
            sizes = dict(re.findall(r"'(\w+)'=(\d+)", groups))
            wide = math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", groups.split("] ")[1])) > 1
        else:  # {{0,1},{2,3}}
            wide = "," in groups.split("},{")[0]
        if wide:
            found.append(len(re.findall(r"\w+\[[\d,]*\]", match.group(1))))
    return found
