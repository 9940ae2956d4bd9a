"""Name tables between bertjax parameters and transformers state dicts (NumPy only), for the
architectures whose converter is one table (``modernbert_hf``, ``eurobert_hf``,
``nomicbert_hf``, ``gte_hf``), the rows of the encoder NomicBERT and GTE share, and the RoPE
settings of their config.json.

A table row is ``(bertjax path, HF state-dict name, transform, bertjax shape)``; the transform
says how the array is laid out on each side:

* ``copy``: the same array (embeddings, norms, 1-D biases);
* ``flatten``: a bias [*out] in bertjax, flat [prod(out)] in HF (attention biases [heads, kv]);
* ``linear``: a kernel [in, *out] in bertjax, a torch Linear weight [prod(out), in] in HF;
* ``linear_heads``: a kernel [heads, kv, out] in bertjax (attention output), [out, heads*kv] in HF.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from bertjax.convert.checkpoint import fmt_shape, listing, mismatch_report
from bertjax.layers.core import ACTIVATIONS
from bertjax.layers.rope import parse_schedule, schedule_json

Row = tuple[str, str, str, tuple]


class Table:
    """Collects the rows of one model (``add``, ``linear`` for a kernel with its bias)."""

    def __init__(self):
        self.rows: list[Row] = []

    def add(self, path: str, name: str, transform: str, shape) -> None:
        self.rows.append((path, name, transform, tuple(shape)))

    def norm(self, path: str, name: str, size: int) -> None:
        """A LayerNorm ``path/{scale,bias}`` [size] (HF ``name.{weight,bias}``)."""
        self.add(f"{path}/scale", f"{name}.weight", "copy", (size,))
        self.add(f"{path}/bias", f"{name}.bias", "copy", (size,))

    def linear(self, path, name, shape, bias: bool, transform="linear", bias_from=1) -> None:
        """A kernel ``path/kernel`` [*shape] (HF ``name.weight``) and, with ``bias``, its bias
        [*shape[bias_from:]] (HF ``name.bias``, flattened when it has more than one axis)."""
        self.add(f"{path}/kernel", f"{name}.weight", transform, shape)
        if bias:
            out_shape = shape[bias_from:]
            self.add(
                f"{path}/bias",
                f"{name}.bias",
                "flatten" if len(out_shape) > 1 else "copy",
                out_shape,
            )


def post_norm_encoder(table: Table, cfg, prefix: str, attention_bias: bool, down_bias: bool):
    """Adds the rows of a ``bertjax.layers.blocks.PostNormEncoder`` (NomicBERT, GTE) without its
    pooler under ``prefix`` (bertjax's encoder name and transformers' ``base_model_prefix``):
    the embeddings (token types where ``cfg.type_vocab_size`` > 0) and every layer, with biases
    on the attention projections and on ``down_proj`` as the flags say."""
    h, n, d = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    i, v = cfg.intermediate_size, cfg.vocab_size
    emb = f"{prefix}.embeddings"
    table.add(
        f"{prefix}/embeddings/word_embeddings/embedding",
        f"{emb}.word_embeddings.weight",
        "copy",
        (v, h),
    )
    if cfg.type_vocab_size:
        types = (cfg.type_vocab_size, h)
        table.add(
            f"{prefix}/embeddings/token_type_embeddings/embedding",
            f"{emb}.token_type_embeddings.weight",
            "copy",
            types,
        )
    table.norm(f"{prefix}/embeddings/LayerNorm", f"{emb}.LayerNorm", h)
    for layer in range(cfg.num_layers):
        src, dst = f"{prefix}.layers.{layer}", f"{prefix}/layer_{layer}"
        for proj in ("q_proj", "k_proj", "v_proj"):
            table.linear(
                f"{dst}/self_attn/{proj}", f"{src}.self_attn.{proj}", (h, n, d), attention_bias
            )
        table.linear(
            f"{dst}/self_attn/o_proj",
            f"{src}.self_attn.o_proj",
            (n, d, h),
            attention_bias,
            "linear_heads",
            bias_from=2,
        )
        table.norm(f"{dst}/post_attention_layernorm", f"{src}.post_attention_layernorm", h)
        table.linear(f"{dst}/mlp/gate_proj", f"{src}.mlp.gate_proj", (h, i), False)
        table.linear(f"{dst}/mlp/up_proj", f"{src}.mlp.up_proj", (h, i), False)
        table.linear(f"{dst}/mlp/down_proj", f"{src}.mlp.down_proj", (i, h), down_bias)
        table.norm(f"{dst}/post_mlp_layernorm", f"{src}.post_mlp_layernorm", h)


# config.json of the PostNormEncoder families (NomicBERT, GTE): (bertjax field, HF key)
POST_NORM_KEYS = (
    ("vocab_size", "vocab_size"),
    ("hidden_size", "hidden_size"),
    ("num_layers", "num_hidden_layers"),
    ("num_heads", "num_attention_heads"),
    ("intermediate_size", "intermediate_size"),
    ("hidden_act", "hidden_act"),
    ("hidden_dropout", "hidden_dropout_prob"),
    ("attention_dropout", "attention_probs_dropout_prob"),
    ("max_position_embeddings", "max_position_embeddings"),
    ("type_vocab_size", "type_vocab_size"),
    ("initializer_range", "initializer_range"),
    ("layer_norm_eps", "layer_norm_eps"),
    ("tie_word_embeddings", "tie_word_embeddings"),
    ("pad_token_id", "pad_token_id"),
    ("bos_token_id", "bos_token_id"),
    ("eos_token_id", "eos_token_id"),
)
_TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id")


def post_norm_values(hf: dict[str, Any], default) -> dict[str, Any]:
    """The config fields of :data:`POST_NORM_KEYS` (and ``param_dtype``) that a config.json
    gives, ``default``'s (a config) where it has none; RoPE is the caller's."""
    values = {
        field: hf.get(key, getattr(default, field))
        for field, key in POST_NORM_KEYS
        if key not in _TOKEN_KEYS
    }
    values["num_layers"] = int(values["num_layers"])
    for field in ("hidden_dropout", "attention_dropout"):
        values[field] = float(values[field] or 0.0)
    values["tie_word_embeddings"] = bool(values["tie_word_embeddings"])
    values.update({key: getattr(default, key) for key in _TOKEN_KEYS})
    values.update(metadata(hf, _TOKEN_KEYS))
    return values


def post_norm_config(cfg, model_type: str, hf_class: str, num_labels: int) -> dict[str, Any]:
    """The config.json of a PostNormEncoder family's ``cfg`` as transformers' class ``hf_class``
    of ``model_type``; ``num_labels`` > 0 writes id2label/label2id."""
    hf: dict[str, Any] = {"architectures": [hf_class], "model_type": model_type}
    hf.update({key: getattr(cfg, field) for field, key in POST_NORM_KEYS})
    hf.update(rope_parameters=rope_parameters(cfg), dtype=cfg.param_dtype)
    hf.update(label_maps(num_labels))
    return hf


def check_derived(hf: dict[str, Any], family: str, default_act: str) -> None:
    """ValueError naming the key: a ``head_dim`` that is not hidden_size // num_attention_heads
    (bertjax derives it) or a ``hidden_act`` bertjax does not have."""
    hidden, heads = hf.get("hidden_size", 768), hf.get("num_attention_heads", 12)
    if hf.get("head_dim") not in (None, hidden // max(heads, 1)):
        raise ValueError(
            f"HF config: head_dim={hf['head_dim']} is not hidden_size // num_attention_heads "
            f"(bertjax's {family} derives it)"
        )
    if hf.get("hidden_act", default_act) not in ACTIVATIONS:
        raise ValueError(f"HF config: hidden_act={hf['hidden_act']!r} is not one of {ACTIVATIONS}")


def hf_shape(transform: str, shape: tuple) -> tuple:
    """The HF shape of a bertjax array of ``shape`` under ``transform``."""
    if transform == "flatten":
        return (math.prod(shape),)
    if transform == "linear":
        return (math.prod(shape[1:]), shape[0])
    if transform == "linear_heads":
        return (shape[2], shape[0] * shape[1])
    return shape


def to_hf(x: np.ndarray, transform: str) -> np.ndarray:
    """A bertjax array in HF layout."""
    if transform == "flatten":
        return x.reshape(-1)
    if transform in ("linear", "linear_heads"):
        lead = 1 if transform == "linear" else 2
        return np.ascontiguousarray(x.reshape(math.prod(x.shape[:lead]), -1).T)
    return x


def from_hf(x: np.ndarray, transform: str, shape: tuple) -> np.ndarray:
    """Inverse of :func:`to_hf` (``shape``: the bertjax shape)."""
    if transform in ("linear", "linear_heads"):
        x = x.T
    return np.ascontiguousarray(x.reshape(shape))


def read(rows: list[Row], state: dict[str, np.ndarray], what: str) -> dict[str, np.ndarray]:
    """Flat bertjax tensors from an HF ``state`` holding exactly the ``rows``' names. Raises one
    ValueError starting with ``what`` that lists every missing, unexpected and mis-shaped tensor
    with its shape."""
    wanted = {name: (path, tf, shape) for path, name, tf, shape in rows}
    missing = [
        f"{k} {fmt_shape(hf_shape(tf, s))}" for k, (_, tf, s) in wanted.items() if k not in state
    ]
    extra = [f"{k} {fmt_shape(a.shape)}" for k, a in state.items() if k not in wanted]
    bad = [
        f"{k} {fmt_shape(state[k].shape)} (config implies {fmt_shape(hf_shape(tf, s))})"
        for k, (_, tf, s) in wanted.items()
        if k in state and tuple(state[k].shape) != hf_shape(tf, s)
    ]
    report = mismatch_report(missing, extra, bad)
    if report:
        raise ValueError(f"{what}: {report}")
    return {path: from_hf(state[k], tf, s) for k, (path, tf, s) in wanted.items()}


def read_heads(state: dict[str, np.ndarray], head_prefixes: dict[str, str], rows, what: str):
    """(flat bertjax tensors, heads present) of an HF ``state``: the heads with a name starting
    with their prefix (``head_prefixes``: head -> prefix, in the heads' order), read through
    ``rows(heads, num_labels)`` (the number of labels is the classifier's); :func:`read`'s one
    ValueError starts with ``what`` and the heads."""
    heads = tuple(
        head for head, prefix in head_prefixes.items() if any(k.startswith(prefix) for k in state)
    )
    labels = state.get("classifier.weight", state.get("classifier.bias"))
    num_labels = int(labels.shape[0]) if labels is not None and labels.ndim else 0
    what = f"{what} (heads {list(heads)}) does not match its config"
    return read(rows(heads, num_labels), state, what), heads


def write(rows: list[Row], flat: dict[str, np.ndarray], caller: str) -> dict[str, np.ndarray]:
    """The HF state dict of the ``rows`` from flat bertjax tensors (a missing one is an error
    naming ``caller``)."""
    missing = [path for path, *_ in rows if path not in flat]
    if missing:
        raise ValueError(f"{caller}: missing bertjax tensors {listing(missing)}")
    return {name: to_hf(np.asarray(flat[path]), tf) for path, name, tf, _ in rows}


def untie(state: dict, tied_name: str, words_name: str, source: str) -> None:
    """Drops ``tied_name`` (a decoder tied to the word embeddings) from ``state``, which must
    equal ``words_name``'s array: config.json says they are tied."""
    tied = state.pop(tied_name, None)
    if tied is None:
        return
    words = state.get(words_name)
    if words is None or tied.shape != words.shape or not np.array_equal(tied, words):
        raise ValueError(
            f"{source}: {tied_name} {fmt_shape(tied.shape)} is not tied to {words_name} although "
            "config.json has tie_word_embeddings=true"
        )


def rope_from_hf(hf: dict[str, Any], default_theta: float) -> tuple[float, str]:
    """(rope_theta, schedule JSON) of a config.json: ``rope_parameters`` (transformers 5) or the
    older top-level ``rope_theta`` + ``rope_scaling``; ``default_theta`` where neither says."""
    params = dict(hf.get("rope_parameters") or {})
    params.update(hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("yarn", "longrope", "llama3"):
        params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    return float(theta), schedule_json(params)


def with_rope(cfg, schedule: str):
    """``cfg`` (a ``bertjax.layers.rope.RopeConfig``) with the schedule of :func:`rope_from_hf`;
    one it cannot run is a ValueError naming ``rope_parameters``."""
    try:
        return cfg.replace(rope_scaling=schedule)
    except ValueError as e:
        raise ValueError(f"HF config: rope_parameters: {e}") from None


def rope_parameters(cfg) -> dict[str, Any]:
    """config.json's ``rope_parameters`` of a rotary config."""
    return {
        "rope_type": "default",
        **parse_schedule(cfg.rope_scaling),
        "rope_theta": cfg.rope_theta,
    }


def num_labels(flat: dict[str, np.ndarray]) -> int:
    """The classifier's number of labels in flat bertjax tensors (0 without a classifier)."""
    classifier = flat.get("classifier/kernel")
    return int(classifier.shape[-1]) if classifier is not None else 0


def write_dir(path: str, config: dict[str, Any], state: dict[str, np.ndarray]) -> None:
    """config.json + model.safetensors in ``path`` (created), as ``from_pretrained`` reads them."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def metadata(hf: dict[str, Any], token_keys) -> dict[str, Any]:
    """The special-token ids of ``token_keys`` that config.json has (None where null; the first
    of a list) and ``param_dtype`` from its ``dtype`` (or ``torch_dtype``), as config fields."""
    values: dict[str, Any] = {}
    for key in token_keys:
        if key in hf:
            value = hf[key][0] if isinstance(hf[key], list) and hf[key] else hf[key]
            values[key] = None if value in (None, []) else int(value)
    dtype = hf.get("dtype", hf.get("torch_dtype"))
    if dtype in ("float32", "bfloat16", "float16"):
        values["param_dtype"] = dtype
    return values


def label_maps(num_labels: int) -> dict[str, dict]:
    """config.json's ``id2label`` / ``label2id`` for ``num_labels`` classes (none for 0)."""
    if not num_labels:
        return {}
    return {
        "id2label": {str(i): f"LABEL_{i}" for i in range(num_labels)},
        "label2id": {f"LABEL_{i}": i for i in range(num_labels)},
    }


def class_holding(heads, classes: dict[frozenset, str], family: str) -> str:
    """The transformers class of ``classes`` (heads -> class) whose state dict holds exactly
    ``heads``; none is a one-line error naming the family's classes."""
    arch = classes.get(frozenset(heads))
    if arch is None:
        raise ValueError(
            f"no Hugging Face {family} class holds exactly the heads {sorted(heads)} "
            f"(transformers has {sorted(classes.values())}); export this run with --to=bertjax"
        )
    return arch
