"""BERT model configuration: one frozen dataclass and its named presets.

Presets follow the BERT paper and the 24 official "BERT miniatures" (Turc et al., 2019):
``L{2,4,6,8,10,12}_H{128,256,512,768}`` with ``H/64`` heads and a ``4H`` feed-forward layer, the named
aliases ``tiny`` (L2/H128), ``mini`` (L4/H256), ``small`` (L4/H512), ``medium`` (L8/H512), ``base``
(L12/H768/A12) and ``large`` (L24/H1024/A16).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

_ACTIVATIONS = ("gelu", "gelu_new", "gelu_tanh", "relu", "silu")
_ATTENTION_IMPLS = ("xla", "dot_product", "cudnn", "splash")
_REMAT_POLICIES = ("none", "dots", "full")
DROPOUT_IMPLS = ("bits16", "flax")
_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Architecture and numerics of a BERT encoder (field names follow the paper, not a framework)."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"  # exact (erf) GELU as in the original BERT
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    # bits16: 16 random bits per element, four elements per Threefry block (bertjax.dropout);
    # flax: exactly flax.linen.Dropout's masks (a full block per element, ~15% slower on CPU)
    dropout_impl: str = "bits16"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    dtype: str = (
        "float32"  # compute dtype (bfloat16 on TPU/GPU); softmax and LayerNorm stats stay fp32
    )
    param_dtype: str = "float32"
    # xla: explicit einsums; dot_product/cudnn: jax.nn.dot_product_attention; splash: Pallas TPU
    # kernel (bertjax.splash_attention; seq a multiple of 128, attention_dropout=0 to use it)
    attention_impl: str = "xla"
    remat: str = "none"  # rematerialisation per layer: none | dots (save matmuls) | full
    scan_layers: bool = False  # nn.scan over layers: params stacked on a leading "layers" axis

    def __post_init__(self):
        def bad(key, why):
            raise ValueError(f"model config: {key}={getattr(self, key)!r} {why}")

        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size"):
            if getattr(self, key) <= 0:
                bad(key, "must be positive")
        if self.hidden_size % self.num_heads:
            bad("hidden_size", f"is not divisible by num_heads={self.num_heads}")
        if self.type_vocab_size < 1 or self.max_position_embeddings < 2:
            bad("max_position_embeddings", "and type_vocab_size must be >= 2 and >= 1")
        if self.hidden_act not in _ACTIVATIONS:
            bad("hidden_act", f"is not one of {_ACTIVATIONS}")
        if self.attention_impl not in _ATTENTION_IMPLS:
            bad("attention_impl", f"is not one of {_ATTENTION_IMPLS}")
        if self.dropout_impl not in DROPOUT_IMPLS:
            bad("dropout_impl", f"is not one of {DROPOUT_IMPLS}")
        if self.remat not in _REMAT_POLICIES:
            bad("remat", f"is not one of {_REMAT_POLICIES}")
        for key in ("dtype", "param_dtype"):
            if getattr(self, key) not in _DTYPES:
                bad(key, f"is not one of {_DTYPES}")
        for key in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                bad(key, "must be in [0, 1)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def replace(self, **changes: Any) -> BertConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> BertConfig:
        """Builds a config from a dict; unknown keys are an error that names them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"model config: unknown keys {unknown}; known keys: {sorted(known)}")
        return cls(**values)

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
}
ALIASES = {
    "tiny": "L2_H128",
    "mini": "L4_H256",
    "small": "L4_H512",
    "medium": "L8_H512",
    "base": "L12_H768",
    "large": "L24_H1024",
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
