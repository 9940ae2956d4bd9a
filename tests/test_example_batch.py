"""Batched rows, masking and serialization (data/example_batch.py, data/example_codec.py): the bytes
are `records.example_bytes`' and TFRecord's, and masking follows the original rates (statistics)."""

import io
import os
import struct

import numpy as np
import pytest

from bertjax.data import masking
from bertjax.data.example_batch import ExampleBatch, _whole_words, _whole_words_full
from bertjax.data.example_codec import encode_examples, frame_records
from bertjax.data.instances import PrepareConfig
from bertjax.data.records import RecordWriter, example_bytes, float_feature, int64_feature
from bertjax.data.spans import Span

VOCAB = 70000  # ids above 2**14 take 3 varint bytes
CLS, SEP, PAD, MASK = 2, 3, 0, 4
WORD_START = np.random.default_rng(1).random(VOCAB) < 0.7


def _consts(whole_word):
    return dict(
        vocab_size=VOCAB,
        mask_id=MASK,
        cls_id=CLS,
        sep_id=SEP,
        pad_id=PAD,
        special_ids=(CLS, SEP, PAD),
        word_start=WORD_START if whole_word else None,
    )


def _varint(data, i):
    value = shift = 0
    while True:
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if byte < 0x80:
            return value, i


def _parse(record: bytes) -> dict:
    """A minimal tf.train.Example reader (as our writer lays it out): {name: values}."""
    out = {}
    assert record[0] == 0x0A
    size, i = _varint(record, 1)
    assert i + size == len(record)
    while i < len(record):
        assert record[i] == 0x0A
        entry, i = _varint(record, i + 1)
        end = i + entry
        key_len, i = _varint(record, i + 1)
        name = record[i : i + key_len].decode()
        i += key_len + 1  # 0x12
        _, i = _varint(record, i)
        kind = record[i]
        _, i = _varint(record, i + 1)
        packed, i = _varint(record, i + 1)
        payload = record[i : i + packed]
        if kind == 0x12:
            out[name] = list(struct.unpack(f"<{packed // 4}f", payload))
        else:
            values, j = [], 0
            while j < len(payload):
                v, j = _varint(payload, j)
                values.append(v)
            out[name] = values
        i = end
    return out


def test_encode_examples_equals_example_bytes():
    rng = np.random.default_rng(0)
    rows = 60
    big = rng.integers(0, 1 << 62, (rows, 5))
    big[:, 0] = rng.integers(0, 200, rows)
    features = [
        ("input_ids", rng.integers(0, VOCAB, (rows, 40))),
        ("b_small", rng.integers(0, 2, (rows, 7))),
        ("weights", (rng.random((rows, 6)) < 0.5).astype(np.float32)),
        ("big", big),
        ("one", rng.integers(0, 300, (rows, 1))),
    ]
    blob, lengths = encode_examples(features)
    assert len(blob) == lengths.sum()
    start = 0
    for r in range(rows):
        expected = {
            name: float_feature(v[r].tolist())
            if v.dtype == np.float32
            else int64_feature(v[r].tolist())
            for name, v in features
        }
        assert blob[start : start + lengths[r]] == example_bytes(expected)
        start += lengths[r]


def test_frame_records_equals_record_writer(tmp_path):
    records = [os.urandom(n) for n in (0, 1, 5, 300, 70000, 5)]
    path = str(tmp_path / "a.tfrecord")
    with RecordWriter(path) as writer:
        for record in records:
            writer.write(record)
    framed = b"".join(frame_records(b"".join(records), [len(r) for r in records]))
    assert framed == open(path, "rb").read()


def _run_batch(cfg, consts, spans, seed=0, size=64):
    got = []

    def emit(blob, lengths):
        stream = io.BytesIO(blob)
        got.extend(_parse(stream.read(n)) for n in lengths)

    batch = ExampleBatch(cfg, consts, emit, np.random.default_rng(seed), size=size)
    for k in range(0, len(spans), 7):  # a document's instances at a time
        batch.add_spans(spans[k : k + 7])
    batch.flush()
    return got


def _spans(rng, count, max_num, doc_len=400):
    tokens = rng.permutation(np.arange(5, VOCAB, dtype=np.int32))  # distinct: found by value
    doc, other = tokens[:doc_len], tokens[doc_len : 2 * doc_len]
    out = []
    for _ in range(count):
        la = int(rng.integers(1, max_num))
        lb = int(rng.integers(1, max_num - la + 1))
        a0, b0 = int(rng.integers(0, doc_len - la)), int(rng.integers(0, doc_len - lb))
        out.append(Span(doc, a0, a0 + la, other, b0, b0 + lb, bool(rng.random() < 0.5)))
    return out


