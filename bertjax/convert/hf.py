"""Hugging Face BERT checkpoints: names, config.json, safetensors and pytorch_model.bin, no torch.

HF names follow the original Google names with ``.`` for ``/``, ``weight``/``bias`` for
``kernel``/``gamma``/``beta`` and ``[out, in]`` Linear weights. Accepted namings: BertModel
(no prefix), BertForPreTraining / BertForMaskedLM / BertForNextSentencePrediction /
BertForSequenceClassification / BertForTokenClassification / BertForQuestionAnswering (``bert.``
prefix, ``cls.*``, ``classifier.*``, ``qa_outputs.*``), legacy ``LayerNorm.gamma/beta``, the
``embeddings.position_ids`` buffer and a tied ``cls.predictions.decoder.weight``.

``pytorch_model.bin`` is read by :func:`read_torch_file`: the zip archive's ``data.pkl`` is
unpickled with an allow-list (OrderedDict, tensor rebuild functions, storage types) and every
tensor is rebuilt from a NumPy view of its storage file: no code from the file runs, no torch.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pickle
import zipfile
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

import bertjax.convert.eurobert_hf as eurobert_hf
import bertjax.convert.gte_hf as gte_hf
import bertjax.convert.hf_table as hf_table
import bertjax.convert.modernbert_hf as modernbert_hf
import bertjax.convert.nomicbert_hf as nomicbert_hf
from bertjax.convert.bert_layout import (
    MATRIX_ROLES,
    from_original,
    layout,
    original_shape,
    to_original,
)
from bertjax.convert.checkpoint import (
    HEADS,
    Checkpoint,
    Entry,
    find_vocab,
    head_of,
    match_tensors,
    read_json_object,
    with_param_dtype,
)
from bertjax.convert.tf import config_from_original, config_to_original
from bertjax.models.bert import BertConfig
from bertjax.text import load_tokenizer

SAFETENSORS = "model.safetensors"
TORCH_BIN = "pytorch_model.bin"
_ENCODER_PREFIXES = ("embeddings.", "encoder.", "pooler.")
# The architectures converted by one name table (bertjax.convert.hf_table), by config.json's
# model_type (NomicBERT's is nomic_bert; GTE's original code writes "new") and by bertjax
# architecture name; BERT is converted through its Google names.
_TABLE_MODULES = (modernbert_hf, eurobert_hf, nomicbert_hf, gte_hf)
TABLE_FAMILIES = {family.MODEL_TYPE: family for family in _TABLE_MODULES}
TABLE_FAMILIES[gte_hf.ORIGINAL_MODEL_TYPE] = gte_hf
FAMILY_OF_ARCHITECTURE = {family.ARCHITECTURE: family for family in _TABLE_MODULES}
MODEL_TYPES = ("bert", *TABLE_FAMILIES)
_SPECIAL_NAMES = {
    "cls/predictions/output_bias": "cls.predictions.bias",
    "cls/seq_relationship/output_weights": "cls.seq_relationship.weight",
    "cls/seq_relationship/output_bias": "cls.seq_relationship.bias",
    "output_weights": "classifier.weight",
    "output_bias": "classifier.bias",
    "cls/squad/output_weights": "qa_outputs.weight",
    "cls/squad/output_bias": "qa_outputs.bias",
}
_ARCHITECTURES = {  # heads present -> HF class whose state dict holds exactly those tensors
    frozenset(): "BertModel",
    frozenset({"pooler"}): "BertModel",
    frozenset({"pooler", "mlm", "nsp"}): "BertForPreTraining",
    frozenset({"mlm"}): "BertForMaskedLM",
    frozenset({"pooler", "mlm"}): "BertForMaskedLM",
    frozenset({"pooler", "nsp"}): "BertForNextSentencePrediction",
    frozenset({"pooler", "classifier"}): "BertForSequenceClassification",
    frozenset({"classifier"}): "BertForTokenClassification",
    frozenset({"qa"}): "BertForQuestionAnswering",
}


# ---------------------------------------------------------------------------------------------
# Names and layouts.
# ---------------------------------------------------------------------------------------------
def hf_name(entry: Entry, prefix: bool = True) -> str:
    """The HF state-dict name of a layout entry (``bert.`` prefix unless ``prefix=False``)."""
    if entry.original in _SPECIAL_NAMES:
        return _SPECIAL_NAMES[entry.original]
    *parts, leaf = entry.original.split("/")
    leaf = {"gamma": "weight", "beta": "bias", "kernel": "weight"}.get(leaf, leaf)
    name = ".".join([*parts, leaf])
    if entry.path.endswith("/embedding"):
        name += ".weight"
    name = name.replace(".layer_", ".layer.")
    return name if prefix or not name.startswith("bert.") else name[len("bert.") :]


def to_hf(x: np.ndarray, entry: Entry) -> np.ndarray:
    """A bertjax array in HF layout (Linear weights are [out, in])."""
    x = to_original(x, entry.role)
    return np.ascontiguousarray(x.T) if entry.role in MATRIX_ROLES else x


def hf_shape(entry: Entry) -> tuple[int, ...]:
    shape = original_shape(entry)
    return shape[::-1] if entry.role in MATRIX_ROLES else shape


def from_hf(x: np.ndarray, entry: Entry) -> np.ndarray:
    """Inverse of :func:`to_hf`."""
    return from_original(x.T if entry.role in MATRIX_ROLES else x, entry)


def normalize_state_dict(state: dict[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    """Canonical HF names: ``bert.`` prefix added, legacy gamma/beta renamed, buffers and the tied
    decoder dropped (a decoder that differs from the word embeddings is an error)."""
    out = {}
    for name, value in state.items():
        if name.startswith(_ENCODER_PREFIXES):
            name = "bert." + name
        if ".LayerNorm.gamma" in name or ".LayerNorm.beta" in name:
            name = name.replace(".LayerNorm.gamma", ".LayerNorm.weight")
            name = name.replace(".LayerNorm.beta", ".LayerNorm.bias")
        if name in out:
            raise ValueError(f"{source}: tensor {name} appears twice (with and without prefix)")
        out[name] = value
    out.pop("bert.embeddings.position_ids", None)
    decoder = out.pop("cls.predictions.decoder.weight", None)
    if decoder is not None:
        words = out.get("bert.embeddings.word_embeddings.weight")
        if words is None or decoder.shape != words.shape or not np.array_equal(decoder, words):
            raise ValueError(
                f"{source}: cls.predictions.decoder.weight {list(decoder.shape)} is not tied to "
                "bert.embeddings.word_embeddings.weight (untied MLM decoders are not supported)"
            )
    decoder_bias = out.pop("cls.predictions.decoder.bias", None)
    if decoder_bias is not None:
        bias = out.setdefault("cls.predictions.bias", decoder_bias)
        if bias.shape != decoder_bias.shape or not np.array_equal(bias, decoder_bias):
            raise ValueError(
                f"{source}: cls.predictions.decoder.bias differs from cls.predictions.bias"
            )
    return out


def hf_to_tensors(state: dict[str, np.ndarray], config: BertConfig, source: str):
    """HF state dict -> flat bertjax tensors, checking names and shapes against ``config``."""
    state = normalize_state_dict(state, source)
    classifier = state.get("classifier.weight")
    num_labels = 0 if classifier is None else int(classifier.shape[0])
    entries = {hf_name(e): e for e in layout(config, HEADS, num_labels)}
    tensors = match_tensors(state, entries, source, shape_of=hf_shape)
    by_path = {e.path: e for e in entries.values()}
    return {path: from_hf(x, by_path[path]) for path, x in tensors.items()}


def tensors_to_hf(ckpt: Checkpoint) -> tuple[dict[str, np.ndarray], str]:
    """Flat bertjax tensors -> (HF state dict, architecture name), naming by the heads present."""
    heads = frozenset(ckpt.heads)
    arch = _ARCHITECTURES.get(heads)
    if arch is None:
        raise ValueError(
            f"{ckpt.source}: no Hugging Face BERT class holds exactly the heads {sorted(heads)}"
        )
    prefix = arch != "BertModel"
    entries = [e for e in layout(ckpt.config, HEADS, ckpt.num_labels) if e.path in ckpt.tensors]
    return {hf_name(e, prefix): to_hf(ckpt.tensors[e.path], e) for e in entries}, arch


# ---------------------------------------------------------------------------------------------
# Reading weights without torch.
# ---------------------------------------------------------------------------------------------
_STORAGE_DTYPES = {
    "FloatStorage": np.float32,
    "DoubleStorage": np.float64,
    "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


class _StorageType:
    def __init__(self, name: str):
        self.dtype = np.dtype(_STORAGE_DTYPES[name])


def _rebuild_tensor(storage, offset, size, stride, *_unused):
    """torch._utils._rebuild_tensor(_v2): a strided view of a storage, copied out."""
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    if len(size) != len(stride):
        raise pickle.UnpicklingError(f"tensor size {size} and stride {stride} differ in rank")
    if 0 in size:
        return np.zeros(size, storage.dtype)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if offset < 0 or min(stride, default=0) < 0 or last >= storage.size:
        raise pickle.UnpicklingError(
            f"tensor (offset {offset}, size {size}, stride {stride}) overruns its storage "
            f"of {storage.size} elements"
        )
    item = storage.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(
        storage[offset:], shape=size, strides=[s * item for s in stride], writeable=False
    )
    return np.array(view, dtype=storage.dtype.newbyteorder("="))


def _rebuild_parameter(data, *_unused):
    return data


def _rebuild_from_type(func, _new_type, args, _state):
    return func(*args)


_ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch", "Tensor"): None,
    ("torch.nn.parameter", "Parameter"): None,
}


class _TorchUnpickler(pickle.Unpickler):
    """Unpickles a torch ``data.pkl`` allowing only tensor-rebuilding globals."""

    def __init__(self, file, archive: zipfile.ZipFile, root: str, byteorder: str, source: str):
        super().__init__(file, encoding="utf-8")
        self.archive, self.root, self.source = archive, root, source
        self.byteorder = ">" if byteorder == "big" else "<"
        self.storages: dict[str, np.ndarray] = {}

    def find_class(self, module: str, name: str):
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name)
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        raise pickle.UnpicklingError(
            f"{self.source}: refusing to load {module}.{name} (only tensors are allowed)"
        )

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"{self.source}: unsupported persistent id {pid!r}")
        storage_type, key, numel = pid[1], str(pid[2]), int(pid[4])
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(f"{self.source}: unsupported storage type {storage_type}")
        if key not in self.storages:
            dtype = storage_type.dtype.newbyteorder(self.byteorder)
            data = self.archive.read(f"{self.root}/data/{key}")
            if len(data) < numel * dtype.itemsize:
                raise pickle.UnpicklingError(
                    f"{self.source}: storage {key} holds {len(data)} bytes, expected "
                    f"{numel * dtype.itemsize}"
                )
            self.storages[key] = np.frombuffer(data, dtype=dtype, count=numel)
        return self.storages[key]


def read_torch_file(path: str) -> dict[str, np.ndarray]:
    """A ``torch.save``-d state dict (zip format, torch >= 1.6) as NumPy arrays, without torch."""
    if not zipfile.is_zipfile(path):
        raise ValueError(
            f"{path}: not a zip-format PyTorch file (legacy pre-1.6 torch.save format is not "
            "supported; re-save it with a recent torch or convert it to safetensors)"
        )
    with zipfile.ZipFile(path) as archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise ValueError(
                f"{path}: expected one <root>/data.pkl in the archive, found {pickles}"
            )
        root = pickles[0].split("/")[0]
        names = set(archive.namelist())
        byteorder = "little"
        if f"{root}/byteorder" in names:
            byteorder = archive.read(f"{root}/byteorder").decode().strip()
        with archive.open(pickles[0]) as f:
            state = _TorchUnpickler(f, archive, root, byteorder, path).load()
    if not isinstance(state, dict):
        raise ValueError(f"{path}: holds a {type(state).__name__}, not a state dict")
    if "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    bad = [k for k, v in state.items() if not isinstance(v, np.ndarray)]
    if bad:
        raise ValueError(f"{path}: entries that are not tensors: {bad[:10]}")
    return dict(state)


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file as NumPy (bf16 via ml_dtypes)."""
    try:
        return load_file(path)
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"{path}: unreadable safetensors file ({e})") from None


