"""Late interaction (ColBERT): one vector per token, as PyLate's ``ColBERT`` computes them.

:class:`LateInteraction` runs any registered encoder, projects every token's output through the
``dense_{i}`` layers of a :class:`LateInteractionHead` (PyLate's ``Dense`` modules: by default one
linear map without bias to 128 dims) and L2-normalises each token vector: [batch, seq, dim].

Texts become token ids as PyLate's ``ColBERT.tokenize`` makes them (:class:`LateInteractionSettings`
holds the settings of ``config_sentence_transformers.json``):

* a query is ``[CLS] [Q] tokens [SEP]`` cut to ``query_length`` tokens and, with
  ``do_query_expansion``, padded to exactly ``query_length`` with [MASK] tokens (query
  augmentation). The [MASK] tokens are attended only with ``attend_to_expansion_tokens`` (PyLate's
  default: not attended), and every query token, [MASK]s included, is kept for scoring;
* a document is ``[CLS] [D] tokens [SEP]`` cut to ``document_length`` tokens; its tokens whose id
  is in the skiplist (``skiplist_words``, by default ``string.punctuation``, each looked up as one
  token: a word that is not a token maps to [UNK], as in PyLate) are dropped from its vectors.

The prefix ("[Q] ", "[D] ") is one token of the tokenizer, put after [CLS]; an empty prefix adds
nothing. :func:`embed_tokens` returns a list of [tokens, dim] arrays, one per text, equal to
``ColBERT.encode(texts, is_query=...)``.
"""

from __future__ import annotations

import dataclasses
import functools
import string
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
    check_dense_tensors,
    dense_layers,
    l2_normalize,
)
from bertjax.text import features

Array = jax.Array
MIN_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class LateInteractionHead:
    """The per-token projections (PyLate's ``Dense`` modules, in order) and the final per-token
    L2 normalisation."""

    dense: tuple[DenseLayer, ...] = ()
    normalize: bool = True

    def dimension(self, hidden_size: int) -> int:
        """The token-vector width for an encoder of ``hidden_size``."""
        width = hidden_size
        for layer in self.dense:
            if layer.in_features != width:
                raise ValueError(
                    f"Dense layer in_features={layer.in_features} but the token vectors before it "
                    f"have {width} values"
                )
            width = layer.out_features
        return width


def projection_head(hidden_size: int, dim: int = 128) -> LateInteractionHead:
    """PyLate's default head: one linear projection without bias, ``hidden_size`` -> ``dim``."""
    return LateInteractionHead((DenseLayer(hidden_size, dim, bias=False, activation="linear"),))


@dataclasses.dataclass
class LateInteractionSettings:
    """A ColBERT model's settings (PyLate's ``config_sentence_transformers.json``) and its
    projection weights (``tensors``: ``dense_{i}/kernel`` [in, out], ``dense_{i}/bias``,
    ``dense_{i}_residual/kernel``). ``extra``: the file's other keys, written back unchanged."""

    head: LateInteractionHead = LateInteractionHead()
    tensors: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    query_prefix: str = "[Q] "
    document_prefix: str = "[D] "
    query_length: int = 32
    document_length: int = 180
    do_query_expansion: bool = True
    attend_to_expansion_tokens: bool = False
    skiplist_words: tuple[str, ...] = tuple(string.punctuation)
    do_lower_case: bool = False
    prompts: dict[str, str] = dataclasses.field(default_factory=dict)
    default_prompt_name: str | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def check(self, source: str) -> None:
        """ValueError naming ``source`` when a length leaves no room for text."""
        for key in ("query_length", "document_length"):
            value = getattr(self, key)
            if value < 3:
                raise ValueError(f"{source}: {key}={value} must be at least 3")

    def capped(self, position_table: int) -> LateInteractionSettings:
        """These settings with the lengths cut to the position table (PyLate would fail on a
        longer input; the default document_length 180 exceeds a small model's table)."""
        return dataclasses.replace(
            self,
            query_length=min(self.query_length, position_table),
            document_length=min(self.document_length, position_table),
        )

    # ---- what a loaded model does with these settings (``pretrained.HeadBehaviour``) ----------
    @property
    def late_interaction(self) -> bool:
        return True  # one vector per token

    def embed(self, model, texts, batch_size=32, prompt=None, prompt_name=None):
        raise ValueError(
            f"{model.source}: a late-interaction (ColBERT) model: use embed_queries / "
            "embed_documents"
        )

    def embed_queries(self, model, texts: Sequence[str], batch_size: int = 32) -> list[np.ndarray]:
        """``Pretrained.embed_queries``: see :func:`embed_tokens`."""
        return self._token_vectors(model, texts, True, batch_size)

    def embed_documents(self, model, texts: Sequence[str], batch_size: int = 32):
        """``Pretrained.embed_documents``: see :func:`embed_tokens`."""
        return self._token_vectors(model, texts, False, batch_size)

    def _token_vectors(self, model, texts, is_query: bool, batch_size: int) -> list[np.ndarray]:
        settings = self.capped(model.config.max_position_embeddings)
        if model.tokenizer is None:
            raise ValueError(f"{model.source}: no vocabulary file found beside the checkpoint")
        name = architecture(model.config).encoder_name
        params = {name: model.encoder_params, **unflatten_params(settings.tensors)}
        prompt = settings.prompts.get(settings.default_prompt_name or "", "")
        return embed_tokens(
            LateInteraction(model.config, settings.head),  # jitted once per (config, head)
            params,
            model.tokenizer,
            settings,
            texts,
            is_query=is_query,
            batch_size=batch_size,
            prompt=prompt,
        )


