"""ModernBERT (Warner et al., 2024): config with presets, the pre-LN encoder with rotary positions,
alternating global/sliding-window attention and GeGLU feed-forward layers, its heads, and what
the rest of bertjax needs to know about it. Numerically the same as Hugging Face transformers'
``ModernBertModel`` / ``ModernBertForMaskedLM`` / ``ModernBertForSequenceClassification``
(``bertjax.convert.modernbert_hf`` converts the weights; tests/test_modernbert.py compares them).

Layer ``i`` attends globally when ``i % global_attn_every_n_layers == 0`` (or, with a
``layer_pattern``, when its letter is ``g``; RoPE base ``global_rope_theta``, schedule
``global_rope_scaling``), else only to keys with ``|q - k| <= local_attention // 2`` (RoPE base
``local_rope_theta``, schedule ``local_rope_scaling``; see ``bertjax.layers.rope``). Layer 0 has
no attention norm. Parameter tree::

    model/embeddings/word_embeddings/embedding [vocab, embed];  model/embeddings/norm/{scale,bias}
    model/layer_{i}/attn_norm/{scale,bias}                       (not in layer 0)
    model/layer_{i}/attn/Wqkv/{kernel [embed, 3, heads, kv], bias [3, heads, kv]}
    model/layer_{i}/attn/Wo/{kernel [heads, kv, embed], bias [embed]}
    model/layer_{i}/mlp_norm/{scale,bias}
    model/layer_{i}/mlp/Wi/{kernel [embed, 2, mlp], bias [2, mlp]}   (input, gate)
    model/layer_{i}/mlp/Wo/{kernel [mlp, embed], bias [embed]}
    model/final_norm/{scale,bias}
    model/pooler/{dense,norm}          (HF ForSequenceClassification / MultipleChoice ``head``)
    head/{dense,norm}                  (HF ForTokenClassification / QuestionAnswering ``head``)
    predictions/{dense,norm}, predictions/output_bias [vocab]   (MLM head; decoder tied)
    predictions/decoder [vocab, embed]   (the MLM decoder when tie_word_embeddings=False)

Biases exist as ``norm_bias``, ``attention_bias``, ``mlp_bias``, ``classifier_bias`` (head dense
layers) and ``decoder_bias`` say. Every kernel carries logical axis names (``bertjax.sharding``).
Dropout: ``hidden_dropout`` after the embeddings, inside the MLP and in the task heads;
``attention_dropout`` on the attention probabilities and the attention output (as in HF).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bertjax.layers import fast_ops
from bertjax.layers.attention import attend, kernel_seed, resolve_impl, sees_a_key
from bertjax.layers.core import (
    ACTIVATIONS,
    BATCH_LENGTH_EMBED,
    BATCH_LENGTH_HEADS_KV,
    BATCH_LENGTH_MLP,
    EncoderConfig,
    EncoderOutput,
    Linear,
    activation,
    attention_bias,
    check_common_fields,
    config_error,
    dtype_of,
    embedding_lookup,
    gather_positions,
    layer_norm,
    model_inputs,
    normal_init,
    pool_members,
    remat,
    zeros_init,
)
from bertjax.layers.dropout import Dropout
from bertjax.layers.rope import apply_rope, frequencies, parse_schedule, rope_tables
from bertjax.layers.splash_attention import segment_ids_from_mask
from bertjax.models.contract import Architecture

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class ModernBertConfig(EncoderConfig):
    """Architecture and numerics of a ModernBERT encoder (defaults: answerdotai/ModernBERT-base)."""

    vocab_size: int = 50368
    hidden_size: int = 768
    num_layers: int = 22
    num_heads: int = 12
    intermediate_size: int = 1152  # GeGLU width: Wi projects to 2 * intermediate_size
    hidden_act: str = "gelu"  # HF hidden_activation (exact GELU)
    hidden_dropout: float = 0.0  # HF embedding_dropout = mlp_dropout = classifier_dropout
    attention_dropout: float = 0.0
    dropout_impl: str = "auto"  # auto (per platform) | bits16 | flax (bertjax.layers.dropout)
    max_position_embeddings: int = 8192  # longest sequence accepted (RoPE has no table)
    initializer_range: float = 0.02
    dtype: str = "float32"  # compute dtype; softmax, RoPE and LayerNorm statistics stay fp32
    param_dtype: str = "float32"
    attention_impl: str = "xla"  # auto | xla | dot_product | cudnn | splash (layers.attention)
    remat: str = "none"  # rematerialisation per layer: none | dots | full
    scan_layers: bool = False  # refused: the layers differ (see __post_init__)
    norm_eps: float = 1e-5
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    decoder_bias: bool = True
    classifier_bias: bool = False  # the dense layer of the MLM head and of the pooler
    classifier_activation: str = "gelu"
    classifier_pooling: str = "cls"  # cls | mean (the pooler's input)
    global_rope_theta: float = 160_000.0
    local_rope_theta: float = 10_000.0
    # transformers' rope_parameters of the global / local layers other than rope_theta, as JSON
    # ("" = default RoPE), e.g. '{"factor": 2.0, "rope_type": "linear"}' (bertjax.layers.rope)
    global_rope_scaling: str = ""
    local_rope_scaling: str = ""
    global_attn_every_n_layers: int = 3
    # One letter per layer, g (global) or l (sliding window), for patterns that are not "global
    # every global_attn_every_n_layers layers from layer 0" (transformers' layer_types); "" = that.
    layer_pattern: str = ""
    local_attention: int = 128  # sliding window: keys with |q - k| <= local_attention // 2
    tie_word_embeddings: bool = True  # False: the MLM head has its own decoder [vocab, hidden]
    pad_token_id: int | None = 50283  # token ids: metadata (None where the checkpoint has none)
    cls_token_id: int | None = 50281
    sep_token_id: int | None = 50282

    architecture: ClassVar[str] = "modernbert"

    def __post_init__(self):
        check_common_fields(
            self,
            positive=("norm_eps", "global_rope_theta", "local_rope_theta", "initializer_range"),
        )

        def bad(key, why):
            raise config_error(self, key, why)

        if self.scan_layers:  # the layers differ: global/local, no attention norm in layer 0
            bad(
                "scan_layers",
                "is not supported by ModernBERT: its layers differ (layer 0 has no attention "
                "norm, global and sliding-window layers alternate); use False",
            )
        if self.head_dim % 2:
            bad("hidden_size", f"gives an odd head_dim={self.head_dim} (RoPE needs it even)")
        if self.classifier_activation not in ACTIVATIONS:
            bad("classifier_activation", f"is not one of {ACTIVATIONS}")
        if self.classifier_pooling not in ("cls", "mean"):
            bad("classifier_pooling", "is not one of ('cls', 'mean')")
        for key in ("global_attn_every_n_layers", "local_attention", "max_position_embeddings"):
            if getattr(self, key) < 1:
                bad(key, "must be >= 1")
        pattern = self.layer_pattern
        if pattern and (len(pattern) != self.num_layers or set(pattern) - set("gl")):
            bad("layer_pattern", f"is not one letter g or l for each of {self.num_layers} layers")
        for key in ("global_rope_scaling", "local_rope_scaling"):
            try:
                self.rope(key.startswith("global"))
            except ValueError as e:
                bad(key, str(e))

    def rope(self, is_global: bool, seq_len: int | None = None) -> tuple[np.ndarray, float]:
        """(inverse frequencies float32 [head_dim // 2], cos/sin scale) of the global or local
        layers' RoPE for inputs of ``seq_len`` tokens (``bertjax.layers.rope.frequencies``)."""
        prefix = "global" if is_global else "local"
        schedule = parse_schedule(getattr(self, f"{prefix}_rope_scaling"))
        theta = getattr(self, f"{prefix}_rope_theta")
        return frequencies(schedule, theta, self.head_dim, self.max_position_embeddings, seq_len)

    def is_global(self, layer: int) -> bool:
        """Whether layer ``layer`` attends globally (else within the sliding window)."""
        if self.layer_pattern:
            return self.layer_pattern[layer] == "g"
        return layer % self.global_attn_every_n_layers == 0

    def num_params(self, include_heads: bool = True, include_pooler: bool = False) -> int:
        """Analytic parameter count: the encoder, plus the MLM head (``include_heads``: what
        ``PreTrainingModel(nsp=False)`` and HF ModernBertForMaskedLM hold) and the pooler
        (``include_pooler``: ``Encoder(add_pooler=True)``, HF's ForSequenceClassification head)."""
        h, v, i = self.hidden_size, self.vocab_size, self.intermediate_size
        norm = h * (2 if self.norm_bias else 1)
        head = h * h + (h if self.classifier_bias else 0) + norm  # dense + norm
        ab, mb = int(self.attention_bias), int(self.mlp_bias)
        layer = (3 * h * h + 3 * h * ab) + (h * h + h * ab) + norm  # Wqkv, Wo, mlp_norm
        layer += (h * 2 * i + 2 * i * mb) + (i * h + h * mb)  # Wi, Wo
        total = v * h + norm + self.num_layers * layer + (self.num_layers - 1) * norm + norm
        if include_pooler:
            total += head
        if include_heads:
            total += head + (v if self.decoder_bias else 0)
            total += 0 if self.tie_word_embeddings else v * h
        return total


PRESETS: dict[str, dict[str, Any]] = {
    "modernbert-tiny": dict(num_layers=4, hidden_size=128, num_heads=2, intermediate_size=192),
    "modernbert-mini": dict(num_layers=6, hidden_size=256, num_heads=4, intermediate_size=384),
    "modernbert-base": dict(num_layers=22, hidden_size=768, num_heads=12, intermediate_size=1152),
    "modernbert-large": dict(num_layers=28, hidden_size=1024, num_heads=16, intermediate_size=2624),
    # The ModernBERT family at other shapes (their checkpoints' config.json gives the rest when
    # loaded): Ettin's encoders (Weller et al., 2025; ModernBERT's 50,368-token vocabulary) and
    # mmBERT (Marone et al., 2025; Gemma 2's 256,000-token vocabulary).
    "ettin-17m": dict(num_layers=7, hidden_size=256, num_heads=4, intermediate_size=384),
    "ettin-32m": dict(num_layers=10, hidden_size=384, num_heads=6, intermediate_size=576),
    "ettin-68m": dict(num_layers=19, hidden_size=512, num_heads=8, intermediate_size=768),
    "ettin-150m": dict(num_layers=22, hidden_size=768, num_heads=12, intermediate_size=1152),
    "ettin-400m": dict(num_layers=28, hidden_size=1024, num_heads=16, intermediate_size=2624),
    "ettin-1b": dict(num_layers=28, hidden_size=1792, num_heads=28, intermediate_size=3840),
    "mmbert-small": dict(
        num_layers=22, hidden_size=384, num_heads=6, intermediate_size=1152, vocab_size=256_000
    ),
    "mmbert-base": dict(
        num_layers=22, hidden_size=768, num_heads=12, intermediate_size=1152, vocab_size=256_000
    ),
}


def preset_names() -> list[str]:
    """Every preset name."""
    return list(PRESETS)


def get_preset(name: str, **overrides: Any) -> ModernBertConfig:
    """A preset (``modernbert-base``, ...) as a ModernBertConfig, with overrides."""
    if name not in PRESETS:
        if f"modernbert-{name}" in PRESETS:  # bertjax 0.2's short names ("base": BERT's preset)
            raise ValueError(
                f"ModernBERT preset {name!r} is now named 'modernbert-{name}' ({name!r} is BERT's)"
            )
        raise ValueError(f"unknown model preset {name!r}; choose one of {preset_names()}")
    return ModernBertConfig(**{**PRESETS[name], **overrides})


def _init(config: ModernBertConfig, names: tuple[str | None, ...], std: float | None = None):
    """Truncated-normal init with logical names; ``std`` overrides initializer_range."""
    if std is None:
        return normal_init(config, names)
    return nn.with_logical_partitioning(nn.initializers.truncated_normal(stddev=std), names)


def _out_std(config: ModernBertConfig) -> float:
    """ModernBERT's init of output projections: initializer_range / sqrt(2 * num_layers)."""
    return config.initializer_range / float(np.sqrt(2.0 * config.num_layers))


def _norm(cfg: ModernBertConfig, name: str):
    """PyTorch's two-pass variance, as transformers' nn.LayerNorm (see layer_norm). Its input is
    materialised first: otherwise XLA fuses the producers (residual, dropout mask hashing) into each
    of the two passes and the backward, which made the CPU step of modernbert-base 2.5x slower.
    Called with ``add``: ``(x + add, norm(x + add))``, the residual sum (materialised the same
    way) and its norm with one backward (:class:`bertjax.layers.core.LayerNorm` with ``add``)."""
    norm = layer_norm(cfg, name, epsilon=cfg.norm_eps, use_bias=cfg.norm_bias, exact_variance=True)

    def apply(x, add=None):
        return norm(jax.lax.optimization_barrier(x)) if add is None else norm(x, add=add)

    return apply


class ModernBertAttention(nn.Module):
    """Fused-QKV self-attention with RoPE, global or sliding-window (``local``)."""

    config: ModernBertConfig
    local: bool

    @nn.compact
    def __call__(
        self, x, bias, rope, deterministic: bool, attention_segment_ids=None, seen=None
    ) -> Array:
        """``seen`` [batch, seq, 1, 1] (``bertjax.layers.attention.sees_a_key``) zeroes the
        context of queries that see no key, as PyTorch's SDPA does; None: every query sees one."""
        cfg = self.config
        h, n, d = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        qkv = Linear(
            cfg, (h, 3, n, d), ("embed", None, "heads", "kv"), 1, cfg.attention_bias, name="Wqkv"
        )(x)  # [batch, seq, 3, heads, head_dim]
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        q, k = apply_rope(q, rope), apply_rope(k, rope)
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
            local_window=cfg.local_attention if self.local else 0,
            kernel_seed=kernel_seed(self),
        )  # [batch, seq, heads, head_dim]
        if seen is not None:
            ctx = ctx * seen.astype(ctx.dtype)
        ctx = nn.with_logical_constraint(ctx, BATCH_LENGTH_HEADS_KV)
        out = Linear(
            cfg,
            (n, d, h),
            ("heads", "kv", "embed"),
            2,
            cfg.attention_bias,
            _out_std(cfg),
            name="Wo",
        )(ctx)
        out = Dropout(cfg.attention_dropout, cfg.dropout_impl)(out, deterministic=deterministic)
        return nn.with_logical_constraint(out, BATCH_LENGTH_EMBED)  # [batch, seq, hidden]


class ModernBertMLP(nn.Module):
    """GeGLU: Wo(dropout(act(input) * gate)) with (input, gate) = Wi(x)."""

    config: ModernBertConfig

    @nn.compact
    def __call__(self, x: Array, deterministic: bool) -> Array:
        cfg = self.config
        h, i = cfg.hidden_size, cfg.intermediate_size
        wi = Linear(cfg, (h, 2, i), ("embed", None, "mlp"), 1, cfg.mlp_bias, name="Wi")(x)
        y = activation(cfg.hidden_act)(wi[..., 0, :]) * wi[..., 1, :]  # [batch, seq, mlp]
        y = nn.with_logical_constraint(y, BATCH_LENGTH_MLP)
        y = Dropout(cfg.hidden_dropout, cfg.dropout_impl)(y, deterministic=deterministic)
        return Linear(cfg, (i, h), ("mlp", "embed"), 1, cfg.mlp_bias, _out_std(cfg), name="Wo")(y)


class ModernBertLayer(nn.Module):
    """Pre-LN layer: x += Attn(LN(x)) (no LN in layer 0); x += MLP(LN(x))."""

    config: ModernBertConfig
    layer_id: int

    @nn.compact
    def __call__(
        self, x, bias, rope, deterministic: bool, attention_segment_ids=None, seen=None
    ) -> Array:
        cfg = self.config
        h = x if self.layer_id == 0 else _norm(cfg, "attn_norm")(x)
        local = not cfg.is_global(self.layer_id)
        attended = ModernBertAttention(cfg, local, name="attn")(
            h, bias, rope, deterministic, attention_segment_ids, seen
        )
        x, h = _norm(cfg, "mlp_norm")(x, attended)
        x = x + ModernBertMLP(cfg, name="mlp")(h, deterministic)
        return nn.with_logical_constraint(x, BATCH_LENGTH_EMBED)


class ModernBertEmbeddings(nn.Module):
    """Token embeddings, LayerNorm, dropout (no position or segment embeddings)."""

    config: ModernBertConfig

    @nn.compact
    def __call__(self, input_ids: Array, deterministic: bool) -> Array:
        cfg = self.config
        words = nn.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=dtype_of(cfg.dtype),
            param_dtype=dtype_of(cfg.param_dtype),
            embedding_init=normal_init(cfg, ("vocab", "embed")),
            name="word_embeddings",
        )
        x = _norm(cfg, "norm")(embedding_lookup(words, input_ids))  # [batch, seq, hidden]
        x = Dropout(cfg.hidden_dropout, cfg.dropout_impl)(x, deterministic=deterministic)
        return nn.with_logical_constraint(x, BATCH_LENGTH_EMBED)


