"""Hugging Face ModernBERT checkpoints <-> bertjax ``modernbert`` parameters (NumPy only).

One table (:func:`hf_names`, rows and transforms of ``bertjax.convert.hf_table``) pairs every
flat bertjax path (``model/layer_0/attn/Wqkv/kernel``) with its transformers state-dict name and
how the array is laid out on each side (``Wqkv`` [h, 3, heads, kv] is a ``linear`` row with a
``flatten``ed bias, ``Wo`` a ``linear_heads`` row).

Heads: ``pooler`` is the ``head.*`` of ForSequenceClassification and ForMultipleChoice (bertjax
``model/pooler``: pooled, then dense + act + norm), ``mlm`` ForMaskedLM's ``head.*`` and
``decoder.bias`` (bertjax ``predictions``; ``decoder.weight`` is tied to
``model.embeddings.tok_embeddings.weight``, or with ``tie_word_embeddings=False`` bertjax's
``predictions/decoder``), ``token_head`` the per-token ``head.*`` of
ForTokenClassification and ForQuestionAnswering (bertjax ``head``, run by the TokenClassifier and
SpanClassifier heads), ``classifier`` is ``classifier.*``, and ForQuestionAnswering's
``classifier.*`` [2, hidden] is ``qa`` (bertjax ``qa_outputs``). These classes share tensor names,
so the class named in config.json's ``architectures`` tells them apart.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
from safetensors.numpy import save_file

import bertjax.convert.hf_table as hf_table
from bertjax.layers.core import ACTIVATIONS
from bertjax.layers.rope import frequencies, parse_schedule, schedule_json
from bertjax.models.modernbert import ModernBertConfig

MODEL_TYPE = "modernbert"  # config.json's model_type
ARCHITECTURE = ModernBertConfig.architecture  # bertjax's name
HEADS = ("pooler", "mlm", "classifier", "token_head", "qa")
# config.json's special-token ids <- the roles of the vocabulary's tokens.
TOKEN_IDS = {"pad_token_id": "pad", "cls_token_id": "cls", "sep_token_id": "sep"}
_ARCHITECTURES = {  # heads present -> the transformers class whose state dict holds exactly them
    frozenset(): "ModernBertModel",
    frozenset({"mlm"}): "ModernBertForMaskedLM",
    frozenset({"pooler", "classifier"}): "ModernBertForSequenceClassification",
    frozenset({"token_head", "classifier"}): "ModernBertForTokenClassification",
    frozenset({"token_head", "qa"}): "ModernBertForQuestionAnswering",
}
# Classes with the same heads as another one, told apart only by config.json's architectures.
_SAME_HEADS = {"ModernBertForMultipleChoice": frozenset({"pooler", "classifier"})}
_HEAD_TENSORS = {"head.": ("pooler", "mlm", "token_head"), "classifier.": ("classifier", "qa")}
_ENCODER_PREFIXES = ("embeddings.", "layers.", "final_norm.")  # ModernBertModel's own names
_TIED = "decoder.weight"
_WORDS = "model.embeddings.tok_embeddings.weight"
_ROPE_DEFAULTS = {"full_attention": 160_000.0, "sliding_attention": 10_000.0}


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------
def _layer_pattern(hf: dict[str, Any], layers: int) -> tuple[int, str]:
    """(global_attn_every_n_layers, layer_pattern) of ``layer_types`` (transformers 5) or
    ``global_attn_every_n_layers`` (older files; transformers' default 3)."""
    every = hf.get("global_attn_every_n_layers")
    types = hf.get("layer_types")
    if types is None:
        return int(every if every is not None else 3), ""
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown or len(types) != layers:
        raise ValueError(
            f"HF config: layer_types={types} is not full_attention / sliding_attention for each "
            f"of the num_hidden_layers={layers} layers"
        )
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    candidates = [int(every)] if every is not None else []
    candidates += [full[1] - full[0] if len(full) > 1 else max(layers, 1)]
    for n in candidates:  # the legacy every-n rule where it gives these layer types
        if n >= 1 and full == list(range(0, layers, n)):
            return n, ""
    pattern = "".join("g" if t == "full_attention" else "l" for t in types)
    return int(every if every is not None else 3), pattern


def _rope_schedules(hf: dict[str, Any]) -> dict[str, tuple[float, str]]:
    """{layer type: (rope_theta, schedule JSON)} as transformers' ModernBertConfig reads
    ``rope_parameters`` (or legacy ``rope_scaling`` + ``global_rope_theta`` /
    ``local_rope_theta``; a top-level ``partial_rotary_factor`` joins each layer type's)."""
    rope = hf.get("rope_parameters") or {}
    out = {}
    for kind, legacy in (
        ("full_attention", "global_rope_theta"),
        ("sliding_attention", "local_rope_theta"),
    ):
        params = dict(rope.get(kind) or {"rope_type": "default"})
        params.update(hf.get("rope_scaling") or {})  # legacy: applies to both layer types
        if hf.get("partial_rotary_factor") is not None:
            params.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
        theta = params.get("rope_theta")
        if theta is None:
            theta = hf.get(legacy, _ROPE_DEFAULTS[kind])
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type in ("yarn", "longrope", "llama3"):
            params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
        out[kind] = (float(theta), schedule_json(params))
    return out


def config_from_hf(hf: dict[str, Any]) -> ModernBertConfig:
    """A ModernBertConfig from a transformers ModernBERT config.json (dict).

    Reads ``layer_types`` + ``rope_parameters`` (transformers 5; any pattern of layer types, any
    RoPE schedule of ``bertjax.layers.rope``) or ``global_attn_every_n_layers`` +
    ``global_rope_theta``/``local_rope_theta`` (older files). The dropouts collapse into
    ``hidden_dropout`` (the largest of embedding/mlp/classifier dropout); ``dtype`` (or
    ``torch_dtype``) becomes ``param_dtype``. Unsupported settings are a ValueError naming the key.
    """
    if hf.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise ValueError(f"HF config: model_type={hf['model_type']!r} is not {MODEL_TYPE!r}")
    layers = int(hf.get("num_hidden_layers", 22))
    hidden, heads = hf.get("hidden_size", 768), hf.get("num_attention_heads", 12)
    if hf.get("head_dim") not in (None, hidden // max(heads, 1)):
        raise ValueError(
            f"HF config: head_dim={hf['head_dim']} is not hidden_size // num_attention_heads "
            f"(transformers' ModernBERT fails on it)"
        )
    for key in ("hidden_activation", "classifier_activation"):
        if hf.get(key, "gelu") not in ACTIVATIONS:
            raise ValueError(f"HF config: {key}={hf[key]!r} is not one of {ACTIVATIONS}")
    every, pattern = _layer_pattern(hf, layers)
    rope = _rope_schedules(hf)
    dropout = max(
        float(hf.get(k, 0.0) or 0.0)
        for k in ("embedding_dropout", "mlp_dropout", "classifier_dropout")
    )
    values: dict[str, Any] = dict(
        vocab_size=hf.get("vocab_size", 50368),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        intermediate_size=hf.get("intermediate_size", 1152),
        hidden_act=hf.get("hidden_activation", "gelu"),
        hidden_dropout=dropout,
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        max_position_embeddings=hf.get("max_position_embeddings", 8192),
        initializer_range=hf.get("initializer_range", 0.02),
        norm_eps=hf.get("norm_eps", 1e-5),
        global_rope_theta=rope["full_attention"][0],
        local_rope_theta=rope["sliding_attention"][0],
        global_attn_every_n_layers=every,
        layer_pattern=pattern,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )
    for key in ("norm_bias", "attention_bias", "mlp_bias", "decoder_bias", "classifier_bias"):
        if key in hf:
            values[key] = bool(hf[key])
    for key in ("classifier_activation", "classifier_pooling", "local_attention"):
        if key in hf:
            values[key] = hf[key]
    for key in ("pad_token_id", "cls_token_id", "sep_token_id"):
        if key in hf:
            values[key] = None if hf[key] is None else int(hf[key])
    dtype = hf.get("dtype", hf.get("torch_dtype"))
    if dtype in ("float32", "bfloat16", "float16"):
        values["param_dtype"] = dtype
    cfg = ModernBertConfig(**values)  # validates all but the RoPE schedules
    schedules = {}
    for name, (kind, (theta, schedule)) in zip(("global", "local"), rope.items()):
        try:
            frequencies(parse_schedule(schedule), theta, cfg.head_dim, cfg.max_position_embeddings)
        except ValueError as e:
            raise ValueError(f"HF config: rope_parameters[{kind!r}]: {e}") from None
        schedules[f"{name}_rope_scaling"] = schedule
    return cfg.replace(**schedules)


def config_to_hf(
    cfg: ModernBertConfig, heads=("mlm",), num_labels: int = 0, hf_class: str | None = None
) -> dict[str, Any]:
    """A config.json dict that transformers' ModernBertConfig loads (new and legacy keys), for
    the class holding ``heads`` (``hf_class`` where it is one of several, see
    :func:`hf_architecture`); ``num_labels`` > 0 writes id2label/label2id."""
    every = cfg.global_attn_every_n_layers
    hf: dict[str, Any] = {
        "architectures": [hf_architecture(heads, hf_class)],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "hidden_activation": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range,
        "norm_eps": cfg.norm_eps,
        "norm_bias": cfg.norm_bias,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": cfg.attention_dropout,
        "embedding_dropout": cfg.hidden_dropout,
        "mlp_dropout": cfg.hidden_dropout,
        "classifier_dropout": cfg.hidden_dropout,
        "mlp_bias": cfg.mlp_bias,
        "decoder_bias": cfg.decoder_bias,
        "classifier_bias": cfg.classifier_bias,
        "classifier_activation": cfg.classifier_activation,
        "classifier_pooling": cfg.classifier_pooling,
        "local_attention": cfg.local_attention,
        "global_attn_every_n_layers": every,
        "global_rope_theta": cfg.global_rope_theta,
        "local_rope_theta": cfg.local_rope_theta,
        "layer_types": [
            "full_attention" if cfg.is_global(i) else "sliding_attention"
            for i in range(cfg.num_layers)
        ],
        "rope_parameters": {
            "full_attention": {
                "rope_type": "default",
                **parse_schedule(cfg.global_rope_scaling),
                "rope_theta": cfg.global_rope_theta,
            },
            "sliding_attention": {
                "rope_type": "default",
                **parse_schedule(cfg.local_rope_scaling),
                "rope_theta": cfg.local_rope_theta,
            },
        },
        "pad_token_id": cfg.pad_token_id,
        "cls_token_id": cfg.cls_token_id,
        "sep_token_id": cfg.sep_token_id,
        "bos_token_id": cfg.cls_token_id,
        "eos_token_id": cfg.sep_token_id,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "dtype": cfg.param_dtype,
    }
    hf.update(hf_table.label_maps(num_labels))
    return hf


def hf_architecture(heads, hf_class: str | None = None) -> str:
    """The transformers class whose state dict holds exactly ``heads``: ``hf_class`` when it
    holds them (ModernBertForMultipleChoice has the heads of a sequence classifier)."""
    if hf_class is not None and _SAME_HEADS.get(hf_class) == frozenset(heads):
        return hf_class
    arch = _ARCHITECTURES.get(frozenset(heads))
    if arch is None:
        raise ValueError(
            f"no Hugging Face ModernBERT class holds exactly the heads {sorted(heads)}; "
            f"supported: {[sorted(h) for h in _ARCHITECTURES]}"
        )
    return arch


def heads_of_class(hf_class: str | None, names) -> tuple[str, ...] | None:
    """The heads of a transformers ModernBERT class named in config.json, where its state-dict
    ``names`` have ``head.*`` or ``classifier.*`` (None: unknown class, decide by names)."""
    if not any(n.startswith(tuple(_HEAD_TENSORS)) for n in names):
        return None
    table = {v: k for k, v in _ARCHITECTURES.items()} | _SAME_HEADS
    heads = table.get(hf_class or "")
    return None if heads is None else tuple(h for h in HEADS if h in heads)


# ---------------------------------------------------------------------------------------------
# The name table
# ---------------------------------------------------------------------------------------------
def _entries(cfg: ModernBertConfig, heads, num_labels: int) -> list[tuple[str, str, str, tuple]]:
    """(bertjax path, HF name, transform, bertjax shape) of the encoder and the given heads."""
    h, n, d, i, v = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
    )
    table = hf_table.Table()
    add, linear = table.add, table.linear

    def norm(path, name):
        add(f"{path}/scale", f"{name}.weight", "copy", (h,))
        if cfg.norm_bias:
            add(f"{path}/bias", f"{name}.bias", "copy", (h,))

    add("model/embeddings/word_embeddings/embedding", _WORDS, "copy", (v, h))
    norm("model/embeddings/norm", "model.embeddings.norm")
    for layer in range(cfg.num_layers):
        src, dst = f"model.layers.{layer}", f"model/layer_{layer}"
        if layer:
            norm(f"{dst}/attn_norm", f"{src}.attn_norm")
        linear(f"{dst}/attn/Wqkv", f"{src}.attn.Wqkv", (h, 3, n, d), cfg.attention_bias)
        linear(f"{dst}/attn/Wo", f"{src}.attn.Wo", (n, d, h), cfg.attention_bias, "linear_heads", 2)
        norm(f"{dst}/mlp_norm", f"{src}.mlp_norm")
        linear(f"{dst}/mlp/Wi", f"{src}.mlp.Wi", (h, 2, i), cfg.mlp_bias)
        linear(f"{dst}/mlp/Wo", f"{src}.mlp.Wo", (i, h), cfg.mlp_bias)
    norm("model/final_norm", "model.final_norm")
    if "pooler" in heads:
        linear("model/pooler/dense", "head.dense", (h, h), cfg.classifier_bias)
        norm("model/pooler/norm", "head.norm")
    if "token_head" in heads:
        linear("head/dense", "head.dense", (h, h), cfg.classifier_bias)
        norm("head/norm", "head.norm")
    if "qa" in heads:
        linear("qa_outputs", "classifier", (h, 2), True)
    if "mlm" in heads:
        linear("predictions/dense", "head.dense", (h, h), cfg.classifier_bias)
        norm("predictions/norm", "head.norm")
        if cfg.decoder_bias:
            add("predictions/output_bias", "decoder.bias", "copy", (v,))
        if not cfg.tie_word_embeddings:
            add("predictions/decoder", _TIED, "copy", (v, h))
    if "classifier" in heads and num_labels > 0:
        linear("classifier", "classifier", (h, num_labels), True)
    return table.rows


def hf_names(
    cfg: ModernBertConfig, heads=("mlm",), num_labels: int = 0
) -> list[tuple[str, str, str]]:
    """(bertjax flat path, HF state-dict name, transform) for the encoder plus ``heads`` (among
    pooler, mlm, classifier; the classifier only with ``num_labels`` > 0). HF names carry the
    ``model.`` prefix of the task classes; the tied ``decoder.weight`` is not listed."""
    unknown = sorted(set(heads) - set(HEADS))
    if unknown:
        raise ValueError(f"unknown heads {unknown}; known: {list(HEADS)}")
    for prefix, owners in _HEAD_TENSORS.items():
        both = [h for h in owners if h in heads]
        if len(both) > 1:
            raise ValueError(
                f"heads {both} are all HF's {prefix}*: no ModernBERT class holds them together"
            )
    return [
        (path, name, transform) for path, name, transform, _ in _entries(cfg, heads, num_labels)
    ]


def from_hf_tensors(
    cfg: ModernBertConfig,
    named: dict[str, np.ndarray],
    source: str,
    architecture: str | None = None,
) -> tuple[dict[str, np.ndarray], tuple[str, ...]]:
    """A transformers ModernBERT state dict (NumPy) -> (flat bertjax tensors, heads present).

    Names of a bare ModernBertModel (no ``model.`` prefix) are accepted. ``architecture`` (the
    class in config.json) says what ``head.*`` and ``classifier.*`` are (see
    :func:`heads_of_class`); without a known class, heads are told apart by ``decoder.*`` (mlm)
    and ``classifier.*`` (pooler + classifier), and ``head.*`` alone (a masked-LM checkpoint
    without decoder bias, its tied decoder dropped) is the mlm head. A ``decoder.weight`` must equal
    the token embeddings. Raises one ValueError naming ``source`` that lists every missing,
    unexpected and mis-shaped tensor.
    """
    state = {}
    for name, value in named.items():
        state["model." + name if name.startswith(_ENCODER_PREFIXES) else name] = np.asarray(value)
    tied = _TIED in state and cfg.tie_word_embeddings
    if tied:
        hf_table.untie(state, _TIED, _WORDS, source)
    has_head = any(k.startswith("head.") for k in state)
    has_decoder = tied or any(k.startswith("decoder.") for k in state)
    has_classifier = any(k.startswith("classifier.") for k in state)
    heads: tuple[str, ...] = ()
    by_class = heads_of_class(architecture, state)
    if by_class is not None and not has_decoder:  # classifier.* may be absent (head.* only)
        heads = tuple(
            h for h in by_class if has_classifier or h not in _HEAD_TENSORS["classifier."]
        )
    elif has_decoder or (has_head and not has_classifier):
        heads = ("mlm",)
    elif has_classifier:
        heads = ("pooler", "classifier")
    labels = state.get("classifier.weight", state.get("classifier.bias"))
    num_labels = int(labels.shape[0]) if labels is not None and labels.ndim else 0
    what = f"{source}: ModernBERT checkpoint (heads {list(heads)}) does not match its config"
    flat = hf_table.read(_entries(cfg, heads, num_labels), state, what)
    return flat, heads


def to_hf_tensors(
    cfg: ModernBertConfig, flat: dict[str, np.ndarray], heads, hf_class: str | None = None
) -> dict[str, np.ndarray]:
    """Flat bertjax tensors -> the state dict of :func:`hf_architecture` (``heads``): unprefixed
    names for a bare ModernBertModel, ``model.`` ones with heads, and the tied ``decoder.weight``
    with the mlm head (ModernBertForMaskedLM's state dict holds it)."""
    classifier = flat.get("classifier/kernel")
    num_labels = int(classifier.shape[-1]) if classifier is not None else 0
    arch = hf_architecture(heads, hf_class)
    out = hf_table.write(_entries(cfg, heads, num_labels), flat, "to_hf_tensors")
    if "mlm" in heads and cfg.tie_word_embeddings:
        out[_TIED] = out[_WORDS]
    if arch == "ModernBertModel":
        out = {k.removeprefix("model."): a for k, a in out.items()}
    return out


# ---------------------------------------------------------------------------------------------
# Directories (config.json + model.safetensors)
# ---------------------------------------------------------------------------------------------
def write_hf_dir(
    path: str, cfg: ModernBertConfig, flat: dict[str, np.ndarray], heads, hf_class=None
) -> None:
    """Writes config.json + model.safetensors that transformers' ``from_pretrained`` loads, as
    the class holding ``heads`` (``hf_class`` where several do, see :func:`hf_architecture`)."""
    classifier = flat.get("classifier/kernel")
    num_labels = int(classifier.shape[-1]) if classifier is not None else 0
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(cfg, heads, num_labels, hf_class), f, indent=2, sort_keys=True)
    state = to_hf_tensors(cfg, flat, heads, hf_class)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
