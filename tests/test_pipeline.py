"""Tests for bertjax/data/pipeline.py: order, exact resume, hosts, dynamic masks, ArrayData."""

import json

import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    CLS,
    MASK,
    PRED,
    SEP,
    SEQ,
    SHARD_SIZES,
    example_ids,
    example_tokens,
    unmask,
    write_prepared,
)

from bertjax.data import pipeline


def take(ds, n):
    return [{k: v.numpy() for k, v in b.items()} for b in ds.take(n)]


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@pytest.fixture(scope="module")
def static_dir(tmp_path_factory):
    return write_prepared(tmp_path_factory.mktemp("static"))


def test_read_metadata_errors(tmp_path):
    with pytest.raises(ValueError, match=r"metadata.json: metadata file not found"):
        pipeline.read_metadata(tmp_path)
    (tmp_path / "metadata.json").write_text('{"max_seq_length": 12,\n oops}')
    with pytest.raises(ValueError, match=r"metadata.json:2: invalid JSON"):
        pipeline.read_metadata(tmp_path)
    (tmp_path / "metadata.json").write_text('{"max_seq_length": 12}')
    with pytest.raises(ValueError, match=r"missing key\(s\) \['max_predictions_per_seq'"):
        pipeline.read_metadata(tmp_path)


def test_list_and_host_shards(static_dir, tmp_path):
    shards = pipeline.list_shards(static_dir, "train")
    assert [s.rsplit("/", 1)[-1] for s in shards] == [
        f"train-{i:05d}-of-00004.tfrecord" for i in range(4)
    ]
    hosts = [pipeline.host_shards(shards, i, 3) for i in range(3)]
    assert sorted(sum(hosts, [])) == shards
    assert all(set(a).isdisjoint(b) for i, a in enumerate(hosts) for b in hosts[i + 1 :])
    assert pipeline.host_shards(shards, 4, 5) == shards  # fewer shards than hosts: all, and
    assert pipeline.record_split(len(shards), 4, 5) == (4, 5)  # every 5th record from the 5th
    with pytest.raises(ValueError, match=r"no shards for split 'eval'"):
        pipeline.list_shards(static_dir, "eval")
    write_prepared(tmp_path, shard_sizes=(2, 2, 2))
    (tmp_path / "train-00001-of-00003.tfrecord").unlink()
    with pytest.raises(ValueError, match=r"found 2 shards"):
        pipeline.list_shards(tmp_path, "train")


def test_argument_and_state_errors(static_dir, tmp_path):
    with pytest.raises(ValueError, match=r"start_batch >= 0"):
        pipeline.pretraining_dataset(static_dir, "train", 2, seed=0, start_batch=-1)
    write_prepared(tmp_path)
    meta = json.loads((tmp_path / "metadata.json").read_text())
    del meta["shards"]["train-00002-of-00004.tfrecord"]
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"no example count for train-00002-of-00004.tfrecord"):
        pipeline.pretraining_dataset(tmp_path, "train", 2, seed=0)
    data = pipeline.PretrainingData(
        static_dir, "train", 2, seed=0, process_index=0, process_count=1
    )
    with pytest.raises(ValueError, match=r"missing key 'split'"):
        data.restore({"batches_consumed": 3, "seed": 0})


def test_no_autotuning_thread_to_wait_for_when_an_iterator_is_deleted(static_dir):
    # With tf.data's autotuning, deleting an iterator waited for its optimisation thread's sleep
    # (up to 60 s): the end of every training phase stood still that long.
    ds = pipeline.pretraining_dataset(static_dir, "train", 5, seed=0)
    assert ds.options().autotune.enabled is False and ds.options().deterministic


def test_dtypes_and_shapes(static_dir):
    (batch,) = take(pipeline.pretraining_dataset(static_dir, "train", 5, seed=0), 1)
    expect = {
        "input_ids": ((5, SEQ), np.int32),
        "input_mask": ((5, SEQ), np.int32),
        "segment_ids": ((5, SEQ), np.int32),
        "masked_lm_positions": ((5, PRED), np.int32),
        "masked_lm_ids": ((5, PRED), np.int32),
        "masked_lm_weights": ((5, PRED), np.float32),
        "next_sentence_labels": ((5,), np.int32),
    }
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == expect
    ids = example_ids(batch)
    for row, g in enumerate(ids):  # every field matches what was written for that example
        tokens = example_tokens(g)
        np.testing.assert_array_equal(unmask(batch)[row, : len(tokens)], tokens)
        assert batch["input_mask"][row].sum() == len(tokens)
        assert batch["next_sentence_labels"][row] == g % 2
        np.testing.assert_array_equal(batch["input_ids"][row, 2:4], [MASK, MASK])


