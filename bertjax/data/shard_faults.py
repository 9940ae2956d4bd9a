"""One-line errors naming the prepared shard behind a failure of the interleaved record stream
(which loses the file names): a corrupted or cut record, a record that is no prepared example, or
a shard holding more or fewer records than ``metadata.json`` says (cut at a record boundary)."""

import re
from collections.abc import Mapping, Sequence

import tensorflow as tf

from bertjax.data.metadata import METADATA_FILE


class ShardCorruptedError(ValueError):
    """A TFRecord shard is truncated or corrupted (the message names the file)."""


def name_bad_shard(files: Sequence[str], err: tf.errors.DataLossError) -> str:
    """One line naming the shard behind a DataLossError: each file is read through until one
    fails."""
    reason = " ".join(str(err.message).split())
    for path in files:
        try:
            for _ in tf.data.TFRecordDataset(path):
                pass
        except tf.errors.DataLossError as bad:
            reason = " ".join(str(bad.message).split())
            return f"{path}: corrupted or truncated TFRecord shard ({reason}); prepare it again"
    return f"one of {len(files)} shard(s) is corrupted or truncated ({reason}): {files}"


def name_miscounted_shard(files: Sequence[str], counts: Sequence[int]) -> str | None:
    """One line naming the first shard whose record count is not ``metadata.json``'s (a file cut
    at a record boundary, or rewritten); None when every count agrees."""
    for path, expected in zip(files, counts, strict=True):
        actual = sum(1 for _ in tf.data.TFRecordDataset(path))
        if actual != expected:
            return (
                f"{path}: {actual} records, but {METADATA_FILE} says {expected} "
                f"({'truncated' if actual < expected else 'rewritten'}?); prepare it again"
            )
    return None


def name_bad_record(files: Sequence[str], spec: Mapping[str, tf.io.FixedLenFeature]) -> str | None:
    """One line naming the shard and record that does not parse with ``spec`` (a feature missing
    or of the wrong length); None when every record parses."""
    for path in files:
        for first, records in enumerate(tf.data.TFRecordDataset(path).batch(256)):
            try:
                tf.io.parse_example(records, spec)
                continue
            except tf.errors.InvalidArgumentError:
                pass
            for i, record in enumerate(records):
                try:
                    tf.io.parse_single_example(record, spec)
                except tf.errors.InvalidArgumentError as bad:
                    reason = re.sub(r"\{\{.*?\}\}|\[Op:\w+\]", "", str(bad.message))
                    reason = " ".join(reason.split())
                    return (
                        f"{path}: record {first * 256 + i} is not a prepared example of this data "
                        f"set ({reason}); prepare it again"
                    )
    return None
