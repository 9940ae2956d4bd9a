"""BERT (Devlin et al., 2018): config with presets, the post-LN encoder, its pretraining heads,
and what the rest of bertjax needs to know about it (parameter and FLOP counts).

Presets follow the BERT paper and the 24 official "BERT miniatures" (Turc et al., 2019):
``L{2,4,6,8,10,12}_H{128,256,512,768}`` with ``H/64`` heads and a ``4H`` feed-forward layer, the named
aliases ``tiny`` (L2/H128), ``mini`` (L4/H256), ``small`` (L4/H512), ``medium`` (L8/H512), ``base``
(L12/H768/A12) and ``large`` (L24/H1024/A16).

Parameter tree (names chosen so that conversion to/from Google and Hugging Face checkpoints is a
table, see ``bertjax.convert.bert_layout``)::

    bert/embeddings/{word_embeddings,position_embeddings,token_type_embeddings}/embedding
    bert/embeddings/LayerNorm/{scale,bias}
    bert/encoder/layer_{i}/attention/{query,key,value}/{kernel [embed, heads, kv], bias [heads, kv]}
    bert/encoder/layer_{i}/attention/output/{kernel [heads, kv, embed], bias}
    bert/encoder/layer_{i}/{attention_norm,output_norm}/{scale,bias}
    bert/encoder/layer_{i}/intermediate/kernel [embed, mlp];  .../output/kernel [mlp, embed]
    bert/pooler/dense/{kernel,bias}
    predictions/{dense,LayerNorm}, predictions/output_bias [vocab]   (MLM head)
    seq_relationship/{kernel [embed, 2], bias}                        (NSP head)

With ``scan_layers=True`` the layers live under ``bert/encoder/layers`` with a leading ``layers`` axis.
Every kernel carries logical axis names; ``bertjax.sharding.RULES`` maps them onto the mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.layers import fast_ops
from bertjax.layers.attention import HeadProjection, attend, kernel_seed, resolve_impl
from bertjax.layers.core import (
    BATCH_LENGTH_EMBED,
    BATCH_LENGTH_HEADS_KV,
    BATCH_LENGTH_MLP,
    EncoderConfig,
    EncoderOutput,
    activation,
    attention_bias,
    check_common_fields,
    dense,
    dtype_of,
    embed_table,
    embedding_lookup,
    layer_norm,
    layer_stack,
    model_inputs,
    tanh_pooler,
    zeros_init,
)
from bertjax.layers.dropout import Dropout
from bertjax.layers.platform import current_platform
from bertjax.layers.splash_attention import segment_ids_from_mask
from bertjax.models.contract import Architecture

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class BertConfig(EncoderConfig):
    """Architecture and numerics of a BERT encoder (field names follow the paper, not a framework)."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"  # exact (erf) GELU as in the original BERT
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    # bits16: 16 random bits per element, four elements per Threefry block (bertjax.layers.dropout);
    # flax: exactly flax.linen.Dropout's masks (a full block per element, ~15% slower on CPU)
    dropout_impl: str = "auto"  # auto (per platform) | bits16 | flax (bertjax.layers.dropout)
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    dtype: str = (
        "float32"  # compute dtype (bfloat16 on TPU/GPU); softmax and LayerNorm stats stay fp32
    )
    param_dtype: str = "float32"
    # xla: explicit einsums; dot_product/cudnn: jax.nn.dot_product_attention; splash: Pallas TPU
    # kernel (bertjax.layers.splash_attention; seq a multiple of 128, attention_dropout=0 to use it)
    attention_impl: str = "xla"
    remat: str = "none"  # rematerialisation per layer: none | dots (save matmuls) | full
    scan_layers: bool = False  # nn.scan over layers: params stacked on a leading "layers" axis

    architecture: ClassVar[str] = "bert"

    def __post_init__(self):
        check_common_fields(self)
        if self.type_vocab_size < 1 or self.max_position_embeddings < 2:
            raise ValueError(
                f"model config: max_position_embeddings={self.max_position_embeddings} and "
                f"type_vocab_size={self.type_vocab_size} must be >= 2 and >= 1"
            )

    def num_params(self, include_heads: bool = True) -> int:
        """Analytic parameter count (encoder + pooler, plus MLM/NSP heads when asked)."""
        h, v, i = self.hidden_size, self.vocab_size, self.intermediate_size
        emb = (v + self.max_position_embeddings + self.type_vocab_size) * h + 2 * h
        layer = 4 * (h * h + h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h
        total = emb + self.num_layers * layer + (h * h + h)
        if include_heads:
            total += (h * h + h) + 2 * h + v + (2 * h + 2)
        return total


def _miniatures() -> dict[str, dict[str, int]]:
    presets = {}
    for layers in (2, 4, 6, 8, 10, 12):
        for hidden in (128, 256, 512, 768):
            presets[f"L{layers}_H{hidden}"] = dict(
                num_layers=layers,
                hidden_size=hidden,
                num_heads=hidden // 64,
                intermediate_size=4 * hidden,
            )
    return presets


PRESETS: dict[str, dict[str, int]] = {
    **_miniatures(),
    "L24_H1024": dict(num_layers=24, hidden_size=1024, num_heads=16, intermediate_size=4096),
    # MiniLM-L6-H384 (all-MiniLM-L6-v2's shape): 12 heads of 32
    "L6_H384": dict(num_layers=6, hidden_size=384, num_heads=12, intermediate_size=1536),
}
ALIASES = {
    "tiny": "L2_H128",
    "mini": "L4_H256",
    "small": "L4_H512",
    "medium": "L8_H512",
    "base": "L12_H768",
    "large": "L24_H1024",
    "minilm": "L6_H384",
}


def preset_names() -> list[str]:
    """Every accepted preset name (aliases first)."""
    return list(ALIASES) + list(PRESETS)


def get_preset(name: str, **overrides: Any) -> BertConfig:
    """Decodes a preset name (``base``, ``L4_H256``, ...) into a BertConfig, with field overrides."""
    key = ALIASES.get(name, name)
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {preset_names()}")
    return BertConfig(**{**PRESETS[key], **overrides})


class BertEmbeddings(nn.Module):
    """Token + position + segment embeddings, LayerNorm, dropout.

    ``position_ids`` [batch, seq] (default 0..seq-1) restart at 0 for every sequence of a packed row.
    """

    config: BertConfig

    @nn.compact
    def __call__(
        self,
        input_ids: Array,
        segment_ids: Array,
        *,
        deterministic: bool,
        position_ids: Array | None = None,
    ) -> Array:
        cfg = self.config
        seq_len = input_ids.shape[-1]
        if seq_len > cfg.max_position_embeddings:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_position_embeddings="
                f"{cfg.max_position_embeddings} of the model"
            )

        # embedding_lookup: the tables' gradients accumulate in the parameter dtype (see there)
        words = embedding_lookup(
            embed_table(cfg, cfg.vocab_size, ("vocab", "embed"), "word_embeddings"), input_ids
        )
        table = embed_table(
            cfg, cfg.max_position_embeddings, (None, "embed"), "position_embeddings"
        )
        if position_ids is None:  # rows 0..seq-1: a slice, whose gradient is no scatter
            positions = table.embedding[None, :seq_len].astype(table.dtype)  # [1, seq, hidden]
        else:
            positions = embedding_lookup(table, position_ids)
        types = embedding_lookup(
            embed_table(cfg, cfg.type_vocab_size, (None, "embed"), "token_type_embeddings"),
            segment_ids,
        )
        x = words + positions + types  # [batch, seq, hidden]
        x = layer_norm(cfg, "LayerNorm", epsilon=cfg.layer_norm_eps)(x)
        x = Dropout(cfg.hidden_dropout, cfg.dropout_impl)(x, deterministic=deterministic)
        return nn.with_logical_constraint(x, BATCH_LENGTH_EMBED)


