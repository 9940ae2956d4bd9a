"""`bertjax evaluate retrieval`: a run file scored as pytrec_eval scores it; a model on a BEIR folder
embedded, searched and scored as BEIR does it (brute-force scores, identical ids popped,
pytrec_eval); without TensorFlow; and the real all-MiniLM-L6-v2 on a SciFact subset against
sentence-transformers + pytrec_eval."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from helpers import minilm_directory, write_beir

import bertjax
from bertjax.commands import score
from bertjax.retrieval import beir, ranking_metrics, search, trec_format
from bertjax.retrieval import evaluate as retrieval

pytrec_eval = pytest.importorskip("pytrec_eval")

REPO = pathlib.Path(__file__).resolve().parent.parent
KEYS = ["ndcg@10", "recall@10", "recall@100", "mrr@10", "map@100"]
PYTREC = {"ndcg_cut.10", "recall.10,100", "map_cut.100", "P.1,2,3,4,5,6,7,8,9,10"}


def pytrec_means(qrels, run) -> dict[str, float]:
    """pytrec_eval's per-query values averaged as BEIR does; mrr@10 from P_1..P_10."""
    results = pytrec_eval.RelevanceEvaluator(qrels, PYTREC).evaluate(run)
    rows = []
    for v in results.values():
        first = next((i for i in range(1, 11) if v[f"P_{i}"] > 0), None)
        rows.append(
            [v["ndcg_cut_10"], v["recall_10"], v["recall_100"], 1 / first if first else 0.0]
            + [v["map_cut_100"]]
        )
    return dict(zip(KEYS, np.mean(rows, axis=0).tolist()))


def letter_counts(texts, batch_size=32):
    """A stand-in embedder: counts of a-z (integers: exact dot products, many ties)."""
    out = np.zeros((len(texts), 26), np.float32)
    for i, text in enumerate(texts):
        for c in text.lower():
            if "a" <= c <= "z":
                out[i, ord(c) - 97] += 1
    return out


def _toy_set(tmp_path, n_docs=160, seed=0):
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "zeta", "omega", "sigma"]
    corpus = []
    for i in range(n_docs):
        text = " ".join(rng.choice(words, rng.integers(1, 6)))
        corpus.append({"_id": f"d{i}", "title": str(rng.choice(words)), "text": text})
    corpus[7] = dict(corpus[3], _id="d7")  # a duplicate: exact ties
    queries = [{"_id": f"q{i}", "text": " ".join(rng.choice(words, 3))} for i in range(25)]
    queries.append({"_id": "d5", "text": corpus[5]["title"] + " " + corpus[5]["text"]})  # ArguAna
    queries.append({"_id": "unjudged", "text": "alpha"})
    qrels = {
        q["_id"]: {f"d{j}": int(rng.integers(0, 3)) for j in rng.choice(n_docs, 4, replace=False)}
        for q in queries[:-1]
    }
    qrels["d5"]["d5"] = 2  # judged relevant to itself: BEIR still drops it from the results
    return write_beir(tmp_path / "toy", corpus, queries, qrels)


def beir_reference(data: beir.BeirSet, similarity: str) -> dict[str, float]:
    """BEIR's procedure: every document scored (NumPy), identical ids popped, pytrec_eval."""
    q, c = letter_counts(data.query_texts), letter_counts(data.doc_texts)
    if similarity == "cosine":
        q, c = search.normalize(q), search.normalize(c)
    scores = q @ c.T
    results = {
        qid: {d: float(s) for d, s in zip(data.doc_ids, row) if d != qid}
        for qid, row in zip(data.query_ids, scores)
    }
    return pytrec_means(data.qrels, results)


def test_a_run_file_scores_as_pytrec_eval(tmp_path, capsys):
    rng = np.random.default_rng(1)
    qrels = {f"q{i}": {f"d{j}": int(rng.integers(0, 3)) for j in range(0, 40, 3)} for i in range(9)}
    run = {f"q{i}": {f"d{j}": float(rng.integers(0, 4)) for j in range(150)} for i in range(8)}
    run["extra"] = {"d1": 1.0}
    trec_format.write_qrels(tmp_path / "qrels.tsv", qrels)
    trec_format.write_run(tmp_path / "run.trec", run)
    assert (
        score.main(["retrieval", f"--qrels={tmp_path}/qrels.tsv", f"--run={tmp_path}/run.trec"])
        == 0
    )
    out, err = capsys.readouterr()
    printed = json.loads(out)
    assert list(printed) == KEYS
    expected = pytrec_means(qrels, run)
    for key in KEYS:
        assert printed[key] == pytest.approx(expected[key], abs=1e-12), key
    assert "1 judged queries have no line in the run" in err  # q8: not counted, as pytrec_eval


@pytest.mark.parametrize("similarity", ["dot", "cosine"])
def test_beir_end_to_end_equals_beirs_procedure(tmp_path, similarity):
    data = beir.load(_toy_set(tmp_path))
    assert "unjudged" not in data.query_ids and "d5" in data.query_ids
    found = retrieval.retrieve(letter_counts, data, top_k=100, similarity=similarity)
    assert set(found.run) == set(data.query_ids)
    assert all(len(docs) == 100 for docs in found.run.values())  # 101 searched, self dropped
    assert "d5" not in found.run["d5"]
    ours = ranking_metrics.evaluate(data.qrels, found.run)
    reference = beir_reference(data, similarity)
    if similarity == "dot":  # integer scores: the same ranking, ties included
        for key in KEYS:
            assert ours[key] == pytest.approx(reference[key], abs=1e-12), key
    else:  # float32 rounding may order near-ties differently
        for key in KEYS:
            assert ours[key] == pytest.approx(reference[key], abs=0.02), key
    # the search returns each query's documents in trec_eval's order, ties (d3 = d7) included
    for docs in found.run.values():
        assert list(docs) == [d for d, _ in trec_format.ranked(docs)]