_RECORDED = (
    "query_prefix",
    "document_prefix",
    "query_length",
    "document_length",
    "do_query_expansion",
    "attend_to_expansion_tokens",
    "do_lower_case",
    "default_prompt_name",
)


def settings_record(settings: LateInteractionSettings) -> dict[str, Any]:
    """``settings`` without its tensors, as JSON values: what a ColBERT run records in its
    checkpoint config (``late_interaction``), so that its folder loads as the model it trained."""
    return {
        "dense": [dataclasses.asdict(layer) for layer in settings.head.dense],
        "normalize": settings.head.normalize,
        "skiplist_words": list(settings.skiplist_words),
        "prompts": dict(settings.prompts),
        **{key: getattr(settings, key) for key in _RECORDED},
    }


def settings_from_record(
    record: dict[str, Any], tensors: dict[str, np.ndarray], source: str
) -> LateInteractionSettings:
    """The :class:`LateInteractionSettings` a run recorded (:func:`settings_record`), with the
    projections' tensors (``dense_{i}/...``) taken from the checkpoint's."""
    try:
        head = LateInteractionHead(
            dense=tuple(DenseLayer(**layer) for layer in record["dense"]),
            normalize=bool(record.get("normalize", True)),
        )
        values = {key: record[key] for key in _RECORDED if key in record}
        settings = LateInteractionSettings(
            head=head,
            tensors=dict(tensors),
            skiplist_words=tuple(record.get("skiplist_words") or ()),
            prompts=dict(record.get("prompts") or {}),
            **values,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{source}: the recorded ColBERT head is not readable ({err})") from None
    check_dense_tensors(head.dense, tensors, source, "ColBERT head", "projections")
    settings.check(source)
    return settings


@dataclasses.dataclass(frozen=True)
class TokenLayout:
    """What :func:`query_ids` / :func:`document_ids` need from the settings and the tokenizer."""

    cls_id: int
    sep_id: int
    pad_id: int
    expansion_id: int  # [MASK]: pads queries
    query_prefix_id: int | None
    document_prefix_id: int | None
    skiplist: tuple[int, ...]
    query_length: int
    document_length: int
    do_query_expansion: bool
    attend_to_expansion_tokens: bool
    lower: bool

    @classmethod
    def of(cls, settings: LateInteractionSettings, tokenizer) -> TokenLayout:
        def prefix_id(prefix: str, key: str) -> int | None:
            if not prefix:
                return None
            (found,) = tokenizer.convert_tokens_to_ids([prefix])
            if found == tokenizer.unk_id:
                raise ValueError(
                    f"{key}={prefix!r} is not a token of the tokenizer ({tokenizer.vocab_file}); "
                    "PyLate adds it as a token: use a tokenizer that has it, one of its tokens "
                    "(e.g. '[unused0]'), or '' for no prefix"
                )
            return int(found)

        return cls(
            cls_id=tokenizer.cls_id,
            sep_id=tokenizer.sep_id,
            pad_id=tokenizer.pad_id,
            expansion_id=tokenizer.mask_id,
            query_prefix_id=prefix_id(settings.query_prefix, "query_prefix"),
            document_prefix_id=prefix_id(settings.document_prefix, "document_prefix"),
            skiplist=tuple(
                int(i) for i in tokenizer.convert_tokens_to_ids(settings.skiplist_words)
            ),
            query_length=int(settings.query_length),
            document_length=int(settings.document_length),
            do_query_expansion=bool(settings.do_query_expansion),
            attend_to_expansion_tokens=bool(
                settings.attend_to_expansion_tokens and settings.do_query_expansion
            ),
            lower=bool(settings.do_lower_case and not getattr(tokenizer, "do_lower_case", False)),
        )


def _rows(tokenizer, texts: Sequence[str], length: int, prefix: int | None, lower: bool):
    """``[CLS] (prefix) tokens [SEP]`` per text, at most ``length`` tokens."""
    prefix_ids = () if prefix is None else (prefix,)
    rows = features.rows(tokenizer, list(texts), length, prefix=prefix_ids, lower=lower)
    return [ids for ids, _ in rows]


def query_ids(layout: TokenLayout, tokenizer, texts: Sequence[str], width: int | None = None):
    """(input_ids, input_mask, keep) [n, width] int32/int32/bool of queries: ``width`` is
    ``query_length`` with query expansion, else at least the longest query. ``keep``: the tokens
    whose vectors count (every token with expansion, else the attended ones)."""
    rows = _rows(tokenizer, texts, layout.query_length, layout.query_prefix_id, layout.lower)
    longest = max((len(r) for r in rows), default=1)
    if layout.do_query_expansion:
        width = layout.query_length
    width = max(width or longest, longest)
    ids = np.full((len(rows), width), layout.pad_id, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
        if layout.do_query_expansion:
            ids[i, len(row) :] = layout.expansion_id
    if layout.attend_to_expansion_tokens:
        mask[:] = 1
    keep = np.ones_like(mask, bool) if layout.do_query_expansion else mask.astype(bool)
    return ids, mask, keep


def document_ids(layout: TokenLayout, tokenizer, texts: Sequence[str], width: int | None = None):
    """(input_ids, input_mask, keep) [n, width] of documents padded to ``width`` (default:
    the longest); ``keep``: attended tokens outside the skiplist."""
    rows = _rows(tokenizer, texts, layout.document_length, layout.document_prefix_id, layout.lower)
    longest = max((len(r) for r in rows), default=1)
    width = max(width or longest, longest)
    ids = np.full((len(rows), width), layout.pad_id, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return ids, mask, mask.astype(bool) & ~np.isin(ids, layout.skiplist)


class LateInteraction(nn.Module):
    """Encoder -> ``head``'s per-token Dense layers -> per-token L2 normalisation, in float32:
    [batch, seq] ids -> [batch, seq, dim] (padded positions get vectors too; callers mask)."""

    config: Any
    head: LateInteractionHead = LateInteractionHead()

    @model_inputs
    @nn.compact
    def __call__(
        self,
        input_ids: Array,  # [batch, seq]
        segment_ids: Array | None = None,
        input_mask: Array | None = None,
        *,
        deterministic: bool = True,
    ) -> Array:
        if input_mask is None:
            input_mask = jnp.ones_like(input_ids)
        out = encoder(self.config, add_pooler=False)(
            input_ids, segment_ids, input_mask, deterministic=deterministic
        )
        x = out.sequence_output.astype(jnp.float32)  # [batch, seq, hidden]
        x = dense_layers(self.head.dense, x)
        return l2_normalize(x) if self.head.normalize else x  # [batch, seq, dim]


@functools.lru_cache(maxsize=16)
def _jitted(module: LateInteraction):
    return jax.jit(module.apply)


def _bucket(longest: int, max_length: int) -> int:
    return min(max(MIN_BUCKET, 1 << max(longest - 1, 0).bit_length()), max_length)


def embed_tokens(
    module: LateInteraction,
    params: dict,
    tokenizer,
    settings: LateInteractionSettings,
    texts: Sequence[str],
    *,
    is_query: bool,
    batch_size: int = 32,
    prompt: str = "",
) -> list[np.ndarray]:
    """The kept token vectors [tokens, dim] float32 of each text, as PyLate's
    ``ColBERT.encode(texts, is_query=is_query)`` (see the module docstring). Texts run longest
    first in batches of ``batch_size`` padded to a power-of-two length (queries with expansion:
    ``query_length``), so a corpus compiles a handful of shapes."""
    if isinstance(texts, str):
        raise TypeError("embed_queries / embed_documents take a list of texts, not one string")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    layout = TokenLayout.of(settings, tokenizer)
    texts = [prompt + t for t in texts]
    if not texts:
        return []
    make = query_ids if is_query else document_ids
    limit = layout.query_length if is_query else layout.document_length
    sizes = [len(r) for r in _rows(tokenizer, texts, limit, None, layout.lower)]
    order = np.argsort([-s for s in sizes], kind="stable")
    apply = _jitted(module)
    height = min(batch_size, 1 << max(len(texts) - 1, 0).bit_length())
    out: list[np.ndarray | None] = [None] * len(texts)
    for start in range(0, len(texts), height):
        chosen = order[start : start + height]
        batch = [texts[i] for i in chosen]
        batch += [""] * (height - len(batch))  # rows past the last text
        longest = max(len(r) for r in _rows(tokenizer, batch, limit, None, layout.lower)) + 1
        ids, mask, keep = make(layout, tokenizer, batch, _bucket(longest, limit))
        vectors = np.asarray(
            apply({"params": params}, jnp.asarray(ids), jnp.zeros_like(ids), jnp.asarray(mask)),
            np.float32,
        )
        for row, i in enumerate(chosen):
            out[i] = vectors[row][keep[row]]
        progress.advance(len(chosen))
    return out  # type: ignore[return-value]
