"""Hugging Face EuroBERT checkpoints <-> bertjax ``eurobert`` parameters (NumPy only).

One table (:func:`hf_names`, rows of ``bertjax.convert.hf_table``) pairs every flat bertjax path
with its transformers state-dict name. Heads: ``mlm`` is EuroBertForMaskedLM's ``lm_head`` (bertjax
``predictions/decoder`` and, with ``mlp_bias``, ``predictions/output_bias``; with
``tie_word_embeddings`` the weight is the word embeddings'), ``pooler`` is
EuroBertForSequenceClassification's ``dense`` (bertjax ``model/pooler/dense``) and ``classifier``
its ``classifier``; EuroBertForTokenClassification holds the ``classifier`` alone. transformers has
no EuroBERT class for extractive QA or multiple choice: such a run exports to bertjax's formats
only (one line says so).
"""

from __future__ import annotations

from typing import Any

import numpy as np

import bertjax.convert.hf_table as hf_table
from bertjax.models.eurobert import POOLINGS, EuroBertConfig

MODEL_TYPE = "eurobert"
ARCHITECTURE = EuroBertConfig.architecture  # bertjax's name
_ARCHITECTURES = {  # heads present -> the transformers class whose state dict holds exactly them
    frozenset(): "EuroBertModel",
    frozenset({"mlm"}): "EuroBertForMaskedLM",
    frozenset({"pooler", "classifier"}): "EuroBertForSequenceClassification",
    frozenset({"classifier"}): "EuroBertForTokenClassification",
}
_ENCODER_PREFIXES = ("embed_tokens.", "layers.", "norm.")  # EuroBertModel's own names
_DECODER = "lm_head.weight"
_WORDS = "model.embed_tokens.weight"
# config.json's special-token ids <- the roles of bertjax's tokenizers (a WordPiece vocabulary's
# [CLS] / [SEP] play EuroBERT's <|begin_of_text|> / <|end_of_text|>).
TOKEN_IDS = {
    "pad_token_id": "pad",
    "bos_token_id": "cls",
    "eos_token_id": "sep",
    "mask_token_id": "mask",
}


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------
def config_from_hf(hf: dict[str, Any]) -> EuroBertConfig:
    """A EuroBertConfig from a transformers EuroBERT config.json (dict); a setting bertjax cannot
    run is a ValueError naming the key."""
    if hf.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise ValueError(f"HF config: model_type={hf['model_type']!r} is not {MODEL_TYPE!r}")
    hf_table.check_derived(hf, "EuroBERT", "silu")
    hidden, heads = hf.get("hidden_size", 768), hf.get("num_attention_heads", 12)
    if hf.get("classifier_pooling", "late") not in POOLINGS:
        raise ValueError(
            f"HF config: classifier_pooling={hf['classifier_pooling']!r} is not one of {POOLINGS}"
        )
    if int(hf.get("pretraining_tp", 1) or 1) != 1:
        raise ValueError(f"HF config: pretraining_tp={hf['pretraining_tp']} is not 1")
    kv = hf.get("num_key_value_heads")
    theta, schedule = hf_table.rope_from_hf(hf, 10_000.0)  # transformers' default
    values: dict[str, Any] = dict(
        vocab_size=hf.get("vocab_size", 128256),
        hidden_size=hidden,
        num_layers=int(hf.get("num_hidden_layers", 12)),
        num_heads=heads,
        num_kv_heads=0 if kv in (None, heads) else int(kv),
        intermediate_size=hf.get("intermediate_size", 3072),
        hidden_act=hf.get("hidden_act", "silu"),
        attention_dropout=float(hf.get("attention_dropout", 0.0) or 0.0),
        max_position_embeddings=hf.get("max_position_embeddings", 8192),
        initializer_range=hf.get("initializer_range", 0.02),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        attention_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        rope_theta=theta,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        classifier_pooling=hf.get("classifier_pooling", "late"),
    )
    values.update(hf_table.metadata(hf, TOKEN_IDS))
    return hf_table.with_rope(EuroBertConfig(**values), schedule)


def config_to_hf(cfg: EuroBertConfig, heads=("mlm",), num_labels: int = 0) -> dict[str, Any]:
    """A config.json dict that transformers' EuroBertConfig loads, for the class holding
    ``heads``; ``num_labels`` > 0 writes id2label/label2id."""
    hf: dict[str, Any] = {
        "architectures": [hf_architecture(heads)],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range,
        "rms_norm_eps": cfg.rms_norm_eps,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": cfg.attention_dropout,
        "mlp_bias": cfg.mlp_bias,
        "rope_parameters": hf_table.rope_parameters(cfg),
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "classifier_pooling": cfg.classifier_pooling,
        "dtype": cfg.param_dtype,
        **{key: getattr(cfg, key) for key in TOKEN_IDS},
    }
    hf.update(hf_table.label_maps(num_labels))
    return hf


def hf_architecture(heads, hf_class: str | None = None) -> str:
    """The transformers class whose state dict holds exactly ``heads``."""
    del hf_class  # no two EuroBERT classes hold the same heads
    return hf_table.class_holding(heads, _ARCHITECTURES, "EuroBERT")


