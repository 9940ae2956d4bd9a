"""Ops of the model with hand-written gradients: the same numbers as autodiff, computed in the
order XLA (notably XLA CPU) runs fastest. Each has an equality test in tests/test_fast_ops.py.

* :func:`tied_decoder` - the MLM decoder ``x @ E^T + b`` against the tied word embeddings. Autodiff
  gives ``dE = g^T x`` as a transposed copy of the [predictions, vocab] cotangent followed by a
  product, and ``db = sum(g)`` as a row reduction (YNNPACK's reduction on XLA CPU: 86 ms of a 4 s
  BERT-small step); here ``dE`` is one ``dot_general`` contracting the predictions axis and ``db``
  a [1, n] x [n, vocab] product.
* :func:`gelu` - exact (erf) GELU that keeps ``Phi(x)`` from the forward pass, so the backward
  pass needs one ``exp`` instead of re-evaluating XLA's erf (a rational polynomial with divides):
  3.16-3.36 s vs 3.29-3.88 s per BERT-small step in three alternating pairs of runs.
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


_SQRT_2 = 1.4142135623730951
_INV_SQRT_2PI = 0.3989422804014327


@jax.custom_vjp
def gelu(x: Array) -> Array:
    """Exact GELU ``x * Phi(x)`` (``jax.nn.gelu(x, approximate=False)``), Phi(x) kept for backward."""
    return x * _phi(x)


def _phi(x: Array) -> Array:
    return (lax.erf(x / jnp.asarray(_SQRT_2, x.dtype)) + 1) / 2


def _gelu_fwd(x):
    cdf = _phi(x)
    return x * cdf, (x, cdf)


def _gelu_bwd(residuals, g):
    x, cdf = residuals
    pdf = jnp.exp(-0.5 * x * x) * jnp.asarray(_INV_SQRT_2PI, x.dtype)
    return (g * (cdf + x * pdf),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)
