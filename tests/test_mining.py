"""Hard-negative mining (`bertjax.retrieval.mining`, `bertjax mine-negatives`): the negatives
bertjax mines equal sentence-transformers' ``util.mine_hard_negatives(..., use_faiss=False)`` on
the same model and data (tiny random BERT and ModernBERT sentence-transformers directories written
by the libraries; top sampling with range_min/range_max/margins/max_score/min_score, random
sampling with the same seed, both output layouts); the mined rows train the retrieval task; bad
input is a one-line error naming the file and line.

sentence-transformers' function takes a ``datasets.Dataset``; ``datasets`` (and the pandas it
needs) is not a test dependency, so ``_Table`` below stands in for the few parts of it the
function touches (columns, ``from_dict`` and ``to_pandas().groupby().count()``): the reference's
own mining code runs unchanged.
"""

import json
import random
import sys
import types
from collections import Counter

import numpy as np
import pytest
from helpers import WORDS, st_dir, tiny_hf
from train_fixtures import set_keys

import bertjax
from bertjax import train
from bertjax.commands import mine as mine_tool
from bertjax.retrieval import mining
from configs import retrieval as retrieval_config

torch = pytest.importorskip("torch")
pytest.importorskip("sentence_transformers")
from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.util import hard_negatives  # noqa: E402

TOL = 1e-5  # scores: bertjax's embeddings vs PyTorch's (fp32)
KINDS = ("bert", "modernbert")
EXTRA = ["cat", "bird", "fish", "tree", "red", "blue", "sun", "moon"]


class _Table:
    """The parts of ``datasets.Dataset`` (and of its ``to_pandas()``) that mine_hard_negatives
    uses."""

    def __init__(self, columns):
        self.columns = {name: list(values) for name, values in columns.items()}

    @classmethod
    def from_dict(cls, columns):
        return cls(columns)

    @property
    def column_names(self):
        return list(self.columns)

    def __len__(self):
        return len(next(iter(self.columns.values()), []))

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.columns[key]
        return {name: values[key] for name, values in self.columns.items()}

    def to_pandas(self):
        return self

    def groupby(self, column):
        self.by = column
        return self

    def count(self):
        return self

    def to_dict(self):  # rows per key (sorted, as pandas' groupby), for every other column
        counts = dict(sorted(Counter(self.columns[self.by]).items()))
        return {name: counts for name in self.columns if name != self.by}


@pytest.fixture
def reference(monkeypatch):
    """sentence-transformers' mining as bertjax rows: (pairs, model, corpus, **kwargs) -> rows."""
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(Dataset=_Table))
    monkeypatch.setattr(hard_negatives, "is_datasets_available", lambda: True)

    def mine(pairs, model, corpus, output_format="n-tuple", **kwargs):
        dataset = _Table({"query": [q for q, _ in pairs], "positive": [p for _, p in pairs]})
        out = hard_negatives.mine_hard_negatives(
            dataset,
            model,
            corpus=corpus,
            output_format=output_format,
            output_scores=True,
            use_faiss=False,
            verbose=False,
            **kwargs,
        )
        names = [c for c in out.column_names if c.startswith("negative")]
        return [
            {
                "query": row["query"],
                "positive": row["positive"],
                "negatives": [row[c] for c in names],
                "scores": row["scores"],
            }
            for row in out
        ]

    return mine


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (SentenceTransformer, bertjax model) of one directory: BERT with mean pooling;
    ModernBERT with CLS pooling, Normalize and query / document prompts."""
    root = tmp_path_factory.mktemp("mining")
    out = {}
    for kind in KINDS:
        hf = tiny_hf(root / f"hf_{kind}", kind)
        if kind == "bert":
            directory = st_dir(root / kind, hf, "mean")
        else:
            prompts = {"query": "query: ", "document": "passage: "}
            directory = st_dir(root / kind, hf, "cls", normalize=True, prompts=prompts)
        out[kind] = (
            SentenceTransformer(str(directory), device="cpu"),
            bertjax.load_pretrained(str(directory)),
            directory,
        )
    return out


@pytest.fixture(scope="module")
def data():
    """(pairs, corpus): 16 pairs of 14 queries (one query with two positives, one pair twice),
    46 documents (four positives among them, one twice), upper-case copies of six of them, which
    a lower-casing tokenizer embeds equally (exact ties), and a copy of query 0's positive."""
    rng = np.random.default_rng(0)
    words = WORDS + EXTRA
    docs = [" ".join(rng.choice(words, rng.integers(3, 9))) for _ in range(56)]
    pairs = [(" ".join(rng.choice(words, 3)), docs[i]) for i in range(14)]
    pairs += [(pairs[3][0], docs[20]), pairs[5]]
    corpus = docs[10:] + [docs[11]] + [d.upper() for d in docs[30:36]] + [docs[0].upper()]
    return pairs, corpus


