"""bertjax.retrieval.ranking_metrics against pytrec_eval (the trec_eval BEIR and MTEB use) on generated runs:
ties, graded and negative relevance, no relevant retrieved, empty rankings, k beyond the ranking,
queries only in the run or only in the qrels; equal to 1e-12 per query and on average."""

from __future__ import annotations

import random

import pytest

from bertjax.retrieval import ranking_metrics
from bertjax.retrieval.trec_format import ranked

pytrec_eval = pytest.importorskip("pytrec_eval")

# Ids whose byte order differs from numeric and case order, and non-ASCII ones.
DOC_IDS = [f"d{i}" for i in range(40)] + ["D7", "a", "b", "é1", "z", "Z9", "10", "9", "d-1", "ü"]


def _generated(seed: int):
    """(qrels, run) with many tied scores, relevance -1..3, and awkward queries."""
    rng = random.Random(seed)
    qrels, run = {}, {}
    for q in range(rng.randint(1, 25)):
        qid = f"q{q}"
        kind = rng.random()
        if kind < 0.85:  # judged
            judged = rng.sample(DOC_IDS, rng.randint(1, 12))
            qrels[qid] = {d: rng.choice([-1, 0, 0, 1, 1, 2, 3]) for d in judged}
        if kind < 0.05:  # judged, every judgement non-relevant
            qrels[qid] = {d: 0 for d in qrels[qid]}
        if kind > 0.95 and qrels.get(qid):
            continue  # judged, absent from the run
        size = rng.choice([0, 1, 3, 7, 15, 40, len(DOC_IDS)])
        levels = rng.choice([2, 3, 5, 1000])  # few levels: many ties
        run[qid] = {d: rng.randrange(levels) / 4.0 - 1.0 for d in rng.sample(DOC_IDS, size)}
    run.setdefault("unjudged-query", {"d1": 1.0})
    return qrels, run


def _reference(qrels, run, cutoffs=(1, 3, 5, 10, 100)):
    """pytrec_eval's values under our names; mrr@k from P_1..P_k (the first cutoff with a
    relevant document), which does not rely on our tie order."""
    cuts = ",".join(map(str, cutoffs))
    p_cuts = ",".join(map(str, range(1, max(cutoffs) + 1)))
    names = {f"ndcg_cut.{cuts}", f"recall.{cuts}", f"map_cut.{cuts}", f"P.{p_cuts}"}
    results = pytrec_eval.RelevanceEvaluator(qrels, names).evaluate(run)
    out = {}
    for qid, values in results.items():
        first = next((i for i in range(1, max(cutoffs) + 1) if values[f"P_{i}"] > 0), None)
        out[qid] = {}
        for k in cutoffs:
            out[qid][f"ndcg@{k}"] = values[f"ndcg_cut_{k}"]
            out[qid][f"recall@{k}"] = values[f"recall_{k}"]
            out[qid][f"map@{k}"] = values[f"map_cut_{k}"]
            out[qid][f"mrr@{k}"] = 1.0 / first if first is not None and first <= k else 0.0
    return out


MEASURES = [f"{kind}@{k}" for kind in ("ndcg", "recall", "map", "mrr") for k in (1, 3, 5, 10, 100)]


@pytest.mark.parametrize("seed", range(60))
def test_equal_to_pytrec_eval_on_generated_runs(seed):
    qrels, run = _generated(seed)
    expected = _reference(qrels, run)
    ours = ranking_metrics.per_query(qrels, run, MEASURES)
    assert ours.keys() == expected.keys()  # the judged queries of the run, empty rankings too
    for qid in expected:
        for name in MEASURES:
            assert ours[qid][name] == pytest.approx(expected[qid][name], abs=1e-12), (qid, name)
    if not expected:
        return
    means = ranking_metrics.evaluate(qrels, run, MEASURES)
    for name in MEASURES:
        reference = sum(v[name] for v in expected.values()) / len(expected)
        assert means[name] == pytest.approx(reference, abs=1e-12), name


