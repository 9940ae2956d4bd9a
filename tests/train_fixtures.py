"""Small prepared-data directories and configs for trainer tests (no corpus, no vocab training)."""

import json
import pathlib

import numpy as np

from configs import base

VOCAB_SIZE = 120
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_vocab(path: pathlib.Path) -> pathlib.Path:
    if path.exists():
        return path
    words = SPECIAL + [f"w{i}" for i in range(VOCAB_SIZE - len(SPECIAL) - 10)]
    words += [f"##s{i}" for i in range(10)]
    path.write_text("\n".join(words) + "\n")
    return path


def _feature(values, kind=int):
    import tensorflow as tf  # only to write data: a config over written data imports none

    if kind is float:
        return tf.train.Feature(float_list=tf.train.FloatList(value=[float(v) for v in values]))
    return tf.train.Feature(int64_list=tf.train.Int64List(value=[int(v) for v in values]))


def write_prepared(
    root: pathlib.Path, seq=16, pred=3, shards=4, per_shard=24, seed=0, eval_examples=16
) -> pathlib.Path:
    """Records with a learnable pattern: token t+1 follows token t, masked tokens predictable."""
    rng = np.random.default_rng(seed)
    if (root / "metadata.json").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    counts = {}
    import tensorflow as tf

    def write(name, n):
        counts[name] = n
        with tf.io.TFRecordWriter(str(root / name)) as w:
            for _ in range(n):
                length = int(rng.integers(seq // 2, seq + 1))
                start = int(rng.integers(5, VOCAB_SIZE - seq))
                ids = np.zeros(seq, np.int64)
                ids[:length] = np.arange(start, start + length)
                ids[0], ids[length - 1] = 2, 3
                positions = np.sort(rng.choice(np.arange(1, length - 1), pred, replace=False))
                labels = ids[positions].copy()
                ids[positions] = 4
                feats = {
                    "input_ids": _feature(ids),
                    "input_mask": _feature(np.arange(seq) < length),
                    "segment_ids": _feature(np.arange(seq) >= length // 2),
                    "masked_lm_positions": _feature(positions),
                    "masked_lm_ids": _feature(labels),
                    "masked_lm_weights": _feature(np.ones(pred), float),
                    "next_sentence_labels": _feature([int(rng.integers(0, 2))]),
                }
                ex = tf.train.Example(features=tf.train.Features(feature=feats))
                w.write(ex.SerializeToString())

    for i in range(shards):
        write(f"train-{i:05d}-of-{shards:05d}.tfrecord", per_shard)
    write("eval-00000-of-00001.tfrecord", eval_examples)
    meta = dict(
        max_seq_length=seq,
        max_predictions_per_seq=pred,
        masked_lm_prob=0.15,
        masking="static",
        whole_word_mask=False,
        nsp=True,
        vocab_file="vocab.txt",
        vocab_size=VOCAB_SIZE,
        shards=counts,
    )
    (root / "metadata.json").write_text(json.dumps(meta))
    return root


def tiny_config(tmp: pathlib.Path, steps=4, **overrides):
    """A tiny pretraining config over write_prepared data (fp32, no dropout, logs every step)."""
    c = base.get_config()
    c.model.preset = "tiny"
    c.model.max_position_embeddings = 32
    c.model.hidden_dropout = 0.0
    c.model.attention_dropout = 0.0
    data = write_prepared(tmp / "prepared")
    c.data.prepared_dir = str(data)
    c.data.vocab = str(write_vocab(tmp / "vocab.txt"))
    c.data.max_seq_length = 16
    c.data.max_predictions_per_seq = 3
    c.train.steps = steps
    c.train.global_batch_size = 8
    c.data.streams = 2  # each stream is a tf.data pipeline to build; 8 (the default) in multihost
    # One simulated device: a tiny step on 8 takes over twice as long. Tests of layouts and of
    # several devices name theirs (mesh.num_devices=0: all 8).
    c.mesh.num_devices = 1
    c.train.log_every = 1
    c.train.eval_every = 0
    c.train.eval_steps = 0  # no eval compile unless a test asks for it
    c.train.checkpoint_every = 2
    c.train.async_checkpoints = False
    c.optimizer.warmup_steps = 1
    c.optimizer.learning_rate = 1e-3
    c.tensorboard = False
    return set_keys(c, overrides)


def set_keys(config, overrides: dict):
    """``config`` with each dotted key of ``overrides`` (``"train.steps"``) set; returns it."""
    for key, value in overrides.items():
        node = config
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    return config


def read_metrics(workdir, split="train"):
    lines = pathlib.Path(workdir, "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]
