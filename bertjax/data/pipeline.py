"""Input pipelines with exact, resumable positions.

`pretraining_dataset` turns prepared TFRecord shards (see `bertjax/data/prepare.py`) into batches of
int32/float32 tensors for masked-LM (+ NSP) pretraining; `PretrainingData` wraps it as the host-side
iterator the trainer checkpoints. `ArrayData` offers the same iterator/state/restore interface over
in-memory NumPy features (fine-tuning tasks), including a single padded pass for evaluation.

Order and resume. A host reads only its own shards (`host_shards`; with fewer shards than hosts,
all of them, keeping every process_count-th record) and sees one stream of records
made of consecutive epochs. Epoch `e` lists the host's files in an order seeded by
(seed, e, process_index), interleaves them deterministically, and shuffles the records in blocks of
`shuffle_buffer`, each block permuted by a stateless seed from (seed, e, process_index, block).
Batches are cut from this stream, so a batch may span an epoch boundary and no example is dropped
between epochs. A position is `start_batch * per_host_batch_size` records into the stream, i.e.
(epoch, example_in_epoch) = divmod(position, examples_per_host_epoch): whole epochs are skipped
arithmetically and the remainder is skipped on raw records (whole shuffle blocks before shuffling),
before any parsing or masking. Nothing depends on TF's global seed, so two processes built with the
same arguments yield identical batches.
"""

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from absl import logging

from bertjax import fs, process_hooks
from bertjax.data import masking, shard_faults
from bertjax.data import records as records_lib
from bertjax.data.array_data import ArrayData, check_state  # noqa: F401  (ArrayData re-exported)
from bertjax.data.metadata import METADATA_FILE, read_metadata  # noqa: F401  (re-exported)
from bertjax.data.shard_faults import ShardCorruptedError  # noqa: F401  (re-exported)

_SHARD_RE = re.compile(r"^(?P<split>[\w.-]+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.tfrecord$")
# Tags keep the stateless streams of different purposes apart.
_TAG_FILE_ORDER, _TAG_BLOCK_SHUFFLE, _TAG_MASK = 1, 2, 3
_MAX_CYCLE_LENGTH = 16
_MASKED_KEYS = ("input_ids", "masked_lm_positions", "masked_lm_ids", "masked_lm_weights")
_DYNAMIC_MASKING_KEYS = (
    "vocab_size mask_id special_ids word_start masked_lm_prob max_predictions_per_seq whole_word"
).split()

_warned_empty: set[tuple[str, str]] = set()  # (data_dir, split) found empty, warned once
_warned_tf_accelerators = False


def hide_accelerators_from_tf() -> None:
    """Makes TF see only the CPU, so that tf.data never takes GPU/TPU memory meant for JAX.

    Process-wide and for good (TF's devices are set once): the ``bertjax`` command does it when TF
    is imported; a program that feeds JAX on an accelerator from these pipelines calls it before
    TF's first op.
    """
    process_hooks.tensorflow_on_the_cpu(tf)


def _warn_if_tf_sees_accelerators() -> None:
    """One warning (per process) where TF would put its devices on the accelerators JAX uses."""
    global _warned_tf_accelerators
    if _warned_tf_accelerators:
        return
    _warned_tf_accelerators = True
    seen = [d.name for kind in ("GPU", "TPU") for d in tf.config.get_visible_devices(kind)]
    if seen:
        logging.warning(
            "TensorFlow sees %s: tf.data may take accelerator memory that JAX needs; call "
            "bertjax.data.pipeline.hide_accelerators_from_tf() first (the bertjax command does)",
            ", ".join(seen),
        )