def _transform(cfg: ModernBertConfig, x: Array) -> Array:
    """HF's ModernBertPredictionHead inside the calling module: norm(act(dense(x)))."""
    h = cfg.hidden_size
    x = Linear(
        cfg, (h, h), ("embed", "embed_out"), 1, cfg.classifier_bias, _out_std(cfg), name="dense"
    )(x)
    return _norm(cfg, "norm")(activation(cfg.classifier_activation)(x))


class TokenHead(nn.Module):
    """HF's ModernBertPredictionHead applied to every token (``head``: dense + act + norm), which
    ModernBertForTokenClassification and ...ForQuestionAnswering run before their classifier."""

    config: ModernBertConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        return _transform(self.config, x)  # [..., hidden]


class Pooler(nn.Module):
    """Pools the [CLS] token or the masked mean (``classifier_pooling``), then dense + act + norm.

    ``member`` [batch, k, seq] 0/1 says which tokens each pooled mean averages (mean pooling);
    ``positions`` [batch, k] are the [CLS] positions (cls pooling)."""

    config: ModernBertConfig

    @nn.compact
    def __call__(self, x: Array, positions: Array, member: Array) -> Array:
        if self.config.classifier_pooling == "cls":
            pooled = gather_positions(x, positions)  # [batch, k, hidden]
        else:
            member = member.astype(jnp.float32)
            total = jnp.einsum("bks,bsh->bkh", member, x.astype(jnp.float32))
            count = jnp.maximum(member.sum(-1, keepdims=True), 1.0)
            pooled = (total / count).astype(x.dtype)  # [batch, k, hidden]
        return _transform(self.config, pooled)


