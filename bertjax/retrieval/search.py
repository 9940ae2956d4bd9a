"""Exact top-k search on device: dense (cosine or dot product) and ColBERT's MaxSim.

The corpus is split in equal contiguous blocks over the devices (``NamedSharding`` over a 1-D mesh
``corpus``); each device scans its block in chunks with a running ``jax.lax.top_k`` and the
devices' top-k lists are merged with one more ``top_k``. Queries go in batches, replicated.

Ties: among equal scores the lower corpus index ranks first, on any number of devices (``top_k``
keeps the lower index first; the running merge keeps earlier chunks, and the final merge earlier
devices, first). To rank ties as trec_eval does (document id descending), put the corpus in
``trec_format.tie_order`` order before searching. Similarities are float32 with ``HIGHEST``
matmul precision (no TF32/bf16 passes on GPU/TPU).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bertjax import progress

SIMILARITIES = ("cosine", "dot")
_AXIS = "corpus"


def normalize(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """Rows (last axis) scaled to unit L2 norm, as torch's ``F.normalize`` (norms below eps: eps)."""
    x = np.asarray(x, np.float32)
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(norms, eps)


def _dense_scores(queries, corpus):
    (q,), (c,) = queries, corpus  # [qb, d], [chunk, d]
    return jnp.einsum("qd,cd->qc", q, c, precision=jax.lax.Precision.HIGHEST)


def _maxsim_scores(queries, corpus):
    """ColBERT late interaction: for each query token its best document token, summed over the
    query's tokens; masked tokens take no part (a document with no token scores 0)."""
    (q, q_mask), (d, d_mask) = queries, corpus  # [qb, tq, dim], [qb, tq]; [c, td, dim], [c, td]
    sim = jnp.einsum("qtx,csx->qcts", q, d, precision=jax.lax.Precision.HIGHEST)
    sim = jnp.where(d_mask[None, :, None, :], sim, -jnp.inf)
    best = jnp.where(d_mask.any(-1)[None, :, None], sim.max(-1), 0.0)  # [qb, c, tq]
    return jnp.where(q_mask[:, None, :], best, 0.0).sum(-1)  # [qb, c]


@functools.lru_cache(maxsize=16)
def _search_fn(score_fn, mesh: Mesh, n: int, k: int, chunk: int, per_device: int):
    """jit(queries, corpus) -> (scores [qb, k], indices [qb, k]) for a padded, sharded corpus."""
    num_chunks = per_device // chunk

    def local(queries, corpus):  # one device: its block of `per_device` corpus rows
        first_row = jax.lax.axis_index(_AXIS) * per_device
        chunks = jax.tree.map(lambda a: a.reshape(num_chunks, chunk, *a.shape[1:]), corpus)
        batch = jax.tree.leaves(queries)[0].shape[0]

        def step(carry, xs):
            best, best_idx = carry  # [qb, k] each, sorted by (score desc, index asc)
            i, part = xs
            scores = score_fn(queries, part).astype(jnp.float32)  # [qb, chunk]
            rows = first_row + i * chunk + jnp.arange(chunk, dtype=jnp.int32)
            scores = jnp.where(rows[None, :] < n, scores, -jnp.inf)  # padding rows never win
            cand = jnp.concatenate([best, scores], axis=1)
            cand_idx = jnp.concatenate([best_idx, jnp.broadcast_to(rows, scores.shape)], axis=1)
            top, pos = jax.lax.top_k(cand, k)  # equal scores: the lower position first
            return (top, jnp.take_along_axis(cand_idx, pos, axis=1)), None

        init = (
            jnp.full((batch, k), -jnp.inf, jnp.float32),
            jnp.full((batch, k), jnp.iinfo(jnp.int32).max, jnp.int32),
        )
        (best, best_idx), _ = jax.lax.scan(step, init, (jnp.arange(num_chunks), chunks))
        return best, best_idx

    sharded = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P(_AXIS)),
        out_specs=(P(None, _AXIS), P(None, _AXIS)),  # [qb, devices * k], device blocks in order
        check_vma=False,
    )

    def search(queries, corpus):
        best, best_idx = sharded(queries, corpus)
        top, pos = jax.lax.top_k(best, k)
        return top, jnp.take_along_axis(best_idx, pos, axis=1)

    return jax.jit(search)


