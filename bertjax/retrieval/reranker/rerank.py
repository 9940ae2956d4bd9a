"""Cross-encoder reranking: (query, passage) pairs scored by a sequence classifier with one logit,
as sentence-transformers' ``CrossEncoder``.

A pair becomes ``[CLS] query [SEP] passage [SEP]`` (token types 0 then 1) cut to ``max_length``
tokens by the ``hf_longest_first`` truncation of :mod:`bertjax.text.features`, Hugging Face
tokenizers' "longest_first" (what ``CrossEncoder.predict`` runs): the shorter side is kept whole when the longer one can give
up the tokens, else both are cut to half of the budget each (the initially longer one keeps the odd
token). ``score_pairs`` runs any jitted ``apply(ids, types, mask) -> logits`` over pairs sorted by
length, in batches padded to a few bucketed lengths, and returns the raw logits in input order.

``CrossEncoderSettings`` says what ``CrossEncoder(DIR)`` would do with a directory: its
``max_length`` (``sentence_bert_config.json``'s ``max_seq_length``, else the tokenizer's
``model_max_length`` capped at the position table) and the activation ``predict`` applies
(``config_sentence_transformers.json``'s ``activation_fn``, else config.json's
``sentence_transformers.activation_fn`` or ``sbert_ce_default_activation_function``, else
Sigmoid for one label and Identity for more).

``rerank_run`` reorders the top ``top_k`` documents of each query of a first-stage run by the
cross-encoder's scores (BEIR's ``Rerank``: the reranked run holds those ``top_k`` documents).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from bertjax import progress
from bertjax.retrieval import trec_format
from bertjax.retrieval.bi_encoder.embedding import padded_length
from bertjax.text import features

Pair = tuple[str, str]
# torch.nn activation class (the last part of its dotted name) -> NumPy function on logits
ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "Identity": lambda x: x,
    "Tanh": np.tanh,
}
SETTINGS_FILES = ("config_sentence_transformers.json", "config.json")


def pair_rows(tokenizer, pairs: Sequence[Pair | str], max_length: int) -> list[features.Row]:
    """(ids, token types) of ``[CLS] query [SEP] passage [SEP]`` per pair, at most ``max_length``
    tokens (Hugging Face tokenizers' longest-first truncation, as sentence-transformers'
    CrossEncoder); an item that is one string is a single text, ``[CLS] text [SEP]`` (a sentence
    classifier's input, as GLUE's single-sentence tasks)."""
    if max_length < 4:
        raise ValueError(f"max_length={max_length} leaves no room for [CLS] a [SEP] b [SEP]")
    return features.rows(tokenizer, pairs, max_length, truncation="hf_longest_first")


def pair_features(tokenizer, pairs: Sequence[Pair], max_length: int) -> dict[str, np.ndarray]:
    """Pairs as [n, max_length] int32 ``input_ids``, ``segment_ids`` and ``input_mask``."""
    return features.pad(pair_rows(tokenizer, pairs, max_length), max_length, tokenizer.pad_id)


def score_pairs(
    apply: Callable, tokenizer, pairs: Sequence[Pair], *, max_length: int, batch_size: int = 32
) -> np.ndarray:
    """Raw logits [len(pairs), num_labels] float32 of ``apply(ids, types, mask)`` (each [batch,
    seq] int32) on the pairs: sorted by length, ``batch_size`` rows padded to a bucketed length."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    rows = pair_rows(tokenizer, pairs, max_length)
    if not rows:
        return np.zeros((0, 1), np.float32)
    order = np.argsort([-len(r[0]) for r in rows], kind="stable")
    height = min(batch_size, 1 << max(len(rows) - 1, 0).bit_length())
    out = None
    for start in range(0, len(rows), height):
        chosen = order[start : start + height]
        width = padded_length(len(rows[chosen[0]][0]), max_length)
        filler = features.pair_row(tokenizer, [], [], max_length)  # [CLS] [SEP] [SEP]
        batch = features.pad(
            [rows[chosen[i]] if i < len(chosen) else filler for i in range(height)],
            width,
            tokenizer.pad_id,
        )  # [batch, seq] each
        logits = np.asarray(
            apply(batch["input_ids"], batch["segment_ids"], batch["input_mask"]), np.float32
        )  # [batch, labels]
        if out is None:
            out = np.zeros((len(rows), logits.shape[-1]), np.float32)
        out[chosen] = logits[: len(chosen)]
        progress.advance(len(chosen))
    return out


