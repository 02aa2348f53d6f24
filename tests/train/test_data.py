import numpy as np

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
