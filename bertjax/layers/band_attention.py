"""Sliding-window attention computed by blocks of the band, without the full [seq, seq] matrix.

Queries are cut into blocks of ``block`` = ``half`` tokens (``half`` = ``local_window // 2``); the
keys a block can see (``|q - k| <= half``) all lie in the previous, the same and the next block,
so each query block attends to ``3 * block`` keys instead of ``seq``: scores, softmax, dropout and
the weighted sum cost ``3 * half / seq`` of the full computation (37.5% at seq 512, window 128).
The window and the additive ``bias`` are applied exactly as the explicit ``xla`` path applies them
(:func:`bertjax.layers.attention.attend`), so the outputs at real tokens are equal; a padding
query whose band holds no real key gets a finite average of masked keys (it is never read).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def band_applies(seq_len: int, half: int) -> bool:
    """Whether blocks of ``half`` tokens tile the sequence with fewer keys than the full matrix."""
    return half >= 4 and seq_len % half == 0 and seq_len >= 4 * half


def _blocks(x: Array, block: int, half: int, fill: float, axis: int = 1) -> Array:
    """x [..., seq, ...] (the sequence on ``axis``) -> [..., seq // block, block + 2 * half, ...]:
    row n holds the keys query block n (positions ``n * block ...``) can see, ``half`` on each side
    of it (``fill`` beyond the ends). ``block`` is a multiple of ``half``; strided slices of
    ``half``-token chunks, whose gradient is a pad (no scatter)."""
    n, per = x.shape[axis] // block, block // half
    pad = [(0, 0)] * x.ndim
    pad[axis] = (half, half)
    xp = jnp.pad(x, pad, constant_values=fill)
    xp = xp.reshape(*x.shape[:axis], n * per + 2, half, *x.shape[axis + 1 :])
    index = (slice(None),) * axis
    parts = [xp[(*index, slice(j, j + (n - 1) * per + 1, per))] for j in range(per + 2)]
    return jnp.concatenate(parts, axis=axis + 1)  # parts: each [..., n, half, ...]


def _band_bias(bias: Array, block: int, half: int) -> Array:
    """The additive bias [b, 1, 1 or q, k] on the band: [b, 1, n, 1 or block, keys] fp32, with
    ``n = seq // block`` query blocks and ``keys = block + 2 * half``."""
    b, _, rows, seq = bias.shape
    n, keys = seq // block, block + 2 * half
    low = jnp.finfo(jnp.float32).min
    if rows == 1:  # keys only (padding): the same band for every query of a block
        band = _blocks(bias[:, 0, 0].astype(jnp.float32), block, half, low)  # [b, n, keys]
        return band[:, None, :, None, :]
    # Per query (packed rows): gather the band's columns of each query block.
    padded = jnp.pad(
        bias[:, 0].astype(jnp.float32), ((0, 0), (0, 0), (half, half)), constant_values=low
    )
    padded = padded.reshape(b, n, block, seq + 2 * half)
    cols = np.arange(n)[:, None] * block + np.arange(keys)[None, :]  # [n, keys]
    idx = jnp.broadcast_to(jnp.asarray(cols)[None, :, None, :], (b, n, block, keys))
    return jnp.take_along_axis(padded, idx, axis=3)[:, None]  # [b, 1, n, block, keys]


def _band_bias_from_ids(segment_ids: Array, block: int, half: int) -> Array:
    """Packed rows' bias on the band from their ids [b, seq] (a query sees the keys of its own id,
    padding 0 included, as ``attention_bias`` with ``pack_ids``): [b, 1, n, block, keys]."""
    b, seq = segment_ids.shape
    ids = segment_ids.astype(jnp.int32)
    queries = ids.reshape(b, seq // block, block)  # [b, n, block]
    keys = _blocks(ids, block, half, -1)  # [b, n, keys]; -1 beyond the ends matches nothing
    same = queries[:, :, :, None] == keys[:, :, None, :]
    return jnp.where(same, 0.0, jnp.finfo(jnp.float32).min)[:, None]


def fused_block(seq_len: int, half: int) -> int:
    """The query block of the fused band: up to ``4 * half`` tokens (the keys a block reads, its
    own and ``half`` each side, are then 1.5x the queries rather than 3x: less K/V to copy),
    dividing ``seq_len``."""
    for per in (4, 2):
        if seq_len % (per * half) == 0 and seq_len >= 2 * per * half:
            return per * half
    return half


def band_attention(
    q: Array,
    k: Array,
    v: Array,
    bias: Array,
    half: int,
    dropout=None,
    segment_ids=None,
    fused=None,
) -> Array:
    """Softmax attention of q/k/v [b, seq, heads, dim] restricted to ``|i - j| <= half``, with the
    additive ``bias`` [b, 1, 1 or seq, seq] (fp32 softmax); ``dropout`` (a callable) is applied to
    the probabilities. With ``segment_ids`` [b, seq] (packed rows) the band's mask is built from
    the ids and ``bias`` is not read: memory and time stay ``O(seq * half)``. Needs
    :func:`band_applies`. Returns [b, seq, heads, dim].

    ``fused(q, k, v, bias)`` (a fused attention kernel, e.g. cuDNN's: q [B, T, heads, dim], k and
    v [B, S, heads, dim], bias [B, 1, T, S] in q's dtype) computes every query block
    (:func:`fused_block`: up to ``4 * half`` queries) against its keys (its own and ``half`` on
    each side) as one batch of small attentions: the scores and the probabilities stay inside the
    kernel, and ``dropout`` is the kernel's own (not applied here)."""
    b, seq, h, d = q.shape
    dtype = q.dtype
    block = fused_block(seq, half) if fused is not None else half
    n, width = seq // block, block + 2 * half
    offset = np.arange(width)[None, :] - half - np.arange(block)[:, None]  # key - query
    near = jnp.asarray(np.abs(offset) <= half)  # [block, width]
    band_bias = (
        _band_bias(bias, block, half)
        if segment_ids is None
        else _band_bias_from_ids(segment_ids, block, half)
    )
    if fused is not None:
        # [b, seq, h, d] -> [b * n, block, h, d]: no transpose; the keys of each block beside it.
        low = jnp.finfo(dtype).min  # finite in q's dtype (fp32's min is -inf in bf16)
        block_bias = jnp.where(near, jnp.maximum(band_bias, low), low).astype(dtype)
        block_bias = jnp.broadcast_to(block_bias, (b, 1, n, block, width))
        block_bias = jnp.transpose(block_bias, (0, 2, 1, 3, 4)).reshape(b * n, 1, block, width)
        kb, vb = (_blocks(x, block, half, 0.0).reshape(b * n, width, h, d) for x in (k, v))
        out = fused(q.reshape(b * n, block, h, d), kb, vb, block_bias)
        return out.reshape(b, seq, h, d)
    scale = jnp.asarray(1.0 / np.sqrt(d), dtype)
    # Heads-major blocks: every einsum below has its batch axes (b, h, n) leading and its
    # operands in matmul order, so XLA needs no transposes around them (on CPU the layout copies
    # around the [b, n, ., h, d] form cost about a third of this function; see docs/performance.md).
    qb = jnp.transpose(q * scale, (0, 2, 1, 3)).reshape(b, h, n, block, d)  # [b, h, n, q, d]
    # the keys and values each query block sees: [b, h, n, width, d] (zeros beyond the ends)
    kb, vb = (_blocks(jnp.transpose(x, (0, 2, 1, 3)), block, half, 0.0, axis=2) for x in (k, v))
    logits = jnp.einsum("bhnqd,bhnkd->bhnqk", qb, kb).astype(jnp.float32)
    low = jnp.finfo(jnp.float32).min
    logits = logits + jnp.where(near, band_bias, low)
    probs = jax.nn.softmax(logits, axis=-1)  # [b, h, n, block, width]
    if dropout is not None:
        probs = dropout(probs)
    out = jnp.einsum("bhnqk,bhnkd->bhnqd", probs.astype(dtype), vb)  # [b, h, n, q, d]
    return jnp.transpose(out.reshape(b, h, seq, d), (0, 2, 1, 3))  # [b, seq, h, d]
