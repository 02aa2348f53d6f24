from pathlib import Path

import pytest

from hyperjax import ConfigError, ShardingError, load_config, resolve

CONFIGS = Path(__file__).parents[2] / "configs"


def test_shipped_configs_resolve():
    quick = resolve(load_config(CONFIGS / "quickstart.yaml"))
    assert quick.devices == 8 and quick.processes == 1
    assert dict(quick.parallel) == {
        "data": 4,
        "fsdp": 1,
        "expert": 1,
        "context": 1,
        "tensor": 2,
        "pipeline": 1,
        "virtual_stages": 1,
        "expert_tensor": 2,
    }
    assert quick.micro_batch == 8 and quick.microbatches == 1 and quick.schedule is None
    run = resolve(load_config(CONFIGS / "gpt-tiny-cm384.yaml"))
    assert run.devices == 384 and run.axes["data"] > 1 and run.axes["tensor"] > 1
    assert run.processes > 1


def test_devices_come_from_the_config_or_the_degrees():
    degrees = ["parallel.data=2", "parallel.tensor=4", "parallel.pipeline=2"]
    assert resolve(load_config(None, degrees)).devices == 16  # every degree given: their product
    assert resolve(load_config(None, ["parallel.tensor=2"])).devices == 8  # data inferred on 8 devices
    assert resolve(load_config(None, ["parallel.tensor=2"]), 4).axes["data"] == 2
    assert resolve(load_config(None, ["emulate.devices=4"])).devices == 4


def test_pipeline_microbatches_are_decided_once():
    base = ["parallel.tensor=1", "parallel.pipeline=2"]
    assert resolve(load_config(CONFIGS / "quickstart.yaml", base)).microbatches == 4  # 2 x stages
    run = resolve(load_config(CONFIGS / "quickstart.yaml", [*base, "train.micro_batch=2"]))
    assert (run.microbatches, run.micro_batch) == (4, 2)  # 32 sequences over 4 replicas of 2
    both = [*base, "train.micro_batch=2", "train.microbatches=8"]
    with pytest.raises(ConfigError, match=r"train.micro_batch=2 x 4 data-parallel replicas x train.microbatches=8"):
        resolve(load_config(CONFIGS / "quickstart.yaml", both))


def test_a_run_too_large_to_emulate_still_resolves():
    run = resolve(load_config(None, ["hardware=dgx-h100", "parallel.data=8192", "train.global_batch=8192"]))
    assert run.devices == 8192 and run.processes is None and "8192 devices" in run.emulation_limit


def test_overrides_and_yaml_values():
    cfg = load_config(
        CONFIGS / "quickstart.yaml",
        ["parallel.tensor=4", "train.lr=3e-4", "parallel.data=null", "parallel.sequence_parallel=true"],
    )
    assert cfg.parallel.tensor == 4 and cfg.train.lr == 3e-4 and cfg.parallel.sequence_parallel
    assert resolve(cfg).axes == {"data": 2, "fsdp": 1, "expert": 1, "context": 1, "tensor": 4}


