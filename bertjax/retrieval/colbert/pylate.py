"""PyLate ColBERT directories (``--from`` / ``--to=pylate``).

PyLate saves a ColBERT model as a sentence-transformers directory without pooling: ``modules.json``
lists a ``Transformer`` (the Hugging Face encoder, usually the root, whose tokenizer holds the
added prefix tokens "[Q] " and "[D] ") and one or more ``pylate.models.Dense.Dense`` projections
(``config.json``: in/out features, bias, activation, use_residual; ``model.safetensors``:
``linear.weight``, ``linear.bias``, ``residual.weight``); ``config_sentence_transformers.json``
holds ``model_type: ColBERT`` and the settings (prefixes, query/document lengths, query expansion,
skiplist). Reading gives the HF loader's :class:`Checkpoint` with
:class:`~.late_interaction.LateInteractionSettings` in ``embedding``; PyLate's defaults fill
absent keys. Writing stores the bare encoder through the HF writer and these files
beside it, in the layout PyLate 1.x saves (sentence-transformers 6 loads it too).
"""

from __future__ import annotations

import json
import os

from bertjax.convert.checkpoint import Checkpoint, read_json_object
from bertjax.convert.hf import bare_encoder, load_hf, write_hf
from bertjax.retrieval.bi_encoder.sentence_transformers import read_dense, write_dense
from bertjax.retrieval.colbert.late_interaction import LateInteractionHead, LateInteractionSettings

MODULES = "modules.json"
ST_CONFIG = "config_sentence_transformers.json"
SBERT_CONFIG = "sentence_bert_config.json"
TRANSFORMER_TYPE = "sentence_transformers.models.Transformer"
DENSE_TYPE = "pylate.models.Dense.Dense"
SETTINGS_KEYS = (
    "query_prefix",
    "document_prefix",
    "query_length",
    "document_length",
    "do_query_expansion",
    "attend_to_expansion_tokens",
    "skiplist_words",
)
# torch.nn activation class <-> bertjax.layers.core activation name
_ACTIVATIONS = {
    "Identity": ("linear", "torch.nn.modules.linear.Identity"),
    "Tanh": ("tanh", "torch.nn.modules.activation.Tanh"),
    "GELU": ("gelu", "torch.nn.modules.activation.GELU"),
    "ReLU": ("relu", "torch.nn.modules.activation.ReLU"),
    "SiLU": ("silu", "torch.nn.modules.activation.SiLU"),
    "Sigmoid": ("sigmoid", "torch.nn.modules.activation.Sigmoid"),
}


def _listing(directory: str) -> list[dict]:
    path = os.path.join(directory, MODULES)
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the module list ({e})") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{path}: not a JSON list of modules")
    return sorted(entries, key=lambda e: e.get("idx", 0))


def is_pylate_dir(path: str) -> bool:
    """Whether ``path`` is a PyLate ColBERT directory: modules.json with a PyLate Dense module, or
    config_sentence_transformers.json saying ``model_type: ColBERT``."""
    if not os.path.isfile(os.path.join(path, MODULES)):
        return False
    try:
        types = [str(e.get("type", "")) for e in _listing(path)]
    except ValueError:
        return False
    if any(t.startswith("pylate.") for t in types):
        return True
    config = os.path.join(path, ST_CONFIG)
    try:
        return os.path.isfile(config) and read_json_object(config, "")["model_type"] == "ColBERT"
    except (ValueError, KeyError):
        return False


def _settings(path: str, values: dict) -> dict:
    """The ColBERT keys of config_sentence_transformers.json, type-checked (absent: PyLate's
    defaults)."""
    kinds = {
        "query_prefix": str,
        "document_prefix": str,
        "query_length": int,
        "document_length": int,
        "do_query_expansion": bool,
        "attend_to_expansion_tokens": bool,
        "skiplist_words": list,
    }
    out = {}
    for key, kind in kinds.items():
        value = values.get(key)
        if value is None:
            continue
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{path}: {key}={value!r} is not a {kind.__name__}")
        out[key] = tuple(str(w) for w in value) if kind is list else value
    return out


