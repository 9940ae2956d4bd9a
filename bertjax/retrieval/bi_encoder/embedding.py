"""Texts -> sentence embeddings [n, dim] with a loaded encoder, as ``SentenceTransformer.encode``:
the model (:class:`SentenceEmbedder`), its settings (:class:`EmbeddingSettings`: what a
sentence-transformers directory or a bi-encoder run adds to the encoder) and the embedding loop.

Each text gets the prompt put before it (lower-cased first where the settings say
``do_lower_case`` and the tokenizer does not), becomes ``[CLS] tokens [SEP]`` truncated to
``max_seq_length`` tokens, and runs through :class:`SentenceEmbedder`
jitted: texts sorted by length, batches of ``batch_size`` rows padded to a bucketed length
(:func:`padded_length`: a power of two from 16 to 128, then multiples of 64, at most
``max_seq_length``; a length too few batches need takes the longer one before it), so a corpus
compiles a handful of shapes; the next batch is dispatched before the last one's vectors are read
back. ``bertjax embed``, ``evaluate`` and ``mine-negatives`` embed alike, at the same speed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bertjax import progress
from bertjax.convert import unflatten_params
from bertjax.layers.core import model_inputs
from bertjax.models import architecture
from bertjax.models.heads import encoder
from bertjax.retrieval.bi_encoder.pooling import (
    DenseLayer,
    EmbeddingHead,
    check_dense_tensors,
    dense_layers,
    l2_normalize,
    pool,
)
from bertjax.text import features

Array = jax.Array
MIN_BUCKET = 16
MIN_BATCHES_PER_LENGTH = 3  # a padded length fewer batches need is not compiled


@dataclasses.dataclass
class EmbeddingSettings:
    """What a sentence-transformers directory adds to its encoder.

    ``head``: pooling, Dense layers and Normalize (:class:`~.pooling.EmbeddingHead`);
    ``tensors``: the Dense layers' weights by bertjax path (``dense_{i}/kernel`` [in, out],
    ``dense_{i}/bias``, ``dense_{i}_residual/kernel``); ``max_seq_length``: tokens per text with
    [CLS] and [SEP] (None: the position table); ``do_lower_case``: lower-case texts before the
    tokenizer; ``prompts`` (name -> text put before each text), ``default_prompt_name`` and
    ``similarity_fn_name`` as ``config_sentence_transformers.json`` has them.
    """

    head: EmbeddingHead = EmbeddingHead()
    tensors: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    max_seq_length: int | None = None
    do_lower_case: bool = False
    prompts: dict[str, str] = dataclasses.field(default_factory=dict)
    default_prompt_name: str | None = None
    similarity_fn_name: str | None = None

    def resolve_prompt(self, prompt: str | None, prompt_name: str | None, source: str) -> str:
        """The text put before each input: ``prompt``, else ``prompts[prompt_name]``, else the
        default prompt ("" when none), as ``SentenceTransformer.encode`` picks it."""
        if prompt is not None:
            return prompt
        name = prompt_name if prompt_name is not None else self.default_prompt_name
        if name is None:
            return ""
        if name not in self.prompts:
            raise ValueError(
                f"{source}: prompt name {name!r} is not one of the model's prompts "
                f"{sorted(self.prompts)}"
            )
        return self.prompts[name]

    # ---- what a loaded model does with these settings (``pretrained.HeadBehaviour``) ----------
    @property
    def late_interaction(self) -> bool:
        return False  # one vector per text

    def embed(
        self,
        model,
        texts: Sequence[str],
        batch_size: int = 32,
        prompt: str | None = None,
        prompt_name: str | None = None,
    ) -> np.ndarray:
        """``Pretrained.embed``: ``texts`` through ``model``'s encoder and this head (see the
        module docstring)."""
        name = architecture(model.config).encoder_name
        params = {name: model.encoder_params, **unflatten_params(self.tensors)}
        return embed_texts(
            SentenceEmbedder(model.config, self.head),  # jitted once per (config, head)
            params,
            model.tokenizer,
            self,
            texts,
            max_length=max_length_of(self, model.config.max_position_embeddings),
            batch_size=batch_size,
            prompt=self.resolve_prompt(prompt, prompt_name, model.source),
        )

    def embed_queries(self, model, texts: Sequence[str], batch_size: int = 32):
        raise ValueError(f"{model.source}: not a late-interaction (ColBERT) model; use embed")

    embed_documents = embed_queries


def settings_record(settings: EmbeddingSettings) -> dict[str, Any]:
    """``settings`` without its tensors, as JSON values: what a bertjax run that trains
    embeddings records in its checkpoint config (``embedding``)."""
    head = settings.head
    return {
        "pooling": list(head.pooling),
        "include_prompt": head.include_prompt,
        "dense": [dataclasses.asdict(layer) for layer in head.dense],
        "normalize": head.normalize,
        "max_seq_length": settings.max_seq_length,
        "do_lower_case": settings.do_lower_case,
        "prompts": dict(settings.prompts),
        "default_prompt_name": settings.default_prompt_name,
        "similarity_fn_name": settings.similarity_fn_name,
    }


def settings_from_record(
    record: dict[str, Any], tensors: dict[str, np.ndarray], source: str
) -> EmbeddingSettings:
    """The :class:`EmbeddingSettings` a run recorded (:func:`settings_record`), with the Dense
    layers' tensors (``dense_{i}/...``) taken from the checkpoint's."""
    try:
        head = EmbeddingHead(
            pooling=tuple(record["pooling"]),
            include_prompt=bool(record.get("include_prompt", True)),
            dense=tuple(DenseLayer(**layer) for layer in record.get("dense") or ()),
            normalize=bool(record.get("normalize", False)),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{source}: the recorded embedding head is not readable ({err})") from None
    check_dense_tensors(head.dense, tensors, source, "embedding head", "Dense layers")
    return EmbeddingSettings(
        head=head,
        tensors=dict(tensors),
        max_seq_length=record.get("max_seq_length"),
        do_lower_case=bool(record.get("do_lower_case", False)),
        prompts=dict(record.get("prompts") or {}),
        default_prompt_name=record.get("default_prompt_name"),
        similarity_fn_name=record.get("similarity_fn_name"),
    )


class SentenceEmbedder(nn.Module):
    """One vector per text (sentence-transformers' Transformer -> Pooling -> Dense -> Normalize):
    the encoder's token embeddings pooled, projected and normalised as ``head`` says, in float32
    (see :mod:`bertjax.retrieval.bi_encoder.pooling`). Params: the encoder's (no pooler),
    ``dense_{i}/{kernel [in, out], bias [out]}``, ``dense_{i}_residual/kernel`` (optional)."""

    config: Any
    head: EmbeddingHead = EmbeddingHead()

    @model_inputs
    @nn.compact
    def __call__(
        self,
        input_ids: Array,  # [batch, seq]
        segment_ids: Array | None = None,
        input_mask: Array | None = None,
        prompt_length: Array | None = None,  # [batch]: [CLS] + prompt tokens, when excluded
        *,
        deterministic: bool = True,
    ) -> Array:
        """Returns embeddings [batch, dim] (float32)."""
        if input_mask is None:
            input_mask = jnp.ones_like(input_ids)
        out = encoder(self.config, add_pooler=False)(
            input_ids, segment_ids, input_mask, deterministic=deterministic
        )
        hidden = out.sequence_output.astype(jnp.float32)  # [batch, seq, hidden]
        if self.head.include_prompt:
            prompt_length = None
        x = pool(hidden, input_mask, self.head.pooling, prompt_length)  # [batch, k * hidden]
        x = dense_layers(self.head.dense, x)
        return l2_normalize(x) if self.head.normalize else x


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