def test_corpus_is_embedded_longest_first_and_returned_in_order():
    seen = []

    def embed(texts, batch_size):
        seen.extend(texts)
        return np.array([[len(t)] for t in texts], np.float32)

    texts = ["bb", "a", "dddd", "ccc"]
    out = retrieval.embed_longest_first(embed, texts, 2)
    assert seen == ["dddd", "ccc", "bb", "a"]
    np.testing.assert_array_equal(out[:, 0], [2, 1, 4, 3])


class _FakeModel:
    embed = staticmethod(letter_counts)


def test_the_command_end_to_end_writes_a_run_that_scores_the_same(tmp_path, capsys, monkeypatch):
    folder = _toy_set(tmp_path)
    monkeypatch.setattr(bertjax, "load_pretrained", lambda path, quiet=False: _FakeModel())
    run_path = tmp_path / "out.trec"
    args = ["retrieval", "--checkpoint=fake", f"--data={folder}", f"--output_run={run_path}"]
    monkeypatch.setenv("BERTJAX_PROGRESS_SECONDS", "0")  # a progress line for every batch
    assert score.main([*args, "--similarity=dot"]) == 0
    out, err = capsys.readouterr()
    printed = json.loads(out)  # the progress went to stderr
    assert list(printed) == KEYS and "26 judged queries, 160 documents" in err
    assert "bertjax: searching: 26/26 queries (100%)" in err  # (the fake model's embed counts none)
    reference = beir_reference(beir.load(folder), "dot")
    assert printed == pytest.approx(reference, abs=1e-12)
    score.main(["retrieval", f"--qrels={folder}/qrels/test.tsv", f"--run={run_path}"])
    assert json.loads(capsys.readouterr().out) == printed


@pytest.mark.parametrize(
    "args,message",
    [
        (["--qrels=x"], "either --qrels=FILE --run=FILE"),
        (["--qrels=x", "--run=y", "--data=z"], "either --qrels=FILE --run=FILE"),
        (["--data=z"], "--checkpoint=MODEL and --data=BEIR_DIR go together"),
        (["--checkpoint=m", "--data=z", "--top_k=10"], "--top_k must be at least 100"),
        (["--qrels=nope.tsv", "--run=nope.trec"], "nope.tsv: no such file"),
    ],
)
def test_usage_errors_are_one_line_with_status_2(args, message, capsys):
    with pytest.raises(SystemExit) as exited:
        score.main(["retrieval", *args])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_scoring_a_run_needs_no_tensorflow(tmp_path):
    trec_format.write_qrels(tmp_path / "qrels.tsv", {"q": {"a": 1, "b": 2}})
    trec_format.write_run(tmp_path / "run.trec", {"q": {"a": 2.0, "b": 1.0, "c": 3.0}})
    code = (
        "import sys; from bertjax import cli; "
        "from bertjax.retrieval import search, evaluate, beir, ranking_metrics; "
        "cli.main(['bertjax', 'evaluate', 'retrieval', sys.argv[1], sys.argv[2]]); "
        "assert not [m for m in sys.modules if m.startswith('tensorflow')]"
    )
    env = dict(
        os.environ,
        PYTHONPATH=f"{REPO / 'tests' / 'no_tensorflow'}{os.pathsep}{REPO}",
        JAX_PLATFORMS="cpu",
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, f"--qrels={tmp_path}/qrels.tsv", f"--run={tmp_path}/run.trec"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = pytrec_means({"q": {"a": 1, "b": 2}}, {"q": {"a": 2.0, "b": 1.0, "c": 3.0}})
    assert json.loads(proc.stdout) == pytest.approx(expected, abs=1e-12)


@pytest.mark.slow
@pytest.mark.shared_data
def test_real_minilm_on_a_scifact_subset_equals_sentence_transformers(shared_data):
    """20 judged SciFact test claims against their relevant abstracts and 20 others: our
    embed + search + metrics vs sentence-transformers' encode, cosine in NumPy and pytrec_eval.
    (The corpus costs the CPU time: about 45 abstracts of up to 256 tokens through both models.)"""
    st = pytest.importorskip("sentence_transformers")

    folder = shared_data / "retrieval" / "scifact"
    if not folder.is_dir():
        pytest.skip(f"{folder} is missing")
    directory = minilm_directory()
    model = bertjax.load_pretrained(str(directory), quiet=True)
    full = beir.load(folder, "test")
    query_ids = full.query_ids[:20]
    keep = {d for q in query_ids for d in full.qrels[q]}
    keep |= set(full.doc_ids[:20])
    rows = [i for i, d in enumerate(full.doc_ids) if d in keep]
    data = beir.BeirSet(
        doc_ids=[full.doc_ids[i] for i in rows],
        doc_texts=[full.doc_texts[i] for i in rows],
        query_ids=query_ids,
        query_texts=full.query_texts[:20],
        qrels={q: full.qrels[q] for q in query_ids},
    )
    ours = ranking_metrics.evaluate(data.qrels, retrieval.retrieve(model.embed, data).run)
    reference_model = st.SentenceTransformer(str(directory), device="cpu")
    q = reference_model.encode(data.query_texts, normalize_embeddings=True)
    c = reference_model.encode(data.doc_texts, normalize_embeddings=True, batch_size=32)
    scores = q.astype(np.float64) @ c.T.astype(np.float64)
    results = {
        qid: {d: float(s) for d, s in zip(data.doc_ids, row) if d != qid}
        for qid, row in zip(data.query_ids, scores)
    }
    reference = pytrec_means(data.qrels, results)
    assert ours == pytest.approx(reference, abs=1e-3)