@pytest.mark.parametrize("whole_word", [False, True])
def test_static_rows_and_masking_rates(whole_word):
    cfg = PrepareConfig(max_seq_length=128, max_predictions_per_seq=20, masking="static")
    rng = np.random.default_rng(0)
    spans = _spans(rng, 3000, 125)
    records = _run_batch(cfg, _consts(whole_word), spans, size=512)
    assert len(records) == len(spans)
    kinds = {"mask": 0, "same": 0, "random": 0}
    position_hits, expected = np.zeros(128), np.zeros(128)
    for rec, span in zip(records, spans):
        n = sum(rec["input_mask"])
        k = int(sum(rec["masked_lm_weights"]))
        assert k == masking.num_to_predict(n, 0.15, 20)
        positions, labels = rec["masked_lm_positions"][:k], rec["masked_lm_ids"][:k]
        assert positions == sorted(positions) and len(set(positions)) == k
        original = list(rec["input_ids"][:n])
        for p, label in zip(positions, labels):
            token = original[p]
            kinds["mask" if token == MASK else "same" if token == label else "random"] += 1
            original[p] = label
        la, lb = span.a_stop - span.a_start, span.b_stop - span.b_start
        a, b = original[1 : 1 + la], original[2 + la : 2 + la + lb]
        assert original[0] == CLS and original[la + 1] == SEP and original[-1] == SEP
        assert n == la + lb + 3
        assert a == span.a[span.a_start : span.a_stop].tolist()
        assert b == span.b[span.b_start : span.b_stop].tolist()
        assert rec["segment_ids"][:n] == [0] * (la + 2) + [1] * (lb + 1)
        assert rec["next_sentence_labels"] == [int(span.is_random_next)]
        assert not ({0, la + 1, n - 1} & set(positions))  # specials never masked
        if whole_word:  # a masked group is masked whole: a continuation's word start too
            chosen = set(positions)
            for p in positions:
                if p + 1 < n - 1 and p + 1 != la + 1 and not WORD_START[original[p + 1]]:
                    assert p + 1 in chosen
        if not whole_word:  # each of the n - 3 candidates has prob k / (n - 3)
            position_hits[positions] += 1
            candidates = [p for p in range(1, n - 1) if p != la + 1]
            expected[candidates] += k / len(candidates)
    total = sum(kinds.values())
    assert abs(kinds["mask"] / total - 0.8) < 0.01
    assert abs(kinds["same"] / total - 0.1) < 0.01 and abs(kinds["random"] / total - 0.1) < 0.01
    if not whole_word:  # every candidate position equally likely: chi-square, 126 cells
        seen = expected > 5
        chi2 = np.sum((position_hits[seen] - expected[seen]) ** 2 / expected[seen])
        assert chi2 < 2 * seen.sum(), chi2


def test_dynamic_rows_have_no_masked_features():
    cfg = PrepareConfig(max_seq_length=64, max_predictions_per_seq=7, masking="dynamic")
    spans = _spans(np.random.default_rng(1), 50, 61)
    for rec in _run_batch(cfg, _consts(False), spans):
        assert set(rec) == {"input_ids", "input_mask", "segment_ids", "next_sentence_labels"}
        assert MASK not in rec["input_ids"]


def test_packed_rows():
    cfg = PrepareConfig(max_seq_length=48, max_predictions_per_seq=8, nsp=False, packing=True)
    got = []
    batch = ExampleBatch(cfg, _consts(True), lambda b, n: got.extend(n), np.random.default_rng(0))
    ids = np.array([CLS, 10, 11, SEP, CLS, 12, SEP])
    extra = {"pack_ids": np.array([1, 1, 1, 1, 2, 2, 2]), "position_ids": np.arange(7) % 4}
    batch.add_row(ids, len(ids), 0, extra)
    records = []
    batch.emit = lambda blob, lengths: records.append(_parse(blob))
    batch.flush()
    rec = records[0]
    assert rec["pack_ids"] == [1, 1, 1, 1, 2, 2, 2] + [0] * 41
    assert rec["position_ids"][:7] == [0, 1, 2, 3, 0, 1, 2] and sum(rec["input_mask"]) == 7


def test_whole_words_top_groups_equal_all_groups():
    g = np.random.default_rng(0)
    for _ in range(20):
        word_start = g.random(5000) < g.uniform(0.05, 0.9)
        rows, width = 200, int(g.integers(8, 130))
        ids = g.integers(10, 5000, (rows, width))
        lengths = g.integers(3, width + 1, rows)
        valid = np.arange(width)[None] < lengths[:, None]
        ids[:, 0], ids[np.arange(rows), lengths - 1] = CLS, SEP
        is_cand = valid & (ids != CLS) & (ids != SEP)
        keys = g.random((rows, width))
        budget = np.minimum(20, np.maximum(1, np.rint(lengths * 0.15))).astype(np.int64)
        top = int(g.integers(1, 40))
        fast = _whole_words(ids, is_cand, keys, budget, word_start, top=top)
        assert (fast == _whole_words_full(ids, is_cand, keys, budget, word_start)).all()
