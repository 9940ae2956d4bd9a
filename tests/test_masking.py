"""Masked-LM masking: NumPy reference vs TensorFlow twin, statistics, whole words, tf.data use."""

import numpy as np
import pytest
import tensorflow as tf

from bertjax.data import masking

PAD, CLS, SEP, MASK = 0, 1, 2, 3
VOCAB = 40
SPECIALS = (CLS, SEP, PAD)
# Ids >= 25 are "##" continuation pieces; the rest start words.
WORD_START = np.arange(VOCAB) < 25


def _example(rng, seq_len=64, real=50):
    """[CLS] A [SEP] B [SEP] + padding, with random word/continuation ids."""
    ids = rng.integers(5, VOCAB, seq_len)
    ids[0], ids[real // 2], ids[real - 1] = CLS, SEP, SEP
    ids[real:] = PAD
    return ids, (np.arange(seq_len) < real).astype(np.int64)


def _words(ids, mask):
    """Lists of positions forming whole words (candidates only, split at specials)."""
    words, current = [], []
    for p, (i, m) in enumerate(zip(ids, mask)):
        if not m or i in SPECIALS or WORD_START[i]:
            if current:
                words.append(current)
            current = [] if (not m or i in SPECIALS) else [p]
        else:
            current.append(p)
    if current:
        words.append(current)
    return words


def test_num_to_predict_rounds_half_to_even_and_caps():
    assert masking.num_to_predict(10, 0.15, 20) == 2  # round(1.5) == 2
    assert masking.num_to_predict(30, 0.15, 20) == 4  # round(4.5) == 4 (half to even)
    assert masking.num_to_predict(3, 0.15, 20) == 1  # never 0
    assert masking.num_to_predict(512, 0.15, 20) == 20  # capped


def test_tf_equals_numpy_reference_given_the_same_draws():
    rng = np.random.default_rng(0)
    for trial in range(120):
        seq = int(rng.integers(4, 48))
        real = int(rng.integers(3, seq + 1))
        ids, mask = _example(rng, seq, real)
        if trial % 3 == 0:
            ids[rng.integers(1, real)] = SEP
        draws = [rng.random(seq).astype(np.float32) for _ in range(3)]
        random_ids = rng.integers(0, VOCAB, seq)
        kw = dict(
            mask_id=MASK,
            special_ids=SPECIALS,
            masked_lm_prob=float(rng.choice([0.15, 0.3, 0.6])),
            max_predictions_per_seq=int(rng.integers(1, 10)),
        )
        ws = WORD_START if trial % 2 else None
        ref = masking._mask_from_draws(ids, mask, *draws, random_ids, word_start=ws, **kw)
        out = masking._tf_mask_from_draws(
            tf.constant(ids, tf.int32),
            tf.constant(mask),
            *map(tf.constant, draws),
            tf.constant(random_ids, tf.int32),
            word_start=None if ws is None else tf.constant(ws),
            **kw,
        )
        k = len(ref.positions)
        np.testing.assert_array_equal(out["input_ids"].numpy(), ref.input_ids, err_msg=str(trial))
        np.testing.assert_array_equal(out["masked_lm_positions"].numpy()[:k], ref.positions)
        np.testing.assert_array_equal(out["masked_lm_ids"].numpy()[:k], ref.labels)
        np.testing.assert_array_equal(
            out["masked_lm_weights"].numpy(), np.arange(kw["max_predictions_per_seq"]) < k
        )
        assert not out["masked_lm_positions"].numpy()[k:].any()


def _check_stats(samples, ids, mask, budget, whole_word):
    """Counts masked / kept / random over samples of (masked_ids, positions, labels)."""
    counts = np.zeros(3)
    total = 0
    words = _words(ids, mask)
    for out_ids, positions, labels in samples:
        assert list(positions) == sorted(positions)
        np.testing.assert_array_equal(labels, ids[positions])
        assert not set(positions.tolist()) & {
            p for p, i in enumerate(ids) if i in SPECIALS or not mask[p]
        }
        assert len(positions) <= budget
        if not whole_word:
            assert len(positions) == budget
        else:
            chosen = set(positions.tolist())
            for word in words:  # every word is masked entirely or not at all
                assert len(chosen & set(word)) in (0, len(word))
            assert len(positions) >= budget - max(map(len, words)) + 1
        unchanged = out_ids[positions] == labels
        counts += [
            np.sum(out_ids[positions] == MASK),
            np.sum(unchanged & (labels != MASK)),
            np.sum(~unchanged & (out_ids[positions] != MASK)),
        ]
        total += len(positions)
        untouched = np.setdiff1d(np.arange(len(ids)), positions)
        np.testing.assert_array_equal(out_ids[untouched], ids[untouched])
    return counts / total


@pytest.mark.parametrize("whole_word", [False, True])
def test_numpy_statistics(whole_word):
    rng = np.random.default_rng(1)
    ids, mask = _example(rng, 64, 50)
    gen = np.random.default_rng(2)
    samples = []
    for _ in range(1500):
        m = masking.create_masked_lm_predictions(
            ids[:50],
            gen,
            vocab_size=VOCAB,
            mask_id=MASK,
            special_ids=SPECIALS,
            masked_lm_prob=0.15,
            max_predictions_per_seq=20,
            word_start=WORD_START if whole_word else None,
        )
        samples.append((np.concatenate([m.input_ids, ids[50:]]), m.positions, m.labels))
    budget = masking.num_to_predict(50, 0.15, 20)  # 8 of 47 candidates: ~15% of the sequence
    fractions = _check_stats(samples, ids, mask, budget, whole_word)
    # random replacements hit the original id 1/VOCAB of the time: counted as "kept".
    np.testing.assert_allclose(fractions, [0.8, 0.1 + 0.1 / VOCAB, 0.1 - 0.1 / VOCAB], atol=0.02)


@pytest.mark.parametrize("whole_word", [False, True])
def test_tf_statistics_and_determinism(whole_word):
    rng = np.random.default_rng(3)
    ids, mask = _example(rng, 64, 50)

    def run(seed):
        out = masking.tf_mask_tokens(
            tf.constant(ids),
            tf.constant(mask),
            tf.constant(seed, tf.int64),
            WORD_START,
            vocab_size=VOCAB,
            mask_id=MASK,
            special_ids=SPECIALS,
            masked_lm_prob=0.15,
            max_predictions_per_seq=20,
            whole_word=whole_word,
        )
        k = int(out["masked_lm_weights"].numpy().sum())
        return (
            out["input_ids"].numpy(),
            out["masked_lm_positions"].numpy()[:k],
            out["masked_lm_ids"].numpy()[:k],
        )

    a, b = run([5, 6]), run([5, 6])
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)  # same seed, same mask
    ds = tf.data.Dataset.range(1500).map(
        lambda i: masking.tf_mask_tokens(
            tf.constant(ids),
            tf.constant(mask),
            tf.stack([i, i + 1]),
            WORD_START,
            vocab_size=VOCAB,
            mask_id=MASK,
            special_ids=SPECIALS,
            masked_lm_prob=0.15,
            max_predictions_per_seq=20,
            whole_word=whole_word,
        )
    )
    samples = []
    for out in ds.as_numpy_iterator():
        k = int(out["masked_lm_weights"].sum())
        assert out["masked_lm_positions"].shape == (20,)
        samples.append((out["input_ids"], out["masked_lm_positions"][:k], out["masked_lm_ids"][:k]))
    assert len({tuple(s[1]) for s in samples}) > 1000  # fresh masks per seed
    fractions = _check_stats(samples, ids, mask, masking.num_to_predict(50, 0.15, 20), whole_word)
    np.testing.assert_allclose(fractions, [0.8, 0.1 + 0.1 / VOCAB, 0.1 - 0.1 / VOCAB], atol=0.02)


