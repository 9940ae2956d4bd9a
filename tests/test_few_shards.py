"""Any prepared data set serves any number of hosts. With fewer shards than hosts every host reads
all shards in one order and keeps every process_count-th record: the hosts' epochs partition the
records, the order is deterministic, resume is exact, and streams work the same way;
a corrupted shard is named in streamed reading too."""

import json

import numpy as np
import pytest
from helpers import example_ids, write_prepared

from bertjax.data import pipeline
from bertjax.data.streams import StreamedData


@pytest.mark.parametrize("shuffle", [False, True])
def test_two_hosts_split_the_records_of_one_shard(tmp_path, shuffle):
    root = write_prepared(tmp_path / "one", shard_sizes=(9,))
    hosts = [
        pipeline.PretrainingData(
            root,
            "train",
            2,
            seed=3,
            process_index=i,
            process_count=2,
            shuffle=shuffle,
            shuffle_buffer=4,
            repeat=False,
            drop_remainder=False,
        )
        for i in range(2)
    ]
    seen = [np.concatenate([example_ids(b) for b in host]) for host in hosts]
    assert sorted(len(s) for s in seen) == [4, 5]
    assert sorted(np.concatenate(seen).tolist()) == list(range(9))  # a partition of the records
    if not shuffle:
        assert seen[0].tolist() == [0, 2, 4, 6, 8] and seen[1].tolist() == [1, 3, 5, 7]


def test_record_split_resumes_exactly(tmp_path):
    root = write_prepared(tmp_path / "one", shard_sizes=(7,))
    kw = dict(seed=1, process_index=1, process_count=3, shuffle_buffer=2)
    fresh = pipeline.PretrainingData(root, "train", 2, **kw)
    batches = [example_ids(next(fresh)) for _ in range(5)]  # host 1 has 2 records per epoch
    again = pipeline.PretrainingData(root, "train", 2, **kw)
    for _ in range(3):
        next(again)
    restored = pipeline.PretrainingData(root, "train", 2, **kw)
    restored.restore(json.loads(json.dumps(again.state())))
    np.testing.assert_array_equal(example_ids(next(restored)), batches[3])
    assert all(set(b) <= {1, 4} for b in batches)


def test_streams_over_fewer_shards_than_streams(tmp_path):
    root = write_prepared(tmp_path / "two", shard_sizes=(6, 6))
    kw = dict(num_streams=4, seed=0, shuffle=False)
    hosts = [StreamedData(root, "train", 8, process_index=i, process_count=2, **kw) for i in (0, 1)]
    rows = np.concatenate([example_ids(next(h)) for h in hosts])
    assert sorted(rows.tolist()) == sorted(set(rows.tolist())) and len(rows) == 8


@pytest.mark.parametrize("shuffle", [False, True])
def test_streamed_global_batches_have_the_same_rows_on_any_host_count(tmp_path, shuffle):
    """Hosts own consecutive streams, so the global batch (hosts' rows in process order) is row
    for row the same for 1, 2 or 4 hosts: the dropout masks, which follow rows, agree too."""
    root = write_prepared(tmp_path / "eight", shard_sizes=(5, 6, 7, 8, 5, 6, 7, 8))
    kw = dict(num_streams=4, seed=2, shuffle=shuffle, shuffle_buffer=3)
    runs = {}
    for hosts in (1, 2, 4):
        readers = [
            StreamedData(root, "train", 8, process_index=i, process_count=hosts, **kw)
            for i in range(hosts)
        ]
        runs[hosts] = [
            np.concatenate([example_ids(next(r)) for r in readers]).tolist() for _ in range(5)
        ]
    assert runs[1] == runs[2] == runs[4]


def test_a_corrupted_shard_is_named_when_streamed(tmp_path):
    root = write_prepared(tmp_path / "bad", shard_sizes=(40, 40))
    path = root / "train-00001-of-00002.tfrecord"
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 8] = b"\xff" * 8
    path.write_bytes(bytes(data))
    streamed = StreamedData(
        root, "train", 8, num_streams=2, seed=0, process_index=0, process_count=1, shuffle=False
    )
    with pytest.raises(pipeline.ShardCorruptedError, match="train-00001-of-00002.tfrecord"):
        for _ in range(20):
            next(streamed)


@pytest.mark.parametrize("fault", ["missing feature", "wrong length"])
def test_a_record_that_does_not_parse_names_its_shard_and_record(tmp_path, fault):
    import tensorflow as tf

    root = write_prepared(tmp_path / "bad", shard_sizes=(6, 6))
    path = root / "train-00001-of-00002.tfrecord"
    records = [tf.train.Example.FromString(r.numpy()) for r in tf.data.TFRecordDataset(str(path))]
    feature = records[4].features.feature
    if fault == "missing feature":
        del feature["masked_lm_ids"]
    else:
        feature["input_ids"].int64_list.value.append(7)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for example in records:
            writer.write(example.SerializeToString())
    data = pipeline.PretrainingData(
        root, "train", 4, seed=0, process_index=0, process_count=1, shuffle=False, repeat=False
    )
    with pytest.raises(pipeline.ShardCorruptedError) as info:
        list(data)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: record 4 is not a prepared")
    assert ("masked_lm_ids" if fault == "missing feature" else "input_ids") in message
