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
    needs no separate argmax pass over [..., vocab] logits.
    """
    logits = logits.astype(jnp.float32)
    peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    shifted = logits - peak  # [..., classes], max 0
    log_z = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
    # The label's logit by a one-hot select and sum (exact: one non-zero term): its gradient is
    # a select fused into the softmax's, where take_along_axis's is a scatter into a buffer of
    # [..., classes] (157M floats for BERT-base's MLM at batch 256).
    hit = labels[..., None].astype(jnp.int32) == jnp.arange(shifted.shape[-1])
    label = jnp.sum(jnp.where(hit, shifted, 0.0), axis=-1)
    return log_z - label, (label >= 0).astype(jnp.float32)


def masked_lm_loss(
    logits: Array, label_ids: Array, weights: Array, normalizer: Array | None = None
) -> tuple[Array, Array]:
    """Weighted MLM cross-entropy and accuracy at the masked positions.

    logits [batch, k, vocab], label_ids [batch, k], weights [batch, k] (0 for padding predictions).
    Returns (loss, accuracy) = (sum w*nll, sum w*correct) / normalizer, normalizer defaulting to
    sum(weights) (as the original BERT, which adds 1e-5 to it; here an all-zero batch gives 0).
    """
    weights = weights.astype(jnp.float32)
    if normalizer is None:
        normalizer = weights.sum()
    normalizer = jnp.maximum(normalizer, 1e-5)
    nll, correct = nll_and_correct(logits, label_ids)
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