def fused_qkv(config: BertConfig, x: Array) -> tuple[Array, Array, Array]:
    """Query, key and value [batch, seq, heads, head_dim] from ONE matmul against the three kernels
    stacked at run time (params stay ``query``/``key``/``value``): on CPU one [embed, 3*embed]
    product and its single input gradient beat three products plus two gradient sums. On a GPU,
    three products: cuDNN's attention takes dense q, k and v, so slicing the fused product copied
    each (and its gradient was assembled by another copy), 0.18 ms a layer of BERT-base's H100
    step by the roofline; each output element is the same dot product either way."""
    params = [HeadProjection(config, name=name)(None) for name in ("query", "key", "value")]
    if current_platform() == "gpu":
        return tuple(fast_ops.einsum("bse,ehd->bshd", x.astype(k.dtype), k) + b for k, b in params)
    kernel = jnp.stack([k for k, _ in params], axis=1)  # [embed, 3, heads, head_dim]
    bias = jnp.stack([b for _, b in params], axis=0)  # [3, heads, head_dim]
    qkv = fast_ops.einsum("bse,ethd->bsthd", x.astype(kernel.dtype), kernel) + bias
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


class BertSelfAttention(nn.Module):
    """Multi-head self-attention with fp32 softmax through ``bertjax.layers.attention.attend``.

    ``attention_impl="splash"`` uses the Pallas TPU splash kernel with ``attention_segment_ids``
    [batch, seq] (0 padding, 1..n sequences; not BERT's token-type segment ids) instead of ``bias``.
    Attention dropout > 0 in training falls back to the explicit path (no kernel has dropout): on
    TPU set attention_dropout=0 to use splash.
    """

    config: BertConfig

    @nn.compact
    def __call__(
        self,
        x: Array,
        bias: Array,
        *,
        deterministic: bool,
        attention_segment_ids: Array | None = None,
    ) -> Array:
        cfg = self.config
        q, k, v = fused_qkv(cfg, x)  # [batch, seq, heads, head_dim]
        q = nn.with_logical_constraint(q, BATCH_LENGTH_HEADS_KV)
        k = nn.with_logical_constraint(k, BATCH_LENGTH_HEADS_KV)
        v = nn.with_logical_constraint(v, BATCH_LENGTH_HEADS_KV)
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
        )
        ctx = nn.with_logical_constraint(ctx, BATCH_LENGTH_HEADS_KV)
        out = HeadProjection(cfg, in_heads=True, name="output")(ctx)
        return nn.with_logical_constraint(out, BATCH_LENGTH_EMBED)  # [batch, seq, hidden]


