"""Hugging Face GTE checkpoints <-> bertjax ``gte`` parameters (NumPy only).

One table (:func:`hf_names`, rows of ``bertjax.convert.hf_table``) pairs every flat bertjax path
with its transformers state-dict name. Heads: ``mlm`` is GteForMaskedLM's ``lm_head`` (``dense``
and ``layer_norm`` as bertjax ``predictions/{dense,LayerNorm}``, ``decoder.bias`` as
``predictions/output_bias``, ``decoder.weight`` as ``predictions/decoder`` unless
``tie_word_embeddings`` ties it to the word embeddings), ``pooler`` is
GteForSequenceClassification's ``gte.pooler.dense`` and ``classifier`` its ``classifier``;
GteForTokenClassification holds the ``classifier`` alone. transformers has no GTE class for
extractive QA or multiple choice: such a run exports to bertjax's formats only (one line says so).

Also read: the checkpoints of Alibaba's original code (config.json ``model_type: "new"``,
``NewModel`` / ``NewForMaskedLM`` / ..., what the hub's gte-*-v1.5 and gte-multilingual-*
directories hold), whose names transformers' ``save_pretrained`` writes as well
(``encoder.layer.{i}.attention.qkv_proj``, ``mlp.up_gate_proj``, ``attn_ln``, ``mlp_ln``,
``lm_head.norm``; prefix ``new.`` or ``gte.``), and whose RoPE ``rope_scaling: {"type": "ntk"}``
becomes transformers' linear schedule (``bertjax.models.gte.ntk_rope``). Written: transformers'
config.json (``model_type: "gte"``) and module names.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

import bertjax.convert.hf_table as hf_table
from bertjax.models.gte import GteConfig, ntk_rope

MODEL_TYPE = "gte"
ARCHITECTURE = GteConfig.architecture  # bertjax's name
ORIGINAL_MODEL_TYPE = "new"  # Alibaba-NLP/new-impl's custom code, read as GTE too
_ARCHITECTURES = {  # heads present -> the transformers class whose state dict holds exactly them
    frozenset(): "GteModel",
    frozenset({"mlm"}): "GteForMaskedLM",
    frozenset({"pooler", "classifier"}): "GteForSequenceClassification",
    frozenset({"classifier"}): "GteForTokenClassification",
}
_PREFIX = "gte."  # HF's base_model_prefix (the original code's is "new.")
_ENCODER_PREFIXES = ("embeddings.", "layers.", "encoder.", "pooler.")  # a bare model's names
_WORDS = "gte.embeddings.word_embeddings.weight"
_DECODER = "lm_head.decoder.weight"
_BUFFERS = ("position_ids", "inv_freq")  # non-persistent buffers an old save may hold
# The original names (also what save_pretrained writes: transformers' conversion_mapping for
# gte) -> transformers' module names; qkv_proj stacks the query, key and value weights and
# up_gate_proj the up and gate weights, on the output axis.
_ORIGINAL_PREFIX = "new."
_ORIGINAL_NAMES = (
    ("encoder.layer.", "layers."),
    ("attention.", "self_attn."),
    ("attn_ln.", "post_attention_layernorm."),
    ("mlp_ln.", "post_mlp_layernorm."),
    ("lm_head.norm.", "lm_head.layer_norm."),
)
_FUSED = {
    "self_attn.qkv_proj.": ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj."),
    "mlp.up_gate_proj.": ("mlp.up_proj.", "mlp.gate_proj."),
}
# config.json's special-token ids <- the roles of bertjax's tokenizers.
TOKEN_IDS = {"pad_token_id": "pad"}
# The original NewConfig's defaults where they differ from transformers' GteConfig.
_ORIGINAL_DEFAULTS = dict(
    vocab_size=30528, max_position_embeddings=2048, rope_theta=10_000.0, pad_token_id=None
)


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------
def _original_settings(hf: dict[str, Any]) -> None:
    """ValueError naming the key: a setting of the original code that transformers' GTE (and so
    bertjax's) does not compute."""
    unsupported = {
        "position_embedding_type": ("rope", "absolute positions"),
        "layer_norm_type": ("layer_norm", "RMSNorm layers"),
        "logn_attention_scale": (False, "log-n attention scaling"),
    }
    for key, (supported, what) in unsupported.items():
        if hf.get(key, supported) != supported:
            raise ValueError(
                f"HF config: {key}={hf[key]!r} ({what}) is not supported by GTE in transformers "
                "or bertjax"
            )