def _assert_same(ours, theirs):
    """Row by row: the same query and positive, scores within TOL, the same negatives (or, at an
    exact tie, its other text: sentence-transformers' order among equal scores is torch.topk's,
    which is not defined). Returns how many tied texts took each other's place."""
    assert len(ours) == len(theirs)
    swapped = 0
    for a, b in zip(ours, theirs):
        assert (a["query"], a["positive"]) == (b["query"], b["positive"])
        assert len(a["negatives"]) == len(b["negatives"])
        np.testing.assert_allclose(a["scores"], b["scores"], atol=TOL)
        for x, y in zip(a["negatives"], b["negatives"]):
            if x != y:
                assert x.lower() == y.lower(), (a["query"], x, y)
                swapped += 1
    return swapped


SETTINGS = {
    "defaults": dict(num_negatives=3),
    "range": dict(range_min=2, range_max=15, num_negatives=4),
    "relative_margin": dict(relative_margin=0.05, num_negatives=5),
    "absolute_margin": dict(absolute_margin=0.02, range_max=40, num_negatives=3),
    "scores": dict(max_score=0.95, min_score=0.9, num_negatives=2),
}
GUARDS = ("absolute_margin", "relative_margin", "max_score", "min_score")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_top_negatives_equal_sentence_transformers(models, data, reference, kind, setting):
    st_model, model, _ = models[kind]
    pairs, corpus = data
    kwargs = SETTINGS[setting]
    want = reference(pairs, st_model, corpus, **kwargs)
    got = mining.mine_hard_negatives(pairs, model, corpus=corpus, batch_size=16, **kwargs)
    _assert_same(got.rows, want)
    assert len(got.rows) + got.too_few >= 1
    assert all(got.skipped[k] > 0 for k in GUARDS if k in kwargs)  # each guard had work
    if got.too_few:  # n-tuple drops those rows; keep_incomplete keeps them with fewer negatives
        kept = mining.mine_hard_negatives(
            pairs, model, corpus=corpus, keep_incomplete=True, batch_size=16, **kwargs
        )
        full = [r for r in kept.rows if len(r["negatives"]) == kwargs["num_negatives"]]
        assert full == got.rows and len(kept.rows) > len(got.rows)


@pytest.mark.parametrize("kind", KINDS)
def test_triplets_and_random_sampling_equal_sentence_transformers(models, data, reference, kind):
    st_model, model, _ = models[kind]
    pairs, corpus = data
    kwargs = dict(range_min=1, num_negatives=3, absolute_margin=0.001)
    want = reference(pairs, st_model, corpus, output_format="triplet", **kwargs)
    got = mining.mine_hard_negatives(pairs, model, corpus=corpus, output_format="triplet", **kwargs)
    _assert_same(got.rows, want)
    assert all(len(r["negatives"]) == 1 and len(r["scores"]) == 2 for r in got.rows)
    # random: sentence-transformers draws with the random module, bertjax with Random(seed)
    kwargs = dict(range_max=20, num_negatives=4, sampling_strategy="random")
    random.seed(7)
    want = reference(pairs, st_model, corpus, **kwargs)
    kwargs["sampling"] = kwargs.pop("sampling_strategy")
    got = mining.mine_hard_negatives(pairs, model, corpus=corpus, seed=7, **kwargs)
    _assert_same(got.rows, want)
    top = mining.mine_hard_negatives(pairs, model, corpus=corpus, range_max=20, num_negatives=4)
    assert [r["negatives"] for r in got.rows] != [r["negatives"] for r in top.rows]


