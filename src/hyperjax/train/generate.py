"""Generation on a resolved run's mesh: the model's parameters laid out by the run's strategy (restored from a
training checkpoint, or given), prompts split over its batch axes, and the KV cache laid out like the
activations (:mod:`hyperjax.models.decode`).

Prompts are byte-level text by default, as the training corpus is (:mod:`hyperjax.train.data`): a prompt's
tokens are its UTF-8 bytes, and generated tokens decode back the same way. A Hugging Face ``tokenizer.json``
(:class:`Tokenizer`) encodes and decodes instead, and token ids can be given directly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from hyperjax.config import Run
from hyperjax.emulate.runtime import machine_memory
from hyperjax.errors import ConfigError
from hyperjax.models import build_model
from hyperjax.models.decode import Generation, cache_bytes, generate
from hyperjax.shard import Constrainer, Strategy, place
from hyperjax.topology import make_mesh
from hyperjax.train.checkpoint import Restored, restore_params
from hyperjax.train.prepare import prepare


@dataclasses.dataclass(frozen=True, kw_only=True)
class Texts:
    """Generated text (the ``generate --json`` object).

    Attributes:
      text: each prompt followed by its continuation (``None``: token ids given without a tokenizer).
      tokens: each continuation's tokens.
      prefill_s: the prompts' pass over the emulated mesh (compiled beforehand).
      decode_tokens_per_s: tokens generated per second over every sequence, after the prefill.
      step: the training step of the checkpoint the parameters came from (``None``: given).
    """

    text: list[str] | None
    tokens: list[list[int]]
    prefill_s: float
    decode_tokens_per_s: float | None
    step: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data."""
        return dataclasses.asdict(self)


class Bytes:
    """Byte-level text, as the shipped corpus is: a prompt's tokens are its UTF-8 bytes."""

    name = "UTF-8 bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: Sequence[int]) -> str:
        return decode_text(tokens)


class Tokenizer:
    """A Hugging Face ``tokenizer.json`` (the ``tokenizers`` library): prompts encoded with the special tokens
    its template adds (a Llama's beginning of sequence), as transformers' tokenizer and vLLM encode them;
    continuations decoded as the tokenizer's own ``decode`` does.

    Raises:
      ConfigError: a file ``tokenizers`` cannot read.
    """

    name = "tokens"

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as HfTokenizer

        try:
            self._tok = HfTokenizer.from_file(str(path))
        except Exception as e:
            raise ConfigError(f"--tokenizer {str(path)!r} cannot be read as a tokenizer.json ({e})") from None
        self.path = str(path)

    def encode(self, text: str) -> list[int]:
        """``text``'s tokens.

        Raises:
          ConfigError: a character no token covers (a vocabulary without it or an unknown token drops it; one
            the tokenizer's normalizer removes on purpose is not counted).
        """
        found = self._ids(text, text, special=True)
        norm = self._tok.normalizer
        kept = (c for c in dict.fromkeys(text) if (norm.normalize_str(c) if norm else c).strip())  # not normalized away
        lost = [c for c in kept if not self._ids(c, text, special=False)]
        if lost:
            raise ConfigError(
                f"tokenizer {self.path!r} drops {''.join(lost)!r} of {text[:20]!r}: its vocabulary has no token for "
                "them and no unknown token; give the model's own tokenizer.json (--tokenizer)"
            )
        return found

    def _ids(self, text: str, prompt: str, *, special: bool) -> list[int]:
        """``text``'s token ids (a piece of ``prompt``; ``special``: with the tokens the tokenizer's template
        adds, a Llama's beginning of sequence), the errors ``tokenizers`` raises named."""
        try:
            return list(self._tok.encode(text, add_special_tokens=special).ids)
        except Exception as e:  # tokenizers raises its own errors (a word-level model without an unknown token)
            raise ConfigError(
                f"tokenizer {self.path!r} cannot encode {text!r} of {prompt[:20]!r} ({e}); give the model's own "
                "tokenizer.json (--tokenizer), or the token ids (--prompt-ids)"
            ) from None

    def decode(self, tokens: Sequence[int]) -> str:
        return self._tok.decode(list(tokens), skip_special_tokens=False)


Codec = Bytes | Tokenizer


def encode(
    prompts: Sequence[str], run: Run, max_new_tokens: int, codec: Codec | None = None
) -> tuple[np.ndarray, list[int]]:
    """The prompts as tokens (``codec``: bytes by default), ``(batch, longest)`` padded on the right, and
    their lengths. Raises as :func:`prompt_rows`."""
    codec = codec or Bytes()
    rows = [codec.encode(p) for p in prompts]
    labels = [f"--prompt {p[:20]!r}" for p in prompts]
    return prompt_rows(rows, run, max_new_tokens, labels=labels, unit=codec.name)