@pytest.mark.parametrize("shard_sizes", [SHARD_SIZES, (22,)])
def test_epochs_are_permutations_and_differ(tmp_path, shard_sizes):
    data_dir = write_prepared(tmp_path, shard_sizes=shard_sizes)  # one shard: only blocks shuffle
    batches = take(pipeline.pretraining_dataset(data_dir, "train", 11, seed=3, shuffle_buffer=4), 6)
    epochs = [np.concatenate([example_ids(b) for b in batches[e : e + 2]]) for e in (0, 2, 4)]
    for ids in epochs:
        assert sorted(ids) == list(range(22))
    assert not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[0], np.arange(22))
    ds = pipeline.pretraining_dataset(data_dir, "train", 11, seed=3, shuffle=False)
    head = list(np.concatenate([example_ids(b) for b in take(ds, 2)]))[:8]
    # Without shuffling, the files are interleaved round-robin in name order.
    assert head == ([0, 7, 12, 18, 1, 8, 13, 19] if len(shard_sizes) == 4 else list(range(8)))


def test_deterministic_for_a_seed(static_dir):
    make = lambda seed: take(pipeline.pretraining_dataset(static_dir, "train", 4, seed=seed), 8)
    first = make(7)
    tf.random.set_seed(1234)  # TF's global seed must not matter
    assert_batches_equal(first, make(7))
    other = make(8)
    assert any(not np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, other))


@pytest.mark.parametrize("shuffle", [True, False])
def test_resume_static_across_epoch_boundary(static_dir, shuffle):
    kw = dict(seed=5, shuffle=shuffle, shuffle_buffer=4)
    fresh = take(
        pipeline.pretraining_dataset(static_dir, "train", 3, **kw), 20
    )  # 60 ex = 2.7 epochs
    for k in (1, 2, 6, 7, 8, 15):  # 7: batch spans epochs 0/1 (examples 21..23)
        resumed = take(pipeline.pretraining_dataset(static_dir, "train", 3, start_batch=k, **kw), 3)
        assert_batches_equal(resumed, fresh[k : k + 3])


def test_hosts_read_disjoint_examples(static_dir):
    per_host = []
    for index in range(2):
        ds = pipeline.pretraining_dataset(
            static_dir, "train", 1, seed=0, process_index=index, process_count=2, repeat=False
        )
        per_host.append([int(i) for b in take(ds, 100) for i in example_ids(b)])
    # Host 0 has shards 0, 2 (examples 0-6, 12-17); host 1 has shards 1, 3 (7-11, 18-21).
    assert sorted(per_host[0]) == [*range(0, 7), *range(12, 18)]
    assert sorted(per_host[1]) == [*range(7, 12), *range(18, 22)]


def test_single_pass_and_remainder(static_dir):
    ds = pipeline.pretraining_dataset(
        static_dir, "train", 5, seed=0, repeat=False, drop_remainder=False
    )
    sizes = [b["input_ids"].shape[0] for b in take(ds, 100)]
    assert sizes == [5, 5, 5, 5, 2]
    ds = pipeline.pretraining_dataset(static_dir, "train", 5, seed=0, repeat=False, start_batch=4)
    assert take(ds, 100) == []  # only 2 left, dropped as a remainder


def test_dynamic_records_need_dynamic_masking(tmp_path):
    write_prepared(tmp_path, masking="dynamic")
    with pytest.raises(ValueError, match=r"masking is 'dynamic': records carry no masks"):
        pipeline.pretraining_dataset(tmp_path, "train", 2, seed=0)
    with pytest.raises(
        ValueError, match=r"dynamic_masking: missing key\(s\) \['special_ids', 'word_start'"
    ):
        pipeline.pretraining_dataset(
            tmp_path, "train", 2, seed=0, dynamic_masking={"vocab_size": 3000, "mask_id": MASK}
        )


