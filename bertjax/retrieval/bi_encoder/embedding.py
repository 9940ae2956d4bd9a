"""Texts -> sentence embeddings [n, dim] with a loaded encoder, as ``SentenceTransformer.encode``.

Each text gets the prompt put before it (lower-cased first where the settings say
``do_lower_case`` and the tokenizer does not), becomes ``[CLS] tokens [SEP]`` truncated to
``max_seq_length`` tokens, and runs through :class:`~bertjax.models.heads.SentenceEmbedder`
jitted: texts sorted by length, batches of ``batch_size`` rows padded to a bucketed length
(:func:`padded_length`: a power of two from 16 to 128, then multiples of 64, at most
``max_seq_length``; a length too few batches need takes the longer one before it), so a corpus
compiles a handful of shapes; the next batch is dispatched before the last one's vectors are read
back. ``bertjax embed``, ``evaluate`` and ``mine-negatives`` embed alike, at the same speed.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bertjax import progress
from bertjax.models.heads import SentenceEmbedder
from bertjax.retrieval.bi_encoder.sentence_transformers import EmbeddingSettings
from bertjax.text import features

MIN_BUCKET = 16
MIN_BATCHES_PER_LENGTH = 3  # a padded length fewer batches need is not compiled


@functools.lru_cache(maxsize=16)
def jitted_apply(module: SentenceEmbedder):
    """``jax.jit(module.apply)``, once per module."""
    return jax.jit(module.apply)


def padded_length(longest: int, max_length: int) -> int:
    """The bucketed length of a batch whose longest row has ``longest`` tokens."""
    if longest <= 128:
        width = max(MIN_BUCKET, 1 << max(longest - 1, 0).bit_length())
    else:
        width = -(-longest // 64) * 64
    return min(width, max_length)


def batch_lengths(longest: list[int], max_length: int) -> list[int]:
    """Padded lengths of batches whose longest rows (non-increasing) are ``longest``; a length
    fewer than MIN_BATCHES_PER_LENGTH batches would use takes the longer one before it."""
    widths = [padded_length(n, max_length) for n in longest]
    out: list[int] = []
    i = 0
    while i < len(widths):
        j = i
        while j < len(widths) and widths[j] == widths[i]:
            j += 1
        keep = not out or j - i >= MIN_BATCHES_PER_LENGTH
        out += [widths[i] if keep else out[-1]] * (j - i)
        i = j
    return out


def prompt_length(tokenizer, prompt: str, max_length: int) -> int:
    """Tokens before the text: [CLS] and the prompt's own (as sentence-transformers counts them:
    the prompt tokenized alone, without its trailing [SEP])."""
    return min(1 + len(tokenizer.encode(prompt)), max_length - 1) if prompt else 0


def token_rows(
    tokenizer, texts: Sequence[str], max_length: int, *, prompt: str = "", lower: bool = False
) -> tuple[list[features.Row], int]:
    """``[CLS] prompt text [SEP]`` rows (the text cut to ``max_length`` tokens; ``lower``: lower-cased
    first) and the number of leading tokens the pooling skips (see :func:`prompt_length`)."""
    if max_length < 3:
        raise ValueError(f"max_seq_length={max_length} leaves no room for [CLS] text [SEP]")
    texts = [prompt + t for t in texts]
    if lower:
        texts, prompt = [t.lower() for t in texts], prompt.lower()
    rows = features.rows(tokenizer, texts, max_length)
    return rows, prompt_length(tokenizer, prompt, max_length)


def batch_of(tokenizer, rows: Sequence[features.Row], chosen, height: int, width: int) -> dict:
    """The ``chosen`` rows padded to [height, width] (rows past the last: ``[CLS] [SEP]``)."""
    filler = features.single_row(tokenizer, [], width)
    picked = [rows[c] for c in chosen] + [filler] * (height - len(chosen))
    return features.pad(picked, width, tokenizer.pad_id)


def embed_texts(
    module: SentenceEmbedder,
    params: dict,
    tokenizer,
    settings: EmbeddingSettings,
    texts: Sequence[str],
    *,
    max_length: int,
    batch_size: int = 32,
    prompt: str = "",
) -> np.ndarray:
    """Embeddings [len(texts), dim] float32 of ``texts`` (see the module docstring); ``params``
    are ``module``'s (the encoder subtree and the Dense layers)."""
    if isinstance(texts, str):
        raise TypeError("embed takes a list of texts, not one string")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    dim = module.head.dimension(module.config.hidden_size)
    if not texts:
        return np.zeros((0, dim), np.float32)
    lower = settings.do_lower_case and not getattr(tokenizer, "do_lower_case", False)
    rows, skip = token_rows(tokenizer, texts, max_length, prompt=prompt, lower=lower)
    apply = jitted_apply(module)
    height = min(batch_size, 1 << max(len(rows) - 1, 0).bit_length())

    def run(*arrays):
        return apply({"params": params}, *(jnp.asarray(a) for a in arrays))

    return embed_rows(tokenizer, rows, skip, height, max_length, dim, run)


def embed_rows(tokenizer, rows, skip: int, height: int, max_length: int, dim: int, run):
    """Vectors [len(rows), dim] float32 of token ``rows`` (:func:`token_rows`), in their order:
    longest first, ``height`` rows a batch padded to :func:`batch_lengths`, each batch
    ``run(input_ids, segment_ids, input_mask, skip)`` (NumPy [height, seq] and [height]; it
    dispatches the model and returns its vectors unawaited), read back once the next batch is
    dispatched. Counts the texts in the running progress phase."""
    order = np.argsort([-len(r[0]) for r in rows], kind="stable")
    starts = range(0, len(rows), height)
    widths = batch_lengths([len(rows[order[s]][0]) for s in starts], max_length)
    out = np.zeros((len(rows), dim), np.float32)

    def read(chosen, vectors) -> None:
        out[chosen] = np.asarray(vectors, np.float32)[: len(chosen)]
        progress.advance(len(chosen))

    pending = None
    for start, width in zip(starts, widths):
        chosen = order[start : start + height]
        batch = batch_of(tokenizer, rows, chosen, height, width)  # [batch, seq] each
        vectors = run(
            batch["input_ids"],
            batch["segment_ids"],
            batch["input_mask"],
            np.full((height,), skip, np.int32),
        )  # dispatched, not awaited: the next batch is built meanwhile
        if pending is not None:
            read(*pending)
        pending = (chosen, vectors)
    if pending is not None:
        read(*pending)
    return out


def max_length_of(settings: EmbeddingSettings, position_table: int) -> int:
    """Tokens per text: the settings' ``max_seq_length`` (the position table when None)."""
    length = settings.max_seq_length or position_table
    if length > position_table:
        raise ValueError(
            f"max_seq_length={length} exceeds the position table (max_position_embeddings="
            f"{position_table})"
        )
    return int(length)