def list_shards(data_dir: str, split: str) -> list[str]:
    """Sorted paths of `{split}-{i:05d}-of-{n:05d}.tfrecord` in data_dir; error if none/incomplete."""
    pattern = f"{str(data_dir).rstrip('/')}/{split}-*-of-*.tfrecord"
    paths = sorted(
        p
        for p in fs.glob(pattern)
        if (m := _SHARD_RE.match(p.rsplit("/", 1)[-1])) and m["split"] == split
    )
    if not paths:
        raise ValueError(f"{pattern}: no shards for split {split!r}")
    counts = {int(_SHARD_RE.match(p.rsplit("/", 1)[-1])["count"]) for p in paths}
    if len(counts) != 1 or len(paths) != counts.pop():
        raise ValueError(f"{pattern}: found {len(paths)} shards whose '-of-' counts disagree")
    return paths


def split_is_empty(data_dir: str, split: str) -> bool:
    """Whether metadata.json records no examples for ``split`` (no shards, or only empty ones),
    e.g. an eval split to which eval_fraction assigned no document. Every host reads the same
    metadata, so all agree. Logs a warning the first time a (data_dir, split) is found empty."""
    meta = read_metadata(data_dir)
    table = meta.get("shards")
    if not isinstance(table, Mapping):
        raise ValueError(
            f"{data_dir}/{METADATA_FILE}: key 'shards' must map shard file names to example counts"
        )
    names = [n for n in table if (m := _SHARD_RE.match(n)) and m["split"] == split]
    if sum(int(table[n]) for n in names):
        return False
    if (str(data_dir), split) not in _warned_empty:
        _warned_empty.add((str(data_dir), split))
        logging.warning(
            "%s/%s: the %s split has no examples (%d shard(s)); skipping it",
            data_dir,
            METADATA_FILE,
            split,
            len(names),
        )
    return True