def read_hf_weights(directory: str) -> tuple[dict[str, np.ndarray], str]:
    """State dict of a HF model directory (single or sharded safetensors / .bin) and its file."""
    candidates = (
        (SAFETENSORS, "model.safetensors.index.json", read_safetensors),
        (TORCH_BIN, "pytorch_model.bin.index.json", read_torch_file),
    )
    for name, index_name, reader in candidates:
        single, index = os.path.join(directory, name), os.path.join(directory, index_name)
        if os.path.isfile(single):
            return reader(single), single
        if os.path.isfile(index):
            weight_map = read_json_object(index, "weights index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no 'weight_map' object (tensor name -> shard file)")
            shards = sorted(set(weight_map.values()))
            state: dict[str, np.ndarray] = {}
            for shard in shards:
                state.update(reader(os.path.join(directory, shard)))
            return state, index
    raise FileNotFoundError(f"{directory}: no {SAFETENSORS} or {TORCH_BIN} (or sharded index)")


# ---------------------------------------------------------------------------------------------
# Directories.
# ---------------------------------------------------------------------------------------------
def _do_lower_case(directory: str) -> bool | None:
    path = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(path):
        value = read_json_object(path, "tokenizer config").get("do_lower_case")
        return None if value is None else bool(value)
    return None


