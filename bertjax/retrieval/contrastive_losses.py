"""Contrastive losses of embedding training, as pure functions of the embeddings.

``multiple_negatives_ranking_loss`` is InfoNCE over in-batch and hard negatives, exactly as
sentence-transformers' ``MultipleNegativesRankingLoss`` computes it (its directions and partition
modes; no hardness penalty): every query's positive is scored against every document of the
batch, the other queries' positives and every hard negative included. Called on the embeddings of
the WHOLE global batch inside the jitted step, the documents of every device are negatives for
every query (XLA gathers them across the mesh). The loss couples the batch's rows, so it does not
add up over micro-batches: a task using it declares ``micro_batching = "cached"`` and the trainer
runs the exact two-pass cached step (``bertjax.microbatch``).

``matryoshka`` sums a loss over truncated, re-normalised prefixes of the embeddings (Kusupati et
al., 2022), as sentence-transformers' ``MatryoshkaLoss``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from bertjax.retrieval.bi_encoder.pooling import l2_normalize

Array = jax.Array

DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


def normalize(x: Array) -> Array:
    """Rows in float32 scaled to unit L2 norm (``bi_encoder.pooling.l2_normalize``)."""
    return l2_normalize(x.astype(jnp.float32))


def similarity(a: Array, b: Array, kind: str = "cosine") -> Array:
    """[n, d] x [m, d] -> [n, m]: cosine similarity or dot product, in float32."""
    if kind == "cosine":
        a, b = normalize(a), normalize(b)
    elif kind != "dot":
        raise ValueError(f"similarity={kind!r} must be 'cosine' or 'dot'")
    return jnp.einsum("nd,md->nm", a.astype(jnp.float32), b.astype(jnp.float32))


def multiple_negatives_ranking_loss(
    queries: Array,
    documents: Array,
    *,
    scale: float = 20.0,
    similarity_fn: str = "cosine",
    directions: Sequence[str] = ("query_to_doc",),
    partition_mode: str = "joint",
    document_mask: Array | None = None,
    positive_key: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """InfoNCE of ``queries`` [b, d] against ``documents`` [b, m, d] (column 0: each query's
    positive; columns 1..m-1: its hard negatives) and every other row's documents.

    ``directions`` adds the symmetric terms of sentence-transformers (``doc_to_query``: each
    positive against every query; ``query_to_query``; ``doc_to_doc``); ``partition_mode`` "joint"
    takes one softmax over all of them, "per_direction" averages one log-partition per direction.
    ``document_mask`` [b, m] (1 = real) drops padded hard negatives from every softmax.
    ``positive_key`` [b] (equal for equal positives): another row's positive that is this row's
    own is not its negative (dropped from its softmax, in every direction that scores positives).

    Returns (mean loss over the queries, metrics): ``accuracy`` (the positive ranked first among
    query_to_doc scores) and ``positive_similarity`` (mean, unscaled).
    """
    unknown = [d for d in directions if d not in DIRECTIONS]
    if unknown or "query_to_doc" not in directions:
        raise ValueError(
            f"directions={tuple(directions)} must include query_to_doc, from {DIRECTIONS}"
        )
    if partition_mode not in ("joint", "per_direction"):
        raise ValueError(f"partition_mode={partition_mode!r} must be 'joint' or 'per_direction'")
    same_type = [d for d in ("query_to_query", "doc_to_doc") if d in directions]
    if partition_mode == "per_direction" and same_type:
        raise ValueError(
            f"partition_mode='per_direction' with {same_type}: their candidates never include the "
            "positive (as sentence-transformers refuses); use partition_mode='joint'"
        )
    b, m, _ = documents.shape
    docs_all = documents.swapaxes(0, 1).reshape(b * m, -1)  # column-major, as torch.cat(docs)
    rows = jnp.arange(b)
    neg_inf = jnp.float32(-jnp.inf)
    doc_ok = None
    if document_mask is not None:
        doc_ok = document_mask.astype(bool).swapaxes(0, 1).reshape(b * m)  # [b * m]
    same = jnp.zeros((b, b), bool)  # [row, other row]: other's positive is row's own, not row
    if positive_key is not None:
        same = (positive_key[:, None] == positive_key[None, :]) & ~jnp.eye(b, dtype=bool)
    sims = {}
    q2d = similarity(queries, docs_all, similarity_fn)  # [b, b * m]
    if doc_ok is not None:
        q2d = jnp.where(doc_ok[None, :], q2d, neg_inf)
    q2d = q2d.at[:, :b].set(jnp.where(same, neg_inf, q2d[:, :b]))
    sims["query_to_doc"] = q2d
    if "query_to_query" in directions:
        q2q = similarity(queries, queries, similarity_fn)
        sims["query_to_query"] = q2q.at[rows, rows].set(neg_inf)
    if "doc_to_query" in directions:
        d2q = similarity(queries, documents[:, 0], similarity_fn).T
        sims["doc_to_query"] = jnp.where(same, neg_inf, d2q)
    if "doc_to_doc" in directions:
        d2d = similarity(docs_all, documents[:, 0], similarity_fn).T  # [b, b * m]
        own = jnp.tile(jnp.eye(b, dtype=bool), (1, m))
        own = own.at[:, :b].set(own[:, :b] | same)
        if doc_ok is not None:
            own = own | ~doc_ok[None, :]
        sims["doc_to_doc"] = jnp.where(own, neg_inf, d2d)
    ordered = [sims[d] * scale for d in DIRECTIONS if d in sims]
    positive = sims["query_to_doc"][rows, rows] * scale
    if partition_mode == "joint":
        log_z = jax.nn.logsumexp(jnp.concatenate(ordered, axis=1), axis=1)
    else:
        log_z = sum(jax.nn.logsumexp(s, axis=1) for s in ordered) / len(ordered)
    loss = -jnp.mean(positive - log_z)
    correct = jnp.argmax(q2d, axis=1) == rows
    metrics = {
        "accuracy": jnp.mean(correct.astype(jnp.float32)),
        "positive_similarity": jnp.mean(positive) / scale,
    }
    return loss, metrics


def matryoshka(
    loss_fn: Callable[..., tuple[Array, dict]],
    queries: Array,
    documents: Array,
    dims: Sequence[int],
    weights: Sequence[float] | None = None,
    **kwargs,
) -> tuple[Array, dict[str, Array]]:
    """``sum_i weights[i] * loss_fn(queries[..., :dims[i]], documents[..., :dims[i]])`` with each
    prefix re-normalised to unit length, as sentence-transformers' ``MatryoshkaLoss``; the metrics
    are those of the full-size embeddings (the first of ``dims`` that equals the size, else the
    largest)."""
    size = queries.shape[-1]
    if any(d > size or d < 1 for d in dims):
        raise ValueError(f"matryoshka dims {tuple(dims)} must lie in [1, {size}]")
    weights = [1.0] * len(dims) if weights is None else list(weights)
    if len(weights) != len(dims):
        raise ValueError(f"{len(weights)} matryoshka weights for {len(dims)} dims")
    total, metrics = jnp.float32(0.0), {}
    for dim, weight in sorted(zip(dims, weights), key=lambda dw: dw[0]):
        loss, m = loss_fn(normalize(queries[..., :dim]), normalize(documents[..., :dim]), **kwargs)
        total = total + weight * loss
        metrics = m  # the largest prefix's
    return total, metrics


# ---- late interaction (ColBERT), as PyLate computes it ------------------------------------------


def colbert_scores(
    queries: Array,
    documents: Array,
    query_mask: Array | None = None,
    document_mask: Array | None = None,
) -> Array:
    """PyLate's ``colbert_scores``: [a, tq, d] queries x [b, td, d] documents -> [a, b], the sum
    over query tokens of the best document token's dot product. As in PyLate a masked token's
    similarity is multiplied by 0 (so it scores 0, not -inf: it can still be a row's maximum)."""
    sims = jnp.einsum("asd,btd->abst", queries.astype(jnp.float32), documents.astype(jnp.float32))
    if query_mask is not None:
        sims = sims * query_mask.astype(jnp.float32)[:, None, :, None]
    if document_mask is not None:
        sims = sims * document_mask.astype(jnp.float32)[None, :, None, :]
    return sims.max(-1).sum(-1)


def _grouped_scores(queries, documents, query_mask, document_mask) -> Array:
    """[b, tq, d] x [g, m, td, d] -> [b, g, m]: every query against every group's documents."""
    g, m, td, d = documents.shape
    dm = None if document_mask is None else document_mask.reshape(g * m, td)
    scores = colbert_scores(queries, documents.reshape(g * m, td, d), query_mask, dm)
    return scores.reshape(-1, g, m)


def colbert_contrastive(
    queries: Array,
    documents: Array,
    *,
    document_mask: Array | None = None,
    query_mask: Array | None = None,
    temperature: float = 1.0,
    document_valid: Array | None = None,
    positive_key: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """PyLate's ``Contrastive`` loss: cross-entropy of each query's MaxSim scores (divided by
    ``temperature``) over every document of the batch, its positive the target.

    ``queries`` [b, tq, d] and ``documents`` [b, m, td, d] are token vectors (L2-normalised here,
    as PyLate does; column 0 of ``documents`` is each query's positive, 1..m-1 its hard
    negatives); ``document_mask`` [b, m, td] (1 = a real token outside the skiplist) and
    ``query_mask`` [b, tq] (PyLate passes none with query expansion) drop tokens as PyLate's
    ``colbert_scores`` does. Beyond PyLate: ``document_valid`` [b, m] drops padded hard negatives
    from every softmax, and ``positive_key`` [b] (equal for equal positives) keeps another row's
    copy of a query's positive out of that query's negatives. Returns (mean loss, metrics).
    """
    b, m = documents.shape[:2]
    q, docs = normalize(queries), normalize(documents)
    scores = _grouped_scores(q, docs, query_mask, document_mask) / temperature  # [b, b, m]
    rows = jnp.arange(b)
    drop = jnp.zeros((b, b, m), bool)
    if document_valid is not None:
        drop = drop | ~document_valid.astype(bool)[None, :, :]
    if positive_key is not None:
        same = (positive_key[:, None] == positive_key[None, :]) & ~jnp.eye(b, dtype=bool)
        drop = drop.at[:, :, 0].set(drop[:, :, 0] | same)
    logits = jnp.where(drop, -jnp.inf, scores).reshape(b, b * m)  # query-major, as PyLate
    positive = logits[rows, rows * m]
    loss = jnp.mean(jax.nn.logsumexp(logits, axis=1) - positive)
    metrics = {
        "accuracy": jnp.mean((jnp.argmax(logits, axis=1) == rows * m).astype(jnp.float32)),
        "positive_score": jnp.mean(positive) * temperature,
    }
    return loss, metrics


def colbert_distillation(
    queries: Array,
    documents: Array,
    teacher_scores: Array,
    *,
    document_mask: Array | None = None,
    query_mask: Array | None = None,
    normalize_scores: bool = True,
    document_valid: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """PyLate's ``Distillation`` loss: KL(teacher || student) between the softmax of each
    query's ``teacher_scores`` [b, m] and of its MaxSim scores against its own ``documents``
    [b, m, td, d] (min-max normalised per query first with ``normalize_scores``, as PyLate:
    (s - min) / (max - min + 1e-8)), summed over documents and averaged over queries
    (``KLDivLoss(reduction="batchmean", log_target=True)``). Token vectors are L2-normalised
    here; masks as :func:`colbert_contrastive`; ``document_valid`` [b, m] drops padded
    documents from both softmaxes (beyond PyLate, which has none)."""
    q, docs = normalize(queries), normalize(documents)
    b, m = documents.shape[:2]
    sims = jnp.einsum("bsd,bmtd->bmst", q, docs)
    if query_mask is not None:
        sims = sims * query_mask.astype(jnp.float32)[:, None, :, None]
    if document_mask is not None:
        sims = sims * document_mask.astype(jnp.float32)[:, :, None, :]
    scores = sims.max(-1).sum(-1)  # [b, m]: PyLate's colbert_kd_scores
    valid = jnp.ones((b, m), bool) if document_valid is None else document_valid.astype(bool)
    if normalize_scores:
        high = jnp.max(jnp.where(valid, scores, -jnp.inf), axis=1, keepdims=True)
        low = jnp.min(jnp.where(valid, scores, jnp.inf), axis=1, keepdims=True)
        scores = (scores - low) / (high - low + 1e-8)
    log_student = jax.nn.log_softmax(jnp.where(valid, scores, -jnp.inf), axis=1)
    teacher = teacher_scores.astype(jnp.float32)
    log_teacher = jax.nn.log_softmax(jnp.where(valid, teacher, -jnp.inf), axis=1)
    terms = jnp.exp(log_teacher) * (log_teacher - log_student)
    loss = jnp.sum(jnp.where(valid, terms, 0.0)) / b
    metrics = {
        "accuracy": jnp.mean(
            (
                jnp.argmax(jnp.where(valid, scores, -jnp.inf), 1) == jnp.argmax(log_teacher, 1)
            ).astype(jnp.float32)
        ),
    }
    return loss, metrics
