"""What a recomputation re-runs: JAX's rematerialisation (hyperjax's own step) or PyTorch's re-forward."""

import math
from pathlib import Path

import jax
import jax.extend as jex
import jax.numpy as jnp
import pytest
from flax import nnx

from hyperjax import estimate, load_config, resolve
from hyperjax.cost.inventory import runtime_inventory
from hyperjax.models import build_model
from tests.parts import DEEPSEEK_PARTS

ROOT = Path(__file__).parents[2]


def gradient_jaxpr(cfg, recompute: str, modules=None, batch: int = 2):
    """The jaxpr of the gradient of hyperjax's model of ``cfg`` under ``recompute`` (and ``modules``)."""
    model = build_model(cfg.model, seed=0, recompute=recompute, recompute_modules=modules)
    graph, state = nnx.split(model)
    tokens = jnp.zeros((batch, cfg.model.seq_len), jnp.int32)

    def loss(s):
        out = nnx.merge(graph, s)(tokens)
        return (out[0] if isinstance(out, tuple) else out).sum()  # a mixture of experts adds its router's stats

    return jax.make_jaxpr(jax.grad(loss))(state).jaxpr


def products(cfg, recompute: str) -> int:
    """The products (``dot_general``) in the jaxpr of the gradient of hyperjax's model under ``recompute``."""
    return str(gradient_jaxpr(cfg, recompute)).count("dot_general")


def grouped_products(jaxpr) -> int:
    """The grouped products (``ragged_dot_general``: routed experts) in ``jaxpr`` and the jaxprs inside it."""
    own = sum(eqn.primitive.name == "ragged_dot_general" for eqn in jaxpr.eqns)
    return own + sum(grouped_products(j) for eqn in jaxpr.eqns for j in jex.core.jaxprs_in_params(eqn.params))


def product_flops(jaxpr) -> float:
    """FLOPs of every product (``dot_general``) in ``jaxpr`` and the jaxprs inside it."""
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contracted, _), _ = eqn.params["dimension_numbers"]
            lhs, out = eqn.invars[0].aval, eqn.outvars[0].aval
            total += 2.0 * math.prod(out.shape) * math.prod(lhs.shape[i] for i in contracted)
        total += sum(product_flops(inner) for inner in jex.core.jaxprs_in_params(eqn.params))
    return total


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_rematerialised_block_re_runs_every_product_but_the_mlp_output(family):
    """JAX drops from a rematerialised block's re-forward what its backward does not read: the MLP's output
    product (the block's output is read by no one in its backward). ``train.reforward: needed`` prices that."""
    layers = 2
    cfg = load_config(ROOT / "configs/quickstart.yaml", [f"model.family={family}", f"model.layers={layers}"])
    model = build_model(cfg.model, seed=0)
    graph, state = nnx.split(model)
    tokens = jnp.zeros((2, cfg.model.seq_len), jnp.int32)
    forward = str(jax.make_jaxpr(lambda s: nnx.merge(graph, s)(tokens))(state)).count("dot_general")
    per_block = (forward - 1) // layers  # the output layer is one product
    assert per_block >= 7  # queries, keys, values or one, scores, values, output, the MLP's two or three
    assert products(cfg, "full") - products(cfg, "none") == layers * (per_block - 1)


def test_reforward_prices_jax_s_re_forward_or_pytorch_s_whole_one():
    sets = ["emulate.devices=null", "train.recompute=full", "parallel.tensor=2", "model.family=llama"]
    needed, whole = (
        estimate(resolve(load_config(ROOT / "configs/quickstart.yaml", [*sets, f"train.reforward={r}"])))
        for r in ("needed", "whole")
    )
    a, b = needed.stages[0].parts[0].layer, whole.stages[0].parts[0].layer
    assert b.recompute_s == pytest.approx(b.forward_s)
    # every named activation recomputed: the forward but the MLP's output product
    assert a.recompute_s == pytest.approx(sum(a.recompute_by_name_s.values())) and a.recompute_s < b.recompute_s
    # and the re-forward's tensor-parallel collectives are those before the MLP's output product: one of the
    # forward's two all-reduces, or three of its four halves with sequence parallelism
    plain = estimate(resolve(load_config(ROOT / "configs/quickstart.yaml", [*sets, "train.recompute=none"])))
    forward_pass = plain.stages[0].parts[0].layer.tensor_comm_s / 2  # the forward's and the backward's
    dropped = 0.25 if needed.run.sequence_parallel else 0.5
    assert forward_pass > 0
    assert b.tensor_comm_s - a.tensor_comm_s == pytest.approx(dropped * forward_pass)
    assert needed.step_time_s < whole.step_time_s


