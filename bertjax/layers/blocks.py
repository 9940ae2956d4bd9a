"""The blocks the rotary encoders share (EuroBERT, NomicBERT, GTE): self-attention with RoPE on
queries and keys over separate ``q_proj``/``k_proj``/``v_proj``/``o_proj`` projections
(grouped-query when there are fewer key-value heads), the gated MLP
``down_proj(act(gate_proj(x)) * up_proj(x))``, what their encoders compute once before the layers
(mask bias, splash segment ids, the RoPE tables), and the whole encoder of the families with BERT's
post-LayerNorm layout (NomicBERT, GTE: :class:`PostNormEncoder`). The parameter names are
transformers' (``bertjax.convert.hf_table`` rows read them).
"""

from __future__ import annotations

from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.layers.attention import attend, kernel_seed, resolve_impl
from bertjax.layers.core import (
    BATCH_LENGTH_EMBED,
    BATCH_LENGTH_HEADS_KV,
    BATCH_LENGTH_MLP,
    EncoderOutput,
    Linear,
    activation,
    attention_bias,
    embed_table,
    embedding_lookup,
    layer_norm,
    layer_stack,
    model_inputs,
    tanh_pooler,
)
from bertjax.layers.dropout import Dropout
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
    def __call__(self, x, bias, rope, deterministic: bool, attention_segment_ids=None) -> Array:
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
            segment_ids=attention_segment_ids,
            kernel_seed=kernel_seed(self),
        )  # [batch, seq, heads, head_dim]
        ctx = nn.with_logical_constraint(ctx, BATCH_LENGTH_HEADS_KV)
        out = Linear(cfg, (n, d, h), ("heads", "kv", "embed"), 2, ab, name="o_proj")(ctx)
        return nn.with_logical_constraint(out, BATCH_LENGTH_EMBED)  # [batch, seq, hidden]


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), the config's ``hidden_act`` and
    ``intermediate_size``; biases when ``use_bias`` (on ``down_proj`` as ``down_bias`` says, None:
    as ``use_bias``); with ``dropout``, the config's ``hidden_dropout`` on the gated activation."""

    config: Any
    use_bias: bool = False
    down_bias: bool | None = None
    dropout: bool = False

    @nn.compact
    def __call__(self, x: Array, deterministic: bool = True) -> Array:
        cfg = self.config
        h, i, mb = cfg.hidden_size, cfg.intermediate_size, self.use_bias
        db = mb if self.down_bias is None else self.down_bias
        gate = Linear(cfg, (h, i), ("embed", "mlp"), 1, mb, name="gate_proj")(x)
        up = Linear(cfg, (h, i), ("embed", "mlp"), 1, mb, name="up_proj")(x)
        y = nn.with_logical_constraint(activation(cfg.hidden_act)(gate) * up, BATCH_LENGTH_MLP)
        if self.dropout:
            y = Dropout(cfg.hidden_dropout, cfg.dropout_impl)(y, deterministic=deterministic)
        return Linear(cfg, (i, h), ("mlp", "embed"), 1, db, name="down_proj")(y)


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
    input_mask: Array,
    position_ids: Array | None,
    pack_ids: Array | None,
) -> tuple[Array, Array | None, tuple[Array, Array]]:
    """(additive mask bias [batch, 1, 1 or q, k], splash segment ids or None, RoPE cos/sin) of a
    rotary encoder's inputs; ``position_ids`` None: 0..seq-1. The config has ``rope(seq_len)``."""
    seq_len = input_mask.shape[1]
    bias = attention_bias(input_mask, jnp.float32, pack_ids)
    attention_segment_ids = None
    if resolve_impl(cfg.attention_impl) == "splash":
        attention_segment_ids = segment_ids_from_mask(input_mask, pack_ids)
    if position_ids is None:
        position_ids = jnp.arange(seq_len)[None, :]  # [1, seq]
    return bias, attention_segment_ids, rope_tables(position_ids, *cfg.rope(seq_len))


def rope_layers(
    layer_cls,
    cfg: Any,
    x: Array,
    inputs: tuple[Array, Array | None, Array | None],
    deterministic: bool,
    output_hidden_states: bool,
    options: dict[str, Any] | None = None,
) -> tuple[Array, tuple[Array, ...]]:
    """A rotary encoder's ``cfg.num_layers`` layers ``layer_cls(cfg, **options)``, called as
    ``(x, bias, rope, deterministic, attention_segment_ids)``, on the embeddings ``x`` with the
    mask bias, splash segment ids and RoPE tables of ``inputs`` (input_mask, position_ids,
    pack_ids; :func:`rope_inputs`): unrolled or scanned (``bertjax.layers.core.layer_stack``).
    Returns the last output and the hidden states (with ``output_hidden_states``)."""
    bias, attention_segment_ids, rope = rope_inputs(cfg, *inputs)
    return layer_stack(
        layer_cls,
        cfg,
        x,
        bias,
        rope,
        deterministic,
        attention_segment_ids,
        static_argnums=(4,),  # counts self: (self, x, bias, rope, deterministic, segment ids)
        options=options,
        output_hidden_states=output_hidden_states,
    )


