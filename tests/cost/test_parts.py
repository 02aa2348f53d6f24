"""A stage's chunks as parts (``hyperjax.cost.parts``)."""

from pathlib import Path

from hyperjax import load_config, resolve
from hyperjax.cost.parts import chunk_starts, part_models

CONFIGS = Path(__file__).parents[2] / "configs"


def test_chunks_start_where_the_chunks_before_them_end():
    run = resolve(load_config(CONFIGS / "quickstart.yaml", ["parallel.tensor=1", "parallel.pipeline=2"]))
    layers = {c: n for s in run.stages for c, n in zip(s.chunks, s.layers, strict=True)}
    starts = chunk_starts(run)
    assert starts[0] == 0
    assert all(starts[c + 1] == starts[c] + layers[c] for c in range(len(layers) - 1))


def test_a_chunk_of_dense_and_moe_blocks_is_two_parts_dense_first():
    run = resolve(load_config(CONFIGS / "moe-tiny.yaml", ["model.moe.first_dense=1"]))
    (stage,) = run.stages
    parts = part_models(run.config.model, stage, 0)
    assert [(module, layers, moe) for module, _, layers, moe in parts] == [
        ("decoder", 1, False),
        ("decoder", run.config.model.layers - 1, True),
    ]
