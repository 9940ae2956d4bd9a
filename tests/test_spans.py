"""spans.document_spans: the original instance algorithm on token arrays, the same distributions as
the list-based reference (instances.create_instances_from_document), checked statistically."""

import numpy as np

from bertjax.data.instances import create_instances_from_document, truncate_seq_pair
from bertjax.data.spans import Document, _truncate, document_spans, trims


def test_trims_equal_truncate_seq_pair():
    rng = np.random.default_rng(0)
    for len_a in range(0, 40):
        for len_b in range(0, 40):
            a, b = list(range(len_a)), list(range(100, 100 + len_b))
            truncate_seq_pair(a, b, 25, rng)
            assert trims(len_a, len_b, 25) == (len_a - len(a), len_b - len(b))


def _docs(rng, n_docs, min_sent=1, max_sent=30):
    """Lists of sentences of consecutive integers, and the same as `Document`s."""
    lists, next_id = [], 10
    for _ in range(n_docs):
        doc = []
        for _ in range(rng.integers(min_sent, max_sent)):
            length = int(rng.integers(1, 25))
            doc.append(list(range(next_id, next_id + length)))
            next_id += length
        lists.append(doc)
    docs = [
        Document(
            np.array([t for s in d for t in s], np.int32), [0, *np.cumsum([len(s) for s in d])]
        )
        for d in lists
    ]
    return lists, docs


def _stats(instances, max_num):
    """Random-next rate, mean lengths of A and B, share of full instances, per-length histogram."""
    a = np.array([len(x[0]) for x in instances])
    b = np.array([len(x[1]) for x in instances])
    total = a + b
    return {
        "random_next": np.mean([x[2] for x in instances]),
        "len_a": a.mean(),
        "len_b": b.mean(),
        "full": np.mean(total == max_num),
        "short": np.mean(total < max_num // 2),
        "count": len(instances),
    }


def _span_tokens(span, rng=None):
    a, b = span.a[span.a_start : span.a_stop], span.b[span.b_start : span.b_stop]
    return a.tolist(), b.tolist(), span.is_random_next


def test_same_distributions_as_the_reference():
    lists, docs = _docs(np.random.default_rng(1), 600, min_sent=4, max_sent=40)
    ref, ours = [], []
    for seed in range(3):
        rng_ref, rng_ours, rng_trunc = (np.random.default_rng([seed, k]) for k in range(3))
        for i in range(len(docs)):
            kw = dict(max_seq_length=128, short_seq_prob=0.1, nsp=True)
            ref += create_instances_from_document(lists, i, rng=rng_ref, **kw)
            ours += [
                _span_tokens(s, rng_trunc) for s in document_spans(docs, i, rng=rng_ours, **kw)
            ]
    r, o = _stats(ref, 125), _stats(ours, 125)
    assert abs(r["random_next"] - o["random_next"]) < 0.02 and 0.5 < o["random_next"] < 0.6
    assert abs(r["len_a"] - o["len_a"]) < 0.03 * r["len_a"]
    assert abs(r["len_b"] - o["len_b"]) < 0.03 * r["len_b"]
    assert abs(r["full"] - o["full"]) < 0.03 and abs(r["short"] - o["short"]) < 0.03
    assert abs(r["count"] - o["count"]) < 0.05 * r["count"]


def test_structure_of_spans():
    lists, docs = _docs(np.random.default_rng(2), 300, min_sent=1, max_sent=30)
    owner = {t: d for d, doc in enumerate(lists) for s in doc for t in s}
    rng, trunc = np.random.default_rng(3), np.random.default_rng(4)
    short_docs = 0
    for i in range(len(docs)):
        spans = document_spans(docs, i, max_seq_length=64, short_seq_prob=0.1, nsp=True, rng=rng)
        instances = [_span_tokens(s, trunc) for s in spans]
        short_docs += len(instances) > 1 and all(len(a) + len(b) < 61 for a, b, _ in instances)
        for a, b, is_random in instances:
            assert a and b and len(a) + len(b) <= 61
            assert a == list(range(a[0], a[0] + len(a))) and {owner[t] for t in a} == {i}
            assert b == list(range(b[0], b[0] + len(b)))  # contiguous text
            if not is_random:
                assert {owner[t] for t in b} == {i} and b[0] > a[-1]
            elif len(docs) > 1:
                assert owner[b[0]] != i
    assert 0.03 < short_docs / len(docs) < 0.2


def test_mlm_only_spans_fill_the_sequence():
    lists, docs = _docs(np.random.default_rng(5), 30, min_sent=5)
    rng, trunc = np.random.default_rng(6), np.random.default_rng(7)
    for i in range(len(docs)):
        spans = document_spans(docs, i, max_seq_length=40, short_seq_prob=0.0, nsp=False, rng=rng)
        instances = [_span_tokens(s, trunc) for s in spans]
        flat = [t for s in lists[i] for t in s]
        assert sum(len(a) for a, _, _ in instances) <= len(flat)
        for a, b, is_random in instances[:-1]:
            assert len(a) == 38 and b == [] and not is_random
            assert a == list(range(a[0], a[0] + 38)) and a[0] in flat


def test_truncation_takes_binomial_fronts():
    """Each trimmed token comes off the front with prob 0.5 (as truncate_seq_pair's coin)."""
    ids = np.arange(1000, dtype=np.int32)
    spans = [(ids, 100, 200, ids, 500, 560, True)] * 4000
    cut = [(t % 7, t % 5) for t in range(4000)]
    out = _truncate(spans, cut, np.random.default_rng(0))
    front_a = [s.a_start - 100 for s in out]
    front_b = [s.b_start - 500 for s in out]
    for span, (ta, tb), fa, fb in zip(out, cut, front_a, front_b):
        assert span.a_stop - span.a_start == 100 - ta and span.b_stop - span.b_start == 60 - tb
        assert 0 <= fa <= ta and 0 <= fb <= tb
    assert abs(sum(front_a) / sum(t for t, _ in cut) - 0.5) < 0.02
    assert abs(sum(front_b) / sum(t for _, t in cut) - 0.5) < 0.02
