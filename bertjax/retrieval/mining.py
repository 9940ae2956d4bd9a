"""Hard-negative mining: the current model's top-ranked non-positive documents as training rows,
as sentence-transformers' ``util.mine_hard_negatives`` (6.2) chooses them.

For (query, positive) pairs and an optional corpus: the corpus is the corpus's texts then the
positives, deduplicated by text (first occurrence kept); rows with the same query text are one
query with several positives (each is never its negative; the margins use its lowest positive
score). Queries and documents are embedded (a model's query / document prompts as
``encode_query`` / ``encode_document`` pick them), normalised, and searched exactly
(``search.dense_search``) for the top ``range_max + most positives of a query``. Then, per query:
positives are removed, and so are candidates scoring above ``positive - absolute_margin``, above
``positive - |positive| * relative_margin``, above ``max_score`` or below ``min_score``; of the
first ``range_max`` left (in rank order), the first ``range_min`` are skipped, and the
``num_negatives`` negatives are the next ones (``sampling="top"``) or drawn from all that are left
(``"random"``, ``random.Random(seed).sample`` as sentence-transformers draws with ``random``,
then put back in rank order).

Rows, JSON lines that the retrieval task reads (``data.train_file``): ``"n-tuple"`` is one row
per (query, positive) with its ``negatives`` and ``scores`` (the positive's, then each
negative's), kept only where all ``num_negatives`` were found unless ``keep_incomplete``;
``"triplet"`` is one row per negative. Equal scores rank the earlier corpus text first
(sentence-transformers' order among equal scores is ``torch.topk``'s, which is not defined).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from bertjax import atomic, progress
from bertjax.retrieval import beir, search

SAMPLING = ("top", "random")
FORMATS = ("n-tuple", "triplet")
DOCUMENT_PROMPTS = ("document", "passage", "corpus")  # encode_document's order


@dataclasses.dataclass(frozen=True)
class Mined:
    rows: list[dict]  # {"query", "positive", "negatives": [...], "scores": [positive, ...]}
    num_queries: int  # distinct query texts
    corpus_size: int  # distinct document texts searched
    range_max: int
    positive_scores: np.ndarray  # [distinct (query, positive) pairs]
    negative_scores: np.ndarray  # every negative written, as written
    difference_scores: np.ndarray  # positive - negative, for each negative written
    too_few: int  # queries with fewer than num_negatives negatives
    skipped: dict[str, int]  # candidates removed by each guard (margins, max_score, min_score)


def default_range_max(range_min, num_negatives, max_positives, *, guarded: bool) -> int:
    """sentence-transformers' range_max when none is given: room for the positives and, where a
    margin or max_score may remove candidates (``guarded``), ten times the negatives."""
    return range_min + num_negatives * (10 if guarded else 1) + max_positives


def check_settings(
    pairs: Sequence[tuple[str, str]],
    *,
    range_min: int = 0,
    range_max: int | None = None,
    num_negatives: int = 3,
    guarded: bool = False,
    sampling: str = "top",
    output_format: str = "n-tuple",
) -> int:
    """The range_max that mining ``pairs`` uses (``default_range_max`` when None; ``guarded``: a
    margin or max_score is set); ValueError for settings sentence-transformers refuses."""
    if not pairs:
        raise ValueError("no (query, positive) pairs to mine negatives for")
    if num_negatives < 1:
        raise ValueError(f"num_negatives must be at least 1, not {num_negatives}")
    if range_max is None:
        max_positives = max(Counter(q for q, _ in pairs).values())  # rows, as s-t counts them
        range_max = default_range_max(range_min, num_negatives, max_positives, guarded=guarded)
    if sampling not in SAMPLING:
        raise ValueError(f"sampling must be one of {SAMPLING}, not {sampling!r}")
    if output_format not in FORMATS:
        raise ValueError(f"output_format must be one of {FORMATS}, not {output_format!r}")
    if range_min < 0:
        raise ValueError(f"range_min must be non-negative, not {range_min}")
    if range_min >= range_max:
        raise ValueError(f"range_min={range_min} must be smaller than range_max={range_max}")
    if num_negatives > range_max - range_min:
        raise ValueError(
            f"cannot mine {num_negatives} negatives per query: only {range_max - range_min} "
            f"candidates remain after skipping range_min={range_min} of range_max={range_max}"
        )
    return int(range_max)


def _embedders(model, batch_size, query_prompt, query_prompt_name, corpus_prompt, corpus_name):
    """(embed queries, embed documents): ``model.embed`` with the prompts encode_query and
    encode_document would use, or a plain ``model(texts, batch_size=...)``."""
    if not hasattr(model, "embed"):
        if not callable(model):
            raise TypeError("model must have embed(texts, batch_size) or be such a function")
        prompts = (query_prompt, query_prompt_name, corpus_prompt, corpus_name)
        if any(p is not None for p in prompts):
            raise ValueError("prompts need a loaded model (with embed), not a plain function")
        plain = lambda texts: model(texts, batch_size=batch_size)  # noqa: E731
        return plain, plain
    prompts = getattr(getattr(model, "embedding", None), "prompts", None) or {}
    if query_prompt is None and query_prompt_name is None and "query" in prompts:
        query_prompt_name = "query"
    if corpus_prompt is None and corpus_name is None:
        corpus_name = next((name for name in DOCUMENT_PROMPTS if name in prompts), None)

    def embedder(prompt, prompt_name):
        kwargs = {k: v for k, v in (("prompt", prompt), ("prompt_name", prompt_name)) if v}
        return lambda texts: model.embed(texts, batch_size=batch_size, **kwargs)

    return embedder(query_prompt, query_prompt_name), embedder(corpus_prompt, corpus_name)


def _vectors(embed: Callable, texts: list[str]) -> np.ndarray:
    vectors = np.asarray(embed(texts), np.float32)
    if vectors.ndim != 2 or len(vectors) != len(texts):
        raise ValueError(f"embed returned shape {vectors.shape} for {len(texts)} texts")
    return search.normalize(vectors)


def mine_hard_negatives(
    pairs: Sequence[tuple[str, str]],
    model,
    *,
    corpus: Sequence[str] | None = None,
    range_min: int = 0,
    range_max: int | None = None,
    max_score: float | None = None,
    min_score: float | None = None,
    absolute_margin: float | None = None,
    relative_margin: float | None = None,
    num_negatives: int = 3,
    sampling: str = "top",
    output_format: str = "n-tuple",
    keep_incomplete: bool = False,
    seed: int | None = 0,
    batch_size: int = 32,
    query_prompt: str | None = None,
    query_prompt_name: str | None = None,
    corpus_prompt: str | None = None,
    corpus_prompt_name: str | None = None,
    devices=None,
) -> Mined:
    """Hard negatives for (query, positive) ``pairs`` (see the module docstring). ``model``: a
    loaded model with ``embed`` (``bertjax.load_pretrained``) or ``embed(texts, batch_size)``;
    ``corpus``: more candidate texts (default: the positives only); ``devices`` share the
    search."""
    pairs = [(str(q), str(p)) for q, p in pairs]
    range_max = check_settings(
        pairs,
        range_min=range_min,
        range_max=range_max,
        num_negatives=num_negatives,
        guarded=(absolute_margin, relative_margin, max_score) != (None, None, None),
        sampling=sampling,
        output_format=output_format,
    )
    max_positives = max(Counter(q for q, _ in pairs).values())

    positives_in_order = [p for _, p in pairs]
    docs = list(dict.fromkeys([*(corpus or []), *positives_in_order]))
    doc_row = {text: i for i, text in enumerate(docs)}
    queries = list(dict.fromkeys(q for q, _ in pairs))
    query_row = {text: i for i, text in enumerate(queries)}
    positives: list[list[int]] = [[] for _ in queries]  # corpus rows, first seen first
    for query, positive in pairs:
        own = positives[query_row[query]]
        if doc_row[positive] not in own:
            own.append(doc_row[positive])

    embed_queries, embed_docs = _embedders(
        model, batch_size, query_prompt, query_prompt_name, corpus_prompt, corpus_prompt_name
    )
    with progress.phase("embedding the corpus", len(docs)):
        doc_vectors = _vectors(embed_docs, docs)
    with progress.phase("embedding queries", len(queries)):
        query_vectors = _vectors(embed_queries, queries)
    width = range_max + max_positives
    with progress.phase("searching", len(queries), "queries"):
        scores, rows = search.dense_search(
            query_vectors, doc_vectors, width, similarity="dot", devices=devices
        )
    if scores.shape[1] < width:  # a corpus smaller than the window
        missing = width - scores.shape[1]
        scores = np.pad(scores, ((0, 0), (0, missing)), constant_values=-np.inf)
        rows = np.pad(rows, ((0, 0), (0, missing)), constant_values=-1)
    pair_query = np.array([q for q, own in enumerate(positives) for _ in own])
    pair_doc = np.array([d for own in positives for d in own])
    positive_scores = np.sum(query_vectors[pair_query] * doc_vectors[pair_doc], axis=1)

    scores = scores.astype(np.float32)
    for q, own in enumerate(positives):
        scores[q, np.isin(rows[q], own) | (rows[q] < 0)] = -np.inf
    starts = np.cumsum([0] + [len(own) for own in positives[:-1]])  # each query's first pair
    lowest = np.minimum.reduceat(positive_scores, starts).astype(np.float32)[:, None]  # [q, 1]
    guards, margin = [], np.abs(lowest) * np.float32(relative_margin or 0.0)
    if absolute_margin is not None:
        guards.append(("absolute_margin", scores + np.float32(absolute_margin) > lowest))
    if relative_margin is not None:
        guards.append(("relative_margin", scores > lowest - margin))
    if max_score is not None:
        guards.append(("max_score", scores > np.float32(max_score)))
    if min_score is not None:
        guards.append(("min_score", scores < np.float32(min_score)))
    skipped = {}
    for name, removed in guards:
        removed &= np.isfinite(scores)
        skipped[name] = int(removed.sum())
        scores[removed] = -np.inf

    order = np.argsort(-scores, axis=1, kind="stable")[:, range_min:range_max]
    scores = np.take_along_axis(scores, order, axis=1)  # [queries, range_max - range_min]
    rows = np.take_along_axis(rows, order, axis=1)
    if sampling == "top":
        scores, rows = scores[:, :num_negatives], rows[:, :num_negatives]
    else:
        draw = random.Random(seed)
        options = np.maximum(np.isfinite(scores).sum(axis=1), num_negatives)
        picked = np.array([draw.sample(range(n), k=num_negatives) for n in options.tolist()])
        scores = np.take_along_axis(scores, picked, axis=1)
        rows = np.take_along_axis(rows, picked, axis=1)
        back = np.argsort(-scores, axis=1, kind="stable")  # rank order again
        scores = np.take_along_axis(scores, back, axis=1)
        rows = np.take_along_axis(rows, back, axis=1)

    out, negative_scores, differences = [], [], []
    found = np.isfinite(scores)
    pair = 0
    for q, own in enumerate(positives):
        negatives = [docs[d] for d in rows[q][found[q]].tolist()]
        negative = scores[q][found[q]].tolist()
        for d in own:
            positive = float(positive_scores[pair])
            pair += 1
            if output_format == "triplet":
                groups = [([text], [score]) for text, score in zip(negatives, negative)]
            elif len(negatives) == num_negatives or keep_incomplete:
                groups = [(negatives, negative)]
            else:
                groups = []
            for texts, values in groups:
                out.append(
                    {
                        "query": queries[q],
                        "positive": docs[d],
                        "negatives": texts,
                        "scores": [positive, *values],
                    }
                )
                negative_scores += values
                differences += [positive - v for v in values]
    return Mined(
        rows=out,
        num_queries=len(queries),
        corpus_size=len(docs),
        range_max=int(range_max),
        positive_scores=positive_scores,
        negative_scores=np.array(negative_scores, np.float32),
        difference_scores=np.array(differences, np.float32),
        too_few=int((found.sum(axis=1) < num_negatives).sum()),
        skipped=skipped,
    )


# ---- files ---------------------------------------------------------------------------------------
def _text(record: dict, key: str, where: str, *, empty_ok: bool = False) -> str:
    value = record.get(key)
    if value is None:
        raise ValueError(f"{where}: no {key!r} key")
    if not isinstance(value, str):
        raise ValueError(f"{where}: {key!r} is not a string")
    if not empty_ok and not value.strip():
        raise ValueError(f"{where}: empty {key!r}")
    return value


def read_corpus(path: str) -> list[str]:
    """Document texts of a JSON-lines corpus: ``text`` (empty allowed) with an optional
    ``title``, joined as BEIR does (a ``corpus.jsonl`` of a BEIR folder reads as is)."""
    texts = []
    for number, record in beir.json_objects(path):
        where = f"{path}:{number}"
        title = record.get("title")
        if title is not None and not isinstance(title, str):
            raise ValueError(f"{where}: 'title' is not a string")
        texts.append(beir.document_text(title, _text(record, "text", where, empty_ok=True)))
    if not texts:
        raise ValueError(f"{path}: no documents")
    return texts


def read_pairs(
    path: str, corpus: Sequence[str] | None = None, corpus_path: str = "the corpus"
) -> list[tuple[str, str]]:
    """(query, positive) per line of a JSON-lines file (other keys, such as old ``negatives``,
    are ignored); with ``corpus``, each positive must be one of its texts."""
    known = set(corpus) if corpus is not None else None
    pairs = []
    for number, record in beir.json_objects(path):
        where = f"{path}:{number}"
        query, positive = _text(record, "query", where), _text(record, "positive", where)
        if known is not None and positive not in known:
            raise ValueError(f"{where}: the positive is not a document of {corpus_path}")
        pairs.append((query, positive))
    if not pairs:
        raise ValueError(f"{path}: no (query, positive) pairs")
    return pairs


def beir_pairs(folder: str, split: str = "train") -> tuple[list[tuple[str, str]], list[str], int]:
    """(query, relevant document) pairs of a BEIR split (relevance >= 1, queries in queries.jsonl
    order), the corpus texts, and how many judged documents the corpus lacks (left out)."""
    data = beir.load(folder, split)
    texts = dict(zip(data.doc_ids, data.doc_texts))
    pairs, missing = [], 0
    for qid, query in zip(data.query_ids, data.query_texts):
        if not query.strip():
            raise ValueError(f"{os.path.join(folder, 'queries.jsonl')}: query {qid!r} is empty")
        for doc, relevance in data.qrels[qid].items():
            if relevance < 1:
                continue
            if doc in texts:
                pairs.append((query, texts[doc]))
            else:
                missing += 1
    if not pairs:
        raise ValueError(f"{folder}/qrels/{split}.tsv: no relevant document in the corpus")
    return pairs, list(data.doc_texts), missing


def write_rows(path: str, rows: Sequence[dict]) -> None:
    """The rows as JSON lines, written atomically."""
    with atomic.atomic_open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