@dataclasses.dataclass(frozen=True)
class CrossEncoderSettings:
    """What ``CrossEncoder(DIR)`` reads beside the weights: tokens per pair and the activation
    ``predict`` applies (a torch.nn class name of ``ACTIVATIONS``); ``scores`` and ``predict``
    are a loaded classifier's ``rerank_scores`` and ``predict`` (``Pretrained.cross_encoder``)."""

    max_length: int
    activation: str = "Sigmoid"

    def scores(
        self, model, pairs: Sequence, batch_size: int = 32, max_length: int | None = None
    ) -> np.ndarray:
        """The raw logits of ``model`` (a loaded sequence classifier) on (query, passage) pairs
        or single texts: [n] float32 for one label, else [n, num_labels]; pairs truncated
        longest-first to ``max_length`` tokens (default ``self.max_length``)."""
        if isinstance(pairs, str) or (
            isinstance(pairs, tuple) and len(pairs) == 2 and all(isinstance(t, str) for t in pairs)
        ):
            pairs = [pairs]  # one text, or one (query, passage) tuple as CrossEncoder.predict takes
        if model.tokenizer is None:
            raise ValueError(f"{model.source}: no vocabulary file found beside the checkpoint")
        max_length = max_length or self.max_length
        model.check_length(max_length)

        def apply(ids, types, mask):
            return model(ids, types, mask).logits

        logits = score_pairs(
            apply, model.tokenizer, pairs, max_length=max_length, batch_size=batch_size
        )
        return logits[:, 0] if model.module.num_labels == 1 else logits

    def predict(
        self,
        model,
        pairs: Sequence,
        batch_size: int = 32,
        activation: str | None = None,
        max_length: int | None = None,
    ) -> np.ndarray:
        """``CrossEncoder.predict``: ``model.rerank_scores`` through ``activation`` (default
        ``self.activation``)."""
        name = activation or self.activation
        if name not in ACTIVATIONS:
            raise ValueError(f"activation={name!r} is not one of {sorted(ACTIVATIONS)}")
        return ACTIVATIONS[name](model.rerank_scores(pairs, batch_size, max_length))


def _json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read it ({e})") from None
    return value if isinstance(value, dict) else {}


def transformer_folder(directory: str) -> str:
    """The folder of a sentence-transformers directory's Transformer module (the directory itself
    for a plain Hugging Face one)."""
    modules = os.path.join(directory, "modules.json")
    if os.path.isfile(modules):
        with open(modules, encoding="utf-8") as f:
            entries = json.load(f)
        if isinstance(entries, list) and entries and isinstance(entries[0], dict):
            return os.path.join(directory, entries[0].get("path") or "")
    return directory


def activation_name(path: str | None, where: str) -> str:
    """``ACTIVATIONS``' key of a torch.nn activation's dotted name (``where`` names the file)."""
    name = str(path).rsplit(".", 1)[-1]
    if not str(path).startswith("torch.") or name not in ACTIVATIONS:
        raise ValueError(
            f"{where}: activation_fn={path!r} is not one of torch.nn's {sorted(ACTIVATIONS)}"
        )
    return name


def read_settings(directory: str | None, num_labels: int, position_table: int):
    """The :class:`CrossEncoderSettings` of a checkpoint directory (defaults where it has no
    sentence-transformers or tokenizer files: a bertjax checkpoint)."""
    activation = "Sigmoid" if num_labels == 1 else "Identity"
    if not directory or not os.path.isdir(directory):
        return CrossEncoderSettings(position_table, activation)
    folder = transformer_folder(directory)
    st_path, hf_path = (os.path.join(directory, name) for name in SETTINGS_FILES)
    hf = _json(os.path.join(folder, "config.json"))
    candidates = (
        (_json(st_path).get("activation_fn"), st_path),
        ((hf.get("sentence_transformers") or {}).get("activation_fn"), hf_path),
        (hf.get("sbert_ce_default_activation_function"), hf_path),
    )
    for path, where in candidates:
        if path is not None:
            activation = activation_name(path, where)
            break
    sbert = _json(os.path.join(folder, "sentence_bert_config.json"))
    if sbert.get("max_seq_length") is not None:
        return CrossEncoderSettings(int(sbert["max_seq_length"]), activation)
    limit = _json(os.path.join(folder, "tokenizer_config.json")).get("model_max_length")
    length = min(int(limit), position_table) if isinstance(limit, (int, float)) else position_table
    return CrossEncoderSettings(length, activation)


def settings_of(model) -> CrossEncoderSettings:
    """The :class:`CrossEncoderSettings` of a loaded classifier (``Pretrained``), from its
    directory."""
    return read_settings(
        model.directory, model.module.num_labels, model.config.max_position_embeddings
    )


def rerank_run(
    score: Callable[[list[Pair]], np.ndarray],
    queries: Mapping[str, str],
    documents: Mapping[str, str],
    run: Mapping[str, Mapping[str, float]],
    top_k: int = 100,
    exclude_identical_ids: bool = True,
) -> trec_format.Run:
    """The top ``top_k`` documents of each query of ``run`` (trec_eval's order) with the scores
    ``score(pairs) -> [n]`` gives their (query text, document text) pairs, all pairs in one call.

    Queries absent from ``queries`` are left out; a document absent from ``documents`` is a
    ValueError; a document whose id is the query's is dropped first (BEIR's
    ``ignore_identical_ids``).
    """
    if top_k < 1:
        raise ValueError(f"top_k={top_k} must be at least 1")
    keys, pairs = [], []
    for qid, docs in run.items():
        if qid not in queries:
            continue
        kept = [d for d, _ in trec_format.ranked(docs) if not (exclude_identical_ids and d == qid)]
        for doc in kept[:top_k]:
            if doc not in documents:
                raise ValueError(f"run document {doc!r} (query {qid!r}) is not in the corpus")
            keys.append((qid, doc))
            pairs.append((queries[qid], documents[doc]))
    with progress.phase("reranking", len(pairs), "pairs"):
        scores = np.asarray(score(pairs), np.float64).reshape(-1)
    if len(scores) != len(pairs):
        raise ValueError(f"score returned {len(scores)} scores for {len(pairs)} pairs")
    out: trec_format.Run = {qid: {} for qid in run if qid in queries}
    for (qid, doc), value in zip(keys, scores.tolist()):
        out[qid][doc] = value
    return out
