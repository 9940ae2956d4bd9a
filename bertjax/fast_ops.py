"""Ops of the model with hand-written gradients: the same numbers as autodiff, computed in the
order XLA (notably XLA CPU) runs fastest. Each has an equality test in tests/test_fast_ops.py.

* :func:`tied_decoder` - the MLM decoder ``x @ E^T + b`` against the tied word embeddings. Autodiff
  gives ``dE = g^T x`` as a transposed copy of the [predictions, vocab] cotangent followed by a
  product, and ``db = sum(g)`` as a row reduction (YNNPACK's reduction on XLA CPU: 86 ms of a 4 s
  BERT-small step); here ``dE`` is one ``dot_general`` contracting the predictions axis and ``db``
  a [1, n] x [n, vocab] product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array


@jax.custom_vjp
def tied_decoder(x: Array, embeddings: Array, bias: Array) -> Array:
    """Logits [..., vocab] fp32 = x [..., hidden] @ embeddings [vocab, hidden]^T + bias [vocab]."""
    logits = jnp.einsum("...h,vh->...v", x, embeddings)
    return logits.astype(jnp.float32) + bias.astype(jnp.float32)


def _tied_decoder_fwd(x, embeddings, bias):
    return tied_decoder(x, embeddings, bias), (x, embeddings, bias)


def _tied_decoder_bwd(residuals, g):
    x, embeddings, bias = residuals
    vocab, hidden = embeddings.shape
    g2 = g.reshape(-1, vocab)  # [n, vocab] fp32
    gx = g2.astype(x.dtype)
    dx = (gx @ embeddings).reshape(x.shape)  # [..., hidden]
    x2 = x.reshape(-1, hidden)
    d_embeddings = lax.dot_general(gx, x2, (((0,), (0,)), ((), ())))  # [vocab, hidden]
    d_bias = (jnp.ones((1, g2.shape[0]), g2.dtype) @ g2)[0]  # [vocab]
    return dx, d_embeddings.astype(embeddings.dtype), d_bias.astype(bias.dtype)


tied_decoder.defvjp(_tied_decoder_fwd, _tied_decoder_bwd)