def prompt_rows(
    rows: Sequence[Sequence[int]],
    run: Run,
    max_new_tokens: int,
    *,
    labels: Sequence[str] | None = None,
    unit: str = "tokens",
) -> tuple[np.ndarray, list[int]]:
    """Token rows as one ``(batch, longest)`` array padded on the right, and their lengths.

    Raises:
      ConfigError: an empty prompt, a token the vocabulary lacks, or a prompt (and, with learned positions,
        its new tokens) longer than ``model.seq_len``.
    """
    m = run.config.model
    if max_new_tokens <= 0:
        raise ConfigError(f"--max-new-tokens {max_new_tokens} must be a positive integer")
    labels = labels or [f"--prompt-ids #{i + 1}" for i in range(len(rows))]
    for label, row in zip(labels, rows, strict=True):
        if len(row) == 0:
            raise ConfigError(f"{label} is empty; give at least one token")
        if len(row) > m.seq_len:
            raise ConfigError(f"{label} is {len(row)} {unit}, longer than model.seq_len={m.seq_len}; shorten it")
        if m.positions == "learned" and len(row) + max_new_tokens > m.seq_len:
            raise ConfigError(
                f"{label}: {len(row)} {unit} + --max-new-tokens {max_new_tokens} = {len(row) + max_new_tokens}, "
                f"but learned positions reach model.seq_len={m.seq_len}; use --max-new-tokens "
                f"{m.seq_len - len(row)} or less"
            )
        if min(row) < 0 or max(row) >= m.vocab:
            bad = max(row) if max(row) >= m.vocab else min(row)
            hint = "; prompts are UTF-8 bytes, so use plain ASCII with this vocabulary" if unit == "UTF-8 bytes" else ""
            raise ConfigError(f"{label} holds token {bad}, outside model.vocab={m.vocab} (0..{m.vocab - 1}){hint}")
    lengths = [len(r) for r in rows]
    out = np.zeros((len(rows), max(lengths)), np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out, lengths


def decode_text(tokens: Sequence[int]) -> str:
    """Byte tokens as text (bytes that are not UTF-8 show as the replacement character)."""
    return bytes(int(t) & 0xFF for t in tokens).decode("utf-8", errors="replace")


def check_generable(run: Run) -> None:
    """Refuse a run generation cannot lay out: it runs the model as one SPMD program on one process.

    Raises:
      ConfigError: a pipeline or MPMD run, a context or sequence split, a vision-language model, or more devices
        than one process holds.
    """
    if run.config.model.vision is not None:
        raise ConfigError("generate covers language models; this config has a model.vision encoder")
    split = run.config.parallel.decode_split
    if split is not None and split[0] == "pipeline":
        raise ConfigError(
            f"generate runs the model as one SPMD program; this config has parallel.pipeline="
            f"{run.config.parallel.pipeline}: set --set parallel.pipeline=1 (any data, fsdp, tensor or expert layout)"
        )
    if split is not None:
        key, value, off = split
        p = run.config.parallel
        # experts over the tensor axis need each of its devices to hold its own tokens: both go together
        also = " --set parallel.expert_tensor=null" if key == "sequence_parallel" and p.expert_tensor == 1 else ""
        raise ConfigError(
            f"generate decodes one token at a time, which parallel.{key}={value} cannot split over "
            f"devices; set --set parallel.{key}={off}{also} (a checkpoint trained with it still loads: "
            "checkpoints are read into the layout generate runs)"
        )
    if run.processes != 1:
        raise ConfigError(
            f"generate runs in one process; this run's {run.devices} devices need {run.processes or 'more'} "
            "processes: pass --devices with 256 or fewer"
        )


Layout = tuple[jax.sharding.Mesh, Strategy]
"""A run's mesh and its strategy with a model's parameter axes."""


def layout(run: Run, state: nnx.State, *, first: int = 0) -> Layout:
    """The mesh and strategy ``run`` lays the model of parameter state ``state`` out with, over the devices
    from ``first`` (a submesh of a larger job)."""
    mesh = make_mesh(run.hardware, run.axes, devices=jax.devices()[first : first + run.devices])
    return mesh, prepare(run).strategy.with_param_axes(state)


def params_like(run: Run) -> tuple[Any, nnx.State, Layout, Any]:
    """The run's model, abstract: its graph and parameter state, the layout it runs on, and every parameter
    as a ``jax.ShapeDtypeStruct`` on the sharding the run's strategy gives it (what a checkpoint is read into)."""
    abstract = nnx.eval_shape(lambda: build_model(run.config.model, dtype=run.dtype, seed=run.config.train.seed))
    graphdef, state = nnx.split(abstract)
    mesh, strategy = layout(run, state)
    shapes = nnx.to_pure_dict(state)
    shardings = strategy.shardings(shapes, mesh)
    like = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    return graphdef, state, (mesh, strategy), like


def restored_model(
    run: Run, checkpoint_dir: str | Path, *, command: str = "generate"
) -> tuple[nnx.Module, Restored, Layout]:
    """The run's model with the parameters of the newest checkpoint in ``checkpoint_dir``, each read straight
    into the shardings the run's strategy gives it (any mesh, as ``train --resume`` restores), and that
    layout (for :func:`generate_on_mesh`). ``command`` names the caller in errors.

    Raises:
      ConfigError: as :func:`hyperjax.train.checkpoint.restore_params`.
    """
    graphdef, state, laid_out, like = params_like(run)
    restored = restore_params(checkpoint_dir, like, command=command, model=run.config.model)
    nnx.replace_by_pure_dict(state, restored.state)
    return nnx.merge(graphdef, state), restored, laid_out


def generate_on_mesh(
    run: Run,
    model: nnx.Module,
    prompt: np.ndarray,
    max_new_tokens: int,
    *,
    lengths: Sequence[int] | None = None,
    laid_out: Layout | None = None,
    **sampling: Any,
) -> Generation:
    """:func:`hyperjax.models.decode.generate` of ``model`` on ``run``'s mesh (one SPMD program); ``sampling``:
    ``temperature``, ``top_k``, ``seed``. ``laid_out``: the run's :func:`layout`, when already built;
    parameters already on their shardings stay where they are.

    A batch the data-parallel axes do not divide is padded with copies of its last prompt, whose tokens are
    dropped; a sequence's tokens depend only on its own prompt, so the others are unchanged. Under a mixture
    of experts' capacity factor the batch's tokens compete for capacity, so such a batch is refused.

    Raises:
      ConfigError: a layout generation does not run (:func:`check_generable`), a KV cache too large for the
        devices, or a padded batch under a capacity factor.
    """
    check_generable(run)
    graphdef, state = nnx.split(model)
    mesh, strategy = laid_out or layout(run, state)
    params = nnx.to_pure_dict(state)
    on = lambda x, s: x if isinstance(x, jax.Array) and x.sharding == s else place(x, s)
    nnx.replace_by_pure_dict(state, jax.tree.map(on, params, strategy.shardings(params, mesh)))
    spec = strategy.spec(("batch", "seq"))
    axes = spec[0] if spec and spec[0] is not None else ()
    split = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
    prompt = np.asarray(prompt)
    b = len(prompt)
    lengths = [prompt.shape[1]] * b if lengths is None else list(lengths)
    extra = -b % split
    capacity = run.config.model.moe and run.config.model.moe.capacity_factor
    if extra and capacity is not None:
        raise ConfigError(
            f"model.moe.capacity_factor={capacity}: a batch's tokens compete for the experts' capacity, and the "
            f"{b} prompt(s) padded to {b + extra} for the {split} data-parallel replicas would route {extra} "
            f"copies of the last prompt beside them, so the tokens would change with the layout; give a multiple of "
            f"{split} prompts, or a layout of fewer data x fsdp x expert replicas"
        )
    prompt = np.concatenate([prompt, np.repeat(prompt[-1:], extra, axis=0)])
    lengths = lengths + lengths[-1:] * extra
    check_cache(run, (mesh, strategy), b, len(prompt), max(lengths), max_new_tokens)
    tokens = place(prompt, jax.sharding.NamedSharding(mesh, spec))
    constrain = Constrainer(strategy=strategy, mesh=mesh)
    out = generate(nnx.merge(graphdef, state), tokens, max_new_tokens, lengths=lengths, constrain=constrain, **sampling)
    return out._replace(tokens=out.tokens[:b], first_logits=out.first_logits[:b])


def device_cache_bytes(run: Run, laid_out: Layout, batch: int, max_len: int) -> int:
    """Bytes one device of ``run``'s mesh holds of the KV cache of ``batch`` sequences of up to ``max_len``
    tokens, laid out by the run's strategy (:data:`hyperjax.models.decode.CACHE_LAYOUTS`)."""
    mesh, strategy = laid_out
    ways = lambda logical: math.prod(mesh.shape[a] for a in strategy.mesh_axes(logical))
    return cache_bytes(run.config.model, run.dtype, batch, max_len, ways)


def check_cache(run: Run, laid_out: Layout, prompts: int, batch: int, longest: int, max_new_tokens: int) -> None:
    """The KV cache of ``prompts`` prompts, padded to ``batch`` sequences, of up to ``longest`` tokens and
    ``max_new_tokens`` more fits beside what the devices of ``run`` (laid out as ``laid_out``) already hold:
    each device's free memory where it reports one (its limit less what is in use: the parameters, once
    restored), else the host's, which emulated CPU devices share.

    Raises:
      ConfigError: a cache larger than that memory, naming its sizes and the most new tokens it could hold.
    """
    total = longest + max_new_tokens
    per_device = device_cache_bytes(run, laid_out, batch, total)
    stats = laid_out[0].devices.flat[0].memory_stats() or {}
    if "bytes_limit" in stats:  # an accelerator: each device holds its own share
        copies, have = 1, stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        where = "free on each device (its limit less what the parameters hold)"
    else:  # emulated CPU devices: every share in the host's memory
        copies, have = run.devices, machine_memory()
        where = f"this machine has (the {run.devices} emulated devices share it)"
    need = per_device * copies
    if need <= have:
        return
    fits = have // (copies * device_cache_bytes(run, laid_out, batch, 1)) - longest
    padded = f", padded to {batch} for the data-parallel replicas" if batch != prompts else ""
    fix = (
        f"at most {fits:,} new tokens would fit; lower --max-new-tokens"
        if fits > 0
        else "even the prompts do not fit: give fewer or shorter prompts, or use fewer data-parallel replicas"
    )
    raise ConfigError(
        f"the KV cache of {prompts} prompt(s){padded}, {total:,} positions each ({longest} of prompt + "
        f"--max-new-tokens {max_new_tokens}), over {run.config.model.layers} layers needs {need / 2**30:,.2f} GiB"
        f"{' in all' if copies > 1 else ''}, more than the {have / 2**30:,.2f} GiB {where}; {fix}"
    )


def generate_text(
    run: Run,
    checkpoint_dir: str | Path,
    prompts: Sequence[str] | None,
    max_new_tokens: int,
    *,
    codec: Codec | None = None,
    ids: Sequence[Sequence[int]] | None = None,
    eos: Sequence[int] = (),
    **sampling: Any,
) -> Texts:
    """Restore the newest checkpoint of ``checkpoint_dir`` onto ``run``'s mesh and continue each prompt:
    ``prompts`` as text (encoded by ``codec``, bytes by default), or ``ids`` as tokens. ``Texts.text`` is
    each prompt and its continuation decoded by ``codec`` (``None`` for ``ids`` without one). A continuation
    ends at its first token of ``eos`` (the end-of-sequence ids), which it keeps, as transformers returns it.

    Raises:
      ConfigError: a run generation cannot lay out, bad prompts (see :func:`prompt_rows`), or a checkpoint
        that is missing or of another model.
    """
    check_generable(run)
    if ids is not None:
        tokens, lengths = prompt_rows(ids, run, max_new_tokens)
    else:
        tokens, lengths = encode(prompts, run, max_new_tokens, codec)
    model, restored, laid_out = restored_model(run, checkpoint_dir)
    out = generate_on_mesh(run, model, tokens, max_new_tokens, lengths=lengths, laid_out=laid_out, **sampling)
    new = np.asarray(out.tokens).tolist()
    rate = len(new) * out.steps / out.decode_s if out.steps else None  # every step decodes every sequence
    stop = set(eos)
    new = [_until(row, stop) for row in new]
    if ids is not None:
        text = None if codec is None else [codec.decode([*p, *t]) for p, t in zip(ids, new, strict=True)]
    elif isinstance(codec, Tokenizer):  # a tokenizer decodes the whole sequence (spaces fall between tokens)
        text = [codec.decode([*codec.encode(p), *t]) for p, t in zip(prompts, new, strict=True)]
    else:
        text = [p + decode_text(t) for p, t in zip(prompts, new, strict=True)]
    return Texts(text=text, tokens=new, prefill_s=out.prefill_s, decode_tokens_per_s=rate, step=restored.step)


def _until(tokens: list[int], eos: set[int]) -> list[int]:
    """``tokens`` up to and including the first of ``eos``."""
    return next((tokens[: i + 1] for i, t in enumerate(tokens) if t in eos), tokens)