@pytest.mark.parametrize(
    ("sets", "error", "pattern"),
    [
        (["paralel.tensor=2"], ConfigError, r"unknown config key paralel; did you mean parallel\?"),
        (["train.stesp=3"], ConfigError, r"unknown config key train.stesp; did you mean train.steps\?"),
        (["train.steps=many"], ConfigError, r"train.steps='many' has the wrong type: expected int"),
        (["train.steps=0"], ConfigError, r"train.steps=0 must be a positive integer"),
        (["train.dtype=float16"], ConfigError, r"train.dtype='float16' is not one of"),
        (["train.lr=-1"], ConfigError, r"train.lr=-1.0 must be > 0"),
        (["model.heads=6"], ConfigError, r"model.d_model=256 is not divisible by model.heads=6"),
        (["model.vocab=100"], ConfigError, r"train.data=text reads bytes .* model.vocab=100"),
        (["parallel.zero_stage=3"], ConfigError, r"zero_stage=3 must be 0, 1 or 2; for stage 3 set parallel.fsdp"),
        (
            ["parallel.tensor=1", "parallel.sequence_parallel=true"],
            ConfigError,
            r"sequence_parallel=true needs parallel.tensor > 1",
        ),
        (
            ["parallel.data=3"],
            ShardingError,
            r"data=3 x fsdp=1 x expert=1 x context=1 x tensor=2 x pipeline=1 = 6, but there are 8 devices",
        ),
        (["parallel.tensor=16"], ShardingError, r"do not divide the 8 devices"),
        (
            ["parallel.tensor=8", "model.heads=4"],
            ShardingError,
            r"dimension '(kv_)?heads' of size 4 is not divisible by mesh axes \('tensor',\) of total size 8",
        ),
        (
            ["parallel.tensor=1", "parallel.context=8", "model.seq_len=100"],
            ShardingError,
            r"activation tokens': dimension 'seq' of size 100 is not divisible",
        ),
        (["train.micro_batch=3"], ConfigError, r"train.global_batch=32 is not a multiple of train.micro_batch=3 x 4"),
        (
            ["parallel.pipeline=2", "parallel.tensor=1", "train.microbatches=3"],
            ConfigError,
            r"train.global_batch=32 does not split into 3 micro-batches",
        ),
        (
            ["parallel.pipeline=2", "parallel.tensor=1", "train.microbatches=16"],
            ConfigError,
            r"2 sequences each, which the batch degrees \(data x fsdp x expert\) \[4, 4\] must divide",
        ),
        (["train.recompute=ful"], ConfigError, r"train.recompute='ful' is not one of .*; did you mean 'full'\?"),
        (["parallel.schedule=1f1"], ConfigError, r"parallel.schedule='1f1' is not one of"),
        (["offload.policy=greed"], ConfigError, r"offload.policy='greed' is not one of .*did you mean 'greedy'"),
        (["train.data=texts"], ConfigError, r"train.data='texts' is not one of"),
        (["parallel.schedule=gpipe"], ConfigError, r"parallel.schedule='gpipe' orders a pipeline's stages, but "),
        (
            ["parallel.schedule=zero-bubble"],
            ConfigError,
            r"parallel.pipeline=1 runs one stage .*set parallel.pipeline > 1",
        ),
        (["parallel.expert_tensor=2"], ConfigError, r"parallel.expert_tensor=2 lays out the experts of model.moe"),
        (["parallel.expert_tensor=1", "parallel.tensor=1"], ConfigError, r"parallel.expert_tensor=1 lays out the"),
        (["offload.prefetch=2"], ConfigError, r"offload.prefetch=2 sets .* offload.policy='none' places nothing"),
        (["offload.manual={layers.0.params: host}"], ConfigError, r"offload.manual is given but offload.policy='none'"),
        (["shard.vocab=tensr"], ShardingError, r"shard.vocab: mesh axis 'tensr' does not exist"),
        (["shard={5: data}"], ConfigError, r"shard key 5 must be a logical axis name \(a string\)"),
        (["shard={batch: 5}"], ConfigError, r"shard.batch=5 must be a mesh axis, a list of mesh axes, or null"),
        (["shard={batch: [[data]]}"], ConfigError, r"shard.batch=\[\['data'\]\] must be a mesh axis"),
        (["shard={batch: {a: 1}}"], ConfigError, r"shard.batch=\{'a': 1\} must be a mesh axis"),
        (
            ["offload.policy=manual", "offload.manual={5: host}"],
            ConfigError,
            r"offload.manual key 5 must be a group pattern \(a string\)",
        ),
        (["hardware=cm384"], Exception, r"unknown hardware preset 'cm384'"),
        (
            ["emulate.devices=384", "emulate.processes=1", "train.global_batch=384"],
            Exception,
            r"384 devices per process .* 256-device limit",
        ),
        (["model=3"], ConfigError, r"model must be a mapping of keys"),
    ],
)
def test_bad_configs(sets, error, pattern):
    with pytest.raises(error, match=pattern):
        resolve(load_config(CONFIGS / "quickstart.yaml", sets))


