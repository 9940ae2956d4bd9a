"""The blocks the rotary encoders share (EuroBERT, NomicBERT): self-attention with RoPE on queries
and keys over separate ``q_proj``/``k_proj``/``v_proj``/``o_proj`` projections (grouped-query
when there are fewer key-value heads), the gated MLP ``down_proj(act(gate_proj(x)) * up_proj(x))``,
and what their encoders compute once before the layers (mask bias, splash segment ids, the RoPE
tables). The parameter names are transformers' (``bertjax.convert.hf_table`` rows read them).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.layers.attention import attend, kernel_seed, resolve_impl
from bertjax.layers.core import (
    BATCH_LENGTH_EMBED,
    BATCH_LENGTH_HEADS_KV,
    BATCH_LENGTH_MLP,
    Linear,
    activation,
    attention_bias,
)
from bertjax.layers.rope import apply_rope, rope_tables
from bertjax.layers.splash_attention import segment_ids_from_mask

Array = jax.Array


class RopeSelfAttention(nn.Module):
    """Self-attention with RoPE on queries and keys; ``kv_heads`` key-value heads (0 = one per
    query head), repeated to the query heads before the kernel (transformers' ``repeat_kv``: query
    head j reads key-value head j // (heads // kv_heads)); biases on every projection when
    ``use_bias``. Reads the config's hidden_size, num_heads, head_dim, attention_impl,
    attention_dropout and dropout_impl."""

    config: Any
    kv_heads: int = 0
    use_bias: bool = False

    @nn.compact
    def __call__(self, x, bias, rope, deterministic: bool, segment_ids=None) -> Array:
        cfg = self.config
        h, n, d, ab = cfg.hidden_size, cfg.num_heads, cfg.head_dim, self.use_bias
        g = self.kv_heads or n
        q = Linear(cfg, (h, n, d), ("embed", "heads", "kv"), 1, ab, name="q_proj")(x)
        k = Linear(cfg, (h, g, d), ("embed", "heads", "kv"), 1, ab, name="k_proj")(x)
        v = Linear(cfg, (h, g, d), ("embed", "heads", "kv"), 1, ab, name="v_proj")(x)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if g != n:
            k, v = jnp.repeat(k, n // g, axis=2), jnp.repeat(v, n // g, axis=2)
        q, k, v = (nn.with_logical_constraint(t, BATCH_LENGTH_HEADS_KV) for t in (q, k, v))
        ctx = attend(
            q,
            k,
            v,
            bias,
            impl=cfg.attention_impl,
            dropout_rate=cfg.attention_dropout,
            dropout_impl=cfg.dropout_impl,
            deterministic=deterministic,
            segment_ids=segment_ids,
            kernel_seed=kernel_seed(self),
        )  # [batch, seq, heads, head_dim]
        ctx = nn.with_logical_constraint(ctx, BATCH_LENGTH_HEADS_KV)
        out = Linear(cfg, (n, d, h), ("heads", "kv", "embed"), 2, ab, name="o_proj")(ctx)
        return nn.with_logical_constraint(out, BATCH_LENGTH_EMBED)  # [batch, seq, hidden]


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), the config's ``hidden_act`` and
    ``intermediate_size``; biases when ``use_bias``."""

    config: Any
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        h, i, mb = cfg.hidden_size, cfg.intermediate_size, self.use_bias
        gate = Linear(cfg, (h, i), ("embed", "mlp"), 1, mb, name="gate_proj")(x)
        up = Linear(cfg, (h, i), ("embed", "mlp"), 1, mb, name="up_proj")(x)
        y = nn.with_logical_constraint(activation(cfg.hidden_act)(gate) * up, BATCH_LENGTH_MLP)
        return Linear(cfg, (i, h), ("mlp", "embed"), 1, mb, name="down_proj")(y)


def check_length(cfg: Any, input_ids: Array) -> None:
    """A sequence longer than ``max_position_embeddings`` (the longest a rotary encoder accepts;
    RoPE has no table) is a ValueError."""
    seq_len = input_ids.shape[1]
    if seq_len > cfg.max_position_embeddings:
        raise ValueError(
            f"sequence length {seq_len} exceeds max_position_embeddings="
            f"{cfg.max_position_embeddings} of the model"
        )


def rope_inputs(
    cfg: Any,
    attention_mask: Array,
    position_ids: Array | None,
    pack_ids: Array | None,
) -> tuple[Array, Array | None, tuple[Array, Array]]:
    """(additive mask bias [batch, 1, 1 or q, k], splash segment ids or None, RoPE cos/sin) of a
    rotary encoder's inputs; ``position_ids`` None: 0..seq-1. The config has ``rope(seq_len)``."""
    seq_len = attention_mask.shape[1]
    bias = attention_bias(attention_mask, jnp.float32, pack_ids)
    segment_ids = None
    if resolve_impl(cfg.attention_impl) == "splash":
        segment_ids = segment_ids_from_mask(attention_mask, pack_ids)
    if position_ids is None:
        position_ids = jnp.arange(seq_len)[None, :]  # [1, seq]
    return bias, segment_ids, rope_tables(position_ids, *cfg.rope(seq_len))