def _top_k(
    score_fn: Callable,
    queries: tuple[np.ndarray, ...],
    corpus: tuple[np.ndarray, ...],
    k: int,
    devices: Sequence[jax.Device] | None,
    corpus_chunk: int,
    query_batch: int,
) -> tuple[np.ndarray, np.ndarray]:
    num_queries, n = len(queries[0]), len(corpus[0])
    if n == 0:
        raise ValueError("the corpus is empty: nothing to search")
    if k < 1:
        raise ValueError(f"k must be at least 1, not {k}")
    k = min(k, n)
    devices = list(devices) if devices is not None else jax.devices()
    mesh = Mesh(np.asarray(devices), (_AXIS,))
    per_device = math.ceil(n / len(devices))
    chunk = max(1, min(corpus_chunk, per_device))
    per_device = math.ceil(per_device / chunk) * chunk
    padded = tuple(_pad(a, per_device * len(devices)) for a in corpus)
    on_devices = jax.device_put(padded, NamedSharding(mesh, P(_AXIS)))
    search = _search_fn(score_fn, mesh, n, k, chunk, per_device)
    batch = max(1, min(query_batch, num_queries))
    replicated = NamedSharding(mesh, P())
    scores, indices = [], []
    for start in range(0, num_queries, batch):
        part = tuple(_pad(a[start : start + batch], batch) for a in queries)
        top, idx = search(jax.device_put(part, replicated), on_devices)
        size = min(batch, num_queries - start)
        scores.append(np.asarray(top)[:size])
        indices.append(np.asarray(idx)[:size].astype(np.int64))
        progress.advance(size)
    if not scores:
        return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
    return np.concatenate(scores), np.concatenate(indices)


def _pad(a: np.ndarray, rows: int) -> np.ndarray:
    """``a`` with zero (False) rows appended up to ``rows``."""
    a = np.asarray(a)
    if len(a) == rows:
        return a
    return np.concatenate([a, np.zeros((rows - len(a), *a.shape[1:]), a.dtype)])


def dense_search(
    queries: np.ndarray,
    corpus: np.ndarray,
    k: int,
    *,
    similarity: str = "cosine",
    devices: Sequence[jax.Device] | None = None,
    corpus_chunk: int = 8192,
    query_batch: int = 512,
) -> tuple[np.ndarray, np.ndarray]:
    """The top ``k`` corpus rows of each query: (scores [q, k] float32, indices [q, k] int64),
    by score descending then index ascending (k is cut to the corpus size).

    ``queries`` [q, dim] and ``corpus`` [n, dim]; ``similarity`` "cosine" (rows normalized first)
    or "dot"; ``devices`` (default: all) share the corpus rows.
    """
    if similarity not in SIMILARITIES:
        raise ValueError(f"similarity must be one of {SIMILARITIES}, not {similarity!r}")
    queries, corpus = np.asarray(queries, np.float32), np.asarray(corpus, np.float32)
    if queries.ndim != 2 or corpus.ndim != 2 or queries.shape[1] != corpus.shape[1]:
        raise ValueError(
            f"queries [q, dim] and corpus [n, dim] must share dim: {queries.shape}, {corpus.shape}"
        )
    if similarity == "cosine":
        queries, corpus = normalize(queries), normalize(corpus)
    return _top_k(_dense_scores, (queries,), (corpus,), k, devices, corpus_chunk, query_batch)


def maxsim_search(
    query_tokens: np.ndarray,
    query_mask: np.ndarray,
    doc_tokens: np.ndarray,
    doc_mask: np.ndarray,
    k: int,
    *,
    similarity: str = "dot",
    devices: Sequence[jax.Device] | None = None,
    corpus_chunk: int = 128,
    query_batch: int = 16,
) -> tuple[np.ndarray, np.ndarray]:
    """ColBERT MaxSim top ``k``: score(q, d) = sum over q's tokens t of max over d's tokens s of
    sim(q_t, d_s), with ``query_tokens`` [q, tq, dim], ``query_mask`` [q, tq], ``doc_tokens``
    [n, td, dim] and ``doc_mask`` [n, td] (True: a real token). Ranked as ``dense_search``;
    ``similarity="cosine"`` normalizes each token vector first (ColBERT models usually already do).
    """
    if similarity not in SIMILARITIES:
        raise ValueError(f"similarity must be one of {SIMILARITIES}, not {similarity!r}")
    query_tokens = np.asarray(query_tokens, np.float32)
    doc_tokens = np.asarray(doc_tokens, np.float32)
    query_mask, doc_mask = np.asarray(query_mask, bool), np.asarray(doc_mask, bool)
    if (
        query_tokens.ndim != 3
        or doc_tokens.ndim != 3
        or query_tokens.shape[2] != doc_tokens.shape[2]
        or query_mask.shape != query_tokens.shape[:2]
        or doc_mask.shape != doc_tokens.shape[:2]
    ):
        raise ValueError(
            "expected query_tokens [q, tq, dim], query_mask [q, tq], doc_tokens [n, td, dim], "
            f"doc_mask [n, td]: got {query_tokens.shape}, {query_mask.shape}, "
            f"{doc_tokens.shape}, {doc_mask.shape}"
        )
    if similarity == "cosine":
        query_tokens, doc_tokens = normalize(query_tokens), normalize(doc_tokens)
    return _top_k(
        _maxsim_scores,
        (query_tokens, query_mask),
        (doc_tokens, doc_mask),
        k,
        devices,
        corpus_chunk,
        query_batch,
    )