@pytest.mark.parametrize(
    ("sets", "buckets", "axes"),
    [
        ([], False, ()),  # one process: XLA's own reductions
        (["emulate.processes=2"], True, ("data",)),  # data=4 spans both processes
        (["emulate.processes=2", "parallel.data=1", "parallel.tensor=8"], False, ()),  # nothing to sum
        (["parallel.gradient_buckets=true"], True, ("data",)),
        (["emulate.processes=2", "parallel.gradient_buckets=false"], False, ()),
        # a `shard` override onto a replica axis, or of the batch, leaves XLA's reductions; others do not
        (["emulate.processes=2", "shard.embed=data"], False, ()),
        (["emulate.processes=2", "shard.batch=data"], False, ()),
        (["emulate.processes=2", "shard.heads=tensor"], True, ("data",)),
    ],
)
def test_gradient_buckets_resolve_to_whether_replicas_span_processes(sets, buckets, axes):
    run = resolve(load_config(CONFIGS / "quickstart.yaml", sets))
    assert run.gradient_buckets is buckets and run.replica_axes == axes
    assert run.to_dict()["gradient_buckets"] is buckets
    assert ("gradient buckets over data" in run.describe()) is buckets


def test_gradient_buckets_over_the_expert_axis_of_the_supernode():
    run = resolve(load_config(CONFIGS / "moe-cm384.yaml"))
    assert run.gradient_buckets and run.replica_axes == ("expert",)  # 48 nodes' worth of replicas
    fsdp = resolve(
        load_config(
            CONFIGS / "moe-tiny.yaml", ["parallel.expert=2", "parallel.fsdp=2", "parallel.gradient_buckets=true"]
        )
    )
    assert fsdp.replica_axes == ("data",)  # FSDP stores parameters over the axis before expert


@pytest.mark.parametrize(
    ("sets", "match"),
    [
        (["parallel.gradient_buckets=true", "parallel.data=1", "parallel.tensor=8"], "needs data-parallel replicas"),
        (
            ["parallel.gradient_buckets=true", "parallel.pipeline=2", "parallel.data=1", "parallel.tensor=4"],
            "needs data",
        ),
    ],
)
def test_gradient_buckets_that_cannot_be_honoured_are_refused(sets, match):
    with pytest.raises(ConfigError, match=match):
        resolve(load_config(CONFIGS / "quickstart.yaml", sets))


ONE_DEVICE_WIDE = ["parallel.tensor=1", "parallel.fsdp=1", "parallel.context=1"]  # quickstart: data 8


@pytest.mark.parametrize(
    ("sets", "match"),
    [
        (["parallel.fsdp_reshard=false"], r"parallel.fsdp_reshard=false says how FSDP runs, but no stage has it"),
        (["parallel.fsdp_unit=layer"], r"parallel.fsdp_unit=layer says how FSDP runs"),
        (["parallel.fsdp_context=true"], r"parallel.fsdp_context=true says how context parallelism runs"),
        (["parallel.context_impl=ring", "model.attention_kernel=flash"], r"parallel.context_impl=ring says how"),
        (["parallel.tp_overlap=bulk"], r"parallel.tp_overlap=bulk says how tensor parallelism runs"),
    ],
)
def test_a_modifier_of_a_feature_no_stage_runs_is_refused(sets, match):
    """Set away from its default where the layout lacks its feature, a modifier would change nothing: an
    error names the key, each stage's degrees and the fix, rather than the run ignoring it."""
    with pytest.raises(ConfigError, match=match) as e:
        resolve(load_config(CONFIGS / "quickstart.yaml", [*ONE_DEVICE_WIDE, *sets]))
    assert "(each stage's degrees: fsdp 1, context 1, tensor 1); remove parallel." in str(e.value)
    assert ", or set parallel." in str(e.value)


