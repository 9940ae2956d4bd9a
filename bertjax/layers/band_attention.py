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


def _blocks(x: Array, block: int, fill: float, axis: int = 1) -> Array:
    """x [..., seq, ...] (the sequence on ``axis``) -> [..., seq // block, 3 * block, ...]: row n
    holds blocks n-1, n, n+1 (``fill`` beyond the ends)."""
    n = x.shape[axis] // block
    pad = [(0, 0)] * x.ndim
    pad[axis] = (block, block)
    xp = jnp.pad(x, pad, constant_values=fill)
    xp = xp.reshape(*x.shape[:axis], n + 2, block, *x.shape[axis + 1 :])
    index = (slice(None),) * axis
    parts = [xp[(*index, slice(j, j + n))] for j in range(3)]  # each [..., n, block, ...]
    return jnp.concatenate(parts, axis=axis + 1)


def _band_bias(bias: Array, block: int) -> Array:
    """The additive bias [b, 1, 1 or q, k] on the band: [b, 1, n, 1 or block, 3 * block] fp32."""
    b, _, rows, seq = bias.shape
    n = seq // block
    low = jnp.finfo(jnp.float32).min
    if rows == 1:  # keys only (padding): the same band for every query of a block
        keys = _blocks(bias[:, 0, 0].astype(jnp.float32), block, low)  # [b, n, 3 * block]
        return keys[:, None, :, None, :]
    # Per query (packed rows): gather the band's columns of each query block.
    padded = jnp.pad(
        bias[:, 0].astype(jnp.float32), ((0, 0), (0, 0), (block, block)), constant_values=low
    )
    padded = padded.reshape(b, n, block, seq + 2 * block)
    cols = np.arange(n)[:, None] * block + np.arange(3 * block)[None, :]  # [n, 3 * block]
    idx = jnp.broadcast_to(jnp.asarray(cols)[None, :, None, :], (b, n, block, 3 * block))
    return jnp.take_along_axis(padded, idx, axis=3)[:, None]  # [b, 1, n, block, 3 * block]


def _band_bias_from_ids(segment_ids: Array, block: int) -> Array:
    """Packed rows' bias on the band from their ids [b, seq] (a query sees the keys of its own id,
    padding 0 included, as ``attention_bias`` with ``pack_ids``): [b, 1, n, block, 3 * block]."""
    b, seq = segment_ids.shape
    ids = segment_ids.astype(jnp.int32)
    queries = ids.reshape(b, seq // block, block)  # [b, n, block]
    keys = _blocks(ids, block, -1)  # [b, n, 3 * block]; -1 beyond the ends matches nothing
    same = queries[:, :, :, None] == keys[:, :, None, :]
    return jnp.where(same, 0.0, jnp.finfo(jnp.float32).min)[:, None]


def band_attention(
    q: Array, k: Array, v: Array, bias: Array, half: int, dropout=None, segment_ids=None
) -> Array:
    """Softmax attention of q/k/v [b, seq, heads, dim] restricted to ``|i - j| <= half``, with the
    additive ``bias`` [b, 1, 1 or seq, seq] (fp32 softmax); ``dropout`` (a callable) is applied to
    the probabilities. With ``segment_ids`` [b, seq] (packed rows) the band's mask is built from
    the ids and ``bias`` is not read: memory and time stay ``O(seq * half)``. Needs
    :func:`band_applies`. Returns [b, seq, heads, dim]."""
    b, seq, h, d = q.shape
    block, n = half, seq // half
    dtype = q.dtype
    scale = jnp.asarray(1.0 / np.sqrt(d), dtype)
    # Heads-major blocks: every einsum below has its batch axes (b, h, n) leading and its
    # operands in matmul order, so XLA needs no transposes around them (on CPU the layout copies
    # around the [b, n, ., h, d] form cost about a third of this function; see docs/performance.md).
    qb = jnp.transpose(q * scale, (0, 2, 1, 3)).reshape(b, h, n, block, d)  # [b, h, n, q, d]
    # the keys and values each query block sees: [b, h, n, 3 * block, d] (zeros beyond the ends)
    kb, vb = (_blocks(jnp.transpose(x, (0, 2, 1, 3)), block, 0.0, axis=2) for x in (k, v))
    logits = jnp.einsum("bhnqd,bhnkd->bhnqk", qb, kb).astype(jnp.float32)
    offset = np.arange(3 * block)[None, :] - block - np.arange(block)[:, None]  # key - query
    near = jnp.asarray(np.abs(offset) <= half)  # [block, 3 * block]
    low = jnp.finfo(jnp.float32).min
    band_bias = (
        _band_bias(bias, block) if segment_ids is None else _band_bias_from_ids(segment_ids, block)
    )
    logits = logits + jnp.where(near, band_bias, low)
    probs = jax.nn.softmax(logits, axis=-1)  # [b, h, n, block, 3 * block]
    if dropout is not None:
        probs = dropout(probs)
    out = jnp.einsum("bhnqk,bhnkd->bhnqd", probs.astype(dtype), vb)  # [b, h, n, q, d]
    return jnp.transpose(out.reshape(b, h, seq, d), (0, 2, 1, 3))  # [b, seq, h, d]