def load_pylate(directory: str) -> Checkpoint:
    """Reads a PyLate ColBERT directory: the HF checkpoint of its Transformer module with
    :class:`LateInteractionSettings` in ``embedding`` (tokenizer: its tokenizer.json)."""
    entries = _listing(directory)
    kinds = [str(e.get("type", "")).rsplit(".", 1)[-1] for e in entries]
    if not kinds or kinds[0] != "Transformer" or any(k != "Dense" for k in kinds[1:]):
        raise ValueError(
            f"{os.path.join(directory, MODULES)}: modules {kinds} are not a Transformer and "
            "Dense projections (a PyLate ColBERT model)"
        )
    folders = [os.path.join(directory, e.get("path") or "") for e in entries]
    ckpt = load_hf(folders[0])
    tokenizer_json = os.path.join(folders[0], "tokenizer.json")
    if os.path.isfile(tokenizer_json):
        ckpt.vocab_file, ckpt.do_lower_case = tokenizer_json, None  # its normalizer decides
    dense, tensors = [], {}
    for folder in folders[1:]:
        layer, weights = read_dense(
            folder,
            len(dense),
            default_activation="torch.nn.modules.linear.Identity",
            activations=_ACTIVATIONS,
            check_io_names=False,
        )
        dense.append(layer)
        tensors.update(weights)
    head = LateInteractionHead(tuple(dense))
    head.dimension(ckpt.config.hidden_size)  # widths chain
    st_path = os.path.join(directory, ST_CONFIG)
    st = (
        read_json_object(st_path, "sentence-transformers config") if os.path.isfile(st_path) else {}
    )
    sbert_path = os.path.join(folders[0], SBERT_CONFIG)
    sbert = read_json_object(sbert_path, "Transformer config") if os.path.isfile(sbert_path) else {}
    prompts = st.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ValueError(f"{st_path}: prompts is not an object of strings")
    known = {*SETTINGS_KEYS, "prompts", "default_prompt_name"}
    ckpt.embedding = LateInteractionSettings(
        head=head,
        tensors=tensors,
        do_lower_case=bool(sbert.get("do_lower_case", False)),
        prompts=dict(prompts),
        default_prompt_name=st.get("default_prompt_name"),
        extra={k: v for k, v in st.items() if k not in known},
        **_settings(st_path, st),
    )
    name = ckpt.embedding.default_prompt_name
    if name is not None and name not in prompts:
        raise ValueError(f"{st_path}: default_prompt_name {name!r} is not one of {sorted(prompts)}")
    ckpt.embedding.check(st_path)
    return ckpt


def _write_json(path: str, value) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)


def write_pylate(ckpt: Checkpoint, directory: str) -> None:
    """Writes the bare encoder (HF writer) and PyLate's files for ``ckpt.embedding`` (a
    :class:`LateInteractionSettings`); the tokenizer files come from ``save_checkpoint``."""
    settings = ckpt.embedding
    if not isinstance(settings, LateInteractionSettings):
        raise ValueError(
            f"{ckpt.source}: --to=pylate needs a late-interaction checkpoint (a PyLate directory, "
            "or the pylate/ export of a colbert run)"
        )
    settings.head.dimension(ckpt.config.hidden_size)
    write_hf(bare_encoder(ckpt), directory)
    modules = [{"idx": 0, "name": "0", "path": "", "type": TRANSFORMER_TYPE}]
    for i, layer in enumerate(settings.head.dense):
        folder = f"{i + 1}_Dense"
        modules.append({"idx": i + 1, "name": str(i + 1), "path": folder, "type": DENSE_TYPE})
        write_dense(
            os.path.join(directory, folder),
            layer,
            settings.tensors,
            i,
            ckpt.source,
            activations=_ACTIVATIONS,
            residual_key_always=True,
        )
    _write_json(os.path.join(directory, MODULES), modules)
    _write_json(
        os.path.join(directory, SBERT_CONFIG),
        {
            "max_seq_length": ckpt.config.max_position_embeddings,
            "do_lower_case": settings.do_lower_case,
        },
    )
    config = {"model_type": "ColBERT", "similarity_fn_name": "MaxSim", **settings.extra}
    config.update(
        prompts=settings.prompts,
        default_prompt_name=settings.default_prompt_name,
        **{k: getattr(settings, k) for k in SETTINGS_KEYS},
    )
    config["skiplist_words"] = list(settings.skiplist_words)
    _write_json(os.path.join(directory, ST_CONFIG), config)