def load_hf(directory: str) -> Checkpoint:
    """Reads a HF BERT model directory (config.json + weights + optional vocab.txt)."""
    config_path = os.path.join(directory, "config.json")
    values = read_json_object(config_path, "model config")
    state, weights = read_hf_weights(directory)
    model_type = values.get("model_type", "bert")
    family = TABLE_FAMILIES.get(model_type)
    if family is not None:
        config = family.config_from_hf(values)
        arch = (values.get("architectures") or [None])[0]
        tensors, _ = family.from_hf_tensors(config, state, weights, architecture=arch)
        config = with_param_dtype(config, tensors)
        return Checkpoint(config, tensors, find_vocab(directory), None, weights, hf_class=arch)
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"{config_path}: model_type={model_type!r} is an architecture bertjax does not have; "
            f"it has {list(MODEL_TYPES)}"
        )
    config = config_from_original(values, config_path)
    tensors = hf_to_tensors(state, config, weights)
    vocab = find_vocab(directory)
    config = with_param_dtype(config, tensors)
    return Checkpoint(config, tensors, vocab, _do_lower_case(directory), weights)


_SPECIAL = (
    ("pad", "pad_id"),
    ("unk", "unk_id"),
    ("cls", "cls_id"),
    ("sep", "sep_id"),
    ("mask", "mask_id"),
)