ONE_DEVICE = ["emulate.devices=1", "parallel.tensor=1", "model.layers=2", "train.global_batch=2"]
MLA = [p for p in DEEPSEEK_PARTS if p.startswith(("model.attention", "model.kv_", "model.q_", "model.rope_"))]
SETTINGS = {  # name: (model, recompute, modules)
    "gpt-full": (["model.family=gpt"], "full", None),
    "llama-core": (["model.family=llama"], "selective", None),  # the attention core
    "llama-act": (["model.family=llama"], "selective", ["mlp_act"]),
    "parallel-full": (["model.family=gpt", "model.block=parallel"], "full", None),
    "flash-out": (["model.family=llama", "model.attention_kernel=flash"], "selective", ["attn_out"]),
    "mla-norms-act": ([*MLA, "model.family=llama"], "selective", ["norms", "mlp_act"]),
    "gpt-qkv-norms": (["model.family=gpt"], "selective", ["qkv", "norms"]),
    "llama-hidden": (["model.family=llama"], "selective", ["mlp_hidden"]),
    "flash-full": (["model.family=gpt", "model.attention_kernel=flash"], "full", None),
    "flash-act": (["model.family=llama", "model.attention_kernel=flash"], "selective", ["mlp_act"]),
    "parallel-norms-core": (["model.family=llama", "model.block=parallel"], "selective", ["norms", "attn_core"]),
    "mla-full": ([*MLA, "model.family=llama"], "full", None),
    "mla-uncompressed-qkv": ([*MLA, "model.family=llama", "model.q_lora_rank=null"], "selective", ["qkv"]),
}


@pytest.mark.parametrize(("sets", "recompute", "modules"), SETTINGS.values(), ids=SETTINGS.keys())
def test_the_inventory_counts_the_products_the_jaxpr_re_runs(sets, recompute, modules):
    """``runtime_inventory`` counts the products hyperjax's step runs, the re-forward's among them, as the
    jaxpr of its gradient holds them (XLA's CPU compiler drops the re-forward, so the compiled program cannot
    say): what each recomputed activation needs, and nothing the backward does not read."""
    extra = [f"train.recompute={recompute}"] + ([f"train.recompute_modules=[{','.join(modules)}]"] if modules else [])
    cfg = load_config(ROOT / "configs/quickstart.yaml", [*ONE_DEVICE, *sets, *extra])
    counted = runtime_inventory(resolve(cfg)).flops
    assert product_flops(gradient_jaxpr(cfg, recompute, modules and tuple(modules))) == pytest.approx(counted, rel=1e-9)
    plain = load_config(ROOT / "configs/quickstart.yaml", [*ONE_DEVICE, *sets])
    assert counted > runtime_inventory(resolve(plain)).flops or modules == ["mlp_act"]


@pytest.mark.parametrize("sets", [["model.family=llama"], [*MLA, "model.family=llama"]], ids=["mha", "mla"])
def test_keeping_the_probabilities_and_latents_re_runs_no_product(sets):
    """A block that recomputes only element-wise work (its MLP's activation) re-runs no product: the softmax's
    derivative reads the kept probabilities (``attn_core``), and latent attention keeps its down-projections'
    outputs, from which its norms and rotary key are rebuilt."""
    cfg = load_config(ROOT / "configs/quickstart.yaml", [*ONE_DEVICE, *sets])
    kept = product_flops(gradient_jaxpr(cfg, "selective", ("mlp_act",)))
    assert kept == product_flops(gradient_jaxpr(cfg, "none"))
    assert product_flops(gradient_jaxpr(cfg, "selective", ("mlp_act", "attn_core"))) > kept


def test_a_parallel_block_re_forwards_neither_output_product_nor_their_collectives():
    """In a parallel block the attention's output only joins the block's output, as the MLP's does: JAX's
    re-forward drops both products and the tensor-parallel all-reduces after them."""
    sets = ["emulate.devices=null", "train.recompute=full", "parallel.tensor=2", "model.family=llama"]
    est = {
        (block, r): estimate(
            resolve(
                load_config(ROOT / "configs/quickstart.yaml", [*sets, f"model.block={block}", f"train.reforward={r}"])
            )
        )
        for block in ("sequential", "parallel")
        for r in ("needed", "whole")
    }
    layer = {k: e.stages[0].parts[0].layer for k, e in est.items()}
    for block in ("sequential", "parallel"):
        a, b = layer[(block, "needed")], layer[(block, "whole")]
        assert a.recompute_s == pytest.approx(sum(a.recompute_by_name_s.values()))
        dropped = b.recompute_s - a.recompute_s
        if block == "parallel":  # the attention's output product too
            assert dropped == pytest.approx(
                a.products_s["attn_out"]
                + (layer[("sequential", "whole")].recompute_s - layer[("sequential", "needed")].recompute_s)
            )
    plain = estimate(
        resolve(load_config(ROOT / "configs/quickstart.yaml", [*sets, "model.block=parallel", "train.recompute=none"]))
    )
    forward_pass = plain.stages[0].parts[0].layer.tensor_comm_s / 2
    p = ("parallel", "needed")
    assert layer[p].tensor_comm_s == pytest.approx(2 * forward_pass)  # forward and backward: no re-forward's
    assert layer[("parallel", "whole")].tensor_comm_s == pytest.approx(3 * forward_pass)