def host_shards(shards: Sequence[str], process_index: int, process_count: int) -> list[str]:
    """The shards host `process_index` reads: every `process_count`-th, starting at its index; all
    of them when there are fewer shards than hosts (the hosts then split records, `record_split`)."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    if len(shards) < process_count:
        return list(shards)
    return list(shards[process_index::process_count])


def record_split(num_shards: int, process_index: int, process_count: int) -> tuple | None:
    """(index, count) when the hosts split records (every count-th record of one stream that all
    hosts read in the same order) because there are fewer shards than hosts; else None."""
    return (process_index, process_count) if num_shards < process_count else None


def _host_input(data_dir: str, split: str, process_index: int, process_count: int):
    """(files, record split, examples per epoch) of one host."""
    shards = list_shards(data_dir, split)
    files = host_shards(shards, process_index, process_count)
    by_record = record_split(len(shards), process_index, process_count)
    examples = sum(shard_example_counts(read_metadata(data_dir), files))
    if by_record is not None:
        examples = len(range(by_record[0], examples, by_record[1]))
    return files, by_record, examples


def shard_example_counts(metadata: Mapping[str, Any], shards: Sequence[str]) -> list[int]:
    """Example count of each shard, from metadata['shards'] (a {file name: count} mapping)."""
    table = metadata.get("shards")
    if not isinstance(table, Mapping):
        raise ValueError(
            f"{METADATA_FILE}: key 'shards' must map shard file names to example counts"
        )
    counts = []
    for path in shards:
        name = path.rsplit("/", 1)[-1]
        if name not in table:
            raise ValueError(f"{METADATA_FILE}: key 'shards' has no example count for {name}")
        counts.append(int(table[name]))
    return counts


def dynamic_masking_config(metadata: Mapping[str, Any], word_start: np.ndarray | None) -> dict:
    """The `dynamic_masking` argument matching prepare.py's settings in `metadata`.

    Masks as prepare.py's static masking does: [CLS]/[SEP]/[PAD] are never candidates.
    `word_start` is the tokenizer's `word_start_table()`, needed only with whole-word masking.
    """
    try:
        special = metadata["special_ids"]
        cfg = {
            "vocab_size": int(metadata["vocab_size"]),
            "mask_id": int(special["mask"]),
            "special_ids": (int(special["cls"]), int(special["sep"]), int(special["pad"])),
            "masked_lm_prob": float(metadata["masked_lm_prob"]),
            "max_predictions_per_seq": int(metadata["max_predictions_per_seq"]),
            "whole_word": bool(metadata["whole_word_mask"]),
        }
    except (KeyError, TypeError) as err:
        raise ValueError(
            f"{METADATA_FILE}: missing or malformed key {err} for dynamic masking"
        ) from None
    if word_start is None and cfg["whole_word"]:
        raise ValueError(
            f"{METADATA_FILE}: whole_word_mask is true: pass the tokenizer's word_start"
        )
    cfg["word_start"] = np.ones(cfg["vocab_size"], bool) if word_start is None else word_start
    return cfg


def _stateless_seed(seed: int, tag: int, *values) -> tf.Tensor:
    """A [2] int64 stateless seed folding (seed, tag, *values) together."""
    key = tf.constant([seed, tag], tf.int64)
    for value in values:
        key = tf.random.experimental.stateless_fold_in(key, tf.cast(value, tf.int64))
    return key


def _feature_spec(meta: Mapping[str, Any], with_masks: bool) -> dict:
    seq, pred = int(meta["max_seq_length"]), int(meta["max_predictions_per_seq"])
    names = ("input_ids", "input_mask", "segment_ids")
    if meta.get("packing"):
        names += ("pack_ids", "position_ids")  # packed rows (bertjax.data.packing)
    spec = {name: tf.io.FixedLenFeature([seq], tf.int64) for name in names}
    nsp_default = None if meta["nsp"] else [0]
    spec["next_sentence_labels"] = tf.io.FixedLenFeature([1], tf.int64, default_value=nsp_default)
    if with_masks:
        spec["masked_lm_positions"] = tf.io.FixedLenFeature([pred], tf.int64)
        spec["masked_lm_ids"] = tf.io.FixedLenFeature([pred], tf.int64)
        spec["masked_lm_weights"] = tf.io.FixedLenFeature([pred], tf.float32)
    return spec


def _check_dynamic_masking(cfg: Mapping[str, Any]) -> dict:
    missing = [k for k in _DYNAMIC_MASKING_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"dynamic_masking: missing key(s) {missing}")
    cfg = dict(cfg)
    cfg["word_start"] = np.asarray(cfg["word_start"], bool)
    if cfg["word_start"].shape != (int(cfg["vocab_size"]),):
        raise ValueError(
            f"dynamic_masking: 'word_start' has shape {cfg['word_start'].shape}, "
            f"expected ({cfg['vocab_size']},)"
        )
    return cfg


def _unmask_batch(features: dict) -> dict:
    """Puts the original tokens back at the static masked positions and drops the static masks."""
    positions, weights = features["masked_lm_positions"], features["masked_lm_weights"]  # [b, pred]
    rows = tf.broadcast_to(tf.range(tf.shape(positions)[0])[:, None], tf.shape(positions))
    real = weights > 0
    index = tf.stack([tf.boolean_mask(rows, real), tf.boolean_mask(positions, real)], axis=-1)
    original = tf.tensor_scatter_nd_update(
        features["input_ids"], index, tf.boolean_mask(features["masked_lm_ids"], real)
    )  # [b, seq]
    out = {k: v for k, v in features.items() if k not in _MASKED_KEYS}
    return {**out, "input_ids": original}


def _mask_batch(features: dict, epochs, indices, *, seed: int, process_index: int, cfg) -> dict:
    """Masks every row of a parsed batch with a seed from (seed, epoch, process_index, index)."""
    word_start = tf.constant(cfg["word_start"])  # [vocab] bool
    pred = int(cfg["max_predictions_per_seq"])
    special_ids = sorted(int(i) for i in cfg["special_ids"])

    def mask_one(args):
        input_ids, input_mask, epoch, index = args  # [seq], [seq], [], []
        out = masking.tf_mask_tokens(
            input_ids,
            input_mask,
            _stateless_seed(seed, _TAG_MASK, epoch, process_index, index),
            word_start,
            vocab_size=int(cfg["vocab_size"]),
            mask_id=int(cfg["mask_id"]),
            special_ids=special_ids,
            masked_lm_prob=float(cfg["masked_lm_prob"]),
            max_predictions_per_seq=pred,
            whole_word=bool(cfg["whole_word"]),
        )
        return {k: out[k] for k in _MASKED_KEYS}

    masked = tf.map_fn(
        mask_one,
        (features["input_ids"], features["input_mask"], epochs, indices),
        fn_output_signature={
            "input_ids": tf.TensorSpec(features["input_ids"].shape[1:], tf.int32),
            "masked_lm_positions": tf.TensorSpec([pred], tf.int32),
            "masked_lm_ids": tf.TensorSpec([pred], tf.int32),
            "masked_lm_weights": tf.TensorSpec([pred], tf.float32),
        },
    )
    return {**features, **masked}


def pretraining_dataset(
    data_dir: str,
    split: str,
    per_host_batch_size: int,
    *,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    start_batch: int = 0,
    repeat: bool = True,
    shuffle: bool = True,
    shuffle_buffer: int = 10_000,
    dynamic_masking: Mapping[str, Any] | None = None,
    drop_remainder: bool = True,
) -> tf.data.Dataset:
    """Batches of pretraining examples for one host, starting after `start_batch` batches.

    Yields dicts: input_ids, input_mask, segment_ids [b, seq] int32; masked_lm_positions,
    masked_lm_ids [b, max_pred] int32; masked_lm_weights [b, max_pred] float32;
    next_sentence_labels [b] int32 (0 when the data has no NSP); packed data (metadata ``packing``)
    adds pack_ids, position_ids [b, seq] int32. The order is a pure function of
    (data, seed, process_index, process_count, per_host_batch_size, shuffle, shuffle_buffer); see
    the module docstring. `dynamic_masking` (keys: vocab_size, mask_id, special_ids, word_start,
    masked_lm_prob, max_predictions_per_seq, whole_word) re-masks every example with a stateless
    seed from (seed, epoch, process_index, index in epoch): fresh masks each epoch, identical ones
    after a resume. `repeat=False` yields a single epoch (epoch 0).
    """
    _warn_if_tf_sees_accelerators()
    if per_host_batch_size <= 0 or start_batch < 0 or shuffle_buffer <= 0:
        raise ValueError(
            f"need per_host_batch_size > 0, start_batch >= 0, shuffle_buffer > 0; got "
            f"{per_host_batch_size}, {start_batch}, {shuffle_buffer}"
        )
    meta = read_metadata(data_dir)
    files, by_record, epoch_examples = _host_input(data_dir, split, process_index, process_count)
    counts = shard_example_counts(meta, files)
    order_index = -1 if by_record else process_index  # split records: one file order for all
    if epoch_examples == 0:
        raise ValueError(f"{data_dir}: host {process_index} has 0 {split} examples in {files}")
    if dynamic_masking is None and meta["masking"] != "static":
        raise ValueError(
            f"{data_dir}/{METADATA_FILE}: masking is {meta['masking']!r}: records carry no masks, "
            "pass dynamic_masking"
        )
    mask_cfg = None if dynamic_masking is None else _check_dynamic_masking(dynamic_masking)

    first_epoch, first_offset = divmod(start_batch * per_host_batch_size, epoch_examples)
    end_epoch = np.iinfo(np.int64).max if repeat else 1
    cycle_length = min(len(files), _MAX_CYCLE_LENGTH)
    block = int(shuffle_buffer)

    all_files, all_counts = tf.constant(files), tf.constant(counts, tf.int64)
    through_fs = any(fs.is_gcs(f) for f in files)

    def read_shard(name: tf.Tensor) -> tf.data.Dataset:
        """A shard's records; an error once it holds more or fewer than metadata.json says."""
        count = tf.gather(all_counts, tf.argmax(tf.cast(tf.equal(all_files, name), tf.int32)))
        if through_fs:  # gs://: bertjax.fs's client (TensorFlow's cannot reach an emulator)
            shard = tf.data.Dataset.from_generator(
                records_lib.read_records,
                args=(name,),
                output_signature=tf.TensorSpec((), tf.string),
            )
        else:
            shard = tf.data.TFRecordDataset(name)
        return shard.apply(tf.data.experimental.assert_cardinality(count))

    def epoch_records(epoch: tf.Tensor) -> tf.data.Dataset:
        """(epoch, index in epoch, serialized record), starting at the resume offset."""
        skip = tf.where(
            epoch == first_epoch, tf.constant(first_offset, tf.int64), tf.constant(0, tf.int64)
        )
        names = tf.constant(files)
        if shuffle:
            names = tf.random.experimental.stateless_shuffle(
                names, seed=_stateless_seed(seed, _TAG_FILE_ORDER, epoch, order_index)
            )
        records = tf.data.Dataset.from_tensor_slices(names).interleave(
            read_shard,
            cycle_length=cycle_length,
            block_length=1,
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=True,
        )
        if by_record:
            records = records.shard(by_record[1], by_record[0])
        if shuffle:
            first_block = skip // block
            blocks = tf.data.Dataset.zip(
                tf.data.Dataset.range(first_block, np.iinfo(np.int64).max),
                records.skip(first_block * block).batch(block),
            )
            records = blocks.map(
                lambda b, recs: tf.random.experimental.stateless_shuffle(
                    recs, seed=_stateless_seed(seed, _TAG_BLOCK_SHUFFLE, epoch, process_index, b)
                )
            ).unbatch()
            records = records.skip(skip - first_block * block)
        else:
            records = records.skip(skip)
        return tf.data.Dataset.zip(
            tf.data.Dataset.from_tensors(epoch).repeat(),
            tf.data.Dataset.range(skip, np.iinfo(np.int64).max),
            records,
        )

    spec = _feature_spec(meta, with_masks=meta["masking"] == "static")

    def parse(epochs, indices, serialized):
        raw = tf.io.parse_example(serialized, spec)
        features = {
            k: tf.cast(v, tf.float32 if v.dtype == tf.float32 else tf.int32) for k, v in raw.items()
        }
        features["next_sentence_labels"] = features["next_sentence_labels"][:, 0]  # [b]
        if mask_cfg is not None:
            if meta["masking"] == "static":  # re-mask from the original tokens
                features = _unmask_batch(features)
            features = _mask_batch(
                features, epochs, indices, seed=seed, process_index=process_index, cfg=mask_cfg
            )
        return features

    ds = tf.data.Dataset.range(first_epoch, end_epoch).flat_map(epoch_records)
    ds = ds.batch(per_host_batch_size, drop_remainder=drop_remainder)
    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    options = tf.data.Options()
    options.deterministic = True
    # No model-based autotuning: its optimisation thread sleeps for up to a minute between rounds
    # and the iterator's deletion waits for it, so every phase ended with up to 60 s of nothing
    # (a 6-step tiny run: 35 s between its last evaluation and its end, 0.5 s without). AUTOTUNE
    # parallelism is then min(16, the runner's threads), and the prefetch buffer still grows on
    # demand; a 2-core host reads as many batches per second either way.
    options.autotune.enabled = False
    return ds.with_options(options).prefetch(tf.data.AUTOTUNE)


