"""TREC run / qrels files and BEIR folders: round trips, BEIR's conventions (title + " " + text,
judged queries only) and one-line errors naming the file and line."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import write_beir, write_text

from bertjax.retrieval import beir, trec_format


def test_run_round_trip_keeps_float32_scores_exactly_in_trec_order(tmp_path):
    scores = np.random.default_rng(0).random(50).astype(np.float32)
    run = {"q1": {f"d{i}": float(s) for i, s in enumerate(scores)}, "q2": {"a": 1.0, "b": 1.0}}
    trec_format.write_run(tmp_path / "run.trec", run, tag="test")
    lines = (tmp_path / "run.trec").read_text().splitlines()
    assert lines[-2:] == ["q2 Q0 b 1 1.0 test", "q2 Q0 a 2 1.0 test"]  # ties: id descending
    back = trec_format.read_run(tmp_path / "run.trec")
    assert back == run
    assert [d for d, _ in trec_format.ranked(back["q1"])] == [
        line.split()[2] for line in lines if line.startswith("q1 ")
    ]


def test_qrels_beir_tsv_and_trec_formats(tmp_path):
    beir_tsv = write_text(tmp_path / "a.tsv", "query-id\tcorpus-id\tscore\nq1\td 1\t2\nq1\td2\t0\n")
    trec = write_text(tmp_path / "b.txt", "q1 0 d1 2\nq1 0 d2 0\nq2 0 d3 1\nq2 0 d3 1\n")
    assert trec_format.read_qrels(beir_tsv) == {"q1": {"d 1": 2, "d2": 0}}
    assert trec_format.read_qrels(trec) == {"q1": {"d1": 2, "d2": 0}, "q2": {"d3": 1}}
    trec_format.write_qrels(tmp_path / "c.tsv", {"q": {"x": 1}})
    assert (tmp_path / "c.tsv").read_text() == "query-id\tcorpus-id\tscore\nq\tx\t1\n"


@pytest.mark.parametrize(
    "text,message",
    [
        ("q Q0 d 1 0.5\n", "run.trec:1: expected 6 fields"),
        ("q Q0 d 1 0.5 t\nq Q0 e 2 high t\n", "run.trec:2: score 'high' is not a number"),
        ("q Q0 d 1 nan t\n", "run.trec:1: score 'nan' is not finite"),
        ("q Q0 d 1 0.5 t\n\nq Q0 d 2 0.4 t\n", "run.trec:3: document 'd' appears twice .*line 1"),
    ],
)
def test_run_errors_name_file_and_line(tmp_path, text, message):
    path = write_text(tmp_path / "run.trec", text)
    with pytest.raises(ValueError, match=message):
        trec_format.read_run(path)


@pytest.mark.parametrize(
    "text,message",
    [
        ("query-id\tcorpus-id\tscore\nq\td\tyes\n", r"qrels.tsv:2: relevance 'yes' is not an int"),
        ("q\td\n", "qrels.tsv:1: expected 3 tab-separated fields"),
        ("q 0 d\n", "qrels.tsv:1: expected BEIR's"),
        ("q\td\t1\nq\td\t2\n", "qrels.tsv:2: query 'q' document 'd' judged 2 here and 1 at line 1"),
    ],
)
def test_qrels_errors_name_file_and_line(tmp_path, text, message):
    path = write_text(tmp_path / "qrels.tsv", text)
    with pytest.raises(ValueError, match=message):
        trec_format.read_qrels(path)
    with pytest.raises(FileNotFoundError, match="nope.tsv: no such file"):
        trec_format.read_qrels(tmp_path / "nope.tsv")


def test_beir_folder_texts_and_judged_queries(tmp_path):
    folder = write_beir(
        tmp_path / "set",
        [
            {"_id": "d1", "title": "Title", "text": "body "},
            {"_id": 2, "text": " no title"},
            {"_id": "d3", "title": "", "text": "x"},
        ],
        [
            {"_id": "q2", "text": "second"},
            {"_id": "q1", "text": "first"},
            {"_id": "q3", "text": "?"},
        ],
        {"q1": {"d1": 1}, "q2": {"2": 0, "d3": 2}},
    )
    data = beir.load(folder)
    assert data.doc_ids == ["d1", "2", "d3"]
    assert data.doc_texts == ["Title body", "no title", "x"]
    assert data.query_ids == ["q2", "q1"] and data.query_texts == ["second", "first"]  # q3 skipped
    assert data.qrels == {"q1": {"d1": 1}, "q2": {"2": 0, "d3": 2}}


@pytest.mark.parametrize(
    "corpus_text,message",
    [
        ('{"_id": "d1", "text": "a"}\nnot json\n', r"corpus.jsonl:2: invalid JSON"),
        ('{"_id": "d1", "text": "a"}\n{"text": "b"}\n', r"corpus.jsonl:2: no '_id' key"),
        (
            '{"_id": "d1", "text": "a"}\n{"_id": "d1", "text": "b"}\n',
            r"corpus.jsonl:2: id 'd1' again",
        ),
        ('{"_id": "d1", "text": 3}\n', r"corpus.jsonl:1: 'text' is not a string"),
    ],
)
def test_beir_errors_name_file_and_line(tmp_path, corpus_text, message):
    folder = write_beir(tmp_path / "set", [], [{"_id": "q", "text": "t"}], {"q": {"d1": 1}})
    write_text(folder / "corpus.jsonl", corpus_text)
    with pytest.raises(ValueError, match=message):
        beir.load(folder)


def test_beir_missing_split_and_unknown_judged_query(tmp_path):
    folder = write_beir(tmp_path / "set", [{"_id": "d", "text": "t"}], [], {"q": {"d": 1}})
    with pytest.raises(FileNotFoundError, match=r"dev.tsv: no such file \(splits in .*: test\)"):
        beir.load(folder, "dev")
    with pytest.raises(ValueError, match=r"1 judged queries are not in .*queries.jsonl"):
        beir.load(folder)
    with pytest.raises(FileNotFoundError, match="missing: no such folder"):
        beir.load(tmp_path / "missing")


@pytest.mark.shared_data
def test_real_beir_sets_load_with_their_published_counts(shared_data):
    root = shared_data / "retrieval"
    if not (root / "scifact").is_dir():
        pytest.skip(f"{root / 'scifact'} is missing")
    scifact = beir.load(root / "scifact", "test")
    assert (len(scifact.doc_ids), len(scifact.query_ids)) == (5183, 300)
    assert sum(len(d) for d in scifact.qrels.values()) == 339
    cisi = beir.load(root / "cisi")
    assert len(cisi.query_ids) == 76  # the 36 unjudged queries skipped
