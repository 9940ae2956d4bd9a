"""bertjax.retrieval.search against a NumPy brute force: dense dot/cosine and ColBERT MaxSim, on one
device and with the corpus sharded over the 8 simulated CPU devices (also in a fresh subprocess
with XLA_FLAGS set there), ties included (integer-valued vectors: exact scores, many ties)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from helpers import xla_flags

from bertjax.retrieval import search
from bertjax.retrieval.trec_format import ranked, tie_order

REPO = pathlib.Path(__file__).resolve().parent.parent


def _brute_top_k(scores: np.ndarray, k: int):
    """Score descending, then index ascending."""
    k = min(k, scores.shape[1])
    order = np.stack([np.lexsort((np.arange(len(row)), -row))[:k] for row in scores])
    return np.take_along_axis(scores, order, axis=1), order


def _maxsim_brute(q, q_mask, d, d_mask):
    out = np.zeros((len(q), len(d)), np.float64)
    for i in range(len(q)):
        for j in range(len(d)):
            sim = q[i][q_mask[i]] @ d[j][d_mask[j]].T  # [tq', td']
            out[i, j] = sim.max(axis=1).sum() if d_mask[j].any() else 0.0
    return out


def _device_sets():
    devices = jax.devices()
    return [devices[:1], devices] if len(devices) > 1 else [devices]


@pytest.mark.parametrize("n,k,chunk,batch", [(37, 5, 4, 3), (8, 20, 8, 7), (200, 50, 16, 64)])
def test_dense_dot_with_ties_equals_brute_force(n, k, chunk, batch):
    rng = np.random.default_rng(n)
    queries = rng.integers(-2, 3, (11, 6)).astype(np.float32)
    corpus = rng.integers(-2, 3, (n, 6)).astype(np.float32)
    corpus[n // 2 :: 3] = corpus[0]  # duplicate rows: exact ties
    want_scores, want_idx = _brute_top_k(queries @ corpus.T, k)
    for devices in _device_sets():
        scores, idx = search.dense_search(
            queries,
            corpus,
            k,
            similarity="dot",
            devices=devices,
            corpus_chunk=chunk,
            query_batch=batch,
        )
        np.testing.assert_array_equal(idx, want_idx)
        np.testing.assert_array_equal(scores, want_scores)


def test_dense_cosine_equals_float64_brute_force():
    rng = np.random.default_rng(0)
    queries = rng.normal(size=(40, 32)).astype(np.float32)
    corpus = rng.normal(size=(1000, 32)).astype(np.float32) * rng.uniform(0.5, 3, (1000, 1))
    q64 = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    c64 = corpus / np.linalg.norm(corpus, axis=1, keepdims=True)
    want_scores, want_idx = _brute_top_k(q64.astype(np.float64) @ c64.T.astype(np.float64), 100)
    for devices in _device_sets():
        scores, idx = search.dense_search(queries, corpus, 100, devices=devices, corpus_chunk=64)
        np.testing.assert_allclose(scores, want_scores, atol=2e-6)
        gaps = np.abs(np.diff(want_scores, axis=1)) > 1e-5  # an order only where scores differ
        assert (idx[:, 0] == want_idx[:, 0]).all()
        assert (idx[:, 1:] == want_idx[:, 1:])[gaps & (np.roll(gaps, -1, axis=1))].all()


def test_maxsim_with_masks_and_ties_equals_brute_force():
    rng = np.random.default_rng(3)
    q = rng.integers(-2, 3, (9, 5, 4)).astype(np.float32)
    d = rng.integers(-2, 3, (45, 7, 4)).astype(np.float32)
    q_mask = rng.random((9, 5)) < 0.7
    q_mask[:, 0] = True
    d_mask = rng.random((45, 7)) < 0.6
    d_mask[3] = False  # a document without tokens scores 0
    d[20:30] = d[10]  # duplicates: exact ties
    d_mask[20:30] = d_mask[10]
    want_scores, want_idx = _brute_top_k(_maxsim_brute(q, q_mask, d, d_mask), 12)
    for devices in _device_sets():
        scores, idx = search.maxsim_search(
            q, q_mask, d, d_mask, 12, devices=devices, corpus_chunk=4, query_batch=4
        )
        np.testing.assert_array_equal(idx, want_idx)
        np.testing.assert_array_equal(scores, want_scores.astype(np.float32))


def test_maxsim_cosine_normalizes_tokens():
    rng = np.random.default_rng(4)
    q, d = rng.normal(size=(3, 4, 8)), rng.normal(size=(20, 6, 8))
    q_mask, d_mask = np.ones((3, 4), bool), rng.random((20, 6)) < 0.8
    d_mask[:, 0] = True
    want = _maxsim_brute(search.normalize(q), q_mask, search.normalize(d), d_mask)
    scores, idx = search.maxsim_search(q, q_mask, d, d_mask, 20, similarity="cosine")
    np.testing.assert_allclose(scores, np.take_along_axis(want, idx, axis=1), atol=1e-5)
    np.testing.assert_array_equal(idx, _brute_top_k(want, 20)[1])


def test_tie_order_makes_the_search_rank_ties_as_trec_eval():
    ids = ["d3", "d10", "a", "D9", "é", "d2", "z1", "d1"]
    corpus = np.array([[1.0], [2.0], [2.0], [1.0], [2.0], [1.0], [0.5], [2.0]], np.float32)
    order = tie_order(ids)
    scores, idx = search.dense_search(np.ones((1, 1)), corpus[order], 5, similarity="dot")
    found = [(ids[order[i]], float(s)) for i, s in zip(idx[0], scores[0])]
    assert found == ranked({d: float(c[0]) for d, c in zip(ids, corpus)})[:5]


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match="must share dim"):
        search.dense_search(np.ones((2, 3)), np.ones((4, 5)), 1)
    with pytest.raises(ValueError, match="similarity must be one of"):
        search.dense_search(np.ones((2, 3)), np.ones((4, 3)), 1, similarity="l2")
    with pytest.raises(ValueError, match="corpus is empty"):
        search.dense_search(np.ones((2, 3)), np.ones((0, 3)), 1)


def test_sharded_over_8_devices_in_a_fresh_process():
    code = textwrap.dedent(
        """
        import jax, numpy as np
        from bertjax.retrieval import search
        assert len(jax.devices()) == 8, jax.devices()
        rng = np.random.default_rng(1)
        q = rng.integers(-1, 2, (13, 4)).astype(np.float32)
        c = rng.integers(-1, 2, (101, 4)).astype(np.float32)
        s = q @ c.T
        want = np.stack([np.lexsort((np.arange(101), -row))[:30] for row in s])
        scores, idx = search.dense_search(q, c, 30, similarity="dot", corpus_chunk=4)
        assert (idx == want).all() and (scores == np.take_along_axis(s, want, 1)).all()
        print("ok")
        """
    )
    env = dict(
        os.environ,
        XLA_FLAGS=xla_flags(8),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(REPO),
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
