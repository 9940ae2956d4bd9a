"""Static masking and serialization of many rows at once: the bytes of `instances.instance_to_example`
and `instances.packed_to_example`, row by row, at a fraction of the per-row cost.

A row's random draws are taken when it is added (`add`), in the same calls and order as
`masking.create_masked_lm_predictions` makes them (three `rng.random(n)` are one `rng.random(3 * n)`:
doubles use one 64-bit output each), so the generator stream, and hence every later draw of the
instance algorithm, is unchanged. Masking (`_select`) and the protobuf varints are then computed in
NumPy over the whole batch; records are emitted in the order rows were added.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from bertjax.data import masking
from bertjax.data.records import example_bytes, packed_feature

_BATCH_ROWS = 256
_ONE_F32, _ZERO_F32 = np.float32(1.0).tobytes(), np.float32(0.0).tobytes()


def varint_rows(values: np.ndarray, lengths: np.ndarray) -> list[bytes]:
    """Packed protobuf varints of consecutive rows of non-negative int64 `values` ([sum(lengths)])."""
    v = values.astype(np.uint64)
    nbytes = np.ones(len(v), np.int64)
    limit = 7
    while limit < 64 and len(v) and int(v.max()) >> limit:
        nbytes += v >= np.uint64(1 << limit)
        limit += 7
    width = int(nbytes.max()) if len(v) else 1
    out = np.empty((len(v), width), np.uint8)  # [values, bytes]
    for k in range(width):
        more = (nbytes > k + 1).astype(np.uint64) << np.uint64(7)
        out[:, k] = ((v >> np.uint64(7 * k)) & np.uint64(0x7F)) | more
    blob = out[np.arange(width)[None, :] < nbytes[:, None]].tobytes()
    ends = np.concatenate([[0], np.cumsum(nbytes)])  # byte offset after k values
    bounds = ends[np.concatenate([[0], np.cumsum(lengths)])].tolist()
    return [blob[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


class ExampleBatch:
    """Buffers rows, masks (static) and serializes them in batches, calling `emit(record)` in order.

    `cfg` is the PrepareConfig; `consts` holds vocab_size, mask_id, pad_id, special_ids and
    word_start (as `units.process_unit` builds them).
    """

    def __init__(self, cfg, consts: dict, emit: Callable[[bytes], None], size: int = _BATCH_ROWS):
        self.cfg, self.consts, self.emit, self.size = cfg, consts, emit, size
        self.static = cfg.masking == "static"
        self.rows: list[tuple] = []
        self.pad = varint_rows(np.array([consts["pad_id"]]), np.array([1]))[0]

    def add(
        self,
        ids: list[int],
        num_a: int,
        next_sentence_label: int,
        rng: np.random.Generator,
        extra: dict[str, list[int]] | None = None,
    ) -> None:
        """One row of real tokens: segment 0 for the first num_a tokens, then segment 1."""
        draws = None
        if self.static:
            n = len(ids)
            draws = (rng.random(3 * n), rng.integers(0, self.consts["vocab_size"], n))
        self.rows.append((ids, num_a, next_sentence_label, draws, extra))
        if len(self.rows) >= self.size:
            self.flush()

    def flush(self) -> None:
        """Emits the records of every buffered row."""
        if not self.rows:
            return
        rows, self.rows = self.rows, []
        seq, cfg = self.cfg.max_seq_length, self.cfg
        lengths = np.array([len(r[0]) for r in rows])
        flat = np.fromiter(itertools.chain.from_iterable(r[0] for r in rows), np.int64)
        extras = [{}] * len(rows)
        if self.static:
            flat, positions, labels, counts = self._mask(rows, flat, lengths)
            pos_bytes = varint_rows(positions, counts)
            label_bytes = varint_rows(labels, counts)
        ids_bytes = varint_rows(flat, lengths)
        if rows[0][4] is not None:
            extras = [
                {
                    k: (varint_rows(np.array(v), np.array([len(v)]))[0], len(v))
                    for k, v in r[4].items()
                }
                for r in rows
            ]
        for i, (_, num_a, label, _, _) in enumerate(rows):
            n = int(lengths[i])
            features = {
                "input_ids": packed_feature(ids_bytes[i] + self.pad * (seq - n)),
                "input_mask": packed_feature(b"\x01" * n + b"\x00" * (seq - n)),
                "segment_ids": packed_feature(
                    b"\x00" * num_a + b"\x01" * (n - num_a) + b"\x00" * (seq - n)
                ),
                "next_sentence_labels": packed_feature(bytes([label])),
            }
            for key, (packed, count) in extras[i].items():
                features[key] = packed_feature(packed + b"\x00" * (seq - count))
            if self.static:
                k = int(counts[i])
                pad = cfg.max_predictions_per_seq - k
                features["masked_lm_positions"] = packed_feature(pos_bytes[i] + b"\x00" * pad)
                features["masked_lm_ids"] = packed_feature(label_bytes[i] + b"\x00" * pad)
                features["masked_lm_weights"] = packed_feature(
                    _ONE_F32 * k + _ZERO_F32 * pad, kind="float"
                )
            self.emit(example_bytes(features))

    def _mask(self, rows, flat: np.ndarray, lengths: np.ndarray):
        """Masked ids (flat), positions and labels (flat, row-major) and counts [rows]."""
        c, cfg = self.consts, self.cfg
        num, width = len(rows), int(lengths.max())
        valid = np.arange(width)[None, :] < lengths[:, None]  # [rows, width]
        ids = np.zeros((num, width), np.int64)
        ids[valid] = flat
        draws = np.concatenate([r[3][0] for r in rows])  # per row: keys, u_mask, u_keep
        starts = np.concatenate([[0], np.cumsum(3 * lengths)[:-1]])  # [rows]
        j = np.arange(width)[None, :]
        index = np.where(valid, starts[:, None] + j, 0)
        keys = draws[index]
        u_mask = draws[index + lengths[:, None]]
        u_keep = draws[np.where(valid, index + 2 * lengths[:, None], 0)]
        random_ids = np.zeros((num, width), np.int64)
        random_ids[valid] = np.concatenate([r[3][1] for r in rows])
        is_cand = valid.copy()
        for special in c["special_ids"]:
            is_cand &= ids != special
        budget = np.minimum(
            cfg.max_predictions_per_seq,
            np.maximum(1, np.rint(lengths * cfg.masked_lm_prob).astype(np.int64)),
        )  # = masking.num_to_predict per row (round half to even)
        if c["word_start"] is None:  # the first `budget` candidates of each row by key
            order = np.argsort(np.where(is_cand, keys, 2.0), axis=1, kind="stable")
            rank = np.empty_like(order)
            np.put_along_axis(rank, order, np.broadcast_to(j, order.shape), axis=1)
            selected = is_cand & (rank < budget[:, None])
        else:
            selected = _whole_words(ids, is_cand, keys, budget, c["word_start"])
        replaced = np.where(u_keep < masking.KEEP_PROB, ids, random_ids)
        masked = np.where(
            selected, np.where(u_mask < masking.MASK_PROB, c["mask_id"], replaced), ids
        )
        positions = np.broadcast_to(j, ids.shape)[selected]
        return masked[valid], positions, ids[selected], selected.sum(axis=1)


def _whole_words(ids, is_cand, keys, budget, word_start) -> np.ndarray:
    """[rows, width] bool: whole-word groups taken greedily in key order, as
    `masking.whole_word_positions` per row, for all rows at once.

    Greedy "take the group if it still fits", in rounds: groups larger than what is left never fit
    later; of the others, the leading run whose running size fits is taken (what the greedy visit
    takes too); every round takes at least one group (as in the TensorFlow twin in masking).
    """
    width = ids.shape[1]
    prev = np.zeros_like(is_cand)
    prev[:, 1:] = is_cand[:, :-1]
    starts = is_cand & (word_start[ids] | ~prev)  # [rows, width]
    pos = np.broadcast_to(np.arange(width), ids.shape)
    start_of = np.maximum.accumulate(np.where(starts, pos, -1), axis=1)  # group start per position
    rows = np.broadcast_to(np.arange(len(ids))[:, None], ids.shape)
    sizes = np.zeros(ids.shape, np.int64)  # by start position
    np.add.at(sizes, (rows[is_cand], start_of[is_cand]), 1)
    order = np.argsort(np.where(starts, keys, 2.0), axis=1, kind="stable")  # groups by key
    sorted_sizes = np.where(
        np.take_along_axis(starts, order, axis=1), np.take_along_axis(sizes, order, axis=1), 0
    )
    left = budget.astype(np.int64).copy()
    undecided, taken = sorted_sizes > 0, np.zeros_like(starts)
    while undecided.any():
        undecided &= sorted_sizes <= left[:, None]
        running = np.cumsum(np.where(undecided, sorted_sizes, 0), axis=1)
        take = undecided & (running <= left[:, None])
        taken |= take
        undecided &= ~take
        left -= np.where(take, sorted_sizes, 0).sum(axis=1)
    taken_start = np.zeros_like(starts)
    np.put_along_axis(taken_start, order, taken, axis=1)
    return is_cand & np.take_along_axis(taken_start, np.maximum(start_of, 0), axis=1)
