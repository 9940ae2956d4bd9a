"""Fine-tuning batches packed one at a time: the same examples per step, in fewer rows.

``data.packing`` packs the whole training set once and then counts a batch in rows, so a step
trains on more examples than ``train.global_batch_size`` (another run). ``BatchPacked`` keeps the
unpacked run's batches instead: each global batch of ``global_batch_size`` examples (the same
examples, in the same order, as unpacked training draws) is packed into as few rows as it needs,
rounded up to one of a few row counts (``row_buckets``: jit compiles one step per count used).
Losses average over the batch's examples (``example_weights``), so a step's loss and gradient
equal the unpacked step's, to float rounding, with dropout off; with dropout on the masks fall
elsewhere (the same rate). On GLUE SST-2 at 64 tokens, a batch of 32 examples needs 9 rows on
average (buckets 8 and 16).

Every host packs the whole global batch (all hosts hold all features) and takes its share of the
rows, so hosts agree on the row count without talking; the position is the wrapped ``ArrayData``'s
(global examples), so ``state``/``restore`` are exact for any host count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from bertjax.data import packing
from bertjax.data.array_data import ArrayData


def row_buckets(global_batch_size: int, shards: int, levels: int = 4) -> list[int]:
    """Row counts a packed batch is padded to: the batch size halved ``levels - 1`` times, each
    rounded up to a multiple of ``shards`` (the devices a batch is split over), ascending."""
    sizes = {-(-max(1, global_batch_size >> k) // shards) * shards for k in range(levels)}
    return sorted(sizes)


class BatchPacked:
    """Packs each global batch of an ``ArrayData`` (built with ``process_count=1``: the global
    batch) into rows; yields this host's rows. Iterator with ``state``/``restore``."""

    def __init__(
        self,
        data: ArrayData,
        *,
        max_examples_per_row: int,
        buckets: list[int],
        process_index: int = 0,
        process_count: int = 1,
    ):
        if any(b % process_count for b in buckets):
            raise ValueError(f"row buckets {buckets} must divide among {process_count} hosts")
        self.data, self.buckets = data, sorted(buckets)
        self.max_examples_per_row = max_examples_per_row
        self._index, self._count = process_index, process_count

    def __iter__(self) -> BatchPacked:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self.data)
        batch.pop("mask")  # all ones: a training stream (repeat=True) has no padding examples
        packed, _ = packing.pack_features(batch, self.max_examples_per_row)
        rows = len(packed["input_ids"])
        target = next((b for b in self.buckets if b >= rows), None)
        if target is None:  # more rows than examples cannot happen; buckets end at the batch size
            raise ValueError(f"a batch packed into {rows} rows, over the largest bucket")
        padded = {k: _pad_rows(v, target) for k, v in packed.items()}
        padded["mask"] = (np.arange(target) < rows).astype(np.float32)  # [rows]
        share = target // self._count
        mine = slice(self._index * share, (self._index + 1) * share)
        return {k: v[mine] for k, v in padded.items()}

    def state(self) -> dict:
        return self.data.state()

    def restore(self, state: Mapping[str, Any]) -> None:
        self.data.restore(state)


def _pad_rows(value: np.ndarray, rows: int) -> np.ndarray:
    """Pads [r, ...] to [rows, ...] with copies of row 0 (weighted 0 by ``mask``)."""
    extra = rows - len(value)
    if extra <= 0:
        return value
    return np.concatenate([value, np.repeat(value[:1], extra, axis=0)])