def test_pretraining_data_state_restore(static_dir):
    kw = dict(seed=1, process_index=0, process_count=1, shuffle_buffer=4)
    data = pipeline.PretrainingData(static_dir, "train", 3, **kw)
    fresh = [next(data) for _ in range(12)]
    again = pipeline.PretrainingData(static_dir, "train", 3, **kw)
    for _ in range(8):
        next(again)
    state = json.loads(json.dumps(again.state()))
    assert state["batches_consumed"] == 8
    assert (state["epoch"], state["example_in_epoch"]) == (1, 2)
    restored = pipeline.PretrainingData(static_dir, "train", 3, **kw)
    restored.restore(state)
    assert_batches_equal([next(restored) for _ in range(4)], fresh[8:])
    with pytest.raises(ValueError, match=r"seed=1 but this iterator has 2"):
        pipeline.PretrainingData(static_dir, "train", 3, **{**kw, "seed": 2}).restore(state)


def test_restore_with_new_process_count(static_dir):
    old = [
        pipeline.PretrainingData(static_dir, "train", 2, seed=4, process_index=i, process_count=2)
        for i in range(2)
    ]
    for data in old:
        for _ in range(6):
            next(data)
    state = old[1].state()
    assert state["global_examples_consumed"] == 24  # 6 batches * 2 per host * 2 hosts
    new = pipeline.PretrainingData(static_dir, "train", 3, seed=4, process_index=3, process_count=4)
    new.restore(state)
    assert new.state()["batches_consumed"] == 2  # 24 global examples / (3 * 4) per global batch
    assert new.state()["global_examples_consumed"] == 24
    expect = take(
        pipeline.pretraining_dataset(
            static_dir, "train", 3, seed=4, process_index=3, process_count=4, start_batch=2
        ),
        1,
    )
    assert_batches_equal([next(new)], expect)


def _array_features(n=10):
    return {"x": np.arange(n) * 10, "y": np.arange(n * 2, dtype=np.float32).reshape(n, 2)}


