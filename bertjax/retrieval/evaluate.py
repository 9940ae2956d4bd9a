"""Embed, search and score a BEIR set, or score a run file: what ``bertjax evaluate retrieval``
runs.

``retrieve`` embeds the judged queries and the corpus with any ``embed(texts, batch_size) ->
[n, dim]`` (the corpus longest first, to cut padding), searches exactly on device
(``search.dense_search``) with ties ranked as trec_eval ranks them, and drops a document whose id
is the query's (BEIR's ``ignore_identical_ids``: ArguAna-style sets need it) before keeping the
top ``top_k``. ``retrieve_maxsim`` does the same for a late-interaction (ColBERT) model, with
per-token vectors and exact MaxSim (``search.maxsim_search``). ``ranking_metrics.evaluate`` then
scores the run as pytrec_eval would.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from bertjax import progress
from bertjax.retrieval import beir, ranking_metrics, search, trec_format

Embed = Callable[..., np.ndarray]  # embed(texts: list[str], batch_size: int) -> [n, dim]


@dataclasses.dataclass(frozen=True)
class Retrieved:
    run: trec_format.Run
    seconds: dict[str, float]  # embed_queries, embed_corpus, search


def embed_longest_first(embed: Embed, texts: Sequence[str], batch_size: int) -> np.ndarray:
    """``embed(texts)`` computed on the texts sorted by length (longest first: an out-of-memory
    shows at once), returned in the given order."""
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    vectors = np.asarray(embed([texts[i] for i in order], batch_size=batch_size))
    if vectors.ndim != 2 or len(vectors) != len(texts):
        raise ValueError(f"embed returned shape {vectors.shape} for {len(texts)} texts")
    out = np.empty_like(vectors)
    out[order] = vectors
    return out


def retrieve(
    embed: Embed,
    data: beir.BeirSet,
    *,
    top_k: int = 100,
    similarity: str = "cosine",
    batch_size: int = 32,
    exclude_identical_ids: bool = True,
    devices=None,
) -> Retrieved:
    """The top ``top_k`` documents of each judged query of ``data`` as a run."""
    seconds = {}
    start = time.perf_counter()
    with progress.phase("embedding queries", len(data.query_texts)):
        queries = np.asarray(embed(list(data.query_texts), batch_size=batch_size))
    seconds["embed_queries"] = time.perf_counter() - start
    start = time.perf_counter()
    with progress.phase("embedding the corpus", len(data.doc_texts)):
        corpus = embed_longest_first(embed, data.doc_texts, batch_size)
    seconds["embed_corpus"] = time.perf_counter() - start
    start = time.perf_counter()
    order = trec_format.tie_order(data.doc_ids)  # equal scores: the larger id first
    k = top_k + 1 if exclude_identical_ids else top_k
    with progress.phase("searching", len(queries), "queries"):
        scores, rows = search.dense_search(
            queries, corpus[order], k, similarity=similarity, devices=devices
        )
    seconds["search"] = time.perf_counter() - start
    run = _run(data, order, scores, rows, top_k, exclude_identical_ids)
    return Retrieved(run=run, seconds=seconds)


def _run(data, order, scores, rows, top_k: int, exclude_identical_ids: bool) -> trec_format.Run:
    """The top ``top_k`` documents per query from searched rows of the corpus in ``order``."""
    run: trec_format.Run = {}
    for qid, query_scores, query_rows in zip(data.query_ids, scores, rows):
        docs = {}
        for score, row in zip(query_scores.tolist(), query_rows.tolist()):
            doc_id = data.doc_ids[order[row]]
            if exclude_identical_ids and doc_id == qid:
                continue
            docs[doc_id] = score
            if len(docs) == top_k:
                break
        run[qid] = docs
    return run


TokenEmbed = Callable[..., Sequence[np.ndarray]]  # (texts, batch_size) -> [tokens, dim] each


def retrieve_maxsim(
    embed_queries: TokenEmbed,
    embed_documents: TokenEmbed,
    data: beir.BeirSet,
    *,
    top_k: int = 100,
    batch_size: int = 32,
    exclude_identical_ids: bool = True,
    devices=None,
) -> Retrieved:
    """``retrieve`` for late interaction (ColBERT): per-token vectors of the queries and of the
    corpus (longest first), ranked by exact MaxSim (``search.maxsim_search``, dot products of
    the normalised token vectors)."""
    seconds = {}
    start = time.perf_counter()
    with progress.phase("embedding queries", len(data.query_texts)):
        q_vectors = embed_queries(list(data.query_texts), batch_size=batch_size)
    q_tokens, q_mask = _padded(q_vectors)
    seconds["embed_queries"] = time.perf_counter() - start
    start = time.perf_counter()
    texts = data.doc_texts
    by_length = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    with progress.phase("embedding the corpus", len(texts)):
        vectors = embed_documents([texts[i] for i in by_length], batch_size=batch_size)
    if len(vectors) != len(texts):
        raise ValueError(f"embed_documents returned {len(vectors)} rows for {len(texts)} texts")
    in_order: list = [None] * len(texts)
    for i, v in zip(by_length, vectors):
        in_order[i] = v
    seconds["embed_corpus"] = time.perf_counter() - start
    start = time.perf_counter()
    order = trec_format.tie_order(data.doc_ids)  # equal scores: the larger id first
    d_tokens, d_mask = _padded([in_order[i] for i in order])
    k = top_k + 1 if exclude_identical_ids else top_k
    with progress.phase("searching", len(q_tokens), "queries"):
        scores, rows = search.maxsim_search(q_tokens, q_mask, d_tokens, d_mask, k, devices=devices)
    seconds["search"] = time.perf_counter() - start
    run = _run(data, order, scores, rows, top_k, exclude_identical_ids)
    return Retrieved(run=run, seconds=seconds)


def _padded(vectors: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-text [tokens, dim] arrays -> zero-padded [n, longest, dim] float32 and mask [n, longest]."""
    longest = max([len(v) for v in vectors] + [1])
    dim = int(np.shape(vectors[0])[-1]) if len(vectors) else 1
    out = np.zeros((len(vectors), longest, dim), np.float32)
    mask = np.zeros((len(vectors), longest), bool)
    for i, v in enumerate(vectors):
        out[i, : len(v)] = v
        mask[i, : len(v)] = True
    return out, mask


def score_run_files(qrels_path: str, run_path: str) -> tuple[dict[str, float], list[str]]:
    """The measures of a TREC run file against qrels, and the judged queries the run lacks (not
    counted, as in pytrec_eval)."""
    qrels = trec_format.read_qrels(qrels_path)
    run = trec_format.read_run(run_path)
    if not any(qid in qrels for qid in run):
        raise ValueError(f"{run_path}: no query of the run is judged in {qrels_path}")
    return ranking_metrics.evaluate(qrels, run), [qid for qid in qrels if qid not in run]