@pytest.mark.parametrize("sets", [["model.family=llama"], [*MLA, "model.family=llama"]], ids=["mha", "mla"])
def test_a_materialized_core_re_runs_the_product_each_activation_needs(sets):
    """JAX rebuilds a materialized core's probabilities from its scores' product and its output from its
    values' product (the jaxpr counts above); Megatron's core_attn checkpoint re-runs the whole core for its
    probabilities (``train.reforward: whole``). Either way the two together cost the core once."""
    base = [*sets, "emulate.devices=null", "parallel.tensor=2", "train.recompute=selective"]
    layer = {
        r: estimate(resolve(load_config(ROOT / "configs/quickstart.yaml", [*base, f"train.reforward={r}"])))
        .stages[0]
        .parts[0]
        .layer
        for r in ("needed", "whole")
    }
    jax_s, torch_s = layer["needed"].recompute_by_name_s, layer["whole"].recompute_by_name_s
    core = layer["needed"].core_s
    m = load_config(ROOT / "configs/quickstart.yaml", sets).model
    values = m.head_dim / (2 * m.head_dim + m.rope_head_dim) if m.attention == "mla" else 0.5
    assert torch_s["attn_core"] - jax_s["attn_core"] == pytest.approx(values * core)
    assert jax_s["attn_out"] - torch_s["attn_out"] == pytest.approx(values * core)
    assert layer["needed"].recompute_s == pytest.approx(jax_s["attn_core"])
    assert layer["needed"].recompute_s < layer["whole"].recompute_s


@pytest.mark.parametrize("block", ["sequential", "parallel"])
def test_a_pytorch_norm_checkpoint_keeps_the_norms_inputs_and_re_runs_no_product(block):
    """Megatron's ``layernorm`` checkpoint (``train.reforward: whole``) keeps the norms' inputs, the mid-block
    residual among them, and re-runs the norms alone; JAX rebuilds that residual, so a sequential block
    re-runs the attention's output product (a parallel block has no such residual). A full recomputation
    keeps the block's input alone either way."""
    base = [f"model.block={block}", "emulate.devices=null", "parallel.tensor=2", "model.bias=false"]
    layer = {
        (r, c): estimate(resolve(load_config(ROOT / "configs/quickstart.yaml", [*base, *c, f"train.reforward={r}"])))
        .stages[0]
        .parts[0]
        .layer
        for r in ("needed", "whole")
        for c in (("train.recompute=selective", "train.recompute_modules=[norms]"), ("train.recompute=full",))
    }
    norms = ("train.recompute=selective", "train.recompute_modules=[norms]")
    jax_l, torch_l = layer[("needed", norms)], layer[("whole", norms)]
    product = jax_l.products_s["attn_out"] if block == "sequential" else 0.0
    assert jax_l.recompute_s - torch_l.recompute_s == pytest.approx(product)
    assert torch_l.recompute_s > 0  # the norms' element-wise work
    # a norm's output is 2 bytes a hidden unit of its 8 (sequential: two norms, the residual and masks) or 4
    assert torch_l.stored_bytes - jax_l.stored_bytes == pytest.approx(jax_l.activation_bytes["norms"] / 2)
    assert torch_l.recompute_keeps_bytes["norms"] == pytest.approx(jax_l.activation_bytes["norms"] / 2)
    assert not jax_l.recompute_keeps_bytes
    full = ("train.recompute=full",)
    assert layer[("whole", full)].stored_bytes == layer[("needed", full)].stored_bytes
    assert layer[("whole", full)].stored_bytes == pytest.approx(jax_l.activation_bytes["block_in"])


MOE_ONE_DEVICE = [
    "emulate.devices=1",
    "parallel.expert=1",
    "parallel.tensor=1",
    "model.layers=2",
    "train.global_batch=2",
]


