"""Retrieval measures exactly as trec_eval (pytrec_eval, which BEIR and MTEB use) computes them.

Per query, the run's documents are first ranked as trec_eval ranks them (``trec_format.ranked``:
score descending, ties by document id descending); unjudged documents are not relevant. With
``rel`` a document's judged relevance and ``R`` the number of judged documents with ``rel >= 1``:

* ``ndcg@k`` (trec_eval ``ndcg_cut_k``): sum over the top k of ``rel / log2(rank + 1)`` for
  ``rel > 0``, divided by the same sum over the judged documents sorted by ``rel`` (0 when no
  document is relevant). Gains are the relevance values themselves.
* ``recall@k`` (``recall_k``): relevant documents in the top k over ``R`` (0 when ``R`` is 0).
* ``map@k`` (``map_cut_k``): the sum of the precision at each relevant document in the top k,
  over ``R``.
* ``mrr@k``: trec_eval's ``recip_rank`` of the ranking cut at k: one over the rank of the first
  relevant document in the top k, else 0. This is MTEB's ``MRR@k`` (and BEIR's
  ``evaluate_custom(..., "mrr")``) except for ties, which those order by insertion rather than
  trec_eval's rule; BEIR also divides by every judged query, not those the run answers.

Means are over the queries that have judgements AND a line in the run, as pytrec_eval evaluates
them and BEIR and MTEB average them (trec_eval without ``-c``); a judged query with an empty
ranking counts 0. Everything is pure Python: no JAX, NumPy or pytrec_eval.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence

from bertjax.retrieval.trec_format import ranked

# What `bertjax evaluate retrieval` reports, in its order.
MEASURES = ("ndcg@10", "recall@10", "recall@100", "mrr@10", "map@100")
RELEVANT = 1  # trec_eval's default relevance level: rel >= 1 is relevant


def _ndcg(rels: Sequence[int], ideal: Sequence[int], num_rel: int, k: int) -> float:
    del num_rel
    dcg = 0.0
    for i, gain in enumerate(rels[:k]):
        if gain > 0:
            dcg += gain / math.log2(i + 2)
    ideal_dcg = 0.0
    for i, gain in enumerate(ideal[:k]):
        ideal_dcg += gain / math.log2(i + 2)
    return dcg / ideal_dcg if ideal_dcg > 0.0 else dcg


def _recall(rels: Sequence[int], ideal: Sequence[int], num_rel: int, k: int) -> float:
    if num_rel == 0:
        return 0.0
    return sum(rel >= RELEVANT for rel in rels[:k]) / num_rel


def _map(rels: Sequence[int], ideal: Sequence[int], num_rel: int, k: int) -> float:
    if num_rel == 0:
        return 0.0
    found, total = 0, 0.0
    for i, rel in enumerate(rels[:k]):
        if rel >= RELEVANT:
            found += 1
            total += found / (i + 1)
    return total / num_rel


def _mrr(rels: Sequence[int], ideal: Sequence[int], num_rel: int, k: int) -> float:
    for i, rel in enumerate(rels[:k]):
        if rel >= RELEVANT:
            return 1.0 / (i + 1)
    return 0.0


_KINDS: dict[str, Callable[[Sequence[int], Sequence[int], int, int], float]] = {
    "ndcg": _ndcg,
    "recall": _recall,
    "map": _map,
    "mrr": _mrr,
}


def parse_measure(name: str) -> tuple[str, int]:
    """``"ndcg@10"`` -> ``("ndcg", 10)``; the kinds are ndcg, recall, map and mrr."""
    match = re.fullmatch(r"([a-z]+)@([0-9]+)", name)
    if not match or match[1] not in _KINDS or int(match[2]) < 1:
        kinds = ", ".join(f"{kind}@K" for kind in _KINDS)
        raise ValueError(f"unknown measure {name!r} (known: {kinds} with K >= 1)")
    return match[1], int(match[2])


def query_scores(
    judged: Mapping[str, int], docs: Mapping[str, float], measures: Iterable[str] = MEASURES
) -> dict[str, float]:
    """The measures of one query: its judgements (document id -> relevance) and its run
    (document id -> score)."""
    parsed = [(name, *parse_measure(name)) for name in measures]
    rels = [judged.get(docid, 0) for docid, _ in ranked(docs)]
    ideal = sorted((rel for rel in judged.values() if rel > 0), reverse=True)
    num_rel = sum(rel >= RELEVANT for rel in judged.values())
    return {name: _KINDS[kind](rels, ideal, num_rel, k) for name, kind, k in parsed}


def per_query(
    qrels: Mapping[str, Mapping[str, int]],
    run: Mapping[str, Mapping[str, float]],
    measures: Iterable[str] = MEASURES,
) -> dict[str, dict[str, float]]:
    """Query id -> measures, for the queries of ``run`` that have judgements (pytrec_eval's
    ``RelevanceEvaluator(qrels, ...).evaluate(run)``)."""
    measures = tuple(measures)
    return {
        qid: query_scores(qrels[qid], docs, measures) for qid, docs in run.items() if qid in qrels
    }


def mean(scores: Mapping[str, Mapping[str, float]], measures: Iterable[str] = MEASURES):
    """The mean of each measure over the queries of ``per_query``'s result."""
    if not scores:
        raise ValueError("no query of the run has judgements: nothing to average")
    return {name: math.fsum(s[name] for s in scores.values()) / len(scores) for name in measures}


def evaluate(
    qrels: Mapping[str, Mapping[str, int]],
    run: Mapping[str, Mapping[str, float]],
    measures: Iterable[str] = MEASURES,
) -> dict[str, float]:
    """Each measure averaged over the judged queries of ``run`` (fractions, not percentages)."""
    measures = tuple(measures)
    return mean(per_query(qrels, run, measures), measures)
