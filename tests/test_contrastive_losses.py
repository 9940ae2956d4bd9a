"""The contrastive losses equal sentence-transformers' on the same embeddings: the loss and its
gradient with respect to every query and document embedding (MultipleNegativesRankingLoss in each
direction set and partition mode, with hard negatives, dot or cosine; MatryoshkaLoss)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.retrieval import contrastive_losses

torch = pytest.importorskip("torch")
st_losses = pytest.importorskip("sentence_transformers.sentence_transformer.losses")
st_util = pytest.importorskip("sentence_transformers.util")


def _reference(queries, documents, **kwargs):
    """sentence-transformers' loss and gradients on the same embeddings (float64)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fn = st_losses.MultipleNegativesRankingLoss(torch.nn.Module(), **kwargs)
    q = torch.tensor(queries, dtype=torch.float64, requires_grad=True)
    cols = [
        torch.tensor(documents[:, j], dtype=torch.float64, requires_grad=True)
        for j in range(documents.shape[1])
    ]
    loss = fn.compute_loss_from_embeddings([q, *cols], None)
    loss.backward()
    return float(loss.detach()), q.grad.numpy(), np.stack([c.grad.numpy() for c in cols], axis=1)


def _ours(queries, documents, **kwargs):
    def f(q, d):
        return contrastive_losses.multiple_negatives_ranking_loss(q, d, **kwargs)[0]

    loss, (gq, gd) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(queries, documents)
    return float(loss), np.asarray(gq), np.asarray(gd)


def _embeddings(b=6, m=3, d=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(b, d)).astype(np.float32), rng.normal(size=(b, m, d)).astype(np.float32)


@pytest.mark.parametrize(
    "directions",
    [
        ("query_to_doc",),
        ("query_to_doc", "doc_to_query"),
        ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"),
    ],
)
@pytest.mark.parametrize("partition_mode", ["joint", "per_direction"])
@pytest.mark.parametrize("negatives", [0, 2])
def test_multiple_negatives_ranking_loss_equals_sentence_transformers(
    directions, partition_mode, negatives
):
    queries, documents = _embeddings(m=1 + negatives)
    kwargs = dict(scale=20.0, directions=directions, partition_mode=partition_mode)
    if partition_mode == "per_direction" and "doc_to_doc" in directions:  # refused by both
        with pytest.raises(ValueError, match="per_direction"):
            _reference(queries, documents, **kwargs)
        with pytest.raises(ValueError, match="per_direction"):
            _ours(queries, documents, **kwargs)
        return
    want = _reference(queries, documents, **kwargs)
    got = _ours(queries, documents, **kwargs)
    assert abs(got[0] - want[0]) < 1e-5 * max(1.0, abs(want[0]))
    np.testing.assert_allclose(got[1], want[1], atol=1e-6)
    np.testing.assert_allclose(got[2], want[2], atol=1e-6)


def test_dot_product_similarity_and_another_scale():
    queries, documents = _embeddings(m=2, seed=1)
    want = _reference(queries, documents, scale=1.0, similarity_fct=st_util.dot_score)
    got = _ours(queries, documents, scale=1.0, similarity_fn="dot")
    assert abs(got[0] - want[0]) < 1e-4 * max(1.0, abs(want[0]))
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-5)


def test_padded_hard_negatives_are_left_out():
    """A row with fewer hard negatives: its padded columns change nothing (as if absent)."""
    queries, documents = _embeddings(b=4, m=3, seed=2)
    mask = np.ones((4, 3), np.float32)
    mask[1, 2] = mask[3, 1:] = 0
    garbage = documents.copy()
    garbage[mask == 0] = 1e3
    loss = jax.jit(contrastive_losses.multiple_negatives_ranking_loss)
    a = loss(queries, documents, document_mask=mask)[0]
    b = loss(queries, garbage, document_mask=mask)[0]
    assert float(a) == float(b)
    kept = [documents[:, 0]] + [documents[[0, 2], 2]] + [documents[[0, 1, 2], 1]]

    @jax.jit
    def log_z_and_scores(kept):
        scores = (
            jnp.concatenate([contrastive_losses.similarity(queries, k) for k in kept], 1) * 20.0
        )
        return jax.nn.logsumexp(scores, axis=1), scores

    log_z, scores = map(np.asarray, log_z_and_scores(kept))
    assert float(a) == pytest.approx(float(np.mean(log_z - np.diag(scores[:, :4]))), rel=1e-6)


def test_matryoshka_is_the_weighted_sum_of_renormalised_prefixes():
    queries, documents = _embeddings(d=32, seed=3)
    dims, weights = (32, 16, 8), (1.0, 0.5, 0.25)
    total, _ = jax.jit(
        lambda q, d: contrastive_losses.matryoshka(
            contrastive_losses.multiple_negatives_ranking_loss, q, d, dims, weights
        )
    )(queries, documents)
    want = sum(
        w * _reference(queries[:, :d], documents[..., :d])[0] for d, w in zip(dims, weights)
    )  # cosine similarity: re-normalising the prefix changes nothing in the reference
    assert float(total) == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match="matryoshka dims"):
        contrastive_losses.matryoshka(
            contrastive_losses.multiple_negatives_ranking_loss, queries, documents, (64,)
        )