def _special_tokens(ckpt: Checkpoint) -> tuple[Any, dict[str, str]]:
    """The checkpoint's tokenizer (None without a vocabulary) and its special tokens by role."""
    if not ckpt.vocab_file:
        return None, {}
    lower = None if ckpt.vocab_file.endswith(".json") else ckpt.do_lower_case
    tokenizer = load_tokenizer(ckpt.vocab_file, lower)
    vocab = getattr(tokenizer, "vocab", None)
    tokens = {}
    for role, attr in _SPECIAL:
        token_id = getattr(tokenizer, attr, None)
        if token_id is not None and vocab is not None and 0 <= token_id < len(vocab):
            tokens[role] = vocab[token_id]
    return tokenizer, tokens


def _write_tokenizer_files(ckpt: Checkpoint, directory: str, tokenizer, tokens) -> None:
    """tokenizer_config.json and special_tokens_map.json for transformers' AutoTokenizer (a
    vocab.txt as BertTokenizer; a tokenizer.json as the fast tokenizer with its special tokens)."""
    if tokenizer is None or ckpt.vocab_file.endswith(".model"):
        return
    special = {f"{role}_token": token for role, token in tokens.items()}
    if ckpt.vocab_file.endswith(".json"):
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **special}
    else:
        config = {"tokenizer_class": "BertTokenizer", "do_lower_case": tokenizer.do_lower_case}
        config.update(special)
        if ckpt.config.architecture in FAMILY_OF_ARCHITECTURE:
            # transformers 5 builds these families' tokenizers from tokenizer.json only (a
            # vocab.txt alone needs sentencepiece or tiktoken to convert): the same WordPiece.
            from tokenizers.implementations import BertWordPieceTokenizer

            wordpiece = BertWordPieceTokenizer(
                ckpt.vocab_file,
                lowercase=tokenizer.do_lower_case,
                unk_token=tokens.get("unk", "[UNK]"),
                sep_token=tokens.get("sep", "[SEP]"),
                cls_token=tokens.get("cls", "[CLS]"),
                pad_token=tokens.get("pad", "[PAD]"),
                mask_token=tokens.get("mask", "[MASK]"),
            )
            wordpiece.save(os.path.join(directory, "tokenizer.json"))
    config["model_max_length"] = getattr(ckpt.config, "max_position_embeddings", None) or 512
    for name, value in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        with open(os.path.join(directory, name), "w") as f:
            json.dump(value, f, indent=2, sort_keys=True)


