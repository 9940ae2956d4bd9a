"""The batched masking + serialization (data/example_batch.py) writes instance_to_example's bytes."""

import numpy as np
import pytest

from bertjax.data.example_batch import ExampleBatch, varint_rows
from bertjax.data.instances import PrepareConfig, instance_to_example, packed_to_example
from bertjax.data.records import _varint

VOCAB = 70000  # ids above 2**14 take 3 varint bytes
WORD_START = np.random.default_rng(1).random(VOCAB) < 0.7


def _consts(whole_word):
    return dict(vocab_size=VOCAB, mask_id=4, cls_id=2, sep_id=3, pad_id=0,
                special_ids=(2, 3, 0), word_start=WORD_START if whole_word else None)  # fmt: skip


@pytest.mark.parametrize("masking", ["static", "dynamic"])
@pytest.mark.parametrize("whole_word", [False, True])
def test_batch_equals_instance_to_example(masking, whole_word):
    cfg = PrepareConfig(max_seq_length=40, max_predictions_per_seq=7, masking=masking)
    consts = _consts(whole_word)
    gen = np.random.default_rng(0)
    instances = []
    for _ in range(300):
        a = gen.integers(5, VOCAB, int(gen.integers(1, 20))).tolist()
        b = gen.integers(5, VOCAB, int(gen.integers(0, 17))).tolist()
        if a and gen.random() < 0.1:
            a[0] = 3  # a special id inside the text is never masked
        instances.append((a, b, bool(gen.random() < 0.5)))
    rng = np.random.default_rng(7)
    expected = [
        instance_to_example(a, b, r, cfg=cfg, consts=consts, rng=rng) for a, b, r in instances
    ]
    got = []
    batch = ExampleBatch(cfg, consts, got.append, size=32)
    rng = np.random.default_rng(7)
    for a, b, r in instances:
        ids = [2, *a, 3] + ([*b, 3] if b else [])
        batch.add(ids, len(a) + 2, int(r), rng)
    batch.flush()
    assert got == expected


def test_packed_rows_equal_packed_to_example():
    cfg = PrepareConfig(max_seq_length=48, max_predictions_per_seq=8, nsp=False, packing=True)
    consts = _consts(True)
    gen = np.random.default_rng(2)
    rows = [
        [gen.integers(5, VOCAB, int(gen.integers(1, 12))).tolist() for _ in range(3)]
        for _ in range(50)
    ]
    rng = np.random.default_rng(3)
    expected = [packed_to_example(r, cfg=cfg, consts=consts, rng=rng) for r in rows]
    from bertjax.data.packing import row_layout

    got = []
    batch = ExampleBatch(cfg, consts, got.append, size=16)
    rng = np.random.default_rng(3)
    for segments in rows:
        ids = [t for s in segments for t in (2, *s, 3)]
        pack_ids, position_ids, _ = row_layout([len(s) + 2 for s in segments], len(ids))
        extra = {"pack_ids": pack_ids.tolist(), "position_ids": position_ids.tolist()}
        batch.add(ids, len(ids), 0, rng, extra)
    batch.flush()
    assert got == expected


def test_varint_rows():
    values = np.array([0, 1, 127, 128, 300, 16383, 16384, 1 << 35, 5])
    rows = varint_rows(values, np.array([3, 0, 5, 1]))
    flat = [_varint(int(v)) for v in values]
    assert rows == [b"".join(flat[:3]), b"", b"".join(flat[3:8]), flat[8]]