def test_array_data_epochs_and_exact_resume():
    data = pipeline.ArrayData(_array_features(), 4, seed=2)
    fresh = [next(data) for _ in range(10)]  # 40 examples = 4 epochs
    stream = np.concatenate([b["x"] for b in fresh]) // 10
    for epoch in range(4):
        assert sorted(stream[epoch * 10 : (epoch + 1) * 10]) == list(range(10))
    assert not np.array_equal(stream[:10], stream[10:20])
    np.testing.assert_array_equal(fresh[0]["y"][:, 0], fresh[0]["x"] // 10 * 2)  # rows stay aligned
    assert all(b["mask"].tolist() == [1.0] * 4 for b in fresh)
    for k in (1, 2, 3, 7):  # batch 2 spans epochs 0/1
        resumed = pipeline.ArrayData(_array_features(), 4, seed=2)
        resumed.restore(json.loads(json.dumps(fresh_state(k))))
        assert_batches_equal([next(resumed) for _ in range(3)], fresh[k : k + 3])


def fresh_state(k):
    data = pipeline.ArrayData(_array_features(), 4, seed=2)
    for _ in range(k):
        next(data)
    return data.state()


def test_array_data_hosts_split_global_batches_and_remap():
    one = next(pipeline.ArrayData(_array_features(), 6, seed=9))
    hosts = [
        pipeline.ArrayData(_array_features(), 3, seed=9, process_index=i, process_count=2)
        for i in range(2)
    ]
    np.testing.assert_array_equal(np.concatenate([next(h)["x"] for h in hosts]), one["x"])
    # Restore a 2-host state on 3 hosts of 2: the global stream continues exactly.
    single = pipeline.ArrayData(_array_features(), 6, seed=9)
    expect = [next(single) for _ in range(3)][1:]
    state = hosts[0].state()
    assert state["examples_consumed"] == 6
    new = [
        pipeline.ArrayData(_array_features(), 2, seed=9, process_index=i, process_count=3)
        for i in range(3)
    ]
    for h in new:
        h.restore(state)
    for want in expect:
        np.testing.assert_array_equal(np.concatenate([next(h)["x"] for h in new]), want["x"])


@pytest.mark.parametrize("shuffle", [True, False])
def test_array_data_single_pass_sees_every_example_once(shuffle):
    hosts = [
        pipeline.ArrayData(
            _array_features(),
            2,
            seed=0,
            process_index=i,
            process_count=2,
            shuffle=shuffle,
            repeat=False,
        )
        for i in range(2)
    ]
    assert hosts[0].num_batches() == 3
    seen, weights = [], []
    for h in hosts:
        for batch in h:
            assert batch["x"].shape == (2,) and batch["mask"].dtype == np.float32
            seen += list(batch["x"][batch["mask"] > 0] // 10)
            weights.append(batch["mask"].sum())
    assert sorted(seen) == list(range(10))
    assert sum(weights) == 10  # two padded rows on host 1 carry weight 0
    if not shuffle:
        assert seen == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7]


def test_array_data_errors():
    with pytest.raises(ValueError, match=r"feature 'b' has 3 examples, expected 4"):
        pipeline.ArrayData({"a": np.zeros(4), "b": np.zeros(3)}, 2, seed=0)
    with pytest.raises(ValueError, match=r"'mask' is reserved"):
        pipeline.ArrayData({"mask": np.zeros(4)}, 2, seed=0)
    data = pipeline.ArrayData(_array_features(), 2, seed=0)
    with pytest.raises(ValueError, match=r"num_examples=11 but this iterator has 10"):
        data.restore({"examples_consumed": 4, "seed": 0, "num_examples": 11})


def _dynamic_cfg(whole_word=False):
    word_start = np.ones(3000, bool)
    word_start[2000:2020] = False  # "##" pieces: with whole_word they go with the token before
    return dict(
        vocab_size=3000,
        mask_id=MASK,
        special_ids=(0, CLS, SEP),
        word_start=word_start,
        masked_lm_prob=0.3,
        max_predictions_per_seq=PRED,
        whole_word=whole_word,
    )


@pytest.fixture(scope="module")
def dynamic_dir(tmp_path_factory):
    return write_prepared(tmp_path_factory.mktemp("dynamic"), masking="dynamic")


@pytest.mark.parametrize("whole_word", [False, True])
def test_dynamic_masks_fresh_per_epoch_and_identical_on_resume(dynamic_dir, whole_word):
    kw = dict(seed=6, shuffle_buffer=4, dynamic_masking=_dynamic_cfg(whole_word))
    word_start = kw["dynamic_masking"]["word_start"]
    fresh = take(pipeline.pretraining_dataset(dynamic_dir, "train", 6, **kw), 11)  # 3 epochs
    masks = {}  # example id -> its masked input_ids + positions, one entry per epoch
    for batch in fresh:
        for row, g in enumerate(example_ids(batch)):
            tokens = example_tokens(g)
            np.testing.assert_array_equal(unmask(batch)[row, : len(tokens)], tokens)
            positions = batch["masked_lm_positions"][row][batch["masked_lm_weights"][row] > 0]
            assert (0 if whole_word else 1) <= len(positions) <= PRED
            assert all(tokens[p] not in (CLS, SEP) for p in positions)
            for p in positions:  # whole words: a masked "##" piece has its word start masked too
                assert not whole_word or word_start[tokens[p]] or p - 1 in positions
            masks.setdefault(int(g), []).append(
                batch["input_ids"][row].tobytes() + positions.tobytes()
            )
    assert sorted(masks) == list(range(22)) and all(len(v) == 3 for v in masks.values())
    changed = sum(len(set(v)) > 1 for v in masks.values())
    assert changed >= 15  # fresh masks each epoch (a short example may redraw the same mask)
    plain = dict(seed=6, shuffle=False, dynamic_masking=kw["dynamic_masking"])
    same_order = take(pipeline.pretraining_dataset(dynamic_dir, "train", 11, **plain), 4)
    first = np.concatenate([b["input_ids"] for b in same_order[:2]])  # [22, seq]
    second = np.concatenate([b["input_ids"] for b in same_order[2:]])
    assert (first != second).any(axis=1).sum() >= 15  # same order, new masks: epoch is in the seed
    for k in (3, 7):  # batch 3 = examples 18-23 spans epochs 0/1; batch 7 spans epochs 1/2
        resumed = take(
            pipeline.pretraining_dataset(dynamic_dir, "train", 6, start_batch=k, **kw), 2
        )
        assert_batches_equal(resumed, fresh[k : k + 2])


def test_dynamic_masking_of_static_records_starts_from_original_tokens(static_dir):
    kw = dict(seed=0, dynamic_masking=_dynamic_cfg())
    chosen = []
    for batch in take(pipeline.pretraining_dataset(static_dir, "train", 11, **kw), 2):
        ids = unmask(batch)
        for row, g in enumerate(example_ids(batch)):
            tokens = example_tokens(g)
            np.testing.assert_array_equal(ids[row, : len(tokens)], tokens)  # no stored [MASK] left
            positions = batch["masked_lm_positions"][row][batch["masked_lm_weights"][row] > 0]
            assert len(positions) == round(len(tokens) * 0.3)
            chosen.append(tuple(positions))
    assert len(chosen) == 22 and sum(c != (2, 3) for c in chosen) >= 11  # not the static masks


@pytest.mark.shared_data
@pytest.mark.parametrize("masking", ["static", "dynamic"])
def test_records_prepared_from_real_text(shared_data, uncased_vocab, tmp_path, masking):
    """prepare.py's real output (Gutenberg text, BERT-base vocab) through the pipeline."""
    from bertjax.data import prepare
    from bertjax.text import load_tokenizer

    novel = shared_data / "corpus" / "gutenberg" / "Pride-and-Prejudice_1342__1342-0.txt"
    lines = novel.read_text(encoding="utf-8-sig").splitlines()[:1500]  # the PG header and ch. 1-4
    (tmp_path / "novel.txt").write_text("\n".join(lines), encoding="utf-8")
    tok = load_tokenizer(str(uncased_vocab))
    meta = prepare.prepare(
        str(tmp_path / "novel.txt"),
        str(tmp_path / "out"),
        tok,
        corpus_format="text",
        max_seq_length=64,
        max_predictions_per_seq=10,
        dupe_factor=1,
        num_shards=2,
        masking=masking,
        whole_word_mask=True,
        num_workers=1,
        show_progress=False,
    )
    dynamic = pipeline.dynamic_masking_config(meta, tok.word_start_table())
    data = pipeline.PretrainingData(
        tmp_path / "out",
        "train",
        8,
        seed=0,
        process_index=0,
        process_count=1,
        repeat=False,
        dynamic_masking=dynamic if masking == "dynamic" else None,
        drop_remainder=False,
    )
    batches = list(data)
    assert sum(b["input_ids"].shape[0] for b in batches) == meta["examples"]["train"] > 50
    for b in batches:
        assert b["input_ids"].shape[1] == 64 and b["masked_lm_ids"].shape[1] == 10
        real = b["masked_lm_weights"] > 0  # [b, pred]
        assert (real.sum(axis=1) >= 1).all()
        masked_tokens = np.take_along_axis(b["input_ids"], b["masked_lm_positions"], axis=1)
        # 80% become [MASK]; the original token is never [CLS]/[SEP]/[PAD]
        assert (masked_tokens[real] == tok.mask_id).mean() > 0.6
        assert not np.isin(b["masked_lm_ids"][real], [tok.cls_id, tok.sep_id, tok.pad_id]).any()
        assert (b["input_ids"][:, 0] == tok.cls_id).all()


@pytest.mark.parametrize("fault", ["truncate", "flip"])
def test_a_corrupted_shard_is_named(tmp_path, fault):
    root = write_prepared(tmp_path / "data")
    bad = root / "train-00001-of-00004.tfrecord"
    data = bytearray(bad.read_bytes())
    if fault == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    it = pipeline.PretrainingData(
        str(root), "train", 8, seed=0, process_index=0, process_count=1, shuffle_buffer=4
    )
    with pytest.raises(pipeline.ShardCorruptedError) as err:
        for _ in range(20):
            next(it)
    message = str(err.value)
    assert (
        message.startswith(f"{bad}: corrupted or truncated TFRecord shard (")
        and "\n" not in message
    )
