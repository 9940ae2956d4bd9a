"""Rows of pretraining records built, masked (static) and serialized a batch at a time, in NumPy.

`ExampleBatch` takes instances as spans of documents (`spans.Span`) or as ready rows (packed
rows), and per batch of rows:

1. lays the rows out as `[CLS] A [SEP] B [SEP]` in a [rows, seq] matrix;
2. static masking, the original algorithm (`masking`): num_to_predict positions per row
   (round(real tokens * masked_lm_prob), at least 1, at most max_predictions_per_seq), chosen
   uniformly among the candidates (not [CLS]/[SEP]/[PAD]): the candidates with the smallest uniform
   keys; with whole-word masking, whole words taken greedily in key order while they fit. Each chosen
   position becomes [MASK] with prob 0.8, stays with prob 0.1, becomes a uniform random id with
   prob 0.1. The draws are taken for the whole batch at once;
3. serializes the rows as `tf.train.Example`s (`example_codec`) and hands the records, in the order
   the rows were added, to `emit(blob, lengths)`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from bertjax.data import masking
from bertjax.data.example_codec import encode_examples
from bertjax.data.spans import Span

_BATCH_ROWS = 2048


class ExampleBatch:
    """Buffers instances; `flush` masks and serializes them (see the module docstring).

    `cfg` is the PrepareConfig; `consts` holds vocab_size, mask_id, cls_id, sep_id, pad_id,
    special_ids and word_start (as `units.process_unit` builds them); `rng` gives every draw.
    """

    def __init__(
        self,
        cfg,
        consts: dict,
        emit: Callable[[bytes, list[int]], None],
        rng: np.random.Generator,
        size: int = _BATCH_ROWS,
    ):
        self.cfg, self.consts, self.emit, self.rng, self.size = cfg, consts, emit, rng, size
        self.items: list = []
        self._cls = np.array([consts["cls_id"]], np.int32)
        self._sep = np.array([consts["sep_id"]], np.int32)

    def add_spans(self, spans: list[Span]) -> None:
        """Instances of `spans.document_spans`."""
        self.items += spans
        if len(self.items) >= self.size:
            self.flush()

    def add_row(
        self, ids: np.ndarray, num_a: int, label: int, extra: dict[str, np.ndarray] | None = None
    ) -> None:
        """A ready row of real tokens (segment 0 for the first num_a, then 1); `extra`: more
        int features of the row ([len] arrays, zero-padded to the sequence length)."""
        self.items.append((ids, num_a, label, extra))
        if len(self.items) >= self.size:
            self.flush()

    def _layout(self, items: list):
        """(flat ids, lengths [rows], num_a [rows], labels [rows], extras) of the items."""
        pieces, num_a, labels, lengths, extras = [], [], [], [], []
        cls, sep = self._cls, self._sep
        for item in items:
            if isinstance(item, Span):
                pieces += (cls, item.a[item.a_start : item.a_stop], sep)
                n = item.a_stop - item.a_start + 2
                num_a.append(n)
                if item.b_stop > item.b_start:
                    pieces += (item.b[item.b_start : item.b_stop], sep)
                    n += item.b_stop - item.b_start + 1
                lengths.append(n)
                labels.append(int(item.is_random_next))
                extras.append(None)
            else:
                ids, na, label, extra = item
                pieces.append(ids)
                lengths.append(len(ids))
                num_a.append(na)
                labels.append(label)
                extras.append(extra)
        flat = np.concatenate(pieces).astype(np.int64)
        return flat, np.array(lengths, np.int64), np.array(num_a, np.int64), labels, extras

    def flush(self) -> None:
        """Emits the records of every buffered instance."""
        if not self.items:
            return
        items, self.items = self.items, []
        cfg, c = self.cfg, self.consts
        seq = cfg.max_seq_length
        flat, lengths, num_a, labels, extras = self._layout(items)
        rows = len(items)
        j = np.arange(seq)[None, :]
        valid = j < lengths[:, None]  # [rows, seq]
        ids = np.full((rows, seq), c["pad_id"], np.int64)
        ids[valid] = flat
        features = [
            ("input_mask", valid.astype(np.int64)),
            ("segment_ids", (valid & (j >= num_a[:, None])).astype(np.int64)),
            ("next_sentence_labels", np.array(labels, np.int64)[:, None]),
        ]
        if extras[0] is not None:
            for key in extras[0]:
                values = np.zeros((rows, seq), np.int64)
                for r, extra in enumerate(extras):
                    values[r, : len(extra[key])] = extra[key]
                features.append((key, values))
        if cfg.masking == "static":
            ids, masked = self._mask(ids, valid, lengths)
            features += masked
        features.append(("input_ids", ids))
        blob, lengths = encode_examples(features)
        self.emit(blob, lengths.tolist())

    def _mask(self, ids: np.ndarray, valid: np.ndarray, lengths: np.ndarray):
        """Masked ids [rows, seq] and the masked_lm_* features (step 2 of the module docstring)."""
        c, cfg, rng = self.consts, self.cfg, self.rng
        rows, seq = ids.shape
        pred = cfg.max_predictions_per_seq
        is_cand = valid.copy()
        for special in c["special_ids"]:
            is_cand &= ids != special
        budget = np.minimum(pred, np.maximum(1, np.rint(lengths * cfg.masked_lm_prob))).astype(
            np.int64
        )  # = masking.num_to_predict per row (round half to even)
        keys = rng.random((rows, seq))
        if c["word_start"] is None:  # the `budget` candidates with the smallest keys
            keys[~is_cand] = 2.0
            k = min(pred, seq)
            smallest = np.partition(keys, k - 1, axis=1)[:, :k]
            smallest.sort(axis=1)
            threshold = smallest[np.arange(rows), budget - 1]
            selected = is_cand & (keys <= threshold[:, None])
        else:
            selected = _whole_words(ids, is_cand, keys, budget, c["word_start"])
        row, col = np.nonzero(selected)  # row-major: positions sorted within a row
        labels = ids[row, col]
        count = len(labels)
        u = rng.random(count)
        random_ids = rng.integers(0, c["vocab_size"], count)
        kept = np.where(
            u < masking.MASK_PROB + (1 - masking.MASK_PROB) * masking.KEEP_PROB, labels, random_ids
        )
        masked = ids.copy()
        masked[row, col] = np.where(u < masking.MASK_PROB, c["mask_id"], kept)
        per_row = selected.sum(axis=1)
        slot = np.arange(count) - np.repeat(np.cumsum(per_row) - per_row, per_row)
        positions = np.zeros((rows, pred), np.int64)
        positions[row, slot] = col
        label_ids = np.zeros((rows, pred), np.int64)
        label_ids[row, slot] = labels
        weights = (np.arange(pred)[None, :] < per_row[:, None]).astype(np.float32)
        return masked, [
            ("masked_lm_positions", positions),
            ("masked_lm_ids", label_ids),
            ("masked_lm_weights", weights),
        ]


def _whole_words(ids, is_cand, keys, budget, word_start, top: int = 32) -> np.ndarray:
    """[rows, width] bool: whole-word groups taken greedily in key order while they fit, as
    `masking.whole_word_positions` per row, for all rows at once.

    A group is a word start and the candidates after it up to the next start or non-candidate. The
    greedy visit runs over each row's `top` groups of smallest key (enough for nearly every row:
    it stops when the budget is spent); a row with budget left and unvisited groups that could
    still fit is done again over all its groups (`_whole_words_full`).
    """
    rows, width = ids.shape
    prev = np.zeros_like(is_cand)
    prev[:, 1:] = is_cand[:, :-1]
    starts = is_cand & (word_start[ids] | ~prev)  # [rows, width]
    # first break (a start, a non-candidate or a row's first position) after each position
    breaks = starts | ~is_cand
    breaks[:, 0] = True
    flat = np.arange(rows * width)
    index = np.where(breaks.ravel(), flat, rows * width)
    after = np.empty(rows * width + 1, np.int64)
    after[-1] = rows * width
    after[:-1] = np.minimum.accumulate(index[::-1])[::-1]
    group_keys = np.where(starts, keys, 2.0)
    top = min(top, width)
    if top < width:
        first = np.argpartition(group_keys, top - 1, axis=1)[:, :top]
    else:
        first = np.broadcast_to(np.arange(width), (rows, width))
    first = np.take_along_axis(
        first, np.argsort(np.take_along_axis(group_keys, first, axis=1), axis=1), axis=1
    )  # [rows, top] positions of the smallest keys, in key order
    at = first + (np.arange(rows) * width)[:, None]  # flat positions
    visit = np.where(np.take_along_axis(starts, first, axis=1), after[at + 1] - at, 0)
    left = budget.astype(np.int64)
    taken = np.zeros(visit.shape, bool)
    for col in range(top):  # the greedy visit; 0 = "not a group"
        size = visit[:, col]
        take = (size > 0) & (size <= left)
        taken[:, col] = take
        left = left - np.where(take, size, 0)
    selected = np.zeros(rows * width, bool)
    begin, size = at[taken], visit[taken]
    for offset in range(int(size.max()) if len(size) else 0):  # groups are short
        selected[(begin + offset)[offset < size]] = True
    selected = selected.reshape(rows, width)
    open_rows = np.flatnonzero(left > 0)
    if len(open_rows):  # unvisited groups that might still fit: the full visit for those rows
        seen = np.zeros((len(open_rows), width), bool)
        np.put_along_axis(seen, first[open_rows], True, axis=1)
        unseen = starts[open_rows] & ~seen
        row_at = (open_rows * width)[:, None] + np.arange(width)
        sizes = after[row_at + 1] - row_at
        redo = open_rows[(unseen & (sizes <= left[open_rows, None])).any(axis=1)]
        if len(redo):
            selected[redo] = _whole_words_full(
                ids[redo], is_cand[redo], keys[redo], budget[redo], word_start
            )
    return selected


def _whole_words_full(ids, is_cand, keys, budget, word_start) -> np.ndarray:
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