def _to_numpy(batch: Mapping[str, tf.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in batch.items()}


class PretrainingData:
    """The trainer's host-side iterator over `pretraining_dataset`, with a checkpointable position.

    `state()` is a small JSON-able dict, identical on every host except 'process_index' (which
    `restore` ignores), so saving it from one host is enough. Restoring with the same
    process_count and per_host_batch_size is exact: the next batch equals the one an uninterrupted
    run would yield. With a different process_count (or per-host batch size) the position is mapped
    by GLOBAL examples consumed, n * old_per_host * old_process_count, rounded down to a whole new
    global batch: the global example count (hence the learning-rate schedule and the fraction of
    the data seen) carries over exactly up to that rounding, but the order is NOT that of either
    run, because shards move between hosts and each host's epochs are seeded by its index and
    cover its own shards: within the current epoch some examples are repeated and others skipped,
    and the epoch number of each host is approximate (hosts hold different example counts).
    """

    def __init__(
        self,
        data_dir: str,
        split: str,
        per_host_batch_size: int,
        *,
        seed: int,
        process_index: int,
        process_count: int,
        dynamic_masking: Mapping[str, Any] | None = None,
        repeat: bool = True,
        shuffle: bool = True,
        shuffle_buffer: int = 10_000,
        drop_remainder: bool = True,
    ):
        _warn_if_tf_sees_accelerators()
        # Every argument is passed on to `pretraining_dataset` when the iterator is (re)built.
        self._args = {k: v for k, v in locals().items() if k != "self"}
        self._files, _, self._epoch_examples = _host_input(
            data_dir, split, process_index, process_count
        )
        self._batches_consumed = 0
        self._iterator: Iterator | None = None

    def __iter__(self) -> "PretrainingData":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._iterator is None:
            self._iterator = iter(
                pretraining_dataset(**self._args, start_batch=self._batches_consumed)
            )
        try:
            batch = next(self._iterator)
        except tf.errors.DataLossError as err:
            raise ShardCorruptedError(shard_faults.name_bad_shard(self._files, err)) from err
        except tf.errors.FailedPreconditionError as err:  # a shard's count is not metadata's
            meta = read_metadata(self._args["data_dir"])
            counts = shard_example_counts(meta, self._files)
            bad = shard_faults.name_miscounted_shard(self._files, counts)
            if bad is None:
                raise
            raise ShardCorruptedError(bad) from err
        except tf.errors.InvalidArgumentError as err:  # a valid record that is no valid example
            meta = read_metadata(self._args["data_dir"])
            spec = _feature_spec(meta, with_masks=meta["masking"] == "static")
            bad = shard_faults.name_bad_record(self._files, spec)
            if bad is None:
                raise
            raise ShardCorruptedError(bad) from err
        self._batches_consumed += 1
        return _to_numpy(batch)

    def state(self) -> dict:
        """JSON-able position: batches consumed plus what is needed to check or remap it."""
        a = self._args
        examples = self._batches_consumed * a["per_host_batch_size"]
        epoch, example_in_epoch = divmod(examples, self._epoch_examples)
        return {
            "batches_consumed": self._batches_consumed,
            "seed": a["seed"],
            "split": a["split"],
            "per_host_batch_size": a["per_host_batch_size"],
            "process_index": a["process_index"],
            "process_count": a["process_count"],
            "shuffle": a["shuffle"],
            "shuffle_buffer": a["shuffle_buffer"],
            "dynamic_masking": a["dynamic_masking"] is not None,
            "global_examples_consumed": examples * a["process_count"],
            "epoch": epoch,  # of this host; informational
            "example_in_epoch": example_in_epoch,  # of this host; informational
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continues from `state` (see the class docstring for what is exact when hosts change)."""
        a = self._args
        required = ("batches_consumed", "seed", "split", "per_host_batch_size", "process_count")
        same = {k: a[k] for k in ("seed", "split", "shuffle", "shuffle_buffer")}
        check_state(state, required, {**same, "dynamic_masking": a["dynamic_masking"] is not None})
        batches = int(state["batches_consumed"])
        old_global = int(state["per_host_batch_size"]) * int(state["process_count"])
        new_global = a["per_host_batch_size"] * a["process_count"]
        if old_global != new_global or int(state["process_count"]) != a["process_count"]:
            global_examples = batches * old_global
            batches = global_examples // new_global
            logging.info(
                "data: remapped %d global examples (%d hosts) to %d batches on %d hosts",
                global_examples,
                state["process_count"],
                batches,
                a["process_count"],
            )
        self._batches_consumed = batches
        self._iterator = None  # Rebuilt lazily at the next __next__.
