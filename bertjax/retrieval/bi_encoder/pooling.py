"""Sentence embeddings from token embeddings: pooling, dense projections and L2 normalisation,
as sentence-transformers' ``Pooling``, ``Dense`` and ``Normalize`` modules compute them.

:class:`EmbeddingHead` describes the head (hashable, so a jitted model keys on it); the functions
here are plain ``jax.numpy`` on right-padded batches and are run by
``bertjax.retrieval.bi_encoder.embedding.SentenceEmbedder`` after the encoder:

* ``cls``: the first token the mask keeps; ``lasttoken``: the last one (zeros for an empty row);
* ``mean`` / ``mean_sqrt_len_tokens``: the masked sum over the count (or its square root);
* ``max``: the masked maximum; ``weightedmean``: positions weighted 1, 2, 3, ...

Several modes concatenate in the order given. ``prompt_length`` [batch] drops the first tokens
(the [CLS] and the prompt) from the mask first: sentence-transformers' ``include_prompt=False``.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.layers.core import activation

Array = jax.Array

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")


@dataclasses.dataclass(frozen=True)
class DenseLayer:
    """One projection after pooling: ``activation(x @ kernel + bias)`` (+ ``x``, or ``x``
    projected without bias where the widths differ, when ``residual``). ``activation`` is one of
    ``bertjax.layers.core.ACTIVATIONS`` (``linear``: none)."""

    in_features: int
    out_features: int
    bias: bool = True
    activation: str = "tanh"
    residual: bool = False


def check_dense_tensors(
    dense: tuple[DenseLayer, ...], tensors: dict, source: str, head: str, layers: str
) -> None:
    """ValueError naming ``source`` unless ``tensors`` (by path) are exactly those of the
    ``dense`` layers: ``dense_{i}/...`` for each, ``dense_{i}_residual/...`` where it has one;
    ``head`` and ``layers`` name the head and its layers in the message."""
    want = {f"dense_{i}" for i in range(len(dense))}
    want |= {f"dense_{i}_residual" for i, layer in enumerate(dense) if layer.residual}
    got = {path.split("/")[0] for path in tensors}
    if not got <= want or not {f"dense_{i}" for i in range(len(dense))} <= got:
        raise ValueError(
            f"{source}: the recorded {head} has {len(dense)} {layers} but the checkpoint holds "
            f"{sorted(got) or 'none'}"
        )


def dense_layers(dense: tuple[DenseLayer, ...], x: Array) -> Array:
    """``x`` through the ``dense`` layers in order, each a Flax ``Dense`` named ``dense_{i}`` (and
    ``dense_{i}_residual``) of the module whose ``nn.compact`` method calls this: the bi-encoder's
    layers after pooling, ColBERT's per-token projections."""
    for i, layer in enumerate(dense):
        y = nn.Dense(layer.out_features, use_bias=layer.bias, name=f"dense_{i}")(x)
        y = activation(layer.activation)(y)
        if layer.residual:
            same = layer.in_features == layer.out_features
            name = f"dense_{i}_residual"
            y = y + (x if same else nn.Dense(layer.out_features, use_bias=False, name=name)(x))
        x = y
    return x


@dataclasses.dataclass(frozen=True)
class EmbeddingHead:
    """How token embeddings become one vector: ``pooling`` modes (concatenated), whether prompt
    tokens count (``include_prompt``), ``dense`` layers in order, then ``normalize`` (L2)."""

    pooling: tuple[str, ...] = ("mean",)
    include_prompt: bool = True
    dense: tuple[DenseLayer, ...] = ()
    normalize: bool = False

    def __post_init__(self):
        bad = [m for m in self.pooling if m not in POOLING_MODES]
        if bad or not self.pooling:
            raise ValueError(f"pooling modes {list(self.pooling)}: choose from {POOLING_MODES}")

    def dimension(self, hidden_size: int) -> int:
        """The embedding width for an encoder of ``hidden_size``."""
        width = len(self.pooling) * hidden_size
        for layer in self.dense:
            if layer.in_features != width:
                raise ValueError(
                    f"dense layer in_features={layer.in_features} but the vector before it has "
                    f"{width} values"
                )
            width = layer.out_features
        return width


def prompt_mask(input_mask: Array, prompt_length: Array | None) -> Array:
    """[batch, seq] mask with the first ``prompt_length`` [batch] positions dropped."""
    if prompt_length is None:
        return input_mask
    positions = jnp.arange(input_mask.shape[-1])[None, :]  # [1, seq]
    return jnp.where(positions < prompt_length[:, None], 0, input_mask)


def pool(
    hidden: Array,  # [batch, seq, hidden] float32
    input_mask: Array,  # [batch, seq] 0/1, right-padded
    modes: tuple[str, ...],
    prompt_length: Array | None = None,  # [batch] tokens to leave out ([CLS] + prompt)
) -> Array:
    """[batch, len(modes) * hidden]: each pooling mode of ``hidden``, concatenated."""
    original = input_mask
    mask = prompt_mask(input_mask, prompt_length)
    weights = mask[..., None].astype(hidden.dtype)  # [batch, seq, 1]
    count = jnp.maximum(weights.sum(axis=1), 1e-9)  # [batch, 1]
    total = (hidden * weights).sum(axis=1)  # [batch, hidden]
    seq = hidden.shape[1]
    out = []
    for mode in modes:
        if mode == "cls":
            first = jnp.argmax(mask, axis=-1)  # [batch]; 0 for an empty row
            out.append(jnp.take_along_axis(hidden, first[:, None, None], axis=1)[:, 0])
        elif mode == "lasttoken":
            kept = mask.any(axis=-1)
            last = jnp.where(kept, seq - 1 - jnp.argmax(mask[:, ::-1], axis=-1), 0)  # [batch]
            picked = jnp.take_along_axis(hidden * weights, last[:, None, None], axis=1)[:, 0]
            out.append(picked)
        elif mode == "mean":
            out.append(total / count)
        elif mode == "mean_sqrt_len_tokens":
            out.append(total / jnp.sqrt(count))
        elif mode == "max":
            out.append(jnp.where(weights > 0, hidden, -jnp.inf).max(axis=1))
        elif mode == "weightedmean":
            start = jnp.argmax(original, axis=-1)[:, None]  # [batch, 1]: left padding, if any
            position = jnp.arange(1, seq + 1, dtype=hidden.dtype)[None, :] - start
            w = weights * position[..., None]  # [batch, seq, 1]
            out.append((hidden * w).sum(axis=1) / jnp.maximum(w.sum(axis=1), 1e-9))
        else:
            raise ValueError(f"pooling mode {mode!r}: choose from {POOLING_MODES}")
    return jnp.concatenate(out, axis=-1)


def l2_normalize(x: Array) -> Array:
    """Rows scaled to unit length (torch's ``F.normalize``: norms below 1e-12 count as 1e-12)."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
