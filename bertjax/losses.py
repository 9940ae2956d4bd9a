"""Pretraining objectives as pure functions: weighted masked-LM and next-sentence cross-entropy.

Each loss takes an explicit normaliser so that a global batch split into micro-batches (gradient
accumulation) gives exactly the loss of the whole batch: the sum over micro-batches of
``sum_micro / normaliser_global`` is the global mean.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def cross_entropy(logits: Array, labels: Array) -> Array:
    """Per-example softmax cross-entropy in fp32: logits [..., classes], int labels [...] -> [...]."""
    return nll_and_correct(logits, labels)[0]


def nll_and_correct(logits: Array, labels: Array) -> tuple[Array, Array]:
    """Cross-entropy and top-1 correctness (fp32 0/1) from one max over the classes.

    Correct means the label's logit equals the maximum (a tie for first counts as correct), which
    needs no separate argmax pass over [..., vocab] logits. Computed in fp32 whatever the logits'
    dtype; the gradient reaches the logits in their own dtype (see :func:`_nll`).
    """
    nll, label = _nll(logits, labels.astype(jnp.int32))
    return nll, (jax.lax.stop_gradient(label) >= 0).astype(jnp.float32)


def _nll_parts(logits: Array, labels: Array):
    x = logits.astype(jnp.float32)
    peak = jnp.max(x, axis=-1, keepdims=True)
    shifted = x - peak  # [..., classes], max 0
    e = jnp.exp(shifted)
    z = jnp.sum(e, axis=-1)
    # The label's logit by a one-hot select and sum (exact: one non-zero term), never a gather:
    # take_along_axis's gradient is a scatter into a [..., classes] buffer.
    hit = labels[..., None] == jnp.arange(x.shape[-1])
    label = jnp.sum(jnp.where(hit, shifted, 0.0), axis=-1)
    return e, z, hit, label


@jax.custom_vjp
def _nll(logits: Array, labels: Array) -> tuple[Array, Array]:
    """(log-sum-exp - label logit, label logit - max) in fp32.

    A custom gradient with the values of JAX's own (``e * (g / z) - [label] * g``, the max held
    constant) that recomputes the softmax from the logits instead of keeping fp32 [..., classes]
    residuals, and returns the gradient in the logits' dtype: the fp32 [batch, predictions,
    vocab] gradient buffer of the MLM head (0.94 GB for BERT-base at batch 256) never exists."""
    _, z, _, label = _nll_parts(logits, labels)
    return jnp.log(z) - label, label


def _nll_fwd(logits, labels):
    return _nll(logits, labels), (logits, labels)


def _nll_bwd(residuals, cotangents):
    logits, labels = residuals
    g = cotangents[0]  # the label-minus-max output is a metric: no gradient flows through it
    e, z, hit, _ = _nll_parts(logits, labels)
    grad = e * (g / z)[..., None] + jnp.where(hit, -g[..., None], 0.0)
    return grad.astype(logits.dtype), None


_nll.defvjp(_nll_fwd, _nll_bwd)


def masked_lm_loss(
    logits: Array, label_ids: Array, weights: Array, normalizer: Array | None = None
) -> tuple[Array, Array]:
    """Weighted MLM cross-entropy and accuracy at the masked positions.

    logits [batch, k, vocab], label_ids [batch, k], weights [batch, k] (0 for padding predictions).
    Returns (loss, accuracy) = (sum w*nll, sum w*correct) / normalizer, normalizer defaulting to
    sum(weights) (as the original BERT, which adds 1e-5 to it; here an all-zero batch gives 0).
    """
    nll, correct = nll_and_correct(logits, label_ids)
    return weighted_nll(nll, correct, weights, normalizer)


def weighted_nll(
    nll: Array, correct: Array, weights: Array, normalizer: Array | None = None
) -> tuple[Array, Array]:
    """(sum w*nll, sum w*correct) / normalizer (default sum(weights), at least 1e-5): the MLM loss
    and accuracy from per-prediction cross-entropies and 0/1 correctness (the fused decoder's
    ``mlm_nll`` and ``mlm_margin >= 0``)."""
    weights = weights.astype(jnp.float32)
    if normalizer is None:
        normalizer = weights.sum()
    normalizer = jnp.maximum(normalizer, 1e-5)
    correct = correct.astype(jnp.float32)
    return (nll * weights).sum() / normalizer, (correct * weights).sum() / normalizer


def nsp_loss(logits: Array, labels: Array, normalizer: Array | None = None) -> tuple[Array, Array]:
    """Next-sentence cross-entropy and accuracy: logits [batch, 2], labels [batch] (1 = random)."""
    labels = labels.reshape(-1)
    if normalizer is None:
        normalizer = jnp.asarray(labels.shape[0], jnp.float32)
    nll, correct = nll_and_correct(logits, labels)
    return nll.sum() / normalizer, correct.sum() / normalizer


def classification_loss(
    logits: Array, labels: Array, weights: Array | None = None, normalizer: Array | None = None
) -> tuple[Array, Array]:
    """Cross-entropy and accuracy for [..., classes] logits; weights mask out padding/ignored labels."""
    if weights is None:
        weights = jnp.ones(labels.shape, jnp.float32)
    weights = weights.astype(jnp.float32)
    if normalizer is None:
        normalizer = weights.sum()
    normalizer = jnp.maximum(normalizer, 1e-5)
    safe_labels = jnp.where(weights > 0, labels, 0)
    nll, correct = nll_and_correct(logits, safe_labels)
    return (nll * weights).sum() / normalizer, (correct * weights).sum() / normalizer


def regression_loss(
    predictions: Array,
    targets: Array,
    weights: Array | None = None,
    normalizer: Array | None = None,
) -> Array:
    """Mean squared error (STS-B): predictions [batch] or [batch, 1], targets [batch]."""
    predictions = predictions.reshape(targets.shape).astype(jnp.float32)
    if weights is None:
        weights = jnp.ones(targets.shape, jnp.float32)
    if normalizer is None:
        normalizer = weights.sum()
    normalizer = jnp.maximum(normalizer, 1e-5)
    return (jnp.square(predictions - targets.astype(jnp.float32)) * weights).sum() / normalizer
