"""Hugging Face NomicBERT checkpoints <-> bertjax ``nomicbert`` parameters (NumPy only).

One table (:func:`hf_names`, rows of ``bertjax.convert.hf_table``) pairs every flat bertjax path
with its transformers state-dict name. Heads: ``mlm`` is NomicBertForMaskedLM's ``cls.predictions``
(``transform`` as bertjax ``predictions/{dense,LayerNorm}``; the output bias is
``cls.predictions.bias``, which transformers ties to ``decoder.bias`` as it ties ``decoder.weight``
to the word embeddings; with ``tie_word_embeddings=false`` the decoder's own weight and bias are
bertjax ``predictions/decoder`` and ``predictions/output_bias``, and ``cls.predictions.bias``,
which transformers' forward then never reads, is written as a copy of the decoder's bias),
``pooler`` is NomicBertForSequenceClassification's ``nomic_bert.pooler.dense`` and ``classifier``
its ``classifier``; NomicBertForTokenClassification holds the ``classifier`` alone. transformers
has no NomicBERT class for extractive QA or multiple choice: such a run exports to bertjax's
formats only (one line says so).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

import bertjax.convert.hf_table as hf_table
from bertjax.models.nomicbert import NomicBertConfig

MODEL_TYPE = "nomic_bert"
ARCHITECTURE = NomicBertConfig.architecture  # bertjax's name (config.json's is MODEL_TYPE)
_ARCHITECTURES = {  # heads present -> the transformers class whose state dict holds exactly them
    frozenset(): "NomicBertModel",
    frozenset({"mlm"}): "NomicBertForMaskedLM",
    frozenset({"pooler", "classifier"}): "NomicBertForSequenceClassification",
    frozenset({"classifier"}): "NomicBertForTokenClassification",
}
_PREFIX = "nomic_bert."  # HF's base_model_prefix
_ENCODER_PREFIXES = ("embeddings.", "layers.", "pooler.")  # NomicBertModel's own names
_WORDS = "nomic_bert.embeddings.word_embeddings.weight"
_DECODER = "cls.predictions.decoder.weight"
_DECODER_BIAS = "cls.predictions.decoder.bias"
_OUTPUT_BIAS = "cls.predictions.bias"
# The original (nomic-ai) names, which the hub checkpoints have and transformers' save_pretrained
# writes (its conversion_mapping for nomic_bert), -> transformers' module names; ``attn.Wqkv`` is
# the query, key and value weights stacked on the output axis.
_ORIGINAL_NAMES = (
    ("encoder.layers.", "layers."),
    ("emb_ln.", "embeddings.LayerNorm."),
    ("attn.out_proj.", "self_attn.o_proj."),
    ("mlp.fc11.", "mlp.up_proj."),
    ("mlp.fc12.", "mlp.gate_proj."),
    ("mlp.fc2.", "mlp.down_proj."),
    (".norm1.", ".post_attention_layernorm."),
    (".norm2.", ".post_mlp_layernorm."),
)
_FUSED_QKV = "attn.Wqkv."
# config.json's special-token ids <- the roles of bertjax's tokenizers.
TOKEN_IDS = {"pad_token_id": "pad"}
# The original code's config.json (nomic-ai's NomicBertConfig, GPT-2's key names, as
# nomic-ai/nomic-bert-2048 has it): key -> transformers' key, read where transformers' is absent.
_ORIGINAL_KEYS = (
    ("n_embd", "hidden_size"),
    ("n_head", "num_attention_heads"),
    ("n_layer", "num_hidden_layers"),
    ("n_inner", "intermediate_size"),
    ("n_positions", "max_position_embeddings"),
    ("layer_norm_epsilon", "layer_norm_eps"),
    ("resid_pdrop", "hidden_dropout_prob"),
    ("attn_pdrop", "attention_probs_dropout_prob"),
    ("rotary_emb_base", "rope_theta"),
)
_GATED_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu", "glu": "sigmoid"}  # activation_function
# The original code's settings transformers' NomicBERT (and so bertjax's) computes only as these.
_ORIGINAL_SETTINGS = {
    "rotary_emb_fraction": 1.0,
    "rotary_emb_interleaved": False,
    "rotary_emb_scale_base": None,
    "qkv_proj_bias": False,
    "mlp_fc1_bias": False,
    "mlp_fc2_bias": False,
    "prenorm": False,
    "parallel_block": False,
    "use_rms_norm": False,
    "causal": False,
}


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------
def _transformers_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json with the original code's keys read as transformers' (where transformers' own
    are absent): GPT-2's names, ``activation_function`` (the gated ones), the embedding table
    padded to ``pad_vocab_size_multiple``, ``rotary_scaling_factor`` as a dynamic schedule over
    ``max_trained_positions``; ValueError naming a setting transformers does not compute."""
    for key, supported in _ORIGINAL_SETTINGS.items():
        if hf.get(key, supported) != supported:
            raise ValueError(
                f"HF config: {key}={hf[key]!r} is not computed by NomicBERT in transformers or "
                f"bertjax (only {supported!r})"
            )
    original = "n_embd" in hf and "hidden_size" not in hf
    hf = {**{key: hf[old] for old, key in _ORIGINAL_KEYS if old in hf}, **hf}
    if original and hf.get("intermediate_size") is None:
        hf["intermediate_size"] = 4 * hf["hidden_size"]  # GPT-2's n_inner=None
    act = hf.get("activation_function")
    if act is not None and "hidden_act" not in hf:
        if act not in _GATED_ACTIVATIONS:
            raise ValueError(
                f"HF config: activation_function={act!r} (an MLP without a gate) is not "
                f"computed by NomicBERT in transformers or bertjax (only {list(_GATED_ACTIVATIONS)})"
            )
        hf["hidden_act"] = _GATED_ACTIVATIONS[act]
    multiple = hf.get("pad_vocab_size_multiple")
    if original and multiple and "vocab_size" in hf:
        hf["vocab_size"] = -(-hf["vocab_size"] // multiple) * multiple
    factor = hf.get("rotary_scaling_factor")
    if factor and not (hf.get("rope_parameters") or hf.get("rope_scaling")):
        hf["rope_scaling"] = {"rope_type": "dynamic", "factor": factor}
        hf["max_position_embeddings"] = hf.get("max_trained_positions", 2048)
    return hf


def config_from_hf(hf: dict[str, Any]) -> NomicBertConfig:
    """A NomicBertConfig from a transformers NomicBERT config.json (dict), or one of the original
    code (nomic-ai's: ``n_embd``, ``n_layer``, ``rotary_emb_base``, ``activation_function``, ...);
    a setting bertjax cannot run is a ValueError naming the key."""
    if hf.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise ValueError(f"HF config: model_type={hf['model_type']!r} is not {MODEL_TYPE!r}")
    hf = _transformers_keys(hf)
    hf_table.check_derived(hf, "NomicBERT", "silu")
    theta, schedule = hf_table.rope_from_hf(hf, 1000.0)  # NomicBertConfig.default_theta
    values = hf_table.post_norm_values(hf, NomicBertConfig())
    return hf_table.with_rope(NomicBertConfig(**values, rope_theta=theta), schedule)


def config_to_hf(cfg: NomicBertConfig, heads=("mlm",), num_labels: int = 0) -> dict[str, Any]:
    """A config.json dict that transformers' NomicBertConfig loads, for the class holding
    ``heads``; ``num_labels`` > 0 writes id2label/label2id."""
    hf = hf_table.post_norm_config(cfg, MODEL_TYPE, hf_architecture(heads), num_labels)
    return {**hf, "head_dim": cfg.head_dim}


def hf_architecture(heads, hf_class: str | None = None) -> str:
    """The transformers class whose state dict holds exactly ``heads``."""
    del hf_class  # no two NomicBERT classes hold the same heads
    return hf_table.class_holding(heads, _ARCHITECTURES, "NomicBERT")


# ---------------------------------------------------------------------------------------------
# The name table
# ---------------------------------------------------------------------------------------------
def _rows(cfg: NomicBertConfig, heads, num_labels: int) -> list[hf_table.Row]:
    """(bertjax path, HF name, transform, bertjax shape) of the encoder and the given heads."""
    h, v = cfg.hidden_size, cfg.vocab_size
    table = hf_table.Table()
    hf_table.post_norm_encoder(table, cfg, "nomic_bert", attention_bias=False, down_bias=False)
    if "pooler" in heads:
        table.linear("nomic_bert/pooler", "nomic_bert.pooler.dense", (h, h), True)
    if "mlm" in heads:
        table.linear("predictions/dense", "cls.predictions.transform.dense", (h, h), True)
        table.norm("predictions/LayerNorm", "cls.predictions.transform.layer_norm", h)
        if cfg.tie_word_embeddings:
            table.add("predictions/output_bias", _OUTPUT_BIAS, "copy", (v,))
        else:
            table.add("predictions/decoder", _DECODER, "copy", (v, h))
            table.add("predictions/output_bias", _DECODER_BIAS, "copy", (v,))
    if "classifier" in heads and num_labels > 0:
        table.linear("classifier", "classifier", (h, num_labels), True)
    return table.rows


def hf_names(cfg: NomicBertConfig, heads=("mlm",), num_labels: int = 0) -> list[tuple[str, str]]:
    """(bertjax flat path, HF state-dict name) of the encoder plus ``heads``."""
    return [(path, name) for path, name, _, _ in _rows(cfg, heads, num_labels)]


def _module_names(named: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A state dict in transformers' module names, from either those or the original ones."""
    state = {}
    for name, value in named.items():
        for original, module in _ORIGINAL_NAMES:
            name = name.replace(original, module)
        if _FUSED_QKV in name:
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), np.split(np.asarray(value), 3)):
                state[name.replace(_FUSED_QKV, f"self_attn.{proj}.")] = part
        else:
            state[name] = np.asarray(value)
    return state