def _rope(hf: dict[str, Any], default_theta: float, head_dim: int) -> tuple[float, str]:
    """(rope_theta, schedule JSON): the original ``rope_scaling: {"type": "ntk"}`` as transformers
    writes it, else as :func:`hf_table.rope_from_hf` reads it."""
    scaling = hf.get("rope_scaling") or {}
    kind = scaling.get("type", scaling.get("rope_type"))
    if kind == "ntk":
        if scaling.get("mixed_b") is not None:
            raise ValueError(
                f"HF config: rope_scaling={scaling} (mixed NTK scaling) is not supported by GTE "
                "in transformers or bertjax"
            )
        rope = ntk_rope(hf.get("rope_theta", default_theta), scaling["factor"], head_dim)
        return rope["rope_theta"], rope["rope_scaling"]
    if hf.get("model_type") == ORIGINAL_MODEL_TYPE and scaling:
        raise ValueError(f"HF config: rope_scaling={scaling} is not one the original GTE code runs")
    return hf_table.rope_from_hf(hf, default_theta)


def config_from_hf(hf: dict[str, Any]) -> GteConfig:
    """A GteConfig from a transformers GTE config.json (dict), or from one of the original code
    (``model_type: "new"``); a setting bertjax cannot run is a ValueError naming the key."""
    model_type = hf.get("model_type", MODEL_TYPE)
    if model_type not in (MODEL_TYPE, ORIGINAL_MODEL_TYPE):
        raise ValueError(f"HF config: model_type={model_type!r} is not {MODEL_TYPE!r}")
    hf_table.check_derived(hf, "GTE", "gelu")
    _original_settings(hf)
    default = GteConfig()
    if model_type == ORIGINAL_MODEL_TYPE:
        default = default.replace(**_ORIGINAL_DEFAULTS)
    values = hf_table.post_norm_values(hf, default)
    head_dim = values["hidden_size"] // max(values["num_heads"], 1)
    theta, schedule = _rope(hf, default.rope_theta, head_dim)
    return hf_table.with_rope(GteConfig(**values, rope_theta=theta), schedule)


def config_to_hf(cfg: GteConfig, heads=("mlm",), num_labels: int = 0) -> dict[str, Any]:
    """A config.json dict that transformers' GteConfig loads, for the class holding ``heads``;
    ``num_labels`` > 0 writes id2label/label2id."""
    return hf_table.post_norm_config(cfg, MODEL_TYPE, hf_architecture(heads), num_labels)


def hf_architecture(heads, hf_class: str | None = None) -> str:
    """The transformers class whose state dict holds exactly ``heads``."""
    del hf_class  # no two GTE classes hold the same heads
    return hf_table.class_holding(heads, _ARCHITECTURES, "GTE")


# ---------------------------------------------------------------------------------------------
# The name table
# ---------------------------------------------------------------------------------------------
def _rows(cfg: GteConfig, heads, num_labels: int) -> list[hf_table.Row]:
    """(bertjax path, HF name, transform, bertjax shape) of the encoder and the given heads."""
    h, v = cfg.hidden_size, cfg.vocab_size
    table = hf_table.Table()
    hf_table.post_norm_encoder(table, cfg, "gte", attention_bias=True, down_bias=True)
    if "pooler" in heads:
        table.linear("gte/pooler", "gte.pooler.dense", (h, h), True)
    if "mlm" in heads:
        table.linear("predictions/dense", "lm_head.dense", (h, h), True)
        table.norm("predictions/LayerNorm", "lm_head.layer_norm", h)
        if not cfg.tie_word_embeddings:
            table.add("predictions/decoder", _DECODER, "copy", (v, h))
        table.add("predictions/output_bias", "lm_head.decoder.bias", "copy", (v,))
    if "classifier" in heads and num_labels > 0:
        table.linear("classifier", "classifier", (h, num_labels), True)
    return table.rows


