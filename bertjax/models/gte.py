"""GTE (Zhang et al., 2024, mGTE; Alibaba's "new" architecture of gte-base-en-v1.5,
gte-large-en-v1.5 and gte-multilingual-base): BERT's post-LayerNorm layout with rotary positions
(full head width, non-interleaved halves) instead of a position table, biases on the attention
projections, a gated MLP ``down_proj(act(gate_proj(x)) * up_proj(x))`` whose only bias is
``down_proj``'s and whose gated activation is dropped out, word embeddings with token-type
embeddings where ``type_vocab_size`` > 0 (gte-base-en-v1.5 has none) and a LayerNorm; BERT's tanh
pooler; an MLM head of dense + exact GELU + LayerNorm and a decoder tied to the word embeddings
(or its own) with a bias. Numerically the same as Hugging Face transformers' ``GteModel`` /
``GteForMaskedLM`` / ``GteForSequenceClassification`` / ``GteForTokenClassification``
(``bertjax.convert.gte_hf`` converts the weights, also the original custom code's ``NewModel``
checkpoints; tests/test_gte.py compares them).

The released checkpoints scale RoPE by the original code's static NTK rule (``rope_scaling:
{"type": "ntk", "factor": f}``: the base times f, every frequency divided by f ** (2 / head_dim)),
which transformers writes as a ``linear`` schedule of factor f ** (2 / head_dim) over the base
times f (:func:`ntk_rope`); the presets hold it that way.

Parameter tree::

    gte/embeddings/{word_embeddings [vocab, embed], token_type_embeddings [types, embed]}
    gte/embeddings/LayerNorm/{scale, bias}
    gte/layer_{i}/self_attn/{q,k,v}_proj/{kernel [embed, heads, kv], bias [heads, kv]}
    gte/layer_{i}/self_attn/o_proj/{kernel [heads, kv, embed], bias [embed]}
    gte/layer_{i}/post_attention_layernorm/{scale, bias}
    gte/layer_{i}/mlp/{gate_proj,up_proj}/kernel [embed, mlp]
    gte/layer_{i}/mlp/down_proj/{kernel [mlp, embed], bias [embed]}
    gte/layer_{i}/post_mlp_layernorm/{scale, bias}
    gte/pooler/{kernel, bias}                 (HF ForSequenceClassification's pooler.dense)
    predictions/{dense, LayerNorm}            (HF lm_head.{dense, layer_norm})
    predictions/output_bias [vocab]           (HF lm_head.decoder.bias)
    predictions/decoder [vocab, embed]        (HF lm_head.decoder.weight; absent when tied)

``hidden_states`` are the embeddings and every layer's output, as transformers'.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from bertjax.layers.blocks import PostNormEncoder
from bertjax.layers.core import EncoderConfig, check_common_fields, config_error
from bertjax.layers.rope import RopeConfig, schedule_json
from bertjax.models.contract import Architecture
from bertjax.models.nomicbert import MaskedLMHead as NomicBertMaskedLMHead
from bertjax.models.nomicbert import forward_flops_per_sequence


@dataclasses.dataclass(frozen=True)
class GteConfig(RopeConfig, EncoderConfig):
    """Architecture and numerics of a GTE encoder (defaults: transformers' GteConfig, the shape
    of gte-multilingual-base without its RoPE scaling)."""

    vocab_size: int = 250048
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072  # the gated MLP's width (gate_proj and up_proj)
    hidden_act: str = "gelu"
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.0
    dropout_impl: str = "auto"
    max_position_embeddings: int = 8192  # longest sequence accepted (RoPE has no table)
    type_vocab_size: int = 1  # 0: no token-type embeddings (segment_ids are ignored)
    initializer_range: float = 0.02
    dtype: str = "float32"  # compute dtype; softmax, RoPE and norm statistics stay fp32
    param_dtype: str = "float32"
    attention_impl: str = "xla"  # auto | xla | dot_product | cudnn | splash (layers.attention)
    remat: str = "none"  # rematerialisation per layer: none | dots | full
    scan_layers: bool = False  # nn.scan over layers: params stacked on a leading "layers" axis
    layer_norm_eps: float = 1e-12
    rope_theta: float = 160_000.0
    # transformers' rope_parameters other than rope_theta, as JSON ("" = default RoPE); the
    # checkpoints' NTK scaling is a linear schedule (ntk_rope)
    rope_scaling: str = ""
    tie_word_embeddings: bool = True  # False: the MLM decoder has its own [vocab, hidden] table
    pad_token_id: int | None = 1  # token ids: metadata (None where the checkpoint has none)
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    architecture: ClassVar[str] = "gte"

    def __post_init__(self):
        check_common_fields(self, positive=("layer_norm_eps", "initializer_range"))
        self.check_rope()

        def bad(key, why):
            raise config_error(self, key, why)

        if self.type_vocab_size < 0:
            bad("type_vocab_size", "must be >= 0")

    def num_params(self, include_heads: bool = True, include_pooler: bool = False) -> int:
        """Analytic parameter count: the encoder, plus the MLM head (``include_heads``: what
        ``PreTrainingModel(nsp=False)`` and HF GteForMaskedLM hold) and the pooler
        (``include_pooler``: HF ForSequenceClassification's)."""
        h, v, i, t = self.hidden_size, self.vocab_size, self.intermediate_size, self.type_vocab_size
        # q, k, v, o with biases; gate, up, down with down's bias; two LayerNorms
        layer = 4 * h * h + 4 * h + 3 * h * i + h + 4 * h
        total = (v + t) * h + 2 * h + self.num_layers * layer
        if include_pooler:
            total += h * h + h
        if include_heads:  # transform dense + LayerNorm, decoder bias, an untied decoder
            total += h * h + 3 * h + v + (0 if self.tie_word_embeddings else v * h)
        return total


def ntk_rope(base: float, factor: float, head_dim: int) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` of the original code's static NTK scaling (base
    ``base``, ``rope_scaling: {"type": "ntk", "factor": factor}``): inverse frequencies
    ``(base * factor) ** (-2i / head_dim) / factor ** (2 / head_dim)``, i.e. a linear schedule
    over the base times ``factor``, as transformers' configs of these checkpoints write it."""
    schedule = {"rope_type": "linear", "factor": factor ** (2 / head_dim)}
    return dict(rope_theta=float(base * factor), rope_scaling=schedule_json(schedule))


_BASE = dict(num_layers=12, hidden_size=768, num_heads=12, intermediate_size=3072)
_ENGLISH = dict(vocab_size=30528, pad_token_id=0)  # BERT's uncased WordPiece, padded to 30528
PRESETS: dict[str, dict[str, Any]] = {
    "gte-tiny": dict(num_layers=4, hidden_size=128, num_heads=4, intermediate_size=384),
    # The published checkpoints' shapes (their config.json: model_type "new", NTK-scaled RoPE,
    # 8192 positions): Alibaba-NLP/gte-base-en-v1.5 (137M parameters, no token types) and
    # gte-large-en-v1.5 (434M), gte-multilingual-base (305M, XLM-R's 250,048-token vocabulary)
    # and gte-multilingual-mlm-base, its MLM-pretrained encoder (unscaled RoPE).
    "gte-base-en-v1.5": dict(_BASE, **_ENGLISH, type_vocab_size=0, **ntk_rope(500_000, 2.0, 64)),
    "gte-large-en-v1.5": dict(
        num_layers=24,
        hidden_size=1024,
        num_heads=16,
        intermediate_size=4096,
        type_vocab_size=2,
        **_ENGLISH,
        **ntk_rope(160_000, 2.0, 64),
    ),
    "gte-multilingual-base": dict(_BASE, **ntk_rope(20_000, 8.0, 64)),
    "gte-multilingual-mlm-base": _BASE,
}


def preset_names() -> list[str]:
    """Every preset name."""
    return list(PRESETS)


def get_preset(name: str, **overrides: Any) -> GteConfig:
    """A preset (``gte-base-en-v1.5``, ...) as a GteConfig, with overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {preset_names()}")
    return GteConfig(**{**PRESETS[name], **overrides})


class GteModel(PostNormEncoder):
    """The GTE encoder: embeddings, post-LN layers with attention biases, ``down_proj``'s bias
    and dropout on the gated activation, the optional tanh pooler
    (``bertjax.layers.blocks.PostNormEncoder``)."""

    config: GteConfig

    attention_bias: ClassVar[bool] = True
    down_bias: ClassVar[bool] = True
    mlp_dropout: ClassVar[bool] = True


class MaskedLMHead(NomicBertMaskedLMHead):
    """HF's ``lm_head``: dense + exact GELU (whatever ``hidden_act`` is) + LayerNorm, the decoder
    tied to the word embeddings or its own (``tie_word_embeddings``), its bias ``output_bias``."""

    config: GteConfig

    def transform_act(self) -> str:
        return "gelu"


ARCHITECTURE = Architecture(
    name="gte",
    config_class=GteConfig,
    get_preset=get_preset,
    preset_names=preset_names,
    encoder=GteModel,
    masked_lm_head=MaskedLMHead,
    token_head=None,  # HF's token classifier reads the sequence output directly
    encoder_name="gte",  # HF's base_model_prefix
    word_embeddings=("embeddings", "word_embeddings", "embedding"),
    pretraining_heads=("mlm",),
    pooler_in_pretraining=False,  # GteForMaskedLM has no pooler
    choice_pools_first_token=False,
    # the same matmuls as NomicBERT's (biases are not counted)
    forward_flops_per_sequence=forward_flops_per_sequence,
    hf_reference="GteForMaskedLM",
    scanned_layers=("layers", "layer_{i}"),
)