def from_hf_tensors(
    cfg: NomicBertConfig, named: dict[str, np.ndarray], source: str, architecture: str | None = None
) -> tuple[dict[str, np.ndarray], tuple[str, ...]]:
    """A transformers NomicBERT state dict (NumPy) -> (flat bertjax tensors, heads present).

    transformers' module names and the original ones (``encoder.layers.{i}.attn.Wqkv``, ``fc11``,
    ``emb_ln``, ...: the hub's, and what ``save_pretrained`` writes) are both read; names of a bare
    NomicBertModel (no ``nomic_bert.`` prefix) are accepted; the heads are read
    from the names (``cls.*``: mlm; ``nomic_bert.pooler.*``: pooler; ``classifier.*``:
    classifier). A tied decoder weight and bias must equal the word embeddings and the output
    bias. One ValueError naming ``source`` lists every missing, unexpected and mis-shaped
    tensor."""
    del architecture  # the names tell every NomicBERT class apart
    state = {}
    for name, value in _module_names(named).items():
        state[_PREFIX + name if name.startswith(_ENCODER_PREFIXES) else name] = value
    mlm = any(k.startswith("cls.") for k in state)
    if mlm and cfg.tie_word_embeddings:
        hf_table.untie(state, _DECODER, _WORDS, source)
        hf_table.untie(state, _DECODER_BIAS, _OUTPUT_BIAS, source)
    elif mlm:  # untied: transformers' forward reads the decoder's bias, never this one
        state.pop(_OUTPUT_BIAS, None)
    prefixes = {"pooler": "nomic_bert.pooler.", "mlm": "cls.", "classifier": "classifier."}
    rows = functools.partial(_rows, cfg)
    return hf_table.read_heads(state, prefixes, rows, f"{source}: NomicBERT checkpoint")