class BertLayer(nn.Module):
    """One post-LN Transformer layer: x = LN(x + Attn(x)); x = LN(x + FFN(x))."""

    config: BertConfig

    @nn.compact
    def __call__(
        self, x: Array, bias: Array, deterministic: bool, attention_segment_ids: Array | None = None
    ) -> Array:
        cfg = self.config
        drop = Dropout(cfg.hidden_dropout, cfg.dropout_impl)
        attn = BertSelfAttention(cfg, name="attention")(
            x, bias, deterministic=deterministic, attention_segment_ids=attention_segment_ids
        )
        x = layer_norm(cfg, "attention_norm", epsilon=cfg.layer_norm_eps)(
            x + drop(attn, deterministic=deterministic)
        )
        h = dense(cfg, cfg.intermediate_size, ("embed", "mlp"), "intermediate")(x)
        h = activation(cfg.hidden_act)(h)
        h = nn.with_logical_constraint(h, BATCH_LENGTH_MLP)  # [batch, seq, intermediate]
        h = dense(cfg, cfg.hidden_size, ("mlp", "embed"), "output")(h)
        x = layer_norm(cfg, "output_norm", epsilon=cfg.layer_norm_eps)(
            x + drop(h, deterministic=deterministic)
        )
        return nn.with_logical_constraint(x, BATCH_LENGTH_EMBED)


class BertEncoder(nn.Module):
    """A stack of BertLayer, unrolled (``layer_{i}``) or scanned (``layers`` with a leading axis;
    ``bertjax.layers.core.layer_stack``)."""

    config: BertConfig

    @nn.compact
    def __call__(
        self,
        x: Array,
        bias: Array,
        *,
        deterministic: bool,
        output_hidden_states: bool = False,
        attention_segment_ids: Array | None = None,
    ):
        # static_argnums counts self: (self, x, bias, deterministic, attention_segment_ids)
        args = (bias, deterministic, attention_segment_ids)
        return layer_stack(
            BertLayer,
            self.config,
            x,
            *args,
            static_argnums=(3,),
            output_hidden_states=output_hidden_states,
        )


BertOutput = EncoderOutput  # the public name of BERT's outputs