# ---------------------------------------------------------------------------------------------
# The name table
# ---------------------------------------------------------------------------------------------
def _rows(cfg: EuroBertConfig, heads, num_labels: int) -> list[hf_table.Row]:
    """(bertjax path, HF name, transform, bertjax shape) of the encoder and the given heads."""
    h, n, g, d = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.head_dim
    i, v, ab, mb = cfg.intermediate_size, cfg.vocab_size, cfg.attention_bias, cfg.mlp_bias
    table = hf_table.Table()
    table.add("model/embed_tokens/embedding", _WORDS, "copy", (v, h))
    for layer in range(cfg.num_layers):
        src, dst = f"model.layers.{layer}", f"model/layer_{layer}"
        table.add(f"{dst}/input_layernorm/scale", f"{src}.input_layernorm.weight", "copy", (h,))
        for proj, heads_of in (("q_proj", n), ("k_proj", g), ("v_proj", g)):
            table.linear(f"{dst}/self_attn/{proj}", f"{src}.self_attn.{proj}", (h, heads_of, d), ab)
        table.linear(
            f"{dst}/self_attn/o_proj", f"{src}.self_attn.o_proj", (n, d, h), ab, "linear_heads", 2
        )
        norm = f"{src}.post_attention_layernorm.weight"
        table.add(f"{dst}/post_attention_layernorm/scale", norm, "copy", (h,))
        table.linear(f"{dst}/mlp/gate_proj", f"{src}.mlp.gate_proj", (h, i), mb)
        table.linear(f"{dst}/mlp/up_proj", f"{src}.mlp.up_proj", (h, i), mb)
        table.linear(f"{dst}/mlp/down_proj", f"{src}.mlp.down_proj", (i, h), mb)
    table.add("model/norm/scale", "model.norm.weight", "copy", (h,))
    if "pooler" in heads:
        table.linear("model/pooler/dense", "dense", (h, h), True)
    if "mlm" in heads:
        if not cfg.tie_word_embeddings:
            table.add("predictions/decoder", _DECODER, "copy", (v, h))
        if cfg.mlp_bias:
            table.add("predictions/output_bias", "lm_head.bias", "copy", (v,))
    if "classifier" in heads and num_labels > 0:
        table.linear("classifier", "classifier", (h, num_labels), True)
    return table.rows


def hf_names(cfg: EuroBertConfig, heads=("mlm",), num_labels: int = 0) -> list[tuple[str, str]]:
    """(bertjax flat path, HF state-dict name) of the encoder plus ``heads``."""
    return [(path, name) for path, name, _, _ in _rows(cfg, heads, num_labels)]


def from_hf_tensors(
    cfg: EuroBertConfig, named: dict[str, np.ndarray], source: str, architecture: str | None = None
) -> tuple[dict[str, np.ndarray], tuple[str, ...]]:
    """A transformers EuroBERT state dict (NumPy) -> (flat bertjax tensors, heads present).

    Names of a bare EuroBertModel (no ``model.`` prefix) are accepted; the heads are read from
    the names (``lm_head.*``: mlm; ``dense.*``: pooler; ``classifier.*``: classifier). A tied
    ``lm_head.weight`` must equal the word embeddings. One ValueError naming ``source`` lists every
    missing, unexpected and mis-shaped tensor."""
    del architecture  # the names tell every EuroBERT class apart
    state = {}
    for name, value in named.items():
        state["model." + name if name.startswith(_ENCODER_PREFIXES) else name] = np.asarray(value)
    mlm = any(k.startswith("lm_head.") for k in state)
    if cfg.tie_word_embeddings:
        hf_table.untie(state, _DECODER, _WORDS, source)
    heads = tuple(
        h
        for h, prefix in (("pooler", "dense."), ("mlm", "lm_head."), ("classifier", "classifier."))
        if (h == "mlm" and mlm) or any(k.startswith(prefix) for k in state)
    )
    labels = state.get("classifier.weight", state.get("classifier.bias"))
    num_labels = int(labels.shape[0]) if labels is not None and labels.ndim else 0
    what = f"{source}: EuroBERT checkpoint (heads {list(heads)}) does not match its config"
    return hf_table.read(_rows(cfg, heads, num_labels), state, what), heads


def to_hf_tensors(
    cfg: EuroBertConfig, flat: dict[str, np.ndarray], heads, hf_class: str | None = None
) -> dict[str, np.ndarray]:
    """Flat bertjax tensors -> the state dict of :func:`hf_architecture` (``heads``): unprefixed
    names for a bare EuroBertModel, ``model.`` ones with heads (a tied ``lm_head.weight`` is
    left to transformers, which ties it on load)."""
    arch = hf_architecture(heads, hf_class)
    out = hf_table.write(_rows(cfg, heads, hf_table.num_labels(flat)), flat, "to_hf_tensors")
    if arch == "EuroBertModel":
        out = {k.removeprefix("model."): a for k, a in out.items()}
    return out


def write_hf_dir(
    path: str, cfg: EuroBertConfig, flat: dict[str, np.ndarray], heads, hf_class=None
) -> None:
    """Writes config.json + model.safetensors that transformers' ``from_pretrained`` loads as the
    class holding ``heads``."""
    state = to_hf_tensors(cfg, flat, heads, hf_class)  # refuses heads no class holds, first
    hf_table.write_dir(path, config_to_hf(cfg, heads, hf_table.num_labels(flat)), state)