def hf_names(cfg: GteConfig, heads=("mlm",), num_labels: int = 0) -> list[tuple[str, str]]:
    """(bertjax flat path, HF state-dict name) of the encoder plus ``heads``."""
    return [(path, name) for path, name, _, _ in _rows(cfg, heads, num_labels)]


def _module_names(named: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A state dict in transformers' module names with the ``gte.`` prefix, from those, the
    original ones, or a bare model's; fused projections split, buffers dropped."""
    state = {}
    for name, value in named.items():
        if name.endswith(_BUFFERS):
            continue
        if name.startswith(_ORIGINAL_PREFIX):
            name = _PREFIX + name.removeprefix(_ORIGINAL_PREFIX)
        elif name.startswith(_ENCODER_PREFIXES):
            name = _PREFIX + name
        for original, module in _ORIGINAL_NAMES:
            name = name.replace(original, module)
        fused = next((f for f in _FUSED if f in name), None)
        if fused is None:
            state[name] = np.asarray(value)
            continue
        parts = np.split(np.asarray(value), len(_FUSED[fused]))
        for split, part in zip(_FUSED[fused], parts):
            state[name.replace(fused, split)] = part
    return state


def from_hf_tensors(
    cfg: GteConfig, named: dict[str, np.ndarray], source: str, architecture: str | None = None
) -> tuple[dict[str, np.ndarray], tuple[str, ...]]:
    """A transformers (or original) GTE state dict (NumPy) -> (flat bertjax tensors, heads
    present).

    transformers' module names and the original ones are both read (prefix ``gte.``, ``new.`` or
    none for a bare model); the heads are read from the names (``lm_head.*``: mlm;
    ``gte.pooler.*``: pooler; ``classifier.*``: classifier). A tied decoder weight must equal the
    word embeddings. One ValueError naming ``source`` lists every missing, unexpected and
    mis-shaped tensor."""
    del architecture  # the names tell every GTE class apart
    state = _module_names(named)
    if cfg.tie_word_embeddings:
        hf_table.untie(state, _DECODER, _WORDS, source)
    prefixes = {"pooler": "gte.pooler.", "mlm": "lm_head.", "classifier": "classifier."}
    rows = functools.partial(_rows, cfg)
    return hf_table.read_heads(state, prefixes, rows, f"{source}: GTE checkpoint")


def to_hf_tensors(
    cfg: GteConfig, flat: dict[str, np.ndarray], heads, hf_class: str | None = None
) -> dict[str, np.ndarray]:
    """Flat bertjax tensors -> the state dict of :func:`hf_architecture` (``heads``) in
    transformers' module names: unprefixed for a bare GteModel, ``gte.`` ones with heads (a tied
    decoder is left to transformers, which ties it on load)."""
    arch = hf_architecture(heads, hf_class)
    out = hf_table.write(_rows(cfg, heads, hf_table.num_labels(flat)), flat, "to_hf_tensors")
    if arch == "GteModel":
        out = {k.removeprefix(_PREFIX): a for k, a in out.items()}
    return out


def write_hf_dir(
    path: str, cfg: GteConfig, flat: dict[str, np.ndarray], heads, hf_class=None
) -> None:
    """Writes config.json + model.safetensors that transformers' ``from_pretrained`` loads as the
    class holding ``heads``."""
    state = to_hf_tensors(cfg, flat, heads, hf_class)  # refuses heads no class holds, first
    hf_table.write_dir(path, config_to_hf(cfg, heads, hf_table.num_labels(flat)), state)