class ModernBertModel(nn.Module):
    """The ModernBERT encoder (embeddings, layers, final norm) with the optional pooler.

    ``input_mask`` [batch, seq] (1 = token, 0 = padding). Packed rows pass ``pack_ids``
    [batch, seq] (1..n per sequence, 0 = padding; attention becomes block diagonal and
    ``input_mask`` is unused) and ``position_ids`` [batch, seq] restarting at 0 per sequence
    (RoPE positions; default 0..seq-1). ``pool_positions`` [batch, k] pools at those positions
    (cls), or over the sequence starting there (mean, with ``pack_ids``): pooled_output
    [batch, k, hidden]; without them pooled_output is [batch, hidden]. ``segment_ids`` are
    accepted and ignored. ``hidden_states`` (when asked): the embeddings, every layer's output
    but the last, and the sequence output (the last layer's after the final norm), as HF's.
    """

    config: ModernBertConfig
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
        del segment_ids  # ModernBERT has no segment embeddings
        cfg = self.config
        batch, seq_len = input_ids.shape
        if seq_len > cfg.max_position_embeddings:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_position_embeddings="
                f"{cfg.max_position_embeddings} of the model"
            )
        if input_mask is None:
            input_mask = jnp.ones_like(input_ids)
        x = ModernBertEmbeddings(cfg, name="embeddings")(input_ids, deterministic)
        bias = attention_bias(input_mask, jnp.float32, pack_ids)  # [batch, 1, 1 or q, k]
        attention_segment_ids = (
            None  # the splash kernel's ids; packed rows' ids for the band blocks
        )
        if resolve_impl(cfg.attention_impl) == "splash" or pack_ids is not None:
            attention_segment_ids = segment_ids_from_mask(input_mask, pack_ids)
        if position_ids is None:
            position_ids = jnp.arange(seq_len)[None, :]  # [1, seq]
        # RoPE of the global and local layers; a schedule may depend on the (padded) length, as
        # transformers' does on max(position_ids) + 1 with its default positions.
        ropes = {g: rope_tables(position_ids, *cfg.rope(g, seq_len)) for g in (True, False)}
        seen = {True: None, False: None}  # packed rows: padding attends to padding
        if pack_ids is None:
            seen = {True: sees_a_key(input_mask, None)}
            seen[False] = sees_a_key(input_mask, cfg.local_attention // 2)
        # static_argnums counts self: (self, x, bias, rope, deterministic, attention_segment_ids, seen)
        layer_cls = remat(ModernBertLayer, cfg.remat, static_argnums=(4,))
        hidden_states = [x]
        for i in range(cfg.num_layers):
            g = cfg.is_global(i)
            x = layer_cls(cfg, i, name=f"layer_{i}")(
                x, bias, ropes[g], deterministic, attention_segment_ids, seen[g]
            )
            hidden_states.append(x)
        x = _norm(cfg, "final_norm")(x)  # [batch, seq, hidden]
        pooled = None
        if self.add_pooler:
            positions, member = pool_members(input_mask, pack_ids, pool_positions)
            pooled = Pooler(cfg, name="pooler")(x, positions, member)
            if pool_positions is None:
                pooled = pooled[:, 0]  # [batch, hidden]
        hidden = (*hidden_states[:-1], x) if output_hidden_states else ()
        return EncoderOutput(sequence_output=x, pooled_output=pooled, hidden_states=hidden)


class MaskedLMHead(nn.Module):
    """HF's MLM head: dense + ``classifier_activation`` + norm, then the decoder tied to the word
    embeddings (its own ``decoder`` [vocab, hidden] when not ``tie_word_embeddings``) with
    ``output_bias`` [vocab] when ``decoder_bias``: [..., H] -> [..., V] float32."""

    config: ModernBertConfig

    @nn.compact
    def __call__(self, x: Array, word_embeddings: Array, labels: Array | None = None):
        cfg = self.config
        x = _transform(cfg, x)
        if cfg.decoder_bias:
            bias = self.param("output_bias", zeros_init(("vocab",)), (cfg.vocab_size,))
        else:
            bias = jnp.zeros((cfg.vocab_size,), jnp.float32)
        if not cfg.tie_word_embeddings:
            word_embeddings = self.param(
                "decoder",
                _init(cfg, ("vocab", "embed"), _out_std(cfg)),
                (cfg.vocab_size, cfg.hidden_size),
                dtype_of(cfg.param_dtype),
            )
        embeddings = word_embeddings.astype(dtype_of(cfg.dtype))
        return fast_ops.decode(x, embeddings, bias, labels)  # [..., vocab] or (nll, margin)


def forward_flops_per_sequence(cfg: ModernBertConfig, seq_len: int, num_masked: int) -> float:
    """Forward FLOPs of one pretraining sequence (encoder + MLM head at ``num_masked`` positions).

    Multiply-add = 2 FLOPs; per token and layer: Wqkv and Wo 8*H^2, GeGLU Wi (input and gate) and
    Wo 6*H*I, attention scores and context 4*K*H with K keys: the sequence in global layers,
    ``min(seq, 2 * (local_attention // 2) + 1)`` in sliding-window layers. Embedding gathers,
    norms, RoPE and activations are not counted; no pooler in pretraining; the MLM head
    (transform H^2 + decoder H*V) only at masked positions.
    """
    h, i, v, layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    num_global = sum(cfg.is_global(i) for i in range(layers))
    local_keys = min(seq_len, 2 * (cfg.local_attention // 2) + 1)
    keys = num_global * seq_len + (layers - num_global) * local_keys  # summed over layers
    per_token = layers * 2 * (4 * h * h + 3 * h * i) + 4 * h * keys
    return float(seq_len * per_token + num_masked * 2 * (h * h + h * v))


ARCHITECTURE = Architecture(
    name="modernbert",
    config_class=ModernBertConfig,
    get_preset=get_preset,
    preset_names=preset_names,
    encoder=ModernBertModel,
    masked_lm_head=MaskedLMHead,
    token_head=TokenHead,
    encoder_name="model",  # the encoder's subtree in every model's params (HF's base_model_prefix)
    word_embeddings=("embeddings", "word_embeddings", "embedding"),  # tied to the MLM decoder
    pretraining_heads=("mlm",),
    pooler_in_pretraining=False,  # MLM only: the pooler is a task head
    choice_pools_first_token=True,  # as HF's ModernBertForMultipleChoice
    forward_flops_per_sequence=forward_flops_per_sequence,
    hf_reference="ModernBertForMaskedLM",
    scanned_layers=None,  # its layers differ (global/local): no nn.scan
)