# ---------------------------------------------------------------------------------------------
# BERT's post-LayerNorm layout with rotary positions (NomicBERT, GTE)
# ---------------------------------------------------------------------------------------------
class PostNormEmbeddings(nn.Module):
    """Word embeddings (+ token-type embeddings where ``type_vocab_size`` > 0), LayerNorm,
    dropout; no position table (RoPE). With one token type every token reads it, whatever its
    ``segment_ids`` (a pair's second segment included: transformers' tokenizers of such
    checkpoints give none). The config has ``type_vocab_size`` and ``layer_norm_eps``."""

    config: Any

    @nn.compact
    def __call__(self, input_ids: Array, segment_ids: Array, deterministic: bool) -> Array:
        cfg = self.config
        words = embed_table(cfg, cfg.vocab_size, ("vocab", "embed"), "word_embeddings")
        x = embedding_lookup(words, input_ids)
        if cfg.type_vocab_size:
            types = embed_table(cfg, cfg.type_vocab_size, (None, "embed"), "token_type_embeddings")
            if cfg.type_vocab_size == 1:
                segment_ids = jnp.zeros_like(segment_ids)
            x = x + embedding_lookup(types, segment_ids)
        x = layer_norm(cfg, "LayerNorm", epsilon=cfg.layer_norm_eps)(x)
        x = Dropout(cfg.hidden_dropout, cfg.dropout_impl)(x, deterministic=deterministic)
        return nn.with_logical_constraint(x, BATCH_LENGTH_EMBED)


class PostNormLayer(nn.Module):
    """x = LN(x + drop(Attn(x))); x = LN(x + drop(MLP(x))): RoPE self-attention (biases on every
    projection with ``attention_bias``), the gated MLP without biases but ``down_bias`` (and
    ``mlp_dropout``: dropout on its gated activation)."""

    config: Any
    attention_bias: bool = False
    down_bias: bool = False
    mlp_dropout: bool = False

    @nn.compact
    def __call__(self, x, bias, rope, deterministic: bool, attention_segment_ids=None) -> Array:
        cfg = self.config
        drop = Dropout(cfg.hidden_dropout, cfg.dropout_impl)
        attention = RopeSelfAttention(cfg, use_bias=self.attention_bias, name="self_attn")
        attn = attention(x, bias, rope, deterministic, attention_segment_ids)
        x = x + drop(attn, deterministic=deterministic)
        x = layer_norm(cfg, "post_attention_layernorm", epsilon=cfg.layer_norm_eps)(x)
        mlp = GatedMLP(cfg, down_bias=self.down_bias, dropout=self.mlp_dropout, name="mlp")
        x = x + drop(mlp(x, deterministic), deterministic=deterministic)
        x = layer_norm(cfg, "post_mlp_layernorm", epsilon=cfg.layer_norm_eps)(x)
        return nn.with_logical_constraint(x, BATCH_LENGTH_EMBED)


class PostNormEncoder(nn.Module):
    """Embeddings (:class:`PostNormEmbeddings`), post-LN layers (:class:`PostNormLayer`, as the
    class attributes ``attention_bias``, ``down_bias`` and ``mlp_dropout`` of a family's subclass
    say) and the optional tanh pooler on the first token (``pooler``).

    ``input_mask`` [batch, seq] (1 = token, 0 = padding; padded keys are masked, padded
    queries computed and never read, as in transformers). Packed rows pass ``pack_ids`` and
    ``position_ids`` restarting at 0 per sequence. ``pool_positions`` [batch, k] pools at those
    positions (pooled_output [batch, k, hidden]); without them pooled_output is [batch, hidden].
    ``hidden_states``: the embeddings and every layer's output, as transformers'.
    """

    config: Any
    add_pooler: bool = True

    attention_bias: ClassVar[bool] = False
    down_bias: ClassVar[bool] = False
    mlp_dropout: ClassVar[bool] = False

    @model_inputs
    @nn.compact
    def __call__(
        self,
        input_ids: Array,
        segment_ids: Array | None = None,
        input_mask: Array | None = None,
        *,
        deterministic: bool = True,
        output_hidden_states: bool = False,
        position_ids: Array | None = None,
        pack_ids: Array | None = None,
        pool_positions: Array | None = None,
    ) -> EncoderOutput:
        cfg = self.config
        check_length(cfg, input_ids)
        if segment_ids is None:
            segment_ids = jnp.zeros_like(input_ids)
        if input_mask is None:
            input_mask = jnp.ones_like(input_ids)
        x = PostNormEmbeddings(cfg, name="embeddings")(input_ids, segment_ids, deterministic)
        options = dict(
            attention_bias=self.attention_bias,
            down_bias=self.down_bias,
            mlp_dropout=self.mlp_dropout,
        )
        inputs = (input_mask, position_ids, pack_ids)
        x, hidden = rope_layers(
            PostNormLayer, cfg, x, inputs, deterministic, output_hidden_states, options
        )
        pooled = tanh_pooler(cfg, x, pool_positions, "pooler") if self.add_pooler else None
        return EncoderOutput(sequence_output=x, pooled_output=pooled, hidden_states=hidden)
