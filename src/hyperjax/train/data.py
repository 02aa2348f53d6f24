"""Training data: the shipped text corpus as byte-level tokens, or a synthetic learnable sequence.

Batches are a pure function of ``(seed, step)``: any process can build any row of the global batch, so
each process builds only the rows its devices hold (``jax.make_array_from_callback``), and a resumed or
resharded run sees exactly the same data.
"""

from __future__ import annotations

import jax
import numpy as np

from hyperjax.errors import ConfigError
from hyperjax.files import corpus_bytes


def check_windows(source: str, tokens: int, key: str = "model.seq_len") -> None:
    """The corpus ``source`` names holds windows of ``tokens`` tokens and the next one (``text``; a synthetic
    sequence has any length).

    Raises:
      ConfigError: naming ``key``, the corpus's size and the fix.
    """
    if source != "text":
        return
    n = len(corpus_bytes())
    if tokens + 1 >= n:
        raise ConfigError(
            f"{key}={tokens} is longer than a window of the shipped text corpus (train.data=text: {n} bytes, so at "
            f"most {n - 2} tokens); set {key} <= {n - 2}, or train.data: synthetic (predict and plan price any "
            "length)"
        )


class Batches:
    """Deterministic batches of ``(inputs, targets)`` token arrays of shape ``(global_batch, seq_len)``.

    Args:
      source: ``text`` (byte-level corpus) or ``synthetic`` (``x[t+1] = (5 x[t] + 3) mod vocab`` from a
        random start, so a model can learn it exactly).
      global_batch: sequences per step.
      seq_len: tokens per sequence.
      vocab: vocabulary size (synthetic tokens are below it).
      seed: data order.
    """

    def __init__(self, *, source: str, global_batch: int, seq_len: int, vocab: int, seed: int) -> None:
        self.source, self.global_batch, self.seq_len, self.vocab, self.seed = source, global_batch, seq_len, vocab, seed
        check_windows(source, seq_len)

    def batch(self, step: int, rows: slice | range = slice(None)) -> dict[str, np.ndarray]:
        """``inputs`` and ``targets`` for ``rows`` of the global batch of ``step``, as host arrays."""
        inputs, targets = self.rows(step, rows)
        return {"inputs": inputs, "targets": targets}

    def rows(self, step: int, rows: slice | range) -> tuple[np.ndarray, np.ndarray]:
        """Inputs and targets for ``rows`` of the global batch of ``step``."""
        rng = np.random.default_rng([self.seed, step])
        index = np.arange(self.global_batch)[rows]
        if self.source == "text":
            text = corpus_bytes()
            starts = rng.integers(0, len(text) - self.seq_len - 1, size=self.global_batch)[index]
            window = np.stack([text[s : s + self.seq_len + 1] for s in starts]).astype(np.int32)
        else:
            first = rng.integers(0, self.vocab, size=self.global_batch)[index]
            window = np.empty((len(index), self.seq_len + 1), dtype=np.int64)
            window[:, 0] = first
            for t in range(self.seq_len):
                window[:, t + 1] = (5 * window[:, t] + 3) % self.vocab
            window = window.astype(np.int32)
        return window[:, :-1], window[:, 1:]

    def global_batch_arrays(
        self, step: int, sharding: jax.sharding.Sharding | dict[str, jax.sharding.Sharding]
    ) -> dict[str, jax.Array]:
        """The batch of ``step`` as global arrays; this process builds only the rows it holds."""
        if isinstance(sharding, dict):
            sharding = sharding["inputs"]
        shape = (self.global_batch, self.seq_len)
        cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

        def part(index: tuple[slice, ...], which: int) -> np.ndarray:
            rows, cols = index
            key = (rows.start, rows.stop)
            if key not in cache:
                cache[key] = self.rows(step, rows)
            return cache[key][which][:, cols]

        return {
            "inputs": jax.make_array_from_callback(shape, sharding, lambda i: part(i, 0)),
            "targets": jax.make_array_from_callback(shape, sharding, lambda i: part(i, 1)),
        }


class CaptionBatches:
    """Synthetic captioned images: ``images`` ``(batch, H, W, C)`` and ``(inputs, targets)`` text.

    Each image shows a random code, one symbol per patch (the patch's pixels encode the symbol, every
    channel differently); its caption spells the code out, patch by patch, over and over. The text
    after the first pass is predictable from the text; the first pass only from the image, so the
    model learns to read its encoder's tokens. A pure function of ``(seed, step)`` like :class:`Batches`.
    """

    def __init__(
        self, *, global_batch: int, seq_len: int, vocab: int, image_size: int, patch: int, channels: int, seed: int
    ) -> None:
        self.global_batch, self.seq_len, self.vocab, self.seed = global_batch, seq_len, vocab, seed
        self.image_size, self.patch, self.channels = image_size, patch, channels
        self.patches = (image_size // patch) ** 2

    def batch(self, step: int, rows: slice | range = slice(None)) -> dict[str, np.ndarray]:
        """``images``, ``inputs`` and ``targets`` for ``rows`` of the global batch of ``step``."""
        rng = np.random.default_rng([self.seed, step, 1])
        codes = rng.integers(0, self.vocab, size=(self.global_batch, self.patches))[np.arange(self.global_batch)[rows]]
        side = self.image_size // self.patch
        level = codes.reshape(-1, side, side, 1).astype(np.float32) / self.vocab  # (b, side, side, 1)
        shades = (np.arange(self.channels, dtype=np.float32) + 1) / self.channels
        pixels = np.repeat(np.repeat(level, self.patch, axis=1), self.patch, axis=2) * shades  # (b, H, W, C)
        text = codes[:, np.arange(self.seq_len + 1) % self.patches].astype(np.int32)
        return {"images": pixels.astype(np.float32), "inputs": text[:, :-1], "targets": text[:, 1:]}

    def global_batch_arrays(self, step: int, shardings: dict[str, jax.sharding.Sharding]) -> dict[str, jax.Array]:
        """The batch of ``step`` as global arrays (this process builds only the rows it holds)."""
        shapes = {
            "images": (self.global_batch, self.image_size, self.image_size, self.channels),
            "inputs": (self.global_batch, self.seq_len),
            "targets": (self.global_batch, self.seq_len),
        }
        cache: dict[tuple, dict[str, np.ndarray]] = {}

        def part(index: tuple[slice, ...], key: str) -> np.ndarray:
            rows = index[0]
            if (rows.start, rows.stop) not in cache:
                cache[(rows.start, rows.stop)] = self.batch(step, rows)
            return cache[(rows.start, rows.stop)][key][(slice(None), *index[1:])]

        return {
            key: jax.make_array_from_callback(shape, shardings[key], lambda i, key=key: part(i, key))
            for key, shape in shapes.items()
        }
