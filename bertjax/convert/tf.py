"""Original Google BERT checkpoints (``bert_config.json`` + ``bert_model.ckpt.*`` + ``vocab.txt``).

Variables carry the names of google-research/bert ``modeling.py`` (``bert/embeddings/...``,
``bert/encoder/layer_0/attention/self/query/kernel``, ``cls/predictions/output_bias``,
``cls/seq_relationship/output_weights`` [2, hidden], ...); kernels are [in, out]. Optimizer slots
(``*/adam_m``, ``*/adam_v``) and ``global_step`` are skipped. :func:`write_tf_checkpoint` writes
a TF checkpoint holding exactly the given names, so tests and ``convert --to=tf`` produce files in
the original format. ``bert_config.json`` <-> BertConfig lives here too; HF's config.json uses the
same keys plus its own.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from bertjax.convert.bert_layout import from_original, layout, original_shape, to_original
from bertjax.convert.checkpoint import (
    HEADS,
    Checkpoint,
    find_vocab,
    match_tensors,
    read_json_object,
    with_param_dtype,
)
from bertjax.models.bert import BertConfig

CONFIG_NAME = "bert_config.json"
CHECKPOINT_NAME = "bert_model.ckpt"
_SKIPPED_SUFFIXES = ("/adam_m", "/adam_v")
_SKIPPED_NAMES = ("global_step",)


_ACT_FROM_ORIGINAL = {
    "gelu": "gelu",
    "gelu_new": "gelu_new",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
_ACT_TO_ORIGINAL = {
    "gelu": "gelu",
    "gelu_new": "gelu_new",
    "gelu_tanh": "gelu_pytorch_tanh",
    "relu": "relu",
    "silu": "silu",
}


def config_from_original(values: dict, source: str) -> BertConfig:
    """BertConfig from bert_config.json / HF config.json keys; bad values name ``source``."""
    if values.get("model_type", "bert") != "bert":
        raise ValueError(f"{source}: model_type {values['model_type']!r} is not a BERT model")
    if values.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(
            f"{source}: position_embedding_type {values['position_embedding_type']!r} is not "
            "supported (only 'absolute')"
        )
    keys = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "max_position_embeddings",
        "type_vocab_size",
    )
    absent = [k for k in keys if k not in values]
    if absent:
        raise ValueError(f"{source}: missing config key(s) {absent}")
    act = values.get("hidden_act", "gelu")
    if act not in _ACT_FROM_ORIGINAL:
        raise ValueError(f"{source}: hidden_act {act!r} is not one of {sorted(_ACT_FROM_ORIGINAL)}")
    try:
        return BertConfig(
            vocab_size=int(values["vocab_size"]),
            hidden_size=int(values["hidden_size"]),
            num_layers=int(values["num_hidden_layers"]),
            num_heads=int(values["num_attention_heads"]),
            intermediate_size=int(values["intermediate_size"]),
            hidden_act=_ACT_FROM_ORIGINAL[act],
            hidden_dropout=float(values.get("hidden_dropout_prob", 0.1)),
            attention_dropout=float(values.get("attention_probs_dropout_prob", 0.1)),
            max_position_embeddings=int(values["max_position_embeddings"]),
            type_vocab_size=int(values["type_vocab_size"]),
            initializer_range=float(values.get("initializer_range", 0.02)),
            layer_norm_eps=float(values.get("layer_norm_eps", 1e-12)),
        )
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def config_to_original(config: BertConfig) -> dict:
    """The bert_config.json keys of a BertConfig (HF's config.json adds its own on top)."""
    return {
        "attention_probs_dropout_prob": config.attention_dropout,
        "hidden_act": _ACT_TO_ORIGINAL[config.hidden_act],
        "hidden_dropout_prob": config.hidden_dropout,
        "hidden_size": config.hidden_size,
        "initializer_range": config.initializer_range,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_position_embeddings,
        "num_attention_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "type_vocab_size": config.type_vocab_size,
        "vocab_size": config.vocab_size,
    }


def find_checkpoint_prefix(path: str) -> str:
    """The checkpoint prefix of a directory (``bert_model.ckpt`` or the single ``*.index``)."""
    if os.path.isfile(path + ".index"):
        return path
    named = os.path.join(path, CHECKPOINT_NAME)
    if os.path.isfile(named + ".index"):
        return named
    indexes = sorted(glob.glob(os.path.join(path, "*.index")))
    if len(indexes) != 1:
        raise FileNotFoundError(
            f"{path}: expected {CHECKPOINT_NAME}.index or exactly one *.index file, found "
            f"{[os.path.basename(p) for p in indexes]}"
        )
    return indexes[0][: -len(".index")]


def read_tf_checkpoint(prefix: str) -> dict[str, np.ndarray]:
    """Every model variable of a TF checkpoint (optimizer slots and global_step skipped)."""
    import tensorflow as tf  # reading and writing TF checkpoints only

    try:
        reader = tf.train.load_checkpoint(prefix)
    except Exception as e:  # tf raises several error types for unreadable checkpoints
        raise ValueError(f"{prefix}: unreadable TF checkpoint ({e})") from None
    names = reader.get_variable_to_shape_map()
    return {
        name: np.asarray(reader.get_tensor(name))
        for name in names
        if not name.endswith(_SKIPPED_SUFFIXES) and name not in _SKIPPED_NAMES
    }


def write_tf_checkpoint(prefix: str, tensors: dict[str, np.ndarray]) -> None:
    """Writes a TF (V2 bundle) checkpoint at ``prefix`` whose variable names are exactly the keys
    (``prefix.index`` + ``prefix.data-00000-of-00001`` + a ``checkpoint`` state file)."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():  # values are fed, not baked into the graph (no 2 GB proto limit)
        feeds, variables = {}, {}
        for name, value in tensors.items():
            value = np.asarray(value)
            placeholder = tf.compat.v1.placeholder(tf.as_dtype(value.dtype), value.shape)
            feeds[placeholder] = value
            variables[name] = tf.compat.v1.Variable(placeholder, name=f"v{len(variables)}")
        saver = tf.compat.v1.train.Saver(var_list=variables, save_relative_paths=True)
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer(), feed_dict=feeds)
            saver.save(session, prefix, write_meta_graph=False)


def tf_to_tensors(named: dict[str, np.ndarray], config, source: str) -> dict[str, np.ndarray]:
    """Original-named arrays -> flat bertjax tensors, checking names and shapes."""
    classifier = named.get("output_weights")
    num_labels = 0 if classifier is None else int(classifier.shape[0])
    entries = {e.original: e for e in layout(config, HEADS, num_labels)}
    tensors = match_tensors(named, entries, source, shape_of=original_shape)
    by_path = {e.path: e for e in entries.values()}
    return {path: from_original(x, by_path[path]) for path, x in tensors.items()}


def load_tf(path: str) -> Checkpoint:
    """Reads an original Google BERT checkpoint directory (or a checkpoint prefix)."""
    prefix = find_checkpoint_prefix(path)
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    config_path = os.path.join(directory, CONFIG_NAME)
    values = read_json_object(config_path, "model config")
    config = config_from_original(values, config_path)
    tensors = tf_to_tensors(read_tf_checkpoint(prefix), config, prefix)
    config = with_param_dtype(config, tensors)
    return Checkpoint(config, tensors, find_vocab(directory), None, prefix)


def write_tf(ckpt: Checkpoint, directory: str) -> None:
    """bert_config.json + bert_model.ckpt.* with the original variable names."""
    entries = [e for e in layout(ckpt.config, HEADS, ckpt.num_labels) if e.path in ckpt.tensors]
    named = {e.original: to_original(ckpt.tensors[e.path], e.role) for e in entries}
    with open(os.path.join(directory, CONFIG_NAME), "w") as f:
        json.dump(config_to_original(ckpt.config), f, indent=2, sort_keys=True)
    write_tf_checkpoint(os.path.join(directory, CHECKPOINT_NAME), named)