class BertModel(nn.Module):
    """The BERT encoder with its tanh pooler on ``[CLS]``.

    Packed rows (several sequences per row) pass ``pack_ids`` [batch, seq] (1..n: the sequence a
    token belongs to, 0 = padding; attention becomes block diagonal, ``input_mask`` is unused) and
    ``position_ids`` [batch, seq] restarting at 0 per sequence. ``pool_positions`` [batch, k] applies
    the pooler at those positions (each packed sequence's [CLS]): pooled_output [batch, k, hidden].
    """

    config: BertConfig
    add_pooler: bool = True

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
    ) -> BertOutput:
        cfg = self.config
        if segment_ids is None:
            segment_ids = jnp.zeros_like(input_ids)
        if input_mask is None:
            input_mask = jnp.ones_like(input_ids)
        x = BertEmbeddings(cfg, name="embeddings")(
            input_ids, segment_ids, deterministic=deterministic, position_ids=position_ids
        )
        bias = attention_bias(input_mask, jnp.float32, pack_ids)
        # [batch, seq] ids for the splash kernel: 0 at padding, 1 (or the pack id) at real tokens
        attention_segment_ids = None
        if resolve_impl(cfg.attention_impl) == "splash":
            attention_segment_ids = segment_ids_from_mask(input_mask, pack_ids)
        x, hidden = BertEncoder(cfg, name="encoder")(
            x,
            bias,
            deterministic=deterministic,
            output_hidden_states=output_hidden_states,
            attention_segment_ids=attention_segment_ids,
        )
        pooled = None
        if self.add_pooler:
            # [batch, hidden], or [batch, k, hidden] at pool_positions
            pooled = tanh_pooler(cfg, x, pool_positions, "pooler")
        return BertOutput(sequence_output=x, pooled_output=pooled, hidden_states=hidden)


class MaskedLMHead(nn.Module):
    """Dense + activation + LayerNorm transform, decoder tied to the word embeddings, output bias."""

    config: BertConfig

    def decoder(self, word_embeddings: Array) -> Array:
        """The decoder's weights [vocab, hidden]: the word embeddings (a subclass may untie)."""
        return word_embeddings

    def transform_act(self) -> str:
        """The transform's activation: ``hidden_act`` (a subclass may fix another)."""
        return self.config.hidden_act

    @nn.compact
    def __call__(self, x: Array, word_embeddings: Array, labels: Array | None = None):
        cfg = self.config
        dtype = dtype_of(cfg.dtype)
        x = dense(cfg, cfg.hidden_size, ("embed", "embed_out"), "dense")(x)
        x = activation(self.transform_act())(x)
        x = layer_norm(cfg, "LayerNorm", epsilon=cfg.layer_norm_eps)(x)
        output_bias = self.param("output_bias", zeros_init(("vocab",)), (cfg.vocab_size,))
        weights = self.decoder(word_embeddings).astype(dtype)
        # [..., vocab] logits, or (nll, label - max) at ``labels`` (fast_ops.decode)
        return fast_ops.decode(x, weights, output_bias, labels)


def forward_flops_per_sequence(cfg: BertConfig, seq_len: int, num_masked: int) -> float:
    """Forward FLOPs of one pretraining sequence (encoder + heads at ``num_masked`` positions).

    Multiply-add = 2 FLOPs; per token and layer: Q/K/V/output projections 8*H^2, feed-forward
    4*H*I, attention scores and context 4*S*H; the embedding gather costs nothing; the pooler and
    NSP head are per sequence; the MLM head (transform H^2 + decoder H*V) only at masked positions.
    """
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    per_token_layer = 2 * (4 * h * h + 2 * h * i) + 2 * 2 * seq_len * h
    encoder = cfg.num_layers * seq_len * per_token_layer
    heads = 2 * h * h + 2 * h * 2  # pooler + NSP
    mlm = num_masked * 2 * (h * h + h * v)
    return float(encoder + heads + mlm)


ARCHITECTURE = Architecture(
    name="bert",
    config_class=BertConfig,
    get_preset=get_preset,
    preset_names=preset_names,
    encoder=BertModel,
    masked_lm_head=MaskedLMHead,
    token_head=None,
    encoder_name="bert",  # the encoder's subtree in every model's params
    word_embeddings=("embeddings", "word_embeddings", "embedding"),  # tied to the MLM decoder
    pretraining_heads=("mlm", "nsp"),
    pooler_in_pretraining=True,  # MLM-only runs carry the pooler too
    choice_pools_first_token=False,  # position 0 ([CLS]), as BertForMultipleChoice
    forward_flops_per_sequence=forward_flops_per_sequence,
    hf_reference="BertForPreTraining",
    scanned_layers=("encoder/layers", "encoder/layer_{i}"),
)