def to_hf_tensors(
    cfg: NomicBertConfig, flat: dict[str, np.ndarray], heads, hf_class: str | None = None
) -> dict[str, np.ndarray]:
    """Flat bertjax tensors -> the state dict of :func:`hf_architecture` (``heads``): unprefixed
    names for a bare NomicBertModel, ``nomic_bert.`` ones with heads (a tied decoder is left to
    transformers, which ties it on load)."""
    arch = hf_architecture(heads, hf_class)
    out = hf_table.write(_rows(cfg, heads, hf_table.num_labels(flat)), flat, "to_hf_tensors")
    if "mlm" in heads and not cfg.tie_word_embeddings:
        out[_OUTPUT_BIAS] = out[_DECODER_BIAS].copy()
    if arch == "NomicBertModel":
        out = {k.removeprefix(_PREFIX): a for k, a in out.items()}
    return out


def write_hf_dir(
    path: str, cfg: NomicBertConfig, flat: dict[str, np.ndarray], heads, hf_class=None
) -> None:
    """Writes config.json + model.safetensors that transformers' ``from_pretrained`` loads as the
    class holding ``heads``."""
    state = to_hf_tensors(cfg, flat, heads, hf_class)  # refuses heads no class holds, first
    hf_table.write_dir(path, config_to_hf(cfg, heads, hf_table.num_labels(flat)), state)