@pytest.mark.parametrize(
    ("recompute", "modules", "again"),
    [("selective", ("mlp_act",), 0), ("selective", None, 0), ("selective", ("mlp_hidden",), 3), ("full", None, 3)],
    ids=["act", "core", "hidden", "full"],
)
def test_a_mixture_of_experts_re_runs_its_experts_only_where_their_outputs_are_not_kept(recompute, modules, again):
    """The routing weights' gradient reads the router's scores and each routed copy's output: a block keeps
    them with the MLP's hidden (``mlp_hidden``), so a policy that keeps that re-runs neither the router's
    product nor an expert product (nor the exchange back); one that recomputes it re-runs all three expert
    products. ``runtime_inventory`` counts the same (the experts' products as XLA:CPU expands them, apart)."""
    from hyperjax.cost.inventory import _experts

    extra = [f"train.recompute={recompute}"] + ([f"train.recompute_modules=[{','.join(modules)}]"] if modules else [])
    cfg = load_config(ROOT / "configs/moe-tiny.yaml", [*MOE_ONE_DEVICE, *extra])
    jaxpr, plain = gradient_jaxpr(cfg, recompute, modules), gradient_jaxpr(cfg, "none")
    moe_layers = cfg.model.moe_layers
    assert grouped_products(jaxpr) - grouped_products(plain) == again * moe_layers  # swiglu: in, gate, out
    run = resolve(cfg)
    experts = _experts(run)
    assert (experts.reforward_flops > 0) == (again > 0)
    # the rest re-run: attention, router, shared experts (the combine's weighting, a product the inventory
    # leaves out, runs once either way)
    counted = runtime_inventory(run).flops - experts.reforward_flops
    plain_counted = runtime_inventory(resolve(load_config(ROOT / "configs/moe-tiny.yaml", MOE_ONE_DEVICE))).flops
    assert product_flops(jaxpr) - product_flops(plain) == pytest.approx(counted - plain_counted, rel=1e-9, abs=1)


def test_jax_s_re_forward_of_routed_experts_runs_the_combine_too():
    """The routing weights' gradient reads the routed copies' outputs back home, so JAX's re-forward runs the
    experts' output product and the exchange back, as PyTorch's whole re-forward does."""
    sets = ["emulate.devices=null", "parallel.expert=2", "train.recompute=full"]
    layer = {}
    for r in ("needed", "whole"):
        est = estimate(resolve(load_config(ROOT / "configs/moe-tiny.yaml", [*sets, f"train.reforward={r}"])))
        layer[r] = next(p.layer for p in est.stages[0].parts if p.moe)
    assert layer["needed"].expert_comm_s == pytest.approx(layer["whole"].expert_comm_s)
    assert layer["needed"].expert_comm_s == pytest.approx(6 * layer["needed"].exchange_s)  # three passes
    assert layer["needed"].recompute_s < layer["whole"].recompute_s  # the shared expert's output product


EVERY = "[norms, qkv, attn_core, attn_out, mlp_hidden, mlp_act]"


@pytest.mark.parametrize(
    ("config", "sets"),
    [
        ("quickstart", ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
        ("quickstart", ["parallel.tensor=2", "parallel.sequence_parallel=false"]),
        ("quickstart", ["model.block=parallel", "model.bias=false", "parallel.tensor=2",
                        "parallel.sequence_parallel=true"]),
        ("quickstart", ["parallel.tensor=2", "parallel.tp_overlap=pipelined"]),
        ("quickstart", ["parallel.context=2", "parallel.data=2", "model.family=llama"]),
        ("quickstart", ["parallel.context=2", "parallel.data=2", "model.family=llama", "model.attention_kernel=flash",
                        "parallel.context_impl=ring"]),
        ("moe-tiny", ["parallel.expert=2"]),
    ],
    ids=["sequence-parallel", "tensor", "parallel-block", "pipelined", "context", "ring", "experts"],
)  # fmt: skip
def test_jax_s_selective_recomputation_of_every_activation_is_its_full_one(config, sets):
    """Under ``train.reforward: needed`` a selective recomputation prices what each recomputed activation needs
    (its products, element-wise work, collectives, the core and its context exchange, the experts'
    regrouping and exchanges); naming every activation is then the full recomputation, to the byte and
    the second."""
    base = [*sets, "emulate.devices=null", "train.reforward=needed"]
    load = lambda *more: estimate(resolve(load_config(ROOT / f"configs/{config}.yaml", [*base, *more])))
    full, every = load("train.recompute=full"), load("train.recompute=selective", f"train.recompute_modules={EVERY}")
    for a, b in zip(full.stages[0].parts, every.stages[0].parts, strict=True):
        x, y = a.layer, b.layer
        for field in ("recompute_s", "tensor_comm_s", "context_comm_s", "expert_comm_s", "stored_bytes"):
            assert getattr(y, field) == pytest.approx(getattr(x, field), rel=1e-12), field
        assert (x.forward_s, x.backward_s) == pytest.approx((y.forward_s, y.backward_s), rel=1e-12)
    assert every.step_time_s == pytest.approx(full.step_time_s, rel=1e-12)
    assert every.memory_per_device_gib["peak"] == pytest.approx(full.memory_per_device_gib["peak"], rel=1e-12)
