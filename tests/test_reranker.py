"""Cross-encoders in: ``load_pretrained(DIR).predict(pairs)`` equals ``CrossEncoder(DIR).predict``
(sigmoid of the one logit) and ``rerank_scores`` its raw logits, for directories written by
``CrossEncoder(...).save()`` (sentence-transformers 6) and by transformers alone, BERT and
ModernBERT; pairs are truncated as Hugging Face's tokenizers truncate them (longest first);
the reranker task's readers turn bad rows into one-line errors naming the file and line; reranking
a run keeps each query's top k in the cross-encoder's order.

References: sentence-transformers' ``CrossEncoder`` and transformers' tokenizer on tiny random
models they write themselves (``helpers.tiny_hf``).
"""

import json

import numpy as np
import pytest
from helpers import LONG, PAIR_MAX_LEN, PAIRS, WORDS, cross_encoder_dir, tiny_hf
from hf_random import randomize

import bertjax
from bertjax.retrieval.reranker import rerank
from bertjax.retrieval.reranker.task import beir_pairs, read_pairs
from bertjax.text import load_tokenizer

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("sentence_transformers")
from sentence_transformers import CrossEncoder  # noqa: E402

TOL = 1e-5


def _classifier_dir(tmp_path, kind, num_labels, seed):
    """A random transformers ``*ForSequenceClassification`` with its tokenizer in tmp_path/clf
    (no sentence-transformers files); returns the model and the tokenizer."""
    hf = tiny_hf(tmp_path / "hf", kind)
    prefix = {"bert": "Bert", "modernbert": "ModernBert", "eurobert": "EuroBert", "gte": "Gte"}
    cls = getattr(transformers, f"{prefix[kind]}ForSequenceClassification")
    model = cls.from_pretrained(hf, num_labels=num_labels).eval()
    randomize(model, seed=seed)
    model.save_pretrained(tmp_path / "clf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf, model_max_length=PAIR_MAX_LEN)
    tokenizer.save_pretrained(tmp_path / "clf")
    return model, tokenizer


def _differences(directory, pairs=PAIRS, **kwargs):
    """(max |predict - CrossEncoder.predict|, max |rerank_scores - raw logits|)."""
    reference = CrossEncoder(str(directory), device="cpu")
    model = bertjax.load_pretrained(str(directory))
    want = reference.predict(pairs, **kwargs)
    raw = reference.predict(pairs, activation_fn=torch.nn.Identity())
    got, logits = model.predict(pairs, batch_size=4), model.rerank_scores(pairs, batch_size=4)
    assert got.shape == want.shape == (len(pairs),) and np.ptp(raw) > 0.1  # not a flat model
    return float(np.abs(got - want).max()), float(np.abs(logits - raw).max())


@pytest.mark.parametrize("kind", ["bert", "modernbert"])
def test_a_saved_cross_encoder_predicts_as_cross_encoder(hf_dirs, tmp_path, kind):
    directory = cross_encoder_dir(tmp_path / "ce", hf_dirs[kind])
    model = bertjax.load_pretrained(str(directory))
    assert model.cross_encoder == rerank.CrossEncoderSettings(PAIR_MAX_LEN, "Sigmoid")
    assert max(_differences(directory)) < TOL


@pytest.mark.parametrize("kind", ["bert", "modernbert", "eurobert", "gte"])
def test_a_transformers_sequence_classifier_predicts_as_cross_encoder(tmp_path, kind):
    """A plain ``*ForSequenceClassification`` (num_labels=1) directory, no sentence-transformers
    files: CrossEncoder applies Sigmoid and truncates to the tokenizer's model_max_length."""
    _classifier_dir(tmp_path, kind, num_labels=1, seed=7)
    assert max(_differences(tmp_path / "clf")) < TOL


@pytest.mark.parametrize("kind", ["bert", "modernbert"])
def test_a_sentence_classifier_predicts_single_texts_as_transformers(tmp_path, kind):
    """A two-label ``*ForSequenceClassification`` (a GLUE SST-2 run's export is one): ``predict``
    takes single texts, ``[CLS] text [SEP]`` as transformers' tokenizer encodes one, and gives
    the model's logits; a text and a pair may share a call."""
    model, tokenizer = _classifier_dir(tmp_path, kind, num_labels=2, seed=11)
    texts = ["the quick fox", LONG, "Hello, world!"]
    with torch.no_grad():
        want = model(**tokenizer(texts, padding=True, truncation=True, return_tensors="pt"))
    ours = bertjax.load_pretrained(str(tmp_path / "clf"))
    got = ours.predict(texts, activation="Identity")
    assert got.shape == (3, 2) and np.abs(got - want.logits.numpy()).max() < TOL
    mixed = ours.predict([texts[0], PAIRS[0]], activation="Identity")
    np.testing.assert_allclose(mixed[0], got[0], atol=TOL)
    np.testing.assert_allclose(
        mixed[1], ours.predict([PAIRS[0]], activation="Identity")[0], atol=TOL
    )


def test_the_saved_activation_applies(hf_dirs, tmp_path):
    directory = cross_encoder_dir(tmp_path / "ce", hf_dirs["bert"], torch.nn.Identity())
    model = bertjax.load_pretrained(str(directory))
    assert model.cross_encoder.activation == "Identity"
    assert max(_differences(directory)) < TOL
    np.testing.assert_allclose(
        model.predict(PAIRS, activation="Sigmoid"),
        1 / (1 + np.exp(-model.rerank_scores(PAIRS))),
        rtol=1e-6,
    )
    with pytest.raises(ValueError, match="activation='Softmax' is not one of"):
        model.predict(PAIRS, activation="Softmax")


@pytest.mark.parametrize("budget", [5, 6, 7, 9, 10, 13])
def test_pairs_are_truncated_as_the_tokenizer_truncates_them(hf_dirs, budget):
    """ids and token types of ``pair_rows`` equal ``tokenizer(a, b, truncation=True,
    max_length=budget + 3)`` for every pair of lengths 0-12 words."""
    reference = transformers.AutoTokenizer.from_pretrained(hf_dirs["bert"])
    ours = load_tokenizer(str(hf_dirs["bert"] / "tokenizer.json"))
    texts = [" ".join((WORDS * 2)[:n]) for n in range(1, 13)]
    pairs = [(a, b) for a in texts for b in texts]
    rows = rerank.pair_rows(ours, pairs, budget + 3)
    want = reference(
        [a for a, _ in pairs], [b for _, b in pairs], truncation=True, max_length=budget + 3
    )
    for (ids, types), ref_ids, ref_types in zip(rows, want["input_ids"], want["token_type_ids"]):
        assert (ids, types) == (ref_ids, ref_types)


def test_batches_and_order_do_not_change_scores(hf_dirs, tmp_path):
    model = bertjax.load_pretrained(str(cross_encoder_dir(tmp_path / "ce", hf_dirs["bert"])))
    whole = model.rerank_scores(PAIRS, batch_size=32)
    np.testing.assert_allclose(
        model.rerank_scores(PAIRS[::-1], batch_size=2)[::-1], whole, atol=1e-6
    )
    assert model.rerank_scores([]).shape == (0,)
    with pytest.raises(TypeError, match="a text or a \\(text, text\\) pair"):
        model.rerank_scores([("one", "two", "three")])
    plain = bertjax.load_pretrained(str(hf_dirs["bert"]))  # no classifier
    with pytest.raises(ValueError, match="no sequence-classification head"):
        plain.rerank_scores(PAIRS)


def test_rerank_run_orders_the_top_k_by_score():
    run = {"q1": {"d1": 3.0, "d2": 2.0, "d3": 1.0, "q1": 9.0}, "q2": {"d1": 1.0}, "q9": {"d2": 1}}
    queries = {"q1": "first", "q2": "second"}
    docs = {"d1": "one", "d2": "two", "d3": "three", "q1": "the query itself"}
    table = {("first", "one"): 0.1, ("first", "two"): 0.9, ("second", "one"): 0.5}
    out = rerank.rerank_run(lambda pairs: [table[p] for p in pairs], queries, docs, run, top_k=2)
    assert out == {"q1": {"d1": 0.1, "d2": 0.9}, "q2": {"d1": 0.5}}  # q1 itself dropped, d3 cut
    with pytest.raises(ValueError, match="run document 'd7' .* is not in the corpus"):
        rerank.rerank_run(lambda p: [0.0] * len(p), queries, docs, {"q2": {"d7": 1.0}})


# ---- the task's readers ----------------------------------------------------------------------
def test_pair_files_in_every_format(tmp_path):
    jsonl = tmp_path / "pairs.jsonl"
    rows = [
        {"query": "q a", "passage": "p a", "label": 1},
        {"query": "q b", "positive": "pos", "negatives": ["n1", "n2", "n3"]},
        {"query": "q c", "passage": "p c", "label": 0.25},
    ]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert read_pairs(str(jsonl), num_negatives=2) == [
        ("q a", "p a", 1.0),
        ("q b", "pos", 1.0),
        ("q b", "n1", 0.0),
        ("q b", "n2", 0.0),
        ("q c", "p c", 0.25),
    ]
    assert len(read_pairs(str(jsonl))) == 6  # 0: every negative
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("query\tpassage\tlabel\nq a\tp a\t1\nq b\tp b\t0.0\n")
    assert read_pairs(str(tsv)) == [("q a", "p a", 1.0), ("q b", "p b", 0.0)]


@pytest.mark.parametrize(
    "name, text, message",
    [
        (
            "a.jsonl",
            '{"query": "q", "passage": "p", "label": 1}\n{"query": "q", "passage": "p"}\n',
            r"a.jsonl:2: no 'label' key",
        ),
        (
            "b.jsonl",
            '\n{"query": "q", "passage": "p", "label": 1.5}\n',
            r"b.jsonl:2: label 1.5 is outside \[0, 1\]",
        ),
        ("c.tsv", "q\tp\t1\nq\tp\t-1\n", r"c.tsv:2: label -1.0 is outside \[0, 1\]"),
        (
            "d.tsv",
            "q\tp\t1\nq only\t1\n",
            r"d.tsv:2: expected 3 tab-separated fields \(query, passage, label\), found 2",
        ),
        ("e.tsv", "q\tp\tyes\n", r"e.tsv:1: label 'yes' is not a number"),
        ("f.jsonl", '{"query": " ", "passage": "p", "label": 1}\n', r"f.jsonl:1: 'query' is empty"),
        (
            "g.jsonl",
            '{"query": "q", "positive": "p", "negatives": ["n", 3]}\n',
            r"g.jsonl:1: negatives\[1\] is not a non-empty string",
        ),
        (
            "h.jsonl",
            '{"query": "q", "passage": "p", "label": 1}\n{"query": \n',
            r"h.jsonl:2: invalid JSON",
        ),
        ("i.tsv", "", r"i.tsv: no \(query, passage, label\) pairs"),
    ],
)
def test_bad_pairs_are_one_line_errors(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        read_pairs(str(tmp_path / name))
    assert "\n" not in str(err.value)
    with pytest.raises(FileNotFoundError, match="nope.tsv: no such file"):
        read_pairs(str(tmp_path / "nope.tsv"))


def test_beir_pairs_take_the_top_unjudged_negatives():
    from bertjax.retrieval.beir import BeirSet

    data = BeirSet(
        ["d1", "d2", "d3", "d4"],
        ["one", "two", "three", "four"],
        ["q1"],
        ["query"],
        {"q1": {"d1": 1, "d2": 0}},
    )
    negatives = {"q1": {"d1": 5.0, "d2": 4.0, "d3": 3.0, "q1": 2.5, "d4": 2.0}}
    assert beir_pairs(data, negatives, 1) == [
        ("query", "one", 1.0),
        ("query", "two", 0.0),  # judged 0
        ("query", "three", 0.0),  # the top mined document that is not judged
    ]
