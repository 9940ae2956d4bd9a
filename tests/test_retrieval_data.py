"""The retrieval task's training rows: JSON lines, Parquet and TSV read alike, errors name the
file and row, and batches hold no text twice exactly as sentence-transformers'
``NoDuplicatesBatchSampler`` arranges them."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bertjax.retrieval.bi_encoder.task import no_duplicate_batches, read_training_rows

torch = pytest.importorskip("torch")
pytest.importorskip("sentence_transformers")
from sentence_transformers.base.sampler import NoDuplicatesBatchSampler  # noqa: E402

ROWS = [
    {"query": "what is a fox", "positive": "a fox is an animal", "negatives": ["a dog", "a cat"]},
    {"query": "why", "positive": "because", "negatives": []},
    {"query": "where", "positive": "here", "negatives": ["there"]},
]
WANT = [(r["query"], r["positive"], r["negatives"]) for r in ROWS]


def test_json_lines_parquet_and_tsv_give_the_same_rows(tmp_path):
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")
    assert read_training_rows(str(jsonl)) == WANT
    table = pa.table({k: [r[k] for r in ROWS] for k in ("query", "positive", "negatives")})
    pq.write_table(table, tmp_path / "rows.parquet")
    assert read_training_rows(str(tmp_path / "rows.parquet")) == WANT
    # sentence-transformers' column names: anchor, positive, negative_1, negative_2
    st_columns = {
        "anchor": [r["query"] for r in ROWS],
        "positive": [r["positive"] for r in ROWS],
        "negative_1": [(r["negatives"] + [None, None])[0] for r in ROWS],
        "negative_2": [(r["negatives"] + [None, None])[1] for r in ROWS],
    }
    pq.write_table(pa.table(st_columns), tmp_path / "st.parquet")
    assert read_training_rows(str(tmp_path / "st.parquet")) == WANT
    lines = ["query\tpositive\tnegative"]
    lines += ["\t".join([r["query"], r["positive"], *r["negatives"]]) for r in ROWS]
    (tmp_path / "rows.tsv").write_text("\n".join(lines) + "\n")
    assert read_training_rows(str(tmp_path / "rows.tsv")) == WANT


@pytest.mark.parametrize(
    "name, content, message",
    [
        (
            "a.jsonl",
            '{"query": "q", "positive": "p"}\n{"query": "q"}\n',
            r"a.jsonl:2: no 'positive'",
        ),
        ("b.jsonl", '{"query": "q", "positive": "p"}\nnot json\n', r"b.jsonl:2: invalid JSON"),
        ("c.jsonl", '{"query": "  ", "positive": "p"}\n', r"c.jsonl:1: empty query"),
        ("d.jsonl", '{"query": "q", "positive": 3}\n', r"d.jsonl:1: .* must be strings"),
        ("e.tsv", "q\tp\nonly one field\n", r"e.tsv:2: 1 field"),
        ("f.jsonl", "\n\n", r"f.jsonl: no training rows"),
    ],
)
def test_bad_rows_are_one_line_naming_the_file_and_row(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        read_training_rows(str(tmp_path / name))
    assert "\n" not in str(err.value)


def test_a_parquet_row_without_a_query_names_its_row(tmp_path):
    pq.write_table(pa.table({"text": ["a"], "positive": ["b"]}), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match=r"x.parquet: row 1: no 'query \(or anchor\)'"):
        read_training_rows(str(tmp_path / "x.parquet"))


class _Rows:
    """The dataset interface NoDuplicatesBatchSampler reads: column names and rows by index."""

    def __init__(self, rows):
        self.rows = rows
        self.column_names = list(rows[0])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


@pytest.mark.parametrize("seed, batch_size", [(0, 4), (3, 5), (7, 6)])
def test_batches_hold_no_text_twice_as_sentence_transformers_arranges_them(seed, batch_size):
    """Texts drawn from a small pool (many repeats across rows): the same shuffled order gives
    sentence-transformers' batches, one after the other, and no full batch repeats a text."""
    rng = np.random.default_rng(seed)
    pool = [f"text {i}" for i in range(30)]
    rows = [
        dict(zip(("anchor", "positive", "negative"), rng.choice(pool, 3, replace=False)))
        for _ in range(50)
    ]
    sampler = NoDuplicatesBatchSampler(
        _Rows(rows), batch_size, drop_last=False, generator=torch.Generator(), seed=seed
    )
    batches = list(sampler)
    want = [i for batch in batches for i in batch]
    generator = torch.Generator()
    generator.manual_seed(seed)  # the sampler's epoch 0
    order = torch.randperm(len(rows), generator=generator, dtype=torch.int32).numpy()
    texts = [frozenset(r.values()) for r in rows]
    got = no_duplicate_batches(order, texts, batch_size)
    assert got.tolist() == want
    leading_full = next(i for i, b in enumerate(batches + [[]]) if len(b) < batch_size)
    assert leading_full >= 2
    for start in range(0, leading_full * batch_size, batch_size):  # the trainer's batches
        seen = [t for i in got[start : start + batch_size] for t in texts[i]]
        assert len(seen) == len(set(seen))


def _beir(root, queries, corpus, qrels):
    root.mkdir()
    (root / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (root / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in corpus))
    (root / "qrels").mkdir()
    (root / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + qrels)
    return root


def test_beir_an_empty_query_names_its_line_and_absent_documents_are_counted(tmp_path, caplog):
    from bertjax.retrieval import beir, ranking_metrics

    corpus = [{"_id": "d1", "text": "one"}, {"_id": "d2", "text": "two"}]
    queries = [{"_id": "q1", "text": "first"}, {"_id": "q2", "text": " "}]
    bad = _beir(tmp_path / "bad", queries, corpus, "q1\td1\t1\nq2\td2\t1\n")
    with pytest.raises(ValueError, match=r"queries.jsonl:2: query 'q2' is empty"):
        beir.load(bad)
    queries[1]["text"] = "second"
    qrels = "q1\td1\t1\nq1\tgone\t1\nq2\td2\t1\nq2\tlost\t1\n"
    data = beir.load(_beir(tmp_path / "ok", queries, corpus, qrels))
    assert "2 judgements name documents that" in caplog.text and "'gone'" in caplog.text
    # still relevant, as pytrec_eval counts them: each query finds 1 of its 2 relevant documents
    run = {"q1": {"d1": 2.0, "d2": 1.0}, "q2": {"d2": 2.0, "d1": 1.0}}
    assert ranking_metrics.evaluate(data.qrels, run)["recall@10"] == 0.5


def test_evaluate_searches_with_the_models_own_similarity():
    from types import SimpleNamespace

    from bertjax.commands.score import _model_similarity

    def model(name):
        return SimpleNamespace(embedding=SimpleNamespace(similarity_fn_name=name))

    assert _model_similarity(SimpleNamespace(embedding=None)) == "cosine"
    assert _model_similarity(model("dot")) == "dot"
    assert _model_similarity(model("cosine")) == "cosine"
    with pytest.raises(ValueError, match="'euclidean'.*--similarity"):
        _model_similarity(model("euclidean"))
