"""bertjax's own checkpoints (Orbax): a training run's WORKDIR or a directory ``convert`` wrote.

A family's head (a retriever's pooling and Dense layers, a ColBERT projection) is recorded in the
checkpoint config under its key, its tensors beside the encoder's; the families register how to
read and write it (:class:`HeadRecord`, :func:`register_head_record`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import ml_collections

import bertjax.models as models
from bertjax import families, fs
from bertjax.checkpointing import Checkpointer, restore_params
from bertjax.convert.checkpoint import (
    Checkpoint,
    find_vocab,
    flatten_params,
    match_tensors,
    unflatten_params,
    unstack_layers,
    vocab_copies,
    with_param_dtype,
)
from bertjax.convert.layouts import param_layout


@dataclasses.dataclass(frozen=True)
class HeadRecord:
    """A family's head as a bertjax checkpoint records it: under config key ``key``, the head's
    settings (``settings``: the class a reader puts in ``Checkpoint.embedding``) as JSON values,
    ``record(settings)``, and back, ``read(record, tensors, source)``, where ``tensors`` are the
    params whose first part starts with ``prefix`` (the head's Dense layers)."""

    key: str
    settings: type
    record: Callable[[Any], dict]
    read: Callable[[dict, dict, str], Any]
    prefix: str = "dense_"


_HEAD_RECORDS: dict[str, HeadRecord] = {}


def register_head_record(head: HeadRecord) -> None:
    """Adds a family's head to those :func:`load_bertjax` reads and :func:`write_bertjax` writes."""
    _HEAD_RECORDS[head.key] = head


def head_records() -> list[HeadRecord]:
    """Every registered head, the last registered first (a head built on another's, as ColBERT's
    on the bi-encoder's Dense layers, is asked first); loads the families first."""
    families.load()
    return list(reversed(_HEAD_RECORDS.values()))


def _model_config(values: dict, flat: dict, source: str):
    """The model config saved by ``convert`` (key model_config) or by a training run (key model)."""
    if "model_config" in values:
        return models.config_from_dict(dict(values["model_config"]))
    if "model" not in values:
        raise ValueError(f"{source}: checkpoint config has neither 'model_config' nor 'model'")
    model = ml_collections.ConfigDict(values["model"])
    arch = models.architecture(model.get("architecture") or models.DEFAULT)
    table = "/".join((arch.encoder_name, *arch.word_embeddings))
    if table not in flat:
        raise ValueError(f"{source}: no {table} in the params")
    return models.model_config_from(model, int(flat[table].shape[0]))


def _has_steps(directory: str) -> bool:
    if fs.is_remote(directory):
        return fs.isdir(directory) and any(
            p.rsplit("/", 1)[-1].isdigit() for p in fs.glob(f"{directory}/*")
        )
    return os.path.isdir(directory) and any(n.isdigit() for n in os.listdir(directory))


def _steps_dir(path: str) -> str:
    """Where a bertjax checkpoint's numbered steps are: ``path`` itself, else its
    ``checkpoints`` folder (a run's WORKDIR)."""
    directory = str(path).rstrip("/") if fs.is_remote(path) else os.path.abspath(path)
    checkpoints = os.path.join(directory, "checkpoints")
    return checkpoints if not _has_steps(directory) and fs.isdir(checkpoints) else directory


def run_tokenizer(values: dict, directory: str, depth: int = 0) -> tuple[str | None, bool | None]:
    """(vocabulary file, do_lower_case) of the run whose checkpoint config is ``values``: a copy
    beside the checkpoint or in the run's prepared data, else the tokenizer the run recorded
    (``tokenizer``), else its config keys (``data.vocab``, the older top-level ``vocab``, the init
    checkpoint's vocabulary); the casing the run recorded, else ``data.do_lower_case``, else the
    top-level ``do_lower_case``."""
    data = values.get("data") or {}
    recorded = values.get("tokenizer") or {}
    run_dir = os.path.dirname(directory)
    vocab = find_vocab(directory, data.get("prepared_dir", ""), os.path.join(run_dir, "data"))
    for candidate in (recorded.get("vocab_file"), data.get("vocab"), values.get("vocab")):
        if vocab is None and candidate and fs.isfile(candidate):
            vocab = candidate
    lower = recorded.get("do_lower_case")
    for candidate in (data.get("do_lower_case"), values.get("do_lower_case")):
        lower = candidate if lower is None else lower
    init = values.get("init_checkpoint") or ""
    if vocab is None and init and fs.isdir(init):  # tokenized with the init checkpoint's
        steps = _steps_dir(init) if depth < 4 else None
        if steps is None or not _has_steps(steps):
            vocab = find_vocab(init)
        else:  # another bertjax run: its own tokenizer, found the same way
            _, init_values, _ = restore_params(steps)
            vocab, init_lower = run_tokenizer(init_values, steps, depth + 1)
            lower = init_lower if lower is None else lower
    return vocab, lower


def load_bertjax(path: str) -> Checkpoint:
    """Reads the newest step of a bertjax checkpoint directory (or a run's WORKDIR)."""
    directory = _steps_dir(path)
    params, values, step = restore_params(directory)
    flat = unstack_layers(flatten_params(params))
    source = f"{directory} (step {step})"
    embedding = None
    for head in head_records():
        if values.get(head.key) is not None:  # a family's head (a retriever's): its own tensors
            own = [k for k in flat if k.split("/")[0].startswith(head.prefix)]
            embedding = head.read(values[head.key], {k: flat.pop(k) for k in own}, source)
            break
    config = _model_config(values, flat, source)
    config = config.replace(scan_layers=False, remat="none")
    feature_head = _feature_head(values)
    if feature_head is not None:  # the encoder alone: no layout holds such a head
        encoder = models.architecture(config).encoder_name
        flat = {k: v for k, v in flat.items() if k.split("/")[0] == encoder}
    num_labels = int(flat["classifier/kernel"].shape[-1]) if "classifier/kernel" in flat else 0
    entries = {e.path: e for e in param_layout(config, num_labels)}
    tensors = match_tensors(flat, entries, source, shape_of=lambda e: e.shape)
    vocab, lower = run_tokenizer(values, directory)
    if vocab is not None and vocab.endswith(".json"):
        lower = None  # a tokenizer.json's normalizer decides (a run's data.do_lower_case does not)
    config = with_param_dtype(config, tensors)
    ckpt = Checkpoint(config, tensors, vocab, lower, source, values.get("hf_class"))
    ckpt.embedding = embedding
    ckpt.feature_head = feature_head
    return ckpt


def _feature_head(values: dict) -> str | None:
    """The feature-based head setting of a fine-tuning run's config (None: a fine-tuning head
    or no task head): ``head.features`` other than ``last``, else ``head.bilstm=True``."""
    head = values.get("head") or {}
    if head.get("features", "last") != "last":
        return f"head.features={head['features']}"
    if head.get("bilstm"):
        return "head.bilstm=True"
    return None


def write_bertjax(ckpt: Checkpoint, directory: str) -> None:
    """Writes step 0 of an Orbax checkpoint: state.params, config JSON with "model_config"."""
    vocab = None
    if ckpt.vocab_file:
        vocab = vocab_copies(ckpt.vocab_file)[ckpt.vocab_file]
    meta = {
        "model_config": ckpt.config.to_dict(),
        "heads": list(ckpt.heads),
        "vocab": vocab,
        "do_lower_case": ckpt.do_lower_case,
        "source": ckpt.source,
        "hf_class": ckpt.hf_class,
    }
    tensors = dict(ckpt.tensors)
    if ckpt.embedding is not None:  # a family's head: its record and its tensors
        heads = [h for h in head_records() if isinstance(ckpt.embedding, h.settings)]
        if not heads:
            raise ValueError(
                f"{ckpt.source}: no registered head record takes {type(ckpt.embedding).__name__}"
            )
        meta[heads[0].key] = heads[0].record(ckpt.embedding)
        tensors.update(ckpt.embedding.tensors)
    manager = Checkpointer(directory, keep=1, async_save=False)
    try:
        manager.save(0, {"params": unflatten_params(tensors)}, {}, json.dumps(meta), True)
    finally:
        manager.close()