def test_tf_batched_pipeline_with_int32_ids_and_no_candidates():
    ids = np.array([[CLS, 7, 8, SEP, PAD], [CLS, SEP, PAD, PAD, PAD]], np.int32)
    masks = (ids != PAD).astype(np.int32)
    ds = tf.data.Dataset.from_tensor_slices((ids, masks)).enumerate()
    ds = ds.map(
        lambda i, x: masking.tf_mask_tokens(
            x[0],
            x[1],
            tf.stack([i, 0]),
            WORD_START,
            vocab_size=VOCAB,
            mask_id=MASK,
            special_ids=SPECIALS,
            max_predictions_per_seq=3,
        )
    ).batch(2)
    out = next(iter(ds))
    assert out["input_ids"].dtype == tf.int32 and out["masked_lm_positions"].shape == (2, 3)
    np.testing.assert_array_equal(out["masked_lm_weights"].numpy(), [[1, 0, 0], [0, 0, 0]])
    assert out["masked_lm_positions"].numpy()[0, 0] in (1, 2)
    np.testing.assert_array_equal(out["input_ids"].numpy()[1], ids[1])


@pytest.mark.parametrize("whole_word", [False, True])
def test_create_masked_lm_predictions_equals_the_reference_on_the_same_draws(whole_word):
    """The fast path of create_masked_lm_predictions gives _mask_from_draws' output."""
    rng = np.random.default_rng(3)
    for trial in range(300):
        n = int(rng.integers(3, 70))
        ids = rng.integers(4, VOCAB, n)
        ids[0], ids[-1] = CLS, SEP
        if n > 6 and trial % 2:
            ids[int(rng.integers(1, n - 1))] = SEP
        kw = dict(
            mask_id=MASK,
            special_ids=SPECIALS,
            masked_lm_prob=float(rng.choice([0.15, 0.5])),
            max_predictions_per_seq=int(rng.integers(1, 25)),
        )
        ws = WORD_START if whole_word else None
        seed = int(rng.integers(1 << 30))
        out = masking.create_masked_lm_predictions(
            ids, np.random.default_rng(seed), vocab_size=VOCAB, word_start=ws, **kw
        )
        draw = np.random.default_rng(seed)
        draws = draw.random(n), draw.random(n), draw.random(n), draw.integers(0, VOCAB, n)
        ref = masking._mask_from_draws(ids, np.ones(n, np.int64), *draws, word_start=ws, **kw)
        for a, b in zip(out, ref):
            np.testing.assert_array_equal(a, b)