@pytest.mark.parametrize(
    "sets",
    [
        ["parallel.fsdp_reshard=false", "parallel.fsdp_unit=layer", "parallel.fsdp=2"],
        # FSDP over fsdp x context: context 2 carries it with fsdp 1
        ["parallel.fsdp_reshard=false", "parallel.fsdp_context=true", "parallel.context=2"],
        ["parallel.context_impl=ring", "model.attention_kernel=flash", "parallel.context=2"],
        ["parallel.tp_overlap=pipelined", "parallel.tensor=2"],
        ["parallel.fsdp_reshard=true", "parallel.tp_overlap=none"],  # the defaults, restated
    ],
)
def test_a_modifier_resolves_where_a_stage_runs_its_feature(sets):
    p = resolve(load_config(CONFIGS / "quickstart.yaml", [*ONE_DEVICE_WIDE, *sets])).config.parallel
    for key, value in (s.split("=") for s in sets if s.startswith("parallel.")):
        assert str(getattr(p, key.removeprefix("parallel."))).lower() == value  # kept as set


def test_an_mpmd_runs_modifiers_follow_its_submeshes():
    vlm = CONFIGS / "vlm-tiny-mpmd.yaml"  # the language model's submesh has tensor 2, neither has fsdp
    assert resolve(load_config(vlm, ["parallel.tp_overlap=bulk"])).config.parallel.tp_overlap == "bulk"
    with pytest.raises(
        ConfigError,
        match=r"fsdp 1, tensor 1 \| fsdp 1, tensor 2\); remove "
        r"parallel.fsdp_reshard, or give an mpmd.submeshes item fsdp > 1",
    ):
        resolve(load_config(vlm, ["parallel.fsdp_reshard=false"]))
    with pytest.raises(ConfigError, match=r"remove parallel.context_impl \(mpmd submeshes have none\)"):
        resolve(load_config(vlm, ["parallel.context_impl=ring", "model.attention_kernel=flash"]))
    # a whole-run degree the submeshes replace is named first, not the modifier it would carry
    with pytest.raises(ConfigError, match=r"parallel.context=2: mpmd submeshes have no context axis"):
        resolve(load_config(vlm, ["parallel.context=2", "parallel.fsdp_context=true"]))


def test_an_elastic_restart_that_drops_a_feature_resets_its_modifiers():
    from hyperjax.resolver import elastic_overrides

    sets = ["parallel.tensor=2", "parallel.fsdp=2", "parallel.fsdp_reshard=false", "parallel.tp_overlap=bulk"]
    load = lambda more: load_config(CONFIGS / "quickstart.yaml", [*sets, *more])
    _, run = elastic_overrides(load, 4)  # tensor 2 x fsdp 2 still fit: the modifiers stay
    assert (run.axes["tensor"], run.axes["fsdp"]) == (2, 2)
    assert run.config.parallel.fsdp_reshard is False and run.config.parallel.tp_overlap == "bulk"
    _, run = elastic_overrides(load, 2)  # data 2 alone: FSDP and tensor parallelism gone, their modifiers reset
    assert (run.axes["data"], run.axes["tensor"], run.axes["fsdp"]) == (2, 1, 1)
    assert run.config.parallel.fsdp_reshard is True and run.config.parallel.tp_overlap == "none"


def test_an_elastic_restart_keeps_a_paired_run_paired_or_says_why_not():
    """A run whose forwards and backwards pair (parallel.overlap: fb-pair) saves its state as a one-stage
    pipeline: an elastic restart that drops the pairing would not load it. On 2 devices, where the experts
    cannot stay spread, the restart is refused naming the setting, before any device starts; before, it
    failed after the devices started, on a tensor the checkpoint lacked."""
    from hyperjax.resolver import elastic_overrides

    sets = ["model.layers=2", "train.global_batch=16", "parallel.expert=4", "parallel.tensor=2"]
    sets += ["train.microbatches=2", "parallel.overlap=fb-pair"]
    load = lambda more: load_config(CONFIGS / "moe-tiny.yaml", [*sets, *more])
    assert elastic_overrides(load, 8)[1].overlap == "fb-pair"
    with pytest.raises(ConfigError, match=r"no strategy fits 2 devices .*parallel.overlap=fb-pair saves"):
        elastic_overrides(load, 2)


