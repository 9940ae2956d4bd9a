"""EuroBERT (Boizard et al., 2025): a Llama-style encoder: pre-RMSNorm layers without biases,
grouped-query attention with rotary positions over the whole sequence, a SiLU-gated MLP, no
position or segment embeddings, an untied MLM decoder with no transform. Numerically the same as
Hugging Face transformers' ``EuroBertModel`` / ``EuroBertForMaskedLM`` /
``EuroBertForSequenceClassification`` / ``EuroBertForTokenClassification``
(``bertjax.convert.eurobert_hf`` converts the weights; tests/test_eurobert.py compares them).

Parameter tree::

    model/embed_tokens/embedding [vocab, embed]
    model/layer_{i}/input_layernorm/scale [embed]
    model/layer_{i}/self_attn/q_proj/{kernel [embed, heads, kv], bias [heads, kv]}
    model/layer_{i}/self_attn/{k,v}_proj/{kernel [embed, kv_heads, kv], bias [kv_heads, kv]}
    model/layer_{i}/self_attn/o_proj/{kernel [heads, kv, embed], bias [embed]}
    model/layer_{i}/post_attention_layernorm/scale [embed]
    model/layer_{i}/mlp/{gate_proj,up_proj}/{kernel [embed, mlp], bias [mlp]}
    model/layer_{i}/mlp/down_proj/{kernel [mlp, embed], bias [embed]}
    model/norm/scale [embed]
    model/pooler/dense/{kernel, bias}   (HF ForSequenceClassification's ``dense``, then GELU)
    predictions/decoder [vocab, embed]   (HF ``lm_head.weight``; absent when tied)
    predictions/output_bias [vocab]      (HF ``lm_head.bias``, with ``mlp_bias``)

Biases exist where ``attention_bias`` and ``mlp_bias`` say. The sequence classifier pools as
``classifier_pooling`` says: ``bos`` (the first token), ``mean`` (the masked mean), or ``late``
(HF's default: dense + GELU on every token, then the masked mean; the classifier is linear, so the
mean of its logits over tokens is the classifier of this mean). Key-value heads are repeated to the
query heads before the attention kernel (transformers' ``repeat_kv``). EuroBERT has no dropout but
attention dropout: ``hidden_dropout`` is the task heads' dropout only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.layers import fast_ops
from bertjax.layers.blocks import GatedMLP, RopeSelfAttention, check_length, rope_layers
from bertjax.layers.core import (
    BATCH_LENGTH_EMBED,
    EncoderConfig,
    EncoderOutput,
    Linear,
    RMSNorm,
    activation,
    check_common_fields,
    config_error,
    dtype_of,
    embed_table,
    embedding_lookup,
    gather_positions,
    model_inputs,
    normal_init,
    pool_members,
    zeros_init,
)
from bertjax.layers.rope import RopeConfig
from bertjax.models.contract import Architecture

Array = jax.Array

POOLINGS = ("bos", "mean", "late")


@dataclasses.dataclass(frozen=True)
class EuroBertConfig(RopeConfig, EncoderConfig):
    """Architecture and numerics of a EuroBERT encoder (defaults: EuroBERT/EuroBERT-210m)."""

    vocab_size: int = 128256
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    num_kv_heads: int = 0  # grouped-query attention: key-value heads (0 = num_heads)
    intermediate_size: int = 3072  # the gated MLP's width (gate_proj and up_proj)
    hidden_act: str = "silu"
    hidden_dropout: float = 0.0  # the task heads' dropout (the encoder has none)
    attention_dropout: float = 0.0
    dropout_impl: str = "auto"
    max_position_embeddings: int = 8192  # longest sequence accepted (RoPE has no table)
    initializer_range: float = 0.02
    dtype: str = "float32"  # compute dtype; softmax, RoPE and norm statistics stay fp32
    param_dtype: str = "float32"
    attention_impl: str = "xla"  # auto | xla | dot_product | cudnn | splash (layers.attention)
    remat: str = "none"  # rematerialisation per layer: none | dots | full
    scan_layers: bool = False  # nn.scan over layers: params stacked on a leading "layers" axis
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    mlp_bias: bool = False  # also the MLM decoder's bias (HF lm_head)
    rope_theta: float = 250_000.0
    # transformers' rope_parameters other than rope_theta, as JSON ("" = default RoPE), e.g.
    # '{"rope_type": "llama3", "factor": 8.0, ...}' (bertjax.layers.rope)
    rope_scaling: str = ""
    tie_word_embeddings: bool = False  # True: the MLM decoder is the word-embedding table
    classifier_pooling: str = "late"  # bos | mean | late (see the module docstring)
    pad_token_id: int | None = 128001  # token ids: metadata (None where the checkpoint has none)
    bos_token_id: int | None = 128000
    eos_token_id: int | None = 128001
    mask_token_id: int | None = 128002

    architecture: ClassVar[str] = "eurobert"

    def __post_init__(self):
        check_common_fields(self, positive=("rms_norm_eps", "initializer_range"))
        self.check_rope()

        def bad(key, why):
            raise config_error(self, key, why)

        if self.num_kv_heads < 0 or self.num_heads % self.kv_heads:
            bad("num_kv_heads", f"does not divide num_heads={self.num_heads}")
        if self.classifier_pooling not in POOLINGS:
            bad("classifier_pooling", f"is not one of {POOLINGS}")

    @property
    def kv_heads(self) -> int:
        """The number of key-value heads (``num_kv_heads``, or ``num_heads`` when 0)."""
        return self.num_kv_heads or self.num_heads

    def num_params(self, include_heads: bool = True, include_pooler: bool = False) -> int:
        """Analytic parameter count: the encoder, plus the MLM decoder (``include_heads``: what
        ``PreTrainingModel(nsp=False)`` and HF EuroBertForMaskedLM hold) and the pooler's dense
        layer (``include_pooler``: HF ForSequenceClassification's ``dense``)."""
        h, v, i, d = self.hidden_size, self.vocab_size, self.intermediate_size, self.head_dim
        kv = self.kv_heads * d
        ab, mb = int(self.attention_bias), int(self.mlp_bias)
        attn = (h * h + h * ab) * 2 + (h * kv + kv * ab) * 2  # q, o; k, v
        mlp = (h * i + i * mb) * 2 + (i * h + h * mb)  # gate, up; down
        total = v * h + self.num_layers * (attn + mlp + 2 * h) + h
        if include_pooler:
            total += h * h + h
        if include_heads:
            total += (0 if self.tie_word_embeddings else v * h) + (v if self.mlp_bias else 0)
        return total


PRESETS: dict[str, dict[str, Any]] = {
    "eurobert-tiny": dict(num_layers=4, hidden_size=128, num_heads=4, intermediate_size=384),
    # The published checkpoints' shapes (config.json of EuroBERT/EuroBERT-{210m,610m,2.1B}).
    "eurobert-210m": dict(num_layers=12, hidden_size=768, num_heads=12, intermediate_size=3072),
    "eurobert-610m": dict(
        num_layers=26, hidden_size=1152, num_heads=18, num_kv_heads=6, intermediate_size=4096
    ),
    "eurobert-2.1b": dict(
        num_layers=32, hidden_size=2304, num_heads=18, num_kv_heads=6, intermediate_size=6144
    ),
}


def preset_names() -> list[str]:
    """Every preset name."""
    return list(PRESETS)


def get_preset(name: str, **overrides: Any) -> EuroBertConfig:
    """A preset (``eurobert-210m``, ...) as a EuroBertConfig, with overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {preset_names()}")
    return EuroBertConfig(**{**PRESETS[name], **overrides})


class EuroBertLayer(nn.Module):
    """Pre-RMSNorm layer: x += Attn(norm(x)); x += MLP(norm(x))."""

    config: EuroBertConfig

    @nn.compact
    def __call__(self, x, bias, rope, deterministic: bool, attention_segment_ids=None) -> Array:
        cfg = self.config
        h = RMSNorm(cfg, cfg.rms_norm_eps, name="input_layernorm")(x)
        attn = RopeSelfAttention(cfg, cfg.num_kv_heads, cfg.attention_bias, name="self_attn")
        x = x + attn(h, bias, rope, deterministic, attention_segment_ids)
        h = RMSNorm(cfg, cfg.rms_norm_eps, name="post_attention_layernorm")(x)
        x = x + GatedMLP(cfg, cfg.mlp_bias, name="mlp")(h)
        return nn.with_logical_constraint(x, BATCH_LENGTH_EMBED)


class Pooler(nn.Module):
    """HF EuroBertForSequenceClassification's ``dense`` + GELU, on the first token (``bos``), on
    the masked mean (``mean``), or on every token before the masked mean (``late``).

    ``members`` [batch, k, seq] says which tokens each pooled mean averages; ``positions``
    [batch, k] are the first tokens (``bos``)."""

    config: EuroBertConfig

    @nn.compact
    def __call__(self, x: Array, positions: Array, members: Array) -> Array:
        cfg = self.config
        h = cfg.hidden_size
        dense = Linear(cfg, (h, h), ("embed", "embed_out"), 1, True, name="dense")
        gelu = activation("gelu")

        def mean(y):
            weights = members.astype(jnp.float32)
            total = jnp.einsum("bks,bsh->bkh", weights, y.astype(jnp.float32))
            return total / jnp.maximum(weights.sum(-1, keepdims=True), 1.0)  # [batch, k, hidden]

        if cfg.classifier_pooling == "bos":
            return gelu(dense(gather_positions(x, positions)))
        if cfg.classifier_pooling == "mean":
            return gelu(dense(mean(x).astype(x.dtype)))
        return mean(gelu(dense(x))).astype(x.dtype)  # late


class EuroBertModel(nn.Module):
    """The EuroBERT encoder (token embeddings, layers, final norm) with the optional pooler.

    ``input_mask`` [batch, seq] (1 = token, 0 = padding; padded keys are masked, padded
    queries computed and never read, as in transformers). Packed rows pass ``pack_ids`` and
    ``position_ids`` restarting at 0 per sequence. ``pool_positions`` [batch, k] pools at those
    positions (pooled_output [batch, k, hidden]); without them pooled_output is [batch, hidden].
    ``segment_ids`` are accepted and ignored. ``hidden_states``: the embeddings, every layer's
    output but the last, and the sequence output (after the final norm), as transformers'.
    """

    config: EuroBertConfig
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
    ) -> EncoderOutput:
        del segment_ids  # EuroBERT has no segment embeddings
        cfg = self.config
        check_length(cfg, input_ids)
        if input_mask is None:
            input_mask = jnp.ones_like(input_ids)
        words = embed_table(cfg, cfg.vocab_size, ("vocab", "embed"), "embed_tokens")
        x = nn.with_logical_constraint(embedding_lookup(words, input_ids), BATCH_LENGTH_EMBED)
        inputs = (input_mask, position_ids, pack_ids)
        x, hidden_states = rope_layers(
            EuroBertLayer, cfg, x, inputs, deterministic, output_hidden_states
        )
        x = RMSNorm(cfg, cfg.rms_norm_eps, name="norm")(x)  # [batch, seq, hidden]
        pooled = None
        if self.add_pooler:
            positions, members = pool_members(input_mask, pack_ids, pool_positions)
            pooled = Pooler(cfg, name="pooler")(x, positions, members)
            if pool_positions is None:
                pooled = pooled[:, 0]  # [batch, hidden]
        hidden = (*hidden_states[:-1], x) if output_hidden_states else ()
        return EncoderOutput(sequence_output=x, pooled_output=pooled, hidden_states=hidden)


class MaskedLMHead(nn.Module):
    """HF's ``lm_head``: a Linear [hidden] -> [vocab] on the normed hidden states (no transform),
    its weight the ``decoder`` [vocab, hidden] (the word embeddings when
    ``tie_word_embeddings``), its bias ``output_bias`` when ``mlp_bias``: float32 logits."""

    config: EuroBertConfig

    @nn.compact
    def __call__(self, x: Array, word_embeddings: Array, labels: Array | None = None):
        cfg = self.config
        if cfg.mlp_bias:
            bias = self.param("output_bias", zeros_init(("vocab",)), (cfg.vocab_size,))
        else:
            bias = jnp.zeros((cfg.vocab_size,), jnp.float32)
        if not cfg.tie_word_embeddings:
            word_embeddings = self.param(
                "decoder",
                normal_init(cfg, ("vocab", "embed")),
                (cfg.vocab_size, cfg.hidden_size),
                dtype_of(cfg.param_dtype),
            )
        dtype = dtype_of(cfg.dtype)
        return fast_ops.decode(x.astype(dtype), word_embeddings.astype(dtype), bias, labels)


def forward_flops_per_sequence(cfg: EuroBertConfig, seq_len: int, num_masked: int) -> float:
    """Forward FLOPs of one pretraining sequence (encoder + MLM decoder at ``num_masked``
    positions). Multiply-add = 2 FLOPs; per token and layer: q and o 4*H^2, k and v 4*H*KV (KV =
    key-value heads * head_dim), the gated MLP 6*H*I, attention scores and context 4*S*H. Embedding
    gathers, norms, RoPE and activations are not counted."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.kv_heads * cfg.head_dim
    per_token = cfg.num_layers * (2 * (2 * h * h + 2 * h * kv + 3 * h * i) + 4 * seq_len * h)
    return float(seq_len * per_token + num_masked * 2 * h * v)


ARCHITECTURE = Architecture(
    name="eurobert",
    config_class=EuroBertConfig,
    get_preset=get_preset,
    preset_names=preset_names,
    encoder=EuroBertModel,
    masked_lm_head=MaskedLMHead,
    token_head=None,  # HF's token classifier reads the normed hidden states directly
    encoder_name="model",  # HF's base_model_prefix
    word_embeddings=("embed_tokens", "embedding"),
    pretraining_heads=("mlm",),
    pooler_in_pretraining=False,
    choice_pools_first_token=False,
    forward_flops_per_sequence=forward_flops_per_sequence,
    hf_reference="EuroBertForMaskedLM",
    scanned_layers=("layers", "layer_{i}"),
)
