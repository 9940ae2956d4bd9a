"""NomicBERT (Nussbaum et al., 2024, the encoder of nomic-embed-text): BERT's post-LayerNorm layout
with rotary positions (full head width, non-interleaved halves, base 1000) instead of a position
table, a SwiGLU MLP, and no bias in attention or MLP; word and token-type embeddings with a
LayerNorm; BERT's tanh pooler and MLM head (dense + act + LayerNorm, decoder tied to the word
embeddings, an output bias). Numerically the same as Hugging Face transformers' ``NomicBertModel``
/ ``NomicBertForMaskedLM`` / ``NomicBertForSequenceClassification`` /
``NomicBertForTokenClassification`` (``bertjax.convert.nomicbert_hf`` converts the weights;
tests/test_nomicbert.py compares them).

Parameter tree::

    nomic_bert/embeddings/{word_embeddings [vocab, embed], token_type_embeddings [types, embed]}
    nomic_bert/embeddings/LayerNorm/{scale, bias}
    nomic_bert/layer_{i}/self_attn/{q,k,v}_proj/kernel [embed, heads, kv]
    nomic_bert/layer_{i}/self_attn/o_proj/kernel [heads, kv, embed]
    nomic_bert/layer_{i}/post_attention_layernorm/{scale, bias}
    nomic_bert/layer_{i}/mlp/{gate_proj,up_proj}/kernel [embed, mlp]
    nomic_bert/layer_{i}/mlp/down_proj/kernel [mlp, embed]
    nomic_bert/layer_{i}/post_mlp_layernorm/{scale, bias}
    nomic_bert/pooler/{kernel, bias}          (HF ForSequenceClassification's pooler.dense)
    predictions/{dense, LayerNorm}            (HF cls.predictions.transform)
    predictions/output_bias [vocab]           (HF cls.predictions.bias = decoder.bias)
    predictions/decoder [vocab, embed]        (HF cls.predictions.decoder.weight; absent when tied)

``hidden_states`` are the embeddings and every layer's output, as transformers'. The MLM
transform's activation is ``hidden_act`` (SiLU in the checkpoints), as transformers'.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax

from bertjax.layers.blocks import PostNormEncoder
from bertjax.layers.core import (
    EncoderConfig,
    check_common_fields,
    config_error,
    dtype_of,
    normal_init,
)
from bertjax.layers.rope import RopeConfig
from bertjax.models.bert import MaskedLMHead as BertMaskedLMHead
from bertjax.models.contract import Architecture

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class NomicBertConfig(RopeConfig, EncoderConfig):
    """Architecture and numerics of a NomicBERT encoder (defaults: nomic-embed-text-v1.5, as
    transformers' NomicBertConfig)."""

    vocab_size: int = 30528
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072  # the SwiGLU MLP's width (gate_proj and up_proj)
    hidden_act: str = "silu"
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    dropout_impl: str = "auto"
    max_position_embeddings: int = 2048  # longest sequence accepted (RoPE has no table)
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    dtype: str = "float32"  # compute dtype; softmax, RoPE and norm statistics stay fp32
    param_dtype: str = "float32"
    attention_impl: str = "xla"  # auto | xla | dot_product | cudnn | splash (layers.attention)
    remat: str = "none"  # rematerialisation per layer: none | dots | full
    scan_layers: bool = False  # nn.scan over layers: params stacked on a leading "layers" axis
    layer_norm_eps: float = 1e-12
    rope_theta: float = 1000.0
    # transformers' rope_parameters other than rope_theta, as JSON ("" = default RoPE), e.g.
    # '{"rope_type": "dynamic", "factor": 2.0}' (bertjax.layers.rope)
    rope_scaling: str = ""
    tie_word_embeddings: bool = True  # False: the MLM decoder has its own [vocab, hidden] table
    pad_token_id: int | None = 0  # token ids: metadata (None where the checkpoint has none)
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    architecture: ClassVar[str] = "nomicbert"

    def __post_init__(self):
        check_common_fields(self, positive=("layer_norm_eps", "initializer_range"))
        self.check_rope()

        def bad(key, why):
            raise config_error(self, key, why)

        if self.type_vocab_size < 1:
            bad("type_vocab_size", "must be >= 1")

    def num_params(self, include_heads: bool = True, include_pooler: bool = False) -> int:
        """Analytic parameter count: the encoder, plus the MLM head (``include_heads``: what
        ``PreTrainingModel(nsp=False)`` and HF NomicBertForMaskedLM hold) and the pooler
        (``include_pooler``: HF ForSequenceClassification's)."""
        h, v, i, t = self.hidden_size, self.vocab_size, self.intermediate_size, self.type_vocab_size
        layer = 4 * h * h + 3 * h * i + 4 * h  # q, k, v, o; gate, up, down; two LayerNorms
        total = (v + t) * h + 2 * h + self.num_layers * layer
        if include_pooler:
            total += h * h + h
        if include_heads:  # transform dense + LayerNorm, output bias, an untied decoder
            total += h * h + 3 * h + v + (0 if self.tie_word_embeddings else v * h)
        return total


_BASE = dict(num_layers=12, hidden_size=768, num_heads=12, intermediate_size=3072)
PRESETS: dict[str, dict[str, Any]] = {
    "nomicbert-tiny": dict(num_layers=4, hidden_size=128, num_heads=4, intermediate_size=384),
    # The published checkpoints' shapes (nomic-ai/nomic-bert-2048, the MLM-pretrained encoder;
    # nomic-ai/nomic-embed-text-v1 and -v1.5, its contrastive fine-tunes): 137M parameters.
    "nomic-bert-2048": _BASE,
    "nomic-embed-text-v1": _BASE,
    "nomic-embed-text-v1.5": _BASE,
}


def preset_names() -> list[str]:
    """Every preset name."""
    return list(PRESETS)


def get_preset(name: str, **overrides: Any) -> NomicBertConfig:
    """A preset (``nomic-embed-text-v1.5``, ...) as a NomicBertConfig, with overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {preset_names()}")
    return NomicBertConfig(**{**PRESETS[name], **overrides})


class NomicBertModel(PostNormEncoder):
    """The NomicBERT encoder: embeddings, post-LN layers without biases, the optional tanh pooler
    (``bertjax.layers.blocks.PostNormEncoder``)."""

    config: NomicBertConfig


class MaskedLMHead(BertMaskedLMHead):
    """BERT's MLM head (dense + ``hidden_act`` + LayerNorm, output bias); the decoder is the word
    embeddings, or its own ``decoder`` [vocab, hidden] without ``tie_word_embeddings``."""

    config: NomicBertConfig

    def decoder(self, word_embeddings: Array) -> Array:
        cfg = self.config
        if cfg.tie_word_embeddings:
            return word_embeddings
        return self.param(
            "decoder",
            normal_init(cfg, ("vocab", "embed")),
            (cfg.vocab_size, cfg.hidden_size),
            dtype_of(cfg.param_dtype),
        )


def forward_flops_per_sequence(cfg: NomicBertConfig, seq_len: int, num_masked: int) -> float:
    """Forward FLOPs of one pretraining sequence (encoder + MLM head at ``num_masked``
    positions). Multiply-add = 2 FLOPs; per token and layer: q, k, v and o 8*H^2, the SwiGLU MLP
    6*H*I, attention scores and context 4*S*H; the MLM transform H^2 and decoder H*V at masked
    positions. Embedding gathers, norms, RoPE and activations are not counted."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    per_token = cfg.num_layers * (2 * (4 * h * h + 3 * h * i) + 4 * seq_len * h)
    return float(seq_len * per_token + num_masked * 2 * (h * h + h * v))


ARCHITECTURE = Architecture(
    name="nomicbert",
    config_class=NomicBertConfig,
    get_preset=get_preset,
    preset_names=preset_names,
    encoder=NomicBertModel,
    masked_lm_head=MaskedLMHead,
    token_head=None,  # HF's token classifier reads the sequence output directly
    encoder_name="nomic_bert",  # HF's base_model_prefix
    word_embeddings=("embeddings", "word_embeddings", "embedding"),
    pretraining_heads=("mlm",),
    pooler_in_pretraining=False,  # NomicBertForMaskedLM has no pooler
    choice_pools_first_token=False,
    forward_flops_per_sequence=forward_flops_per_sequence,
    hf_reference="NomicBertForMaskedLM",
    scanned_layers=("layers", "layer_{i}"),
)
