"""Dropout with a cheaper random mask: 16 random bits per element instead of a full counter block.

``flax.linen.Dropout`` draws ``jax.random.bernoulli``: with JAX's partitionable Threefry (the
default since JAX 0.5) that is one Threefry-2x32 block, 20 rounds producing two 32-bit words, per
element, and the two words are XOR-ed into one. On CPU that hashing is most of the cost of dropout
(about 15% of a BERT-small train step, measured with ``bertjax bench``). :class:`Dropout` uses both
words of each block and both 16-bit halves of each word, so one block masks four elements:

    keep = bits16 < round(keep_prob * 2**16),   y = where(keep, x * 2**16 / threshold, 0)

The keep probability is ``threshold / 2**16`` (rate 0.1 -> 0.1000061) and the rescale divides by
exactly that, so ``E[y] = x`` holds exactly. The counters are iotas over the output shape with the
last axis split, so the mask stays elementwise in the shape and partitions under SPMD like
``jax.random.bits`` (no replicated random-number generation on a sharded activation).

``impl="flax"`` draws exactly what ``flax.linen.Dropout`` draws (the module has the same class
name, hence the same auto-name and RNG path), for exact reproduction of runs made with it. Keys that are not Threefry (``rbg``, ``unsafe_rbg``) and shapes whose last axis
is not a multiple of 4 use 16-bit halves of ``jax.random.bits`` words instead (two per word).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p

from bertjax.layers.platform import current_platform

# kernel: attention dropout inside the fused GPU kernel (bertjax.layers.attention), else flax.
DROPOUT_IMPLS = ("auto", "bits16", "flax", "kernel")
_BITS = 16


def resolve_impl(impl: str, platform: str | None = None) -> str:
    """``auto`` -> the cheaper mask for the platform (default: JAX's default backend).

    On CPU, ``bits16`` (a quarter of the Threefry hashing; about 15% of a BERT-small step). On TPU,
    ``flax``: by the TPU compiler's cost model, ``bits16``'s 16-bit unpacking costs 8x the plain
    32-bit draw (0.36 vs 0.04 ms for a [8192, 3072] mask on v5p), which is 4.7 ms of a 29 ms
    BERT-base step. GPUs get ``flax`` too (the common path; not yet measured).
    """
    if impl != "auto":
        return impl
    platform = platform or current_platform()
    return "bits16" if platform == "cpu" else "flax"


def _threefry_key_words(rng: jax.Array) -> tuple[jax.Array, jax.Array] | None:
    """The two uint32 key words of a Threefry key (typed or raw uint32[2]); None for other impls."""
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        if "threefry" not in str(jax.random.key_impl(rng)):
            return None
        rng = jax.random.key_data(rng)
    if rng.shape != (2,) or rng.dtype != jnp.uint32:
        return None
    return rng[0], rng[1]


def _counters(shape: tuple[int, ...]) -> jax.Array:
    """uint32 row-major linear index of every element of ``shape`` (built from iotas)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride)
        stride *= shape[axis]
    return index


def random_halfwords(rng: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniform uint16 values of ``shape``, four per Threefry block where possible.

    The 32-bit words are reinterpreted (``bitcast_convert_type``) as pairs of 16-bit values rather
    than masked and shifted, so XLA materialises nothing between the hash and the comparison but
    the [..., last/4, 2] words.
    """
    shape = tuple(shape)
    size = math.prod(shape)
    key = _threefry_key_words(rng)
    last = shape[-1] if shape else 1
    if key is not None and last % 4 == 0 and size // 4 < 2**32:
        block_shape = (*shape[:-1], last // 4)
        counts = _counters(block_shape)  # [..., last/4]
        hi, lo = threefry2x32_p.bind(key[0], key[1], jnp.zeros_like(counts), counts)
        words = jnp.stack([hi, lo], axis=-1)  # [..., last/4, 2]
    elif last % 2 == 0:
        words = jax.random.bits(rng, (*shape[:-1], last // 2), jnp.uint32)[..., None]
    else:
        return (jax.random.bits(rng, shape, jnp.uint32) >> np.uint32(32 - _BITS)).astype(jnp.uint16)
    return lax.bitcast_convert_type(words, jnp.uint16).reshape(shape)  # [..., 2, 2] -> [...]


def keep_threshold(rate: float) -> int:
    """The 16-bit threshold for keeping an element with probability ``1 - rate``."""
    return int(round((1.0 - rate) * 2**_BITS))


def dropout_bits16(rng: jax.Array, x: jax.Array, rate: float) -> jax.Array:
    """Inverted dropout of ``x`` with a 16-bit mask; ``E[result] == x`` exactly."""
    threshold = keep_threshold(rate)
    if threshold <= 0:
        return jnp.zeros_like(x)
    if threshold >= 2**_BITS:  # rate below 2**-17: nothing to drop at this resolution
        return x
    keep = random_halfwords(rng, x.shape) < np.uint16(threshold)
    scale = jnp.asarray(2**_BITS / threshold, x.dtype)
    return jnp.where(keep, x * scale, jnp.zeros((), x.dtype))


class Dropout(nn.Module):
    """Drop-in for ``nn.Dropout(rate)(x, deterministic=...)`` with a selectable mask generator."""

    rate: float
    impl: str = "auto"  # auto | bits16 | flax (see resolve_impl)
    rng_collection: str = "dropout"

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
        if self.impl not in DROPOUT_IMPLS:
            raise ValueError(f"dropout impl {self.impl!r} is not one of {DROPOUT_IMPLS}")
        if deterministic or self.rate == 0.0:
            return x
        rng = self.make_rng(self.rng_collection)
        if resolve_impl(self.impl) == "bits16":
            return dropout_bits16(rng, x, self.rate)
        keep_prob = 1.0 - self.rate  # what flax.linen.Dropout draws, bit for bit
        keep = jax.random.bernoulli(rng, p=keep_prob, shape=x.shape)
        return lax.select(keep, x / keep_prob, jnp.zeros_like(x))