def test_expert_tensor_equal_to_tensor_splits_each_expert_as_null_does():
    sets = ["parallel.tensor=2", "parallel.sequence_parallel=true"]
    null = resolve(load_config(CONFIGS / "moe-tiny.yaml", sets))
    same = resolve(load_config(CONFIGS / "moe-tiny.yaml", [*sets, "parallel.expert_tensor=2"]))
    spread = resolve(load_config(CONFIGS / "moe-tiny.yaml", [*sets, "parallel.expert_tensor=1"]))
    assert same.expert_tensor_split and dict(same.parallel) == dict(null.parallel)
    assert not spread.expert_tensor_split


def test_predict_names_a_modifier_it_cannot_honour(capsys):
    from hyperjax.cli.main import main

    assert main(["predict", str(CONFIGS / "quickstart.yaml"), "--set", "parallel.fsdp_unit=layer"]) == 2
    err = capsys.readouterr().err
    assert "parallel.fsdp_unit=layer says how FSDP runs" in err and "Traceback" not in err


def test_a_pipelined_mixture_of_experts_sums_its_replicas_once_too():
    sets = ["parallel.pipeline=2", "parallel.expert=2"]
    resolved = lambda *more: resolve(load_config(CONFIGS / "moe-tiny.yaml", [*sets, *more]))
    assert not resolved("emulate.processes=2").gradient_buckets  # each stage in one process
    run = resolved("emulate.processes=4")  # each stage's data=2 x expert=2 over two processes
    assert run.gradient_buckets and run.replica_axes == ("data",)  # a stage's experts keep their exchange


@pytest.mark.parametrize(
    ("sets", "buckets"),
    [
        (["parallel.pipeline=2"], False),  # one process
        (["parallel.pipeline=2", "emulate.processes=2"], False),  # each stage in its own process
        (["parallel.pipeline=2", "emulate.processes=4"], True),  # each stage's data=2 over two processes
        (["parallel.pipeline=2", "parallel.gradient_buckets=true"], True),
    ],
)
def test_pipeline_stages_sum_their_replicas_once_where_they_span_processes(sets, buckets):
    run = resolve(load_config(CONFIGS / "quickstart.yaml", [*sets, "parallel.data=2", "parallel.tensor=2"]))
    assert run.gradient_buckets is buckets


@pytest.mark.parametrize(
    ("config", "sets", "match"),
    [
        ("quickstart.yaml", ["parallel.dispatcher_sms=32"], r"parallel.dispatcher_sms=32: .*\(model.moe is null\)"),
        (
            "mixtral-8x7b.yaml",
            ["parallel.dispatcher_sms=32", "parallel.dispatcher=alltoall"],
            r"parallel.dispatcher='alltoall' exchanges through NCCL.*set parallel.dispatcher: deepep",
        ),
        ("moe-tiny.yaml", ["parallel.dispatcher_sms=32"], r"preset cloudmatrix384's device .*\(device.compute_units\)"),
        ("mixtral-8x7b.yaml", ["parallel.dispatcher_sms=132"], r"has 132 SMs \(device.compute_units\); set it below"),
        ("mixtral-8x7b.yaml", ["parallel.dispatcher_sms=0"], r"parallel.dispatcher_sms=0 must be a positive integer"),
    ],
)
def test_dispatcher_sms_that_cannot_be_honoured_is_an_error(config, sets, match):
    with pytest.raises(ConfigError, match=match):
        resolve(load_config(CONFIGS / config, sets))


def test_dispatcher_sms_set_the_exchanges_share_of_the_device():
    run = resolve(load_config(CONFIGS / "mixtral-8x7b.yaml"))
    assert run.exchange_share == run.hardware.device.comm_compute_share  # DeepEP's 20 of 132, from the preset
    run = resolve(load_config(CONFIGS / "mixtral-8x7b.yaml", ["parallel.dispatcher_sms=33"]))
    assert run.exchange_share == pytest.approx(33 / 132)


