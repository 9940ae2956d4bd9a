"""Masked-LM masking as in the original BERT `create_masked_lm_predictions`, in NumPy and in TensorFlow.

Algorithm (both versions):
  1. Candidates are the real tokens (input_mask == 1) other than the special ids ([CLS], [SEP], [PAD]).
     Without whole-word masking every candidate is its own group; with it, a group is a word-start
     token followed by its continuation pieces (`word_start[id]` False), never crossing a non-candidate.
  2. num_to_predict = min(max_predictions_per_seq, max(1, round(num_real_tokens * masked_lm_prob)))
     (round half to even, as Python's `round`), where num_real_tokens includes [CLS]/[SEP].
  3. Groups are visited in a random order; a group is taken when it still fits entirely
     (taken + len(group) <= num_to_predict), so whole words stay intact and the count never exceeds
     num_to_predict.
  4. Each taken position independently becomes [MASK] with prob 0.8, else stays unchanged with prob 0.5,
     else becomes a token drawn uniformly from the whole vocabulary [0, vocab_size).
  5. Positions are returned sorted.

The random draws are per position: `keys` (the visiting order of a group is the key of its first
position), `u_mask`, `u_keep` uniforms in [0, 1) and `random_ids`. Both versions compute the result from
the draws with the same rules, so given equal draws they return equal outputs (tested).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

MASK_PROB = 0.8  # of the chosen positions: replaced by [MASK]
KEEP_PROB = 0.5  # of the rest: kept unchanged (the others get a random token)


class MaskedLm(NamedTuple):
    """Output of `create_masked_lm_predictions`: masked ids [seq], positions [k] and their labels [k]."""

    input_ids: np.ndarray
    positions: np.ndarray
    labels: np.ndarray


def num_to_predict(num_tokens: int, masked_lm_prob: float, max_predictions_per_seq: int) -> int:
    """How many positions to mask in a sequence of `num_tokens` real tokens."""
    return min(max_predictions_per_seq, max(1, int(round(num_tokens * masked_lm_prob))))


def _group_starts(
    is_cand: np.ndarray, ids: np.ndarray, word_start: np.ndarray | None
) -> np.ndarray:
    """[seq] bool: positions that start a masking group."""
    if word_start is None:
        return is_cand
    prev_cand = np.concatenate([[False], is_cand[:-1]])
    return is_cand & (word_start[ids] | ~prev_cand)


def _mask_from_draws(
    ids: np.ndarray,  # [seq] int
    input_mask: np.ndarray,  # [seq] 0/1
    keys: np.ndarray,  # [seq] float
    u_mask: np.ndarray,  # [seq] float
    u_keep: np.ndarray,  # [seq] float
    random_ids: np.ndarray,  # [seq] int
    *,
    mask_id: int,
    special_ids: Sequence[int],
    masked_lm_prob: float,
    max_predictions_per_seq: int,
    word_start: np.ndarray | None,
) -> MaskedLm:
    """The deterministic part of masking, given the per-position random draws (reference version)."""
    ids = np.asarray(ids)
    is_real = np.asarray(input_mask) != 0
    is_cand = is_real.copy()
    for special in special_ids:
        is_cand &= ids != special
    starts = _group_starts(is_cand, ids, word_start)  # [seq] bool
    start_pos = np.flatnonzero(starts)  # [groups]; a group is a contiguous run from its start
    sizes = np.bincount(np.cumsum(starts)[is_cand] - 1, minlength=len(start_pos))  # [groups]
    budget = num_to_predict(int(np.sum(is_real)), masked_lm_prob, max_predictions_per_seq)
    chosen: list[int] = []
    for g in np.argsort(keys[start_pos], kind="stable").tolist():  # visiting order of the groups
        if len(chosen) >= budget:
            break
        size, first = int(sizes[g]), int(start_pos[g])
        if len(chosen) + size <= budget:
            chosen.extend(range(first, first + size))
    positions = np.array(sorted(chosen), dtype=np.int64)
    output = np.array(ids, copy=True)
    replaced = np.where(u_keep[positions] < KEEP_PROB, ids[positions], random_ids[positions])
    output[positions] = np.where(u_mask[positions] < MASK_PROB, mask_id, replaced)
    return MaskedLm(output, positions, ids[positions].astype(np.int64))


def create_masked_lm_predictions(
    ids: Sequence[int] | np.ndarray,
    rng: np.random.Generator,
    *,
    vocab_size: int,
    mask_id: int,
    special_ids: Sequence[int],
    masked_lm_prob: float = 0.15,
    max_predictions_per_seq: int = 20,
    word_start: np.ndarray | None = None,
) -> MaskedLm:
    """Masks an unpadded token-id sequence ([CLS] A [SEP] B [SEP]) the way the original BERT did.

    Args:
      ids: [seq] token ids of one instance (no padding).
      rng: the generator all draws come from (4 arrays of len(ids) values, in a fixed order).
      vocab_size: random replacement tokens are drawn from [0, vocab_size).
      mask_id: the [MASK] id.
      special_ids: ids never masked ([CLS], [SEP], [PAD]).
      masked_lm_prob, max_predictions_per_seq: see the module docstring.
      word_start: [vocab] bool table (`tokenizer.word_start_table()`) for whole-word masking, or None.
    Returns:
      MaskedLm(input_ids [seq], positions [k] sorted, labels [k]) with k <= max_predictions_per_seq.
    """
    ids = np.asarray(ids, dtype=np.int64)
    n = len(ids)
    keys, u_mask, u_keep = rng.random(n), rng.random(n), rng.random(n)
    random_ids = rng.integers(0, vocab_size, n)
    budget = num_to_predict(n, masked_lm_prob, max_predictions_per_seq)
    is_cand = ids != special_ids[0]
    for special in special_ids[1:]:
        is_cand &= ids != special
    if word_start is None:  # every group is one token: the first `budget` candidates by key
        cand = np.flatnonzero(is_cand)
        positions = np.sort(cand[np.argsort(keys[cand], kind="stable")[:budget]])
    else:
        positions = whole_word_positions(ids, is_cand, keys, budget, word_start)
    labels = ids[positions]
    replaced = np.where(u_keep[positions] < KEEP_PROB, labels, random_ids[positions])
    output = ids.copy()
    output[positions] = np.where(u_mask[positions] < MASK_PROB, mask_id, replaced)
    return MaskedLm(output, positions, labels)


def whole_word_positions(ids, is_cand, keys, budget: int, word_start) -> np.ndarray:
    """Sorted positions of the whole-word groups taken greedily in key order (as `_mask_from_draws`)."""
    starts = _group_starts(is_cand, ids, word_start)  # [seq] bool
    start_pos = np.flatnonzero(starts)  # [groups]
    ends = np.append(start_pos[1:], len(ids)).tolist()
    cand = is_cand.tolist()
    chosen: list[int] = []
    for g in np.argsort(keys[start_pos], kind="stable").tolist():  # visiting order of the groups
        if len(chosen) >= budget:
            break
        first = int(start_pos[g])
        end = first + 1
        while end < ends[g] and cand[end]:  # a group runs over candidates up to the next start
            end += 1
        if len(chosen) + end - first <= budget:
            chosen.extend(range(first, end))
    return np.array(sorted(chosen), dtype=np.int64)


def _tf_mask_from_draws(
    input_ids,  # [seq] int tf.Tensor
    input_mask,  # [seq] int
    keys,  # [seq] float32
    u_mask,  # [seq] float32
    u_keep,  # [seq] float32
    random_ids,  # [seq] same dtype as input_ids
    *,
    mask_id: int,
    special_ids: Sequence[int],
    masked_lm_prob: float,
    max_predictions_per_seq: int,
    word_start,  # [vocab] bool tf.Tensor or None
):
    """TensorFlow twin of `_mask_from_draws`, vectorised (no Python loop over positions)."""
    import tensorflow as tf

    seq_len = tf.shape(input_ids)[0]
    is_real = tf.not_equal(input_mask, 0)
    is_special = tf.reduce_any(
        tf.equal(input_ids[:, None], tf.constant(list(special_ids), input_ids.dtype)[None, :]),
        axis=1,
    )
    is_cand = is_real & ~is_special  # [seq]
    if word_start is None:
        starts = is_cand
    else:
        prev_cand = tf.concat([[False], is_cand[:-1]], axis=0)
        starts = is_cand & (tf.gather(word_start, input_ids) | ~prev_cand)
    group_id = tf.cumsum(tf.cast(starts, tf.int32)) - 1  # [seq]; the group each candidate is in
    segment = tf.where(is_cand, group_id, seq_len)  # non-candidates go to a dump segment
    sizes = tf.math.unsorted_segment_sum(tf.cast(is_cand, tf.int32), segment, seq_len + 1)[:-1]
    # Groups in visiting order: sort start positions by key (non-starts last, keys are < 1).
    order = tf.argsort(tf.where(starts, keys, 2.0), stable=True)  # [seq] positions
    sorted_sizes = tf.where(
        tf.gather(starts, order), tf.gather(sizes, tf.gather(tf.maximum(group_id, 0), order)), 0
    )  # [seq]; 0 for "not a group"
    budget = tf.minimum(
        max_predictions_per_seq,
        tf.maximum(
            1,
            tf.cast(
                tf.round(
                    tf.cast(tf.reduce_sum(tf.cast(is_real, tf.int32)), tf.float64) * masked_lm_prob
                ),
                tf.int32,
            ),
        ),
    )

    # Greedy "take the group if it fits": groups bigger than the remaining budget can never fit later
    # (the budget only shrinks); among the others the leading run whose running sum fits is taken.
    # Every round takes at least one group, so it ends within budget + 1 rounds.
    def body(taken, undecided, left):
        undecided = undecided & (sorted_sizes <= left)
        running = tf.cumsum(tf.where(undecided, sorted_sizes, 0))
        take = undecided & (running <= left)
        return (
            taken | take,
            undecided & ~take,
            left - tf.reduce_sum(tf.where(take, sorted_sizes, 0)),
        )

    taken, _, _ = tf.while_loop(
        lambda taken, undecided, left: tf.reduce_any(undecided),
        body,
        (tf.zeros_like(starts), sorted_sizes > 0, budget),
    )
    taken_start = tf.scatter_nd(order[:, None], taken, tf.shape(starts))  # [seq] by position
    taken_group = tf.math.unsorted_segment_max(
        tf.cast(taken_start, tf.int32), tf.where(starts, group_id, seq_len), seq_len + 1
    )[:-1]
    selected = is_cand & tf.gather(taken_group > 0, tf.maximum(group_id, 0))  # [seq]

    replaced = tf.where(
        u_mask < MASK_PROB,
        tf.cast(mask_id, input_ids.dtype),
        tf.where(u_keep < KEEP_PROB, input_ids, random_ids),
    )
    masked_ids = tf.where(selected, replaced, input_ids)
    positions = tf.boolean_mask(tf.range(seq_len, dtype=input_ids.dtype), selected)
    labels = tf.boolean_mask(input_ids, selected)
    pad = [[0, max_predictions_per_seq - tf.shape(positions)[0]]]
    return {
        "input_ids": masked_ids,
        "masked_lm_positions": tf.ensure_shape(tf.pad(positions, pad), [max_predictions_per_seq]),
        "masked_lm_ids": tf.ensure_shape(tf.pad(labels, pad), [max_predictions_per_seq]),
        "masked_lm_weights": tf.ensure_shape(
            tf.pad(tf.ones_like(positions, tf.float32), pad), [max_predictions_per_seq]
        ),
    }


def tf_mask_tokens(
    input_ids,
    input_mask,
    seed,
    word_start,
    *,
    vocab_size: int,
    mask_id: int,
    special_ids: Sequence[int],
    masked_lm_prob: float = 0.15,
    max_predictions_per_seq: int = 20,
    whole_word: bool = False,
) -> dict:
    """Dynamic masking of one padded example inside `tf.data` (pure TF, stateless random ops).

    Args:
      input_ids: [seq] int32/int64 tensor ([CLS] A [SEP] B [SEP] then [PAD]s).
      input_mask: [seq] int tensor, 1 for real tokens.
      seed: [2] int32/int64 stateless seed; the same seed gives the same mask.
      word_start: [vocab] bool table (`tokenizer.word_start_table()`); used only when whole_word.
      vocab_size, mask_id, special_ids, masked_lm_prob, max_predictions_per_seq: as in
        `create_masked_lm_predictions`.
      whole_word: mask whole words (a word start with its continuation pieces).
    Returns:
      dict with input_ids [seq] (masked), masked_lm_positions [max_pred] (dtype of input_ids),
      masked_lm_ids [max_pred], masked_lm_weights [max_pred] float32; 0-padded.
    """
    import tensorflow as tf

    input_ids = tf.convert_to_tensor(input_ids)
    seeds = tf.random.experimental.stateless_split(tf.cast(seed, tf.int64), 4)
    shape = tf.shape(input_ids)
    keys = tf.random.stateless_uniform(shape, seeds[0])
    u_mask = tf.random.stateless_uniform(shape, seeds[1])
    u_keep = tf.random.stateless_uniform(shape, seeds[2])
    random_ids = tf.random.stateless_uniform(
        shape, seeds[3], minval=0, maxval=vocab_size, dtype=tf.int64
    )
    table = tf.convert_to_tensor(word_start, tf.bool) if whole_word else None
    return _tf_mask_from_draws(
        input_ids,
        tf.convert_to_tensor(input_mask),
        keys,
        u_mask,
        u_keep,
        tf.cast(random_ids, input_ids.dtype),
        mask_id=mask_id,
        special_ids=special_ids,
        masked_lm_prob=masked_lm_prob,
        max_predictions_per_seq=max_predictions_per_seq,
        word_start=table,
    )