@pytest.mark.parametrize("seed", range(20))
def test_mrr_is_pytrec_eval_recip_rank_of_the_ranking_cut_at_k(seed):
    qrels, run = _generated(1000 + seed)
    for k in (1, 10):
        cut = {qid: dict(ranked(docs)[:k]) for qid, docs in run.items()}
        expected = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(cut)
        ours = ranking_metrics.per_query(qrels, run, [f"mrr@{k}"])
        for qid in expected:
            assert ours[qid][f"mrr@{k}"] == pytest.approx(expected[qid]["recip_rank"], abs=1e-12)


def test_mrr_equals_mtebs_loop_without_ties():
    """MTEB's MRR@k: sort by score (Python's stable sort), the first document judged > 0 in the top
    k, averaged over the run's queries; restated here, equal when no scores tie."""
    rng = random.Random(7)
    qrels = {f"q{i}": {d: rng.choice([0, 1, 2]) for d in rng.sample(DOC_IDS, 5)} for i in range(30)}
    run = {qid: {d: rng.random() for d in rng.sample(DOC_IDS, 20)} for qid in qrels}
    rrs = []
    for qid, docs in run.items():
        top = sorted(docs.items(), key=lambda item: item[1], reverse=True)[:10]
        hits = [rank for rank, (d, _) in enumerate(top) if qrels[qid].get(d, 0) > 0]
        rrs.append(1.0 / (hits[0] + 1) if hits else 0.0)
    assert ranking_metrics.evaluate(qrels, run, ["mrr@10"])["mrr@10"] == pytest.approx(
        sum(rrs) / len(rrs), abs=1e-12
    )


def test_ties_are_ranked_by_document_id_descending_as_trec_eval_does():
    for ids in (["a", "b"], ["a10", "a9"], ["B", "a"], ["é", "z"], ["d1", "d10", "d2"]):
        winner = max(ids)  # by code point = UTF-8 byte order
        qrels = {"q": {winner: 1}}
        run = {"q": dict.fromkeys(ids, 0.5)}
        expected = pytrec_eval.RelevanceEvaluator(qrels, {"P.1"}).evaluate(run)["q"]["P_1"]
        assert expected == 1.0 and ranking_metrics.evaluate(qrels, run, ["mrr@1"])["mrr@1"] == 1.0


def test_the_reported_measures_and_their_pytrec_eval_names():
    qrels = {"1": {"a": 2, "b": 1, "c": 0}, "2": {"x": 1}, "3": {"y": 0}}
    run = {"1": {"c": 3.0, "a": 2.0, "z": 2.0}, "2": {}, "3": {"y": 1.0}, "4": {"a": 1.0}}
    names = {"ndcg_cut.10", "recall.10,100", "recip_rank", "map_cut.100"}
    ref = pytrec_eval.RelevanceEvaluator(qrels, names).evaluate(run)
    assert set(ref) == {"1", "2", "3"}
    ours = ranking_metrics.evaluate(qrels, run)
    assert list(ours) == ["ndcg@10", "recall@10", "recall@100", "mrr@10", "map@100"]
    mapping = {
        "ndcg@10": "ndcg_cut_10",
        "recall@10": "recall_10",
        "recall@100": "recall_100",
        "mrr@10": "recip_rank",  # the rankings here are shorter than 10
        "map@100": "map_cut_100",
    }
    for ours_name, ref_name in mapping.items():
        reference = sum(v[ref_name] for v in ref.values()) / 3
        assert ours[ours_name] == pytest.approx(reference, abs=1e-12)


def test_bad_measure_names_and_nothing_to_average():
    for bad in ("ndcg", "ndcg@0", "p@10", "NDCG@10"):
        with pytest.raises(ValueError, match="unknown measure"):
            ranking_metrics.parse_measure(bad)
    with pytest.raises(ValueError, match="no query of the run has judgements"):
        ranking_metrics.evaluate({"q": {"a": 1}}, {"other": {"a": 1.0}})
