"""Sequence packing: several short sequences per row, for pretraining and fine-tuning alike.

A packed row holds whole sequences one after another (none is ever split across rows), then padding.
Besides the usual ``input_ids`` / ``input_mask`` / ``segment_ids`` every packed row carries

* ``pack_ids`` [seq]: 1..n, the sequence of the row each token belongs to (0 = padding); the model
  builds its block-diagonal attention mask from it (``modeling.attention_bias``);
* ``position_ids`` [seq]: restarting at 0 at every sequence (0 on padding).

Fine-tuning rows (``pack_features``) hold at most ``max_examples_per_row`` examples and carry, per
slot, ``cls_positions`` [k] (the offset of each example's [CLS], 0 for an empty slot) and
``example_weights`` [k] (1.0 for a real example, 0.0 for an empty slot); example-level arrays such as
``label`` [n] become [rows, k]. ``PackedLayout`` records where every example went, so outputs map
back to the original example order (``unpack_examples``, ``unpack_tokens``).

Packing is first-fit over a bounded window of open rows (``Packer``): an item goes into the oldest
open row with room for it, else it opens a new row; a row closes when it is full (less room left
than the shortest possible item, or ``max_items`` items), and when more than ``window`` rows are open
the oldest one closes. The rows are a pure function of the sequence of item lengths (deterministic).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

WINDOW = 64  # open rows of the first-fit packer (pretraining and fine-tuning)
PACKED_KEYS = ("pack_ids", "position_ids")
SLOT_KEYS = ("cls_positions", "example_weights")


class Packer:
    """Streaming first-fit packing of items of known length into rows of ``capacity`` tokens."""

    def __init__(
        self, capacity: int, *, max_items: int = 0, window: int = WINDOW, min_length: int = 1
    ):
        """``max_items`` > 0 caps the items per row; ``min_length`` is the shortest item possible
        (a row with less room left is closed at once); ``window`` bounds the open rows."""
        if capacity < 1 or window < 1 or max_items < 0 or min_length < 1:
            raise ValueError(
                f"Packer: need capacity >= 1, window >= 1, max_items >= 0, min_length >= 1; got "
                f"{capacity}, {window}, {max_items}, {min_length}"
            )
        self.capacity, self.max_items = capacity, max_items
        self.window, self.min_length = window, min_length
        self._rows: list[list[Any]] = []  # items of every open row, oldest first
        self._free: list[int] = []  # room left in every open row

    def add(self, item: Any, length: int) -> list[list[Any]]:
        """Places ``item`` (``length`` tokens); returns the rows this closed (oldest first)."""
        if not 0 < length <= self.capacity:
            raise ValueError(f"Packer: item length {length} not in [1, {self.capacity}]")
        row = next((r for r, free in enumerate(self._free) if free >= length), None)
        if row is None:
            row = len(self._rows)
            self._rows.append([])
            self._free.append(self.capacity)
        self._rows[row].append(item)
        self._free[row] -= length
        closed = []
        if self._free[row] < self.min_length or len(self._rows[row]) == self.max_items:
            closed.append(self._close(row))
        while len(self._rows) > self.window:
            closed.append(self._close(0))
        return closed

    def flush(self) -> list[list[Any]]:
        """Closes and returns every open row (oldest first)."""
        rows, self._rows, self._free = self._rows, [], []
        return rows

    def _close(self, row: int) -> list[Any]:
        self._free.pop(row)
        return self._rows.pop(row)


def pack(
    lengths: Sequence[int],
    capacity: int,
    *,
    max_items: int = 0,
    window: int = WINDOW,
    min_length: int = 1,
) -> list[list[int]]:
    """Rows of item indices (in packing order) for items of the given lengths (see ``Packer``)."""
    packer = Packer(capacity, max_items=max_items, window=window, min_length=min_length)
    rows = []
    for index, length in enumerate(lengths):
        rows.extend(packer.add(index, int(length)))
    return rows + packer.flush()


def row_layout(lengths: Sequence[int], seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pack_ids [seq], position_ids [seq], starts [n]) of sequences laid end to end in one row."""
    lengths = np.asarray(lengths, np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)  # [n]
    used = int(lengths.sum())
    if used > seq_len:
        raise ValueError(f"packed row: {used} tokens do not fit in {seq_len}")
    pack_ids = np.zeros(seq_len, np.int64)
    pack_ids[:used] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    position_ids = np.zeros(seq_len, np.int64)
    position_ids[:used] = np.arange(used) - np.repeat(starts, lengths)
    return pack_ids, position_ids, starts


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where every example of ``pack_features`` went: row, slot (index in the row), start offset
    and length in tokens, each [n]; ``num_rows`` and ``seq_len`` of the packed arrays."""

    row: np.ndarray
    slot: np.ndarray
    start: np.ndarray
    length: np.ndarray
    num_rows: int
    seq_len: int


def _pad_value(values: np.ndarray, padded: np.ndarray) -> Any:
    """The value a token array holds at padded positions (0 when no position is padded)."""
    return values[padded][0] if padded.any() else 0


def pack_features(
    features: Mapping[str, np.ndarray], max_examples_per_row: int, *, window: int = WINDOW
) -> tuple[dict[str, np.ndarray], PackedLayout]:
    """Packs fine-tuning features [n, ...] into rows; returns (packed features, layout).

    Token arrays (leading shape [n, seq], e.g. input_ids, label_ids) keep each example's first
    ``input_mask.sum()`` tokens, placed at its offset in its row; the rest of a row holds the value
    the array has at padded positions of the input (e.g. [PAD], -1 for ignored labels). Other arrays
    are per example and become [rows, k] (0 in empty slots). Adds pack_ids, position_ids [rows, seq]
    int32, cls_positions [rows, k] int32 and example_weights [rows, k] float32.
    """
    if max_examples_per_row < 1:
        raise ValueError(f"config key data.max_examples_per_row={max_examples_per_row}: need >= 1")
    taken = [k for k in (*PACKED_KEYS, *SLOT_KEYS) if k in features]
    if taken:
        raise ValueError(f"pack_features: the features are packed already (they hold {taken})")
    mask = np.asarray(features["input_mask"])  # [n, seq]
    n, seq = mask.shape
    lengths = mask.sum(axis=1).astype(np.int64)  # [n]
    real = np.arange(seq)[None, :] < lengths[:, None]  # [n, seq]
    if not np.array_equal(real, mask != 0) or (lengths < 1).any():
        raise ValueError("pack_features: every example needs a non-empty input_mask prefix of 1s")
    rows = pack(lengths, seq, max_items=max_examples_per_row, window=window, min_length=2)
    layout = _layout(rows, lengths, n, seq)
    src_i, src_j = np.nonzero(real)  # every real token: (example, position)
    dst_r, dst_j = layout.row[src_i], layout.start[src_i] + src_j
    shape = (layout.num_rows, max_examples_per_row)  # [rows, k]
    out: dict[str, np.ndarray] = {}
    for key, value in features.items():
        value = np.asarray(value)
        if value.shape[:2] == (n, seq):
            packed = np.full((layout.num_rows, *value.shape[1:]), _pad_value(value, ~real))
            packed = packed.astype(value.dtype)
            packed[dst_r, dst_j] = value[src_i, src_j]
        else:
            packed = np.zeros((*shape, *value.shape[1:]), value.dtype)
            packed[layout.row, layout.slot] = value
        out[key] = packed
    for key in PACKED_KEYS:
        out[key] = np.zeros((layout.num_rows, seq), np.int32)  # [rows, seq]
    out["pack_ids"][dst_r, dst_j] = layout.slot[src_i] + 1
    out["position_ids"][dst_r, dst_j] = src_j
    out["cls_positions"] = np.zeros(shape, np.int32)
    out["cls_positions"][layout.row, layout.slot] = layout.start
    out["example_weights"] = np.zeros(shape, np.float32)
    out["example_weights"][layout.row, layout.slot] = 1.0
    return out, layout


def _layout(rows: list[list[int]], lengths: np.ndarray, n: int, seq: int) -> PackedLayout:
    row, slot, start = (np.zeros(n, np.int64) for _ in range(3))
    for r, members in enumerate(rows):
        members = np.asarray(members, np.int64)
        row[members] = r
        slot[members] = np.arange(len(members))
        start[members] = row_layout(lengths[members], seq)[2]
    return PackedLayout(row, slot, start, lengths, len(rows), seq)


def unpack_examples(values: np.ndarray, layout: PackedLayout) -> np.ndarray:
    """Per-slot outputs [rows, k, ...] -> per-example outputs [n, ...] in the original order."""
    return np.asarray(values)[layout.row, layout.slot]


def unpack_tokens(values: np.ndarray, layout: PackedLayout, fill: Any = 0) -> np.ndarray:
    """Per-token outputs [rows, seq, ...] -> [n, seq, ...], each example back at offset 0 as it
    was before packing (``fill`` after its last token)."""
    values = np.asarray(values)
    seq = layout.seq_len
    offsets = np.arange(seq)[None, :]  # [1, seq]
    inside = offsets < layout.length[:, None]  # [n, seq]
    cols = np.where(inside, layout.start[:, None] + offsets, 0)  # [n, seq]
    out = values[layout.row[:, None], cols]  # [n, seq, ...]
    inside = inside.reshape(*inside.shape, *([1] * (values.ndim - 2)))
    return np.where(inside, out, np.asarray(fill, values.dtype))
