from pathlib import Path

import numpy as np
import pytest

from hyperjax import ConfigError
from hyperjax.train.data import Batches, corpus_bytes


def test_corpus_is_real_text():
    text = corpus_bytes()
    assert len(text) > 300_000
    assert bytes(text[:40]).decode().startswith("THE BOOK OF GENESIS")


def test_rows_are_a_pure_function_of_seed_and_step():
    b = Batches(source="text", global_batch=16, seq_len=32, vocab=256, seed=3)
    inputs, targets = b.rows(5, slice(0, 16))
    part_inputs, _ = b.rows(5, slice(4, 8))
    np.testing.assert_array_equal(part_inputs, inputs[4:8])
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])  # targets are the next tokens
    assert not np.array_equal(b.rows(6, slice(0, 16))[0], inputs)


def test_synthetic_is_learnable():
    b = Batches(source="synthetic", global_batch=4, seq_len=16, vocab=97, seed=0)
    inputs, targets = b.rows(0, slice(0, 4))
    np.testing.assert_array_equal(targets, (5 * inputs + 3) % 97)
    assert inputs.max() < 97


def test_a_sequence_longer_than_the_corpus_is_refused_before_training(capsys, tmp_path):
    """train (and --plan-only, which approves what train runs) names model.seq_len and the corpus's size; an
    rl: config names its prompts' length; predict prices any length, and synthetic data has any."""
    from hyperjax.cli.main import main

    n = len(corpus_bytes())
    configs = Path(__file__).parents[2] / "configs"
    quick = ["train", str(configs / "quickstart.yaml"), "--set", f"model.seq_len={n}", "--out-dir", str(tmp_path / "o")]
    for extra in ([], ["--plan-only"]):
        assert main([*quick[:-2], *extra] if extra else quick) == 2
        err = capsys.readouterr().err
        assert f"model.seq_len={n} is longer than a window of the shipped text corpus" in err, err
        assert f"set model.seq_len <= {n - 2}" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
    assert main([*quick[:-2], "--plan-only", "--set", "train.data=synthetic"]) == 0
    capsys.readouterr()
    rl = ["train", str(configs / "grpo-tiny.yaml"), "--plan-only", "--set", f"model.seq_len={n + 20}"]
    assert main([*rl, "--set", "rl.prompt_len=null"]) == 2
    assert f"rl.prompt_len={n + 4} is longer than a window" in capsys.readouterr().err
    assert main(["predict", str(configs / "quickstart.yaml"), "--set", f"model.seq_len={n}"]) == 0
    with pytest.raises(ConfigError, match=r"model.seq_len=\d+ is longer than a window"):
        Batches(source="text", global_batch=1, seq_len=n - 1, vocab=256, seed=0)
    Batches(source="text", global_batch=1, seq_len=n - 2, vocab=256, seed=0)  # the longest window
