"""The sliding window by blocks of the band (bertjax.layers.band_attention) equals the window as a
mask on the full score matrix: outputs at real tokens and gradients, padded and packed rows, and
through ``attend`` (which picks it on the explicit path), with attention dropout too."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.layers.attention import attend
from bertjax.layers.band_attention import band_applies, band_attention, fused_block
from bertjax.layers.core import attention_bias

SEQ, HEADS, DIM, WINDOW = 64, 2, 16, 16  # half 8: blocks of 8, 24 keys per query block


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((2, SEQ, HEADS, DIM)), jnp.float32) for _ in "qkv")
    mask = (np.arange(SEQ)[None] < np.array([SEQ, 37])[:, None]).astype(np.int32)
    pack = np.where(mask > 0, 1 + (np.arange(SEQ)[None] >= 21) + (np.arange(SEQ)[None] >= 50), 0)
    return q, k, v, mask, pack


def _masked_full(q, k, v, bias):
    """The reference: the window as a mask on the full [q, k] matrix (fp32 softmax)."""
    pos = jnp.arange(SEQ)
    near = jnp.abs(pos[:, None] - pos[None, :]) <= WINDOW // 2
    bias = jnp.where(near, bias, jnp.finfo(jnp.float32).min)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q / np.sqrt(DIM), k) + bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def test_band_applies_only_where_blocks_tile_the_sequence():
    assert band_applies(512, 64) and band_applies(64, 8)
    assert not band_applies(64, 32)  # 2 blocks: no saving
    assert not band_applies(100, 16)  # does not tile
    assert not band_applies(64, 3)  # too small a block


def _xla_kernel(q, k, v, bias):
    """A fused kernel's contract (q [B, T, h, d], k/v [B, S, h, d], bias [B, 1, T, S]) on CPU:
    jax's own attention, as cuDNN's is called on a GPU."""
    assert bias.shape == (q.shape[0], 1, q.shape[1], k.shape[1]), bias.shape
    return jax.nn.dot_product_attention(q, k, v, bias=bias, implementation="xla")


def test_fused_query_blocks_are_up_to_four_halves_and_tile_the_sequence():
    assert fused_block(1024, 64) == 256  # ModernBERT: window 128 at 1024 tokens
    assert fused_block(8192, 64) == 256
    assert fused_block(384, 64) == 128  # 384 is not a multiple of 256
    assert fused_block(256, 64) == 128  # a 256-token block would be the whole sequence
    assert fused_block(SEQ, WINDOW // 2) == 32


@pytest.mark.parametrize("fused", [None, _xla_kernel], ids=["einsums", "kernel"])
@pytest.mark.parametrize("rows", ["padded", "packed", "packed_ids"])
def test_band_equals_the_masked_full_matrix(rows, fused):
    """The band by blocks, as einsums (half-token blocks) and as one batch of small fused
    attentions (the cuDNN path: four-half query blocks and their keys, the band as a bias); packed
    rows' band from their [q, k] bias or from their ids."""
    q, k, v, mask, pack = _inputs()
    packed = rows != "padded"
    bias = attention_bias(jnp.asarray(mask), jnp.float32, jnp.asarray(pack) if packed else None)
    real = (pack if packed else mask) > 0
    ids = jnp.asarray(pack) if rows == "packed_ids" else None

    def band(q, k, v):
        return band_attention(q, k, v, bias, WINDOW // 2, segment_ids=ids, fused=fused)

    def full(q, k, v):
        return _masked_full(q, k, v, bias)

    got, want = jax.jit(band)(q, k, v), jax.jit(full)(q, k, v)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-6)
    assert np.isfinite(np.asarray(got)).all()  # padding queries: finite, never read

    def grads(f):
        weight = jnp.asarray(real, jnp.float32)[:, :, None, None]
        return jax.jit(jax.grad(lambda *a: ((f(*a) * weight) ** 2).sum(), argnums=(0, 1, 2)))

    for g, w in zip(grads(band)(q, k, v), grads(full)(q, k, v)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5)


class _Attend(nn.Module):
    impl: str = "xla"
    rate: float = 0.0

    @nn.compact
    def __call__(self, q, k, v, bias, deterministic=True):
        kwargs = dict(impl=self.impl, dropout_rate=self.rate, dropout_impl="bits16")
        return attend(q, k, v, bias, **kwargs, deterministic=deterministic, local_window=WINDOW)


def test_attend_takes_the_band_on_the_explicit_path_with_dropout():
    q, k, v, mask, _ = _inputs(1)
    bias = attention_bias(jnp.asarray(mask), jnp.float32)
    real = mask > 0
    want = np.asarray(jax.jit(_masked_full)(q, k, v, bias))[real]
    for impl in ("xla", "dot_product"):
        got = jax.jit(_Attend(impl).apply)({}, q, k, v, bias)
        np.testing.assert_allclose(np.asarray(got)[real], want, atol=2e-6)
    rngs = {"dropout": jax.random.key(0)}
    dropout = jax.jit(lambda rngs: _Attend("xla", 0.5).apply({}, q, k, v, bias, False, rngs=rngs))
    dropped = dropout(rngs)
    again = dropout(rngs)
    assert np.isfinite(np.asarray(dropped)).all()
    np.testing.assert_array_equal(np.asarray(dropped), np.asarray(again))
    assert np.abs(np.asarray(dropped)[real] - want).max() > 1e-3  # dropout did act