def test_plan_names_a_dispatcher_sms_it_cannot_honour():
    from hyperjax.search import plan

    with pytest.raises(ConfigError, match=r"parallel.dispatcher_sms=32: preset cloudmatrix384's device"):
        plan(load_config(CONFIGS / "moe-tiny.yaml", ["parallel.dispatcher_sms=32"]), 8)


def test_dispatcher_sms_leaves_tensor_and_context_parallel_transfers_on_the_device_share():
    from hyperjax import estimate

    sets = ["parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.tp_overlap=pipelined"]
    plain = estimate(resolve(load_config(CONFIGS / "mixtral-8x7b.yaml", sets)))
    more = estimate(resolve(load_config(CONFIGS / "mixtral-8x7b.yaml", [*sets, "parallel.dispatcher_sms=40"])))
    layers = lambda est: [p.layer for s in est.stages for p in s.parts if p.layer is not None]
    assert layers(plain) == layers(more)  # the blocks' own prices: tensor-parallel overlap on the device share
    assert more.run.exchange_share != plain.run.exchange_share


def test_a_pipelines_like_stages_are_described_once_with_their_count():
    sets = ["parallel.tensor=1", "parallel.pipeline=8", "parallel.stage_layers=[1,1,1,1,1,1,1,3]"]
    run = resolve(load_config(CONFIGS / "quickstart.yaml", [*sets, "model.layers=10"]), 8)
    assert run.describe().startswith("pipeline 7 stages of 1 device 1 layer | 1 device 3 layers, 1f1b, ")
    mixed = [*sets[:2], "parallel.stage_layers=[1,2,1,2,1,1,1,1]", "model.layers=10"]
    like = [
        "1 device 1 layer",
        "1 device 2 layers",
        "1 device 1 layer",
        "1 device 2 layers",
        "4 stages of 1 device 1 layer",
    ]
    assert (
        resolve(load_config(CONFIGS / "quickstart.yaml", mixed))
        .describe()
        .startswith("pipeline " + " | ".join(like) + ", 1f1b, ")
    )
    wide = resolve(load_config(CONFIGS / "quickstart.yaml", ["parallel.tensor=2", "parallel.pipeline=4"]))
    assert wide.describe().startswith("pipeline 4 stages of 2 devices (tensor=2) 1 layer, ")
    # an MPMD run's submeshes are named, each apart, even where two are alike
    apart = ["train.global_batch=16", "mpmd.submeshes=[{name: x, modules: [encoder], devices: 4}, "]
    piped = resolve(load_config(CONFIGS / "vlm-tiny-mpmd.yaml", [*apart[:1], apart[1] + ALIKE, "model.layers=2"]))
    assert piped.describe().startswith("mpmd x: 4 devices (data=4) 2 layers | y: 4 devices (data=4) 2 layers, ")
    with pytest.raises(ConfigError, match=r"mpmd.submeshes items 0, 1 are all named 'x'.*give each its own name"):
        load_config(CONFIGS / "vlm-tiny-mpmd.yaml", [*apart[:1], apart[1] + ALIKE.replace("y", "x")])


ALIKE = "{name: y, modules: [language_model], devices: 4}]"