def bare_encoder(ckpt: Checkpoint) -> Checkpoint:
    """``ckpt`` with only the tensors of the bare transformers encoder class (``BertModel`` keeps
    the pooler, ``ModernBertModel`` has none): what a sentence-transformers directory stores."""
    keep = (
        ("encoder",)
        if ckpt.config.architecture in FAMILY_OF_ARCHITECTURE
        else ("encoder", "pooler")
    )
    tensors = {k: v for k, v in ckpt.tensors.items() if head_of(k) in keep}
    if "pooler" in keep and not any(head_of(k) == "pooler" for k in tensors):
        tensors.update(initial_pooler(ckpt.config))
    return dataclasses.replace(ckpt, tensors=tensors, hf_class=None)


def initial_pooler(config) -> dict[str, np.ndarray]:
    """A BERT pooler as transformers initialises one (normal(0, initializer_range) kernel, zero
    bias; seed 0): for a model trained without one (a bi-encoder pools its own way), so that
    ``BertModel`` loads the export with no missing weight. Sentence embeddings never read it."""
    h = config.hidden_size
    rng = np.random.default_rng(0)
    kernel = rng.normal(0.0, config.initializer_range, (h, h)).astype(np.float32)
    return {"bert/pooler/kernel": kernel, "bert/pooler/bias": np.zeros((h,), np.float32)}


def write_hf(ckpt: Checkpoint, directory: str) -> None:
    """config.json, model.safetensors, tokenizer_config.json and special_tokens_map.json that
    transformers loads as is (``AutoModel*``, ``AutoTokenizer``, ``pipeline("fill-mask")``): the
    special-token ids of config.json are the vocabulary's, never a preset's."""
    tokenizer, tokens = _special_tokens(ckpt)
    family = FAMILY_OF_ARCHITECTURE.get(ckpt.config.architecture)
    if family is not None:
        cfg = ckpt.config
        if tokenizer is not None:
            ids = {
                key: getattr(tokenizer, f"{role}_id", None)
                for key, role in family.TOKEN_IDS.items()
            }
            cfg = cfg.replace(**{k: v for k, v in ids.items() if v is not None})
        family.write_hf_dir(directory, cfg, ckpt.tensors, ckpt.heads, ckpt.hf_class)
        _write_tokenizer_files(ckpt, directory, tokenizer, tokens)
        return
    state, arch = tensors_to_hf(ckpt)
    config = {"architectures": [arch], "model_type": "bert", **config_to_original(ckpt.config)}
    config.update(
        layer_norm_eps=ckpt.config.layer_norm_eps,
        pad_token_id=getattr(tokenizer, "pad_id", None) or 0,
        position_embedding_type="absolute",
        tie_word_embeddings=True,
        dtype=ckpt.config.param_dtype,
    )
    config.update(hf_table.label_maps(ckpt.num_labels))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    save_file(state, os.path.join(directory, SAFETENSORS), metadata={"format": "pt"})
    _write_tokenizer_files(ckpt, directory, tokenizer, tokens)