def test_ties_and_shared_queries(models, data, reference):
    """The upper-case copies tie exactly with their originals; sentence-transformers' order
    among them is torch's (undefined), bertjax's the corpus order. A query with two positives
    never gets either as a negative; the duplicated pair is one row; a copy of a positive is a
    negative (a false one) with the positive's score."""
    st_model, model, _ = models["bert"]
    pairs, corpus = data
    got = mining.mine_hard_negatives(pairs, model, corpus=corpus, num_negatives=8)
    swapped = _assert_same(got.rows, reference(pairs, st_model, corpus, num_negatives=8))
    assert got.num_queries == 14 and len(got.positive_scores) == 15 and len(got.rows) == 15
    assert swapped == 0 or swapped >= 2  # ties swap in pairs
    docs = list(dict.fromkeys(corpus + [p for _, p in pairs]))
    for row in got.rows:
        for text in row["negatives"]:
            twin = [d for d in docs if d.lower() == text.lower() and d != text]
            if twin and twin[0] in row["negatives"]:  # a tie inside the row: original first
                first = row["negatives"].index(min(text, twin[0], key=docs.index))
                assert first < row["negatives"].index(max(text, twin[0], key=docs.index))
    two = [r for r in got.rows if r["query"] == pairs[3][0]]
    assert len(two) == 2 and [r["positive"] for r in two] == [pairs[3][1], pairs[14][1]]
    assert two[0]["negatives"] == two[1]["negatives"]
    assert not {pairs[3][1], pairs[14][1]} & set(two[0]["negatives"])
    upper_of_own = pairs[0][1].upper()  # a copy of query 0's positive: a "false negative" on top
    at = got.rows[0]["negatives"].index(upper_of_own)
    assert got.rows[0]["scores"][1 + at] == pytest.approx(got.rows[0]["scores"][0], abs=1e-6)


def test_a_plain_embed_function_gives_the_same_rows(models, data, reference):
    """``model`` may be ``embed(texts, batch_size)``: here sentence-transformers' own encode, so
    the scores agree to float32 rounding."""
    st_model, _, _ = models["bert"]
    pairs, corpus = data
    kwargs = dict(range_min=1, range_max=12, num_negatives=3)
    got = mining.mine_hard_negatives(
        pairs,
        lambda texts, batch_size: st_model.encode(texts, batch_size=batch_size),
        corpus=corpus,
        **kwargs,
    )
    want = reference(pairs, st_model, corpus, **kwargs)
    _assert_same(got.rows, want)
    for a, b in zip(got.rows, want):
        np.testing.assert_allclose(a["scores"], b["scores"], atol=1e-6)