def test_serving_describes_the_layout_alone():
    sets = ["train.micro_batch=2", "parallel.zero_stage=1"]
    run = resolve(load_config(CONFIGS / "quickstart.yaml", sets))
    assert "micro-batches" in run.describe() and "zero_stage=1" in run.describe()
    assert run.describe(serving=True) == "data=4, tensor=2"
    piped = resolve(load_config(CONFIGS / "quickstart.yaml", ["parallel.tensor=2", "parallel.pipeline=4"]))
    assert piped.describe(serving=True) == "pipeline 4 stages of 2 devices (tensor=2) 1 layer"
    # what a forward pass is laid out by stays: the sequence split and experts spread over the tensor axis
    moe = ["parallel.data=2", "parallel.expert=2", "parallel.tensor=2", "parallel.expert_tensor=1"]
    moe += ["parallel.sequence_parallel=true", "parallel.overlap=fb-pair", "train.micro_batch=2"]
    paired = resolve(load_config(CONFIGS / "moe-tiny.yaml", moe))
    assert "fb-pair overlap" in paired.describe() and "4 micro-batches" in paired.describe()
    want = "data=2, expert=2, tensor=2, sequence_parallel, experts over expert x tensor"
    assert paired.describe(serving=True) == want
    buckets = resolve(load_config(CONFIGS / "moe-tiny.yaml", [*moe[:5], "parallel.gradient_buckets=true"]))
    assert "gradient buckets" in buckets.describe() and buckets.describe(serving=True) == want


def test_zero_over_a_degree_no_dimension_divides_is_refused_before_anything_runs():
    # 6 devices, tensor 2: data 3, and no dimension of the quick start's tensors divides by 3
    quick = ["train.global_batch=30", "parallel.zero_stage=1"]
    with pytest.raises(ShardingError) as e:
        resolve(load_config(CONFIGS / "quickstart.yaml", quick), 6)
    for part in ["tensor 'embed' of shape (256, 256)", "zero_stage=1", "'data' (3 devices)", "(128, 256)", "=0"]:
        assert part in str(e.value), (part, str(e.value))
    assert resolve(load_config(CONFIGS / "quickstart.yaml", quick[:1]), 6).parallel["data"] == 3  # stage 0 runs
    # a pipeline names the stage; the stages' first refusal is the run's
    piped = [*quick, "parallel.tensor=1", "parallel.pipeline=2", "train.microbatches=2", "parallel.zero_stage=2"]
    with pytest.raises(ShardingError, match=r"^stage 0: tensor .*zero_stage=2 shards its state over mesh axis 'data'"):
        resolve(load_config(CONFIGS / "quickstart.yaml", piped), 6)


def test_the_zero_check_reaches_the_mixture_of_experts_blocks_after_the_dense_ones():
    # moe-tiny's block 0 is dense (first_dense 1): widths of 192 and 384 split 3 ways, the 8 routing biases do not
    sets = ["parallel.data=3", "parallel.expert=2", "model.d_model=192", "model.d_ff=384", "train.global_batch=36"]
    sets += ["model.moe.balance=bias", "model.moe.router=sigmoid"]
    assert resolve(load_config(CONFIGS / "moe-tiny.yaml", sets), 6).parallel["data"] == 3
    with pytest.raises(ShardingError, match=r"tensor 'blocks/1/mlp/router_bias' of shape \(8,\).*'data' \(3 devices\)"):
        resolve(load_config(CONFIGS / "moe-tiny.yaml", [*sets, "parallel.zero_stage=1"]), 6)


@pytest.mark.parametrize(
    ("sets", "match"),
    [
        (["parallel.expert=1", "parallel.dispatcher=alltoall"], r"with parallel.expert=1 every device holds every"),
        (
            ["parallel.expert=1", "parallel.tensor=2", "parallel.dispatcher_sms=20"],
            r"parallel.dispatcher_sms=20 says how a mixture of experts exchanges its tokens, but no stage exchanges "
            r"any: .*\(parallel.tensor=2 splits their hidden width\); remove parallel.dispatcher_sms, or set "
            r"parallel.expert > 1 \(or parallel.expert_tensor: 1",
        ),
    ],
)
def test_a_dispatcher_where_no_stage_exchanges_tokens_is_refused(sets, match):
    """A mixture of experts whose every device holds every expert sends no tokens: its dispatcher's settings
    would change nothing, so the run names them rather than ignoring them."""
    with pytest.raises(ConfigError, match=match):
        resolve(load_config(CONFIGS / "mixtral-8x7b.yaml", ["parallel.pipeline=1", *sets]))


