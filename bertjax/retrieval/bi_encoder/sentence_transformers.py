"""sentence-transformers model directories (``--from`` / ``--to=sentence-transformers``).

Such a directory lists its modules in ``modules.json``: a ``Transformer`` (a Hugging Face
BERT or ModernBERT directory, usually the root itself, with ``sentence_bert_config.json``:
``max_seq_length``, ``do_lower_case``), a ``Pooling`` (``1_Pooling/config.json``), optional
``Dense`` layers (``config.json`` + ``model.safetensors`` / ``pytorch_model.bin``) and an optional
final ``Normalize``; ``config_sentence_transformers.json`` holds the prompts. Reading gives the
HF loader's :class:`Checkpoint` with :class:`EmbeddingSettings` in ``embedding``; writing stores
the bare encoder through the HF writer and these files beside it, in the layout every
sentence-transformers release since 3.0 loads (legacy module type names and pooling keys).

A checkpoint without settings is written as sentence-transformers wraps a plain HF model: mean
pooling, no Dense, no Normalize, ``max_seq_length`` = the position table.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from bertjax.convert.checkpoint import Checkpoint, fmt_shape, read_json_object
from bertjax.convert.hf import bare_encoder, load_hf, read_safetensors, read_torch_file, write_hf
from bertjax.retrieval.bi_encoder.embedding import EmbeddingSettings
from bertjax.retrieval.bi_encoder.pooling import POOLING_MODES, DenseLayer, EmbeddingHead

MODULES = "modules.json"
SBERT_CONFIG = "sentence_bert_config.json"
ST_CONFIG = "config_sentence_transformers.json"
TOKENIZER_JSON = "tokenizer.json"
# sentence-transformers' legacy pooling keys, in its concatenation order
_LEGACY_POOLING = (
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_max_tokens", "max"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len_tokens"),
    ("pooling_mode_weightedmean_tokens", "weightedmean"),
    ("pooling_mode_lasttoken", "lasttoken"),
)
# torch.nn activation class -> bertjax.layers.core activation name (and back, with the module)
_ACTIVATIONS = {
    "Tanh": ("tanh", "torch.nn.modules.activation.Tanh"),
    "Identity": ("linear", "torch.nn.modules.linear.Identity"),
    "GELU": ("gelu", "torch.nn.modules.activation.GELU"),
    "ReLU": ("relu", "torch.nn.modules.activation.ReLU"),
    "Sigmoid": ("sigmoid", "torch.nn.modules.activation.Sigmoid"),
    "SiLU": ("silu", "torch.nn.modules.activation.SiLU"),
    "LeakyReLU": ("leaky_relu", "torch.nn.modules.activation.LeakyReLU"),
    "ReLU6": ("relu6", "torch.nn.modules.activation.ReLU6"),
    "Hardswish": ("hardswish", "torch.nn.modules.activation.Hardswish"),
    "Mish": ("mish", "torch.nn.modules.activation.Mish"),
}
_MODULE_TYPES = {
    "Transformer": "sentence_transformers.models.Transformer",
    "Pooling": "sentence_transformers.models.Pooling",
    "Dense": "sentence_transformers.models.Dense",
    "Normalize": "sentence_transformers.models.Normalize",
}


def is_sentence_transformers_dir(path: str) -> bool:
    """Whether ``path`` is a sentence-transformers model directory (has modules.json)."""
    return os.path.isfile(os.path.join(path, MODULES))


def _modules(directory: str) -> list[tuple[str, str]]:
    """[(kind, folder)] of modules.json: Transformer, Pooling, Dense..., (Normalize)."""
    path = os.path.join(directory, MODULES)
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the module list ({e})") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{path}: not a JSON list of modules")
    out = []
    for entry in sorted(entries, key=lambda e: e.get("idx", 0)):
        kind = str(entry.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _MODULE_TYPES:
            raise ValueError(
                f"{path}: module type {entry.get('type')!r} is not supported (bertjax reads "
                f"{', '.join(_MODULE_TYPES)})"
            )
        out.append((kind, os.path.join(directory, entry.get("path") or "")))
    kinds = [k for k, _ in out]
    ok = kinds[:2] == ["Transformer", "Pooling"] and all(k == "Dense" for k in kinds[2:-1])
    ok = ok and (len(kinds) == 2 or kinds[-1] in ("Dense", "Normalize"))
    if not ok:
        raise ValueError(
            f"{path}: modules {kinds} are not Transformer, Pooling, Dense... and an optional final "
            "Normalize"
        )
    return out


def _pooling(folder: str, hidden_size: int) -> tuple[tuple[str, ...], bool]:
    """(pooling modes, include_prompt) of a Pooling module's config.json (new or legacy keys)."""
    path = os.path.join(folder, "config.json")
    values = read_json_object(path, "pooling config")
    mode = values.get("pooling_mode")
    if mode is None:
        mode = [m for key, m in _LEGACY_POOLING if values.get(key)] or ["mean"]
    modes = (mode,) if isinstance(mode, str) else tuple(mode)
    bad = [m for m in modes if m not in POOLING_MODES]
    if bad:
        raise ValueError(f"{path}: pooling_mode {bad} is not one of {POOLING_MODES}")
    width = values.get("embedding_dimension", values.get("word_embedding_dimension", hidden_size))
    if width != hidden_size:
        raise ValueError(
            f"{path}: embedding_dimension={width} but the encoder's hidden_size is {hidden_size}"
        )
    return modes, bool(values.get("include_prompt", True))