# ---- the command, and a second training round on what it wrote --------------------------------
def _beir(root, docs: list[str], queries: list[str]):
    """A BEIR folder: query i is judged relevant to document i; train: 0-7, test: 8-11."""
    root.mkdir()
    with open(root / "corpus.jsonl", "w") as f:
        for i, text in enumerate(docs):
            f.write(json.dumps({"_id": f"d{i}", "title": "", "text": text}) + "\n")
    with open(root / "queries.jsonl", "w") as f:
        for i, text in enumerate(queries):
            f.write(json.dumps({"_id": f"q{i}", "text": text}) + "\n")
    (root / "qrels").mkdir()
    for split, ids in (("train", range(8)), ("test", range(8, 12))):
        lines = ["query-id\tcorpus-id\tscore"] + [f"q{i}\td{i}\t1" for i in ids]
        lines += ["q0\td99\t1"] if split == "train" else []  # not in the corpus: a warning
        (root / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_mined_rows_train_the_retrieval_task(models, tmp_path, capsys, kind):
    _, model, directory = models[kind]
    rng = np.random.default_rng(1)
    words = WORDS + EXTRA
    docs = [" ".join(rng.choice(words, 6)) for _ in range(30)]
    folder = _beir(tmp_path / "beir", docs, [" ".join(d.split()[:3]) for d in docs[:12]])
    out = tmp_path / "rows.jsonl"
    mine_tool.main(
        [
            f"--checkpoint={directory}",
            f"--data={folder}",
            f"--output={out}",
            "--num_negatives=2",
            "--range_min=1",
            "--batch_size=8",
        ]
    )
    err = capsys.readouterr().err
    assert "1 judged documents of train are not in the corpus" in err
    assert f"wrote 8 rows (n-tuple) to {out}" in err and "mean score: positive" in err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    pairs, corpus, missing = mining.beir_pairs(str(folder), "train")
    assert missing == 1 and len(pairs) == 8
    want = mining.mine_hard_negatives(
        pairs, model, corpus=corpus, num_negatives=2, range_min=1, batch_size=8
    )
    assert rows == json.loads(json.dumps(want.rows))
    c = retrieval_config.get_config()
    set_keys(
        c,
        {
            "init_checkpoint": str(directory),
            "data_dir": str(folder),
            "data.train_file": str(out),
            "data.num_negatives": 2,
            "data.max_seq_length": 24,
            "data.max_query_length": 16,
            "train.global_batch_size": 4,
            "train.steps": 2,
            "train.log_every": 1,
            "train.checkpoint_every": 100,
            "train.async_checkpoints": False,
            "optimizer.warmup_proportion": 0.0,
            "optimizer.warmup_steps": 0,
            "optimizer.learning_rate": 1e-3,
            "tensorboard": False,
            "mesh.num_devices": 1,
        },
    )
    task = train.prepared_task(c, str(tmp_path / "run"))
    assert task.train_features["doc_valid"].sum() == 8 * 3  # every row: positive + 2 negatives
    result = train.train_and_evaluate(c, str(tmp_path / "run"))
    assert result["step"] == 2 and np.isfinite(result["train"]["loss"])


# ---- bad input -------------------------------------------------------------------------------
def _write(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


@pytest.mark.parametrize(
    "lines, message",
    [
        ([{"query": "a", "positive": "b"}, {"query": "c"}], r"pairs.jsonl:2: no 'positive' key"),
        ([{"query": "  ", "positive": "b"}], r"pairs.jsonl:1: empty 'query'"),
        ([{"query": "a", "positive": 3}], r"pairs.jsonl:1: 'positive' is not a string"),
        (["", "{not json"], r"pairs.jsonl:2: invalid JSON"),
        (["[1, 2]"], r"pairs.jsonl:1: expected a JSON object"),
        ([""], r"pairs.jsonl: no \(query, positive\) pairs"),
        (
            [{"query": "a", "positive": "b"}, {"query": "a", "positive": "z"}],
            r"pairs.jsonl:2: the positive is not a document of .*corpus.jsonl",
        ),
    ],
)
def test_bad_pairs_are_one_line_errors_naming_the_line(tmp_path, lines, message):
    corpus = mining.read_corpus(_write(tmp_path / "corpus.jsonl", [{"text": "b"}, {"text": "c"}]))
    with pytest.raises(ValueError, match=message):
        mining.read_pairs(_write(tmp_path / "pairs.jsonl", lines), corpus, "corpus.jsonl")


def test_bad_corpus_files_and_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"corpus.jsonl:2: no 'text' key"):
        mining.read_corpus(_write(tmp_path / "corpus.jsonl", [{"text": ""}, {"title": "t"}]))
    with pytest.raises(FileNotFoundError, match=r"nope.jsonl: no such file"):
        mining.read_pairs(str(tmp_path / "nope.jsonl"))
    titled = _write(tmp_path / "c.jsonl", [{"title": "T", "text": "x"}])
    assert mining.read_corpus(titled) == ["T x"]
    embed = lambda texts, batch_size: np.ones((len(texts), 4))  # noqa: E731
    pairs = [("q", "d")]
    for kwargs, message in [
        (dict(range_min=5, range_max=5), r"range_min=5 must be smaller than range_max=5"),
        (dict(range_max=4, num_negatives=5), r"cannot mine 5 negatives per query: only 4"),
        (dict(num_negatives=0), r"num_negatives must be at least 1"),
        (dict(sampling="best"), r"sampling must be one of"),
        (dict(query_prompt="q: "), r"prompts need a loaded model"),
    ]:
        with pytest.raises(ValueError, match=message):
            mining.mine_hard_negatives(pairs, embed, **kwargs)
    with pytest.raises(ValueError, match=r"no \(query, positive\) pairs"):
        mining.mine_hard_negatives([], embed)
    one = _write(tmp_path / "one.jsonl", [{"query": "a", "positive": "b"}])
    args = ["--checkpoint=/no/model", f"--pairs={one}", "--output=o.jsonl", "--range_min=4"]
    with pytest.raises(ValueError, match="range_min=4 must be smaller than range_max=3"):
        mine_tool.main([*args, "--range_max=3"])  # checked before the model loads
    with pytest.raises(ValueError, match="either --data=BEIR_DIR or --pairs"):
        mine_tool.main(["--checkpoint=x", "--output=o.jsonl"])
    with pytest.raises(ValueError, match="--corpus goes with --pairs"):
        mine_tool.main(["--checkpoint=x", "--data=d", "--corpus=c", "--output=o.jsonl"])


def test_a_beir_query_without_text_is_an_error(tmp_path):
    folder = _beir(tmp_path / "beir", [f"doc {i}" for i in range(12)], ["a"] * 3 + [" "] * 9)
    with pytest.raises(ValueError, match=r"queries.jsonl:4: query 'q3' is empty"):
        mining.beir_pairs(str(folder), "train")


def test_the_command_writes_rows_atomically_from_pairs(models, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("BERTJAX_PROGRESS_SECONDS", "0")  # a progress line for every batch
    _, _, directory = models["bert"]
    docs = ["the lazy dog", "quick brown fox", "a red bird", "blue moon", "sun and tree", "fish"]
    records = [{"_id": str(i), "text": d} for i, d in enumerate(docs)]
    corpus = _write(tmp_path / "corpus.jsonl", records)
    pairs = _write(
        tmp_path / "pairs.jsonl",
        [{"query": "dog", "positive": docs[0]}, {"query": "fox", "positive": docs[1]}],
    )
    out = tmp_path / "sub" / "rows.jsonl"
    mine_tool.main(
        [
            f"--checkpoint={directory}",
            f"--pairs={pairs}",
            f"--corpus={corpus}",
            f"--output={out}",
            "--num_negatives=2",
            "--format=triplet",
        ]
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and {r["query"] for r in rows} == {"dog", "fox"}
    assert all(r["negatives"][0] not in (docs[0], docs[1]) for r in rows)
    assert sorted(p.name for p in out.parent.iterdir()) == ["rows.jsonl"]  # no temporary left
    err = capsys.readouterr().err
    assert "wrote 4 rows (triplet)" in err
    for phase in ("embedding the corpus: 6/6 texts", "embedding queries: 2/2", "searching: 2/2"):
        assert f"bertjax: {phase}" in err, err