def test_a_dispatcher_acts_where_experts_spread_over_either_axis():
    base = ["parallel.pipeline=1", "parallel.dispatcher=alltoall"]
    over_expert = resolve(load_config(CONFIGS / "mixtral-8x7b.yaml", base))
    assert over_expert.config.parallel.dispatcher == "alltoall"
    tensor = ["parallel.expert=1", "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert_tensor=1"]
    over_tensor = resolve(load_config(CONFIGS / "mixtral-8x7b.yaml", [*base, *tensor]))
    assert over_tensor.config.parallel.dispatcher == "alltoall"


def test_fp8_weight_gathers_without_fsdp_are_refused():
    """train.fp8.all_gather gathers FSDP's shards in FP8; without FSDP no weight is gathered, so it is named."""
    sets = ["hardware=dgx-h100", "train.fp8.recipe=tensorwise", "train.fp8.all_gather=true"]
    with pytest.raises(
        ConfigError,
        match=r"train.fp8.all_gather=true gathers FSDP's weight shards in FP8, but parallel.fsdp=1 shards no "
        r"weights; remove train.fp8.all_gather, or set parallel.fsdp > 1",
    ):
        resolve(load_config(CONFIGS / "quickstart.yaml", [*ONE_DEVICE_WIDE, *sets]))
    for fsdp in (["parallel.fsdp=2"], ["parallel.context=2", "parallel.fsdp_context=true"]):
        run = resolve(load_config(CONFIGS / "quickstart.yaml", [*ONE_DEVICE_WIDE, *sets, *fsdp]))
        assert run.config.train.fp8.all_gather is True


def test_an_elastic_restart_that_drops_fsdp_or_the_exchange_resets_their_settings():
    from hyperjax.resolver import elastic_overrides

    sets = ["hardware=dgx-h100", "train.fp8.recipe=tensorwise", "train.fp8.all_gather=true", "parallel.fsdp=2"]
    sets += ["parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.data=2"]
    load = lambda more: load_config(CONFIGS / "quickstart.yaml", [*sets, *more])
    _, run = elastic_overrides(load, 4)  # data, then tensor 2 x fsdp 2: FSDP stays, so do its FP8 gathers
    assert run.axes["fsdp"] == 2 and run.config.train.fp8.all_gather is True
    chosen, run = elastic_overrides(load, 1)  # one device: FSDP gone, its FP8 gathers reset
    assert run.axes["fsdp"] == 1 and run.config.train.fp8.all_gather is False
    assert "train.fp8.all_gather=false" in chosen
    moe = ["parallel.expert=1", "parallel.pipeline=1", "parallel.dispatcher=alltoall", "parallel.tensor=2"]
    moe += ["parallel.sequence_parallel=true", "parallel.expert_tensor=1"]  # experts spread over the tensor axis
    load = lambda more: load_config(CONFIGS / "mixtral-8x7b.yaml", [*moe, *more])
    _, run = elastic_overrides(load, 16)
    assert run.config.parallel.dispatcher == "alltoall"
    _, run = elastic_overrides(load, 1)  # tensor 1: no exchange left, the dispatcher back at its default
    assert run.axes["tensor"] == 1 and run.config.parallel.dispatcher == "deepep"


def test_an_elastic_restart_falls_back_to_the_experts_on_every_device():
    """A mixture of experts shrinks below its expert degree: the last step holds every expert on each device
    (and hides no all-to-all), as the optimizer's state of each expert reshards onto any expert degree."""
    from hyperjax.resolver import elastic_overrides

    load = lambda more: load_config(CONFIGS / "moe-tiny.yaml", ["parallel.overlap=two-microbatch", *more])
    _, run = elastic_overrides(load, 4)  # expert 4 still fits 4 devices
    assert run.axes["expert"] == 4 and run.config.parallel.overlap == "two-microbatch"
    sets, run = elastic_overrides(load, 2)
    assert run.axes["expert"] == 1 and run.axes["data"] == 2 and run.config.parallel.overlap == "none"
    assert sets[-2:] == ["parallel.expert=1", "parallel.overlap=none"]