def read_dense(
    folder: str,
    index: int,
    *,
    default_activation: str = "torch.nn.modules.activation.Tanh",
    activations: dict = _ACTIVATIONS,
    check_io_names: bool = True,
) -> tuple[DenseLayer, dict[str, np.ndarray]]:
    """A Dense module (sentence-transformers' or PyLate's): its layer and weights as bertjax
    tensors (``dense_{index}/...``). ``default_activation`` applies where the config names none;
    ``activations``: the torch.nn classes accepted; ``check_io_names``: only a module reading and
    writing ``sentence_embedding`` is read."""
    path = os.path.join(folder, "config.json")
    values = read_json_object(path, "Dense config")
    for key in ("module_input_name", "module_output_name") if check_io_names else ():
        if values.get(key, "sentence_embedding") not in (None, "sentence_embedding"):
            raise ValueError(f"{path}: {key}={values[key]!r} (only sentence_embedding is read)")
    torch_name = str(values.get("activation_function", default_activation))
    act = activations.get(torch_name.rsplit(".", 1)[-1])
    if act is None or not torch_name.startswith("torch."):
        raise ValueError(
            f"{path}: activation_function={torch_name!r} is not one of torch.nn's "
            f"{sorted(activations)}"
        )
    try:
        layer = DenseLayer(
            int(values["in_features"]),
            int(values["out_features"]),
            bool(values.get("bias", True)),
            act[0],
            bool(values.get("use_residual", False)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: bad Dense config ({type(e).__name__}: {e})") from None
    weights = os.path.join(folder, "model.safetensors")
    if os.path.isfile(weights):
        state = read_safetensors(weights)
    elif os.path.isfile(os.path.join(folder, "pytorch_model.bin")):
        weights = os.path.join(folder, "pytorch_model.bin")
        state = read_torch_file(weights)
    else:
        raise FileNotFoundError(f"{folder}: Dense module without model.safetensors")
    shape = (layer.out_features, layer.in_features)
    wanted = {"linear.weight": (f"dense_{index}/kernel", shape)}
    if layer.bias:
        wanted["linear.bias"] = (f"dense_{index}/bias", (layer.out_features,))
    if layer.residual and layer.in_features != layer.out_features:
        wanted["residual.weight"] = (f"dense_{index}_residual/kernel", shape)
    if set(state) != set(wanted):
        raise ValueError(f"{weights}: tensors {sorted(state)}, expected {sorted(wanted)}")
    tensors = {}
    for name, (target, want) in wanted.items():
        if tuple(state[name].shape) != want:
            raise ValueError(
                f"{weights}: {name} has shape {fmt_shape(state[name].shape)}, the config implies "
                f"{fmt_shape(want)}"
            )
        value = np.asarray(state[name], np.float32)
        tensors[target] = np.ascontiguousarray(value.T) if value.ndim == 2 else value
    return layer, tensors


def write_dense(
    folder: str,
    layer: DenseLayer,
    tensors: dict[str, np.ndarray],
    index: int,
    source: str,
    *,
    activations: dict = _ACTIVATIONS,
    residual_key_always: bool = False,
) -> None:
    """Writes Dense layer ``index`` (``tensors``: bertjax's ``dense_{index}/...``) as a Dense
    module folder: ``config.json`` (``use_residual`` only when set, unless
    ``residual_key_always``) and ``model.safetensors``."""
    torch_names = {name: path for name, path in activations.values()}
    if layer.activation not in torch_names:
        raise ValueError(
            f"{source}: Dense activation {layer.activation!r} has no torch.nn module; "
            f"choose from {sorted(torch_names)}"
        )
    config = {
        "in_features": layer.in_features,
        "out_features": layer.out_features,
        "bias": layer.bias,
        "activation_function": torch_names[layer.activation],
    }
    if layer.residual or residual_key_always:
        config["use_residual"] = layer.residual
    _write_json(os.path.join(folder, "config.json"), config)
    state = {"linear.weight": tensors[f"dense_{index}/kernel"].T}
    if layer.bias:
        state["linear.bias"] = tensors[f"dense_{index}/bias"]
    if f"dense_{index}_residual/kernel" in tensors:
        state["residual.weight"] = tensors[f"dense_{index}_residual/kernel"].T
    state = {k: np.ascontiguousarray(v, np.float32) for k, v in state.items()}
    save_file(state, os.path.join(folder, "model.safetensors"))


def _optional_json(path: str, what: str) -> dict:
    return read_json_object(path, what) if os.path.isfile(path) else {}


def _max_seq_length(folder: str, sbert: dict, config: Any) -> int:
    """``max_seq_length`` of sentence_bert_config.json, else the tokenizer's
    ``model_max_length``, capped by the position table (as sentence-transformers decides)."""
    table = config.max_position_embeddings
    if sbert.get("max_seq_length") is not None:
        return int(sbert["max_seq_length"])
    path = os.path.join(folder, "tokenizer_config.json")
    limit = None
    if os.path.isfile(path):
        limit = read_json_object(path, "tokenizer config").get("model_max_length")
    return min(int(limit), table) if isinstance(limit, (int, float)) else table


def cross_encoder_folder(directory: str) -> str | None:
    """The Transformer folder of a ``CrossEncoder(...).save()`` directory (sentence-transformers
    6: modules.json lists one Transformer whose ``transformer_task`` is sequence-classification);
    None for any other directory."""
    try:
        with open(os.path.join(directory, MODULES), encoding="utf-8") as f:
            entries = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(entries, list) or len(entries) != 1 or not isinstance(entries[0], dict):
        return None
    if str(entries[0].get("type", "")).rsplit(".", 1)[-1] != "Transformer":
        return None
    folder = os.path.join(directory, entries[0].get("path") or "")
    sbert = _optional_json(os.path.join(folder, SBERT_CONFIG), "sentence-transformers config")
    return folder if sbert.get("transformer_task") == "sequence-classification" else None


def load_sentence_transformers(directory: str) -> Checkpoint:
    """Reads a sentence-transformers directory: the HF checkpoint of its Transformer module with
    :class:`EmbeddingSettings` in ``embedding``; the tokenizer is its tokenizer.json when there
    is one (what sentence-transformers runs), else the vocabulary file beside it."""
    cross_encoder = cross_encoder_folder(directory)
    if (
        cross_encoder is not None
    ):  # the HF sequence classifier it wraps (bertjax.retrieval.reranker.rerank)
        ckpt = load_hf(cross_encoder)
        if os.path.isfile(os.path.join(cross_encoder, TOKENIZER_JSON)):
            ckpt.vocab_file = os.path.join(cross_encoder, TOKENIZER_JSON)
            ckpt.do_lower_case = None
        return ckpt
    modules = _modules(directory)
    folder = modules[0][1]
    ckpt = load_hf(folder)
    tokenizer_json = os.path.join(folder, TOKENIZER_JSON)
    if os.path.isfile(tokenizer_json):
        ckpt.vocab_file, ckpt.do_lower_case = tokenizer_json, None  # its normalizer decides
    hidden = ckpt.config.hidden_size
    sbert_path = os.path.join(folder, SBERT_CONFIG)
    sbert = _optional_json(sbert_path, "sentence-transformers config")
    task = sbert.get("transformer_task", "feature-extraction")
    if task != "feature-extraction":
        raise ValueError(f"{sbert_path}: transformer_task={task!r} is not feature-extraction")
    modes, include_prompt = _pooling(modules[1][1], hidden)
    dense, tensors = [], {}
    for kind, module_folder in modules[2:]:
        if kind == "Dense":
            layer, weights = read_dense(module_folder, len(dense))
            dense.append(layer)
            tensors.update(weights)
    head = EmbeddingHead(modes, include_prompt, tuple(dense), modules[-1][0] == "Normalize")
    head.dimension(hidden)  # Dense widths chain
    st_path = os.path.join(directory, ST_CONFIG)
    st = _optional_json(st_path, "sentence-transformers config")
    prompts = st.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ValueError(f"{st_path}: prompts is not an object of strings")
    ckpt.embedding = EmbeddingSettings(
        head=head,
        tensors=tensors,
        max_seq_length=_max_seq_length(folder, sbert, ckpt.config),
        do_lower_case=bool(sbert.get("do_lower_case", False)),
        prompts=dict(prompts),
        default_prompt_name=st.get("default_prompt_name"),
        similarity_fn_name=st.get("similarity_fn_name"),
    )
    ckpt.embedding.resolve_prompt(None, None, st_path)  # the default prompt name exists
    return ckpt


def with_pooling(settings: EmbeddingSettings | None, mode: str) -> EmbeddingSettings:
    """``settings`` (default: mean pooling, nothing else) pooling by ``mode`` alone."""
    settings = settings or EmbeddingSettings()
    if len(settings.head.pooling) != 1 and settings.head.dense:
        raise ValueError(
            f"--pooling={mode}: the model concatenates {list(settings.head.pooling)} before its "
            "Dense layer; one mode would change its input width"
        )
    head = dataclasses.replace(settings.head, pooling=(mode,))
    return dataclasses.replace(settings, head=head)


def set_pooling(ckpt: Checkpoint, mode: str) -> None:
    """``convert --to=sentence-transformers --pooling=MODE``: the checkpoint pools by ``mode``."""
    ckpt.embedding = with_pooling(ckpt.embedding, mode)


def _write_json(path: str, value: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, sort_keys=True)


def write_sentence_transformers(ckpt: Checkpoint, directory: str) -> None:
    """Writes the bare encoder (HF writer) and the sentence-transformers files of
    ``ckpt.embedding`` (mean pooling when None); the tokenizer files come from ``save_checkpoint``."""
    settings = ckpt.embedding or EmbeddingSettings()
    head, hidden = settings.head, ckpt.config.hidden_size
    head.dimension(hidden)
    write_hf(bare_encoder(ckpt), directory)
    modules = [("Transformer", ""), ("Pooling", "1_Pooling")]
    pooling = {"word_embedding_dimension": hidden, "include_prompt": head.include_prompt}
    for key, mode in _LEGACY_POOLING:
        pooling[key] = mode in head.pooling
    if list(head.pooling) != [m for _, m in _LEGACY_POOLING if m in head.pooling]:
        pooling = {
            "embedding_dimension": hidden,
            "pooling_mode": list(head.pooling),
            "include_prompt": head.include_prompt,
        }
    _write_json(os.path.join(directory, "1_Pooling", "config.json"), pooling)
    for i, layer in enumerate(head.dense):
        folder = f"{len(modules)}_Dense"
        modules.append(("Dense", folder))
        write_dense(os.path.join(directory, folder), layer, settings.tensors, i, ckpt.source)
    if head.normalize:
        modules.append(("Normalize", f"{len(modules)}_Normalize"))  # no files of its own
    listing = [
        {"idx": i, "name": str(i), "path": folder, "type": _MODULE_TYPES[kind]}
        for i, (kind, folder) in enumerate(modules)
    ]
    with open(os.path.join(directory, MODULES), "w", encoding="utf-8") as f:
        json.dump(listing, f, indent=2)
    max_len = settings.max_seq_length or ckpt.config.max_position_embeddings
    _write_json(
        os.path.join(directory, SBERT_CONFIG),
        {"max_seq_length": max_len, "do_lower_case": settings.do_lower_case},
    )
    _write_json(
        os.path.join(directory, ST_CONFIG),
        {
            "prompts": settings.prompts,
            "default_prompt_name": settings.default_prompt_name,
            "similarity_fn_name": settings.similarity_fn_name or "cosine",
        },
    )
