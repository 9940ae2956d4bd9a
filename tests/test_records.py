"""TFRecord/Example bytes written without TensorFlow equal TensorFlow's; prepare stays TF-free."""

import subprocess
import sys

import numpy as np
import tensorflow as tf

from bertjax.data import records


def _tf_example(features):
    feature = {}
    for key, (kind, values) in features.items():
        if kind == "int":
            feature[key] = tf.train.Feature(int64_list=tf.train.Int64List(value=values))
        else:
            feature[key] = tf.train.Feature(float_list=tf.train.FloatList(value=values))
    example = tf.train.Example(features=tf.train.Features(feature=feature))
    return example.SerializeToString(deterministic=True)


def test_example_bytes_equal_tensorflow():
    rng = np.random.default_rng(0)
    for trial in range(50):
        features = {}
        for key in rng.choice(["input_ids", "b", "masked_lm_weights", "zz", "a_b"], 3, False):
            n = int(rng.integers(0, 300))
            if rng.random() < 0.3:
                features[str(key)] = ("float", rng.random(n).astype(np.float32).tolist())
            else:
                high = [2, 200, 70000, 1 << 40][trial % 4]
                values = rng.integers(0, high, n).tolist()
                if trial % 7 == 0 and values:
                    values[0] = -5  # negative int64: 10-byte varint
                features[str(key)] = ("int", values)
        ours = records.example_bytes(
            {
                k: records.int64_feature(v) if kind == "int" else records.float_feature(v)
                for k, (kind, v) in features.items()
            }
        )
        assert ours == _tf_example(features)


def test_record_writer_equals_tfrecordwriter(tmp_path):
    payloads = [b"", b"x", bytes(range(256)) * 40, b"record" * 1000]
    with records.RecordWriter(str(tmp_path / "ours.tfrecord")) as writer:
        for p in payloads:
            writer.write(p)
    with tf.io.TFRecordWriter(str(tmp_path / "tf.tfrecord")) as writer:
        for p in payloads:
            writer.write(p)
    assert (tmp_path / "ours.tfrecord").read_bytes() == (tmp_path / "tf.tfrecord").read_bytes()
    read = [r.numpy() for r in tf.data.TFRecordDataset(str(tmp_path / "ours.tfrecord"))]
    assert read == payloads


def test_prepare_imports_no_tensorflow():
    code = (
        "import sys; import bertjax.data.prepare, bertjax.text; "
        "sys.exit('tensorflow' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
