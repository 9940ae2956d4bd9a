"""Fine-tuning heads that start from the init checkpoint's own task head.

A fine-tuning model is an encoder plus a task head of one *kind* (``bertjax.models.heads.HEADS``):
``sequence`` (a classifier on the pooled [CLS]), ``token`` (a classifier per token), ``span``
(QA start/end logits) or ``choice`` (one score per choice). A checkpoint converted from a task model
(Hugging Face ``*ForSequenceClassification``, ``*ForTokenClassification``,
``*ForQuestionAnswering``, ``*ForMultipleChoice``, BERT or ModernBERT, or a bertjax fine-tuning run)
carries such a head. :func:`carry_task_head` puts it into the fresh params when it is of the task's
kind, one top-level subtree at a time (ModernBERT's per-token ``head`` and the ``classifier`` or
``qa_outputs`` separately), each only when every tensor has the shape the task wants: a classifier
with another number of labels stays freshly initialised, with a warning. The pooler is part of the
encoder and comes with it (``bertjax.pretrained.merge_encoder``). One log line says which subtrees
were taken and which are fresh.
"""

from __future__ import annotations

import logging

import flax.linen as nn
import numpy as np
from flax import traverse_util

from bertjax import models
from bertjax.models.heads import HEADS

log = logging.getLogger("bertjax")

# The suffix of a transformers task class -> the head kind it holds.
_CLASS_KINDS = {
    "ForSequenceClassification": "sequence",
    "ForTokenClassification": "token",
    "ForQuestionAnswering": "span",
    "ForMultipleChoice": "choice",
}
_KIND_NAMES = {
    "sequence": "sequence classifier",
    "token": "token classifier",
    "span": "question-answering (span)",
    "choice": "multiple-choice",
}


def model_kind(model: nn.Module) -> str | None:
    """The head kind of a fine-tuning model (a key of ``bertjax.models.heads.HEADS``)."""
    return next((kind for kind, cls in HEADS.items() if type(model) is cls), None)


def checkpoint_kinds(heads, hf_class: str | None, num_labels: int) -> frozenset[str]:
    """The head kinds a checkpoint's task head can serve (empty: it has none).

    The transformers class named in its config.json decides where it names a task class; otherwise
    the heads present do: ``qa`` is a span head, a classifier beside a pooler a sequence classifier
    (a one-label one may also be a multiple-choice scorer: their tensors are the same), a classifier
    without pooler a token classifier.
    """
    for suffix, kind in _CLASS_KINDS.items():
        if hf_class and hf_class.endswith(suffix):
            return frozenset({kind})
    if "qa" in heads:
        return frozenset({"span"})
    if "classifier" not in heads:
        return frozenset()
    if "pooler" not in heads:
        return frozenset({"token"})
    return frozenset({"sequence", "choice"} if num_labels == 1 else {"sequence"})


def _describe(kinds: frozenset[str], hf_class: str | None) -> str:
    names = " or ".join(_KIND_NAMES[k] for k in sorted(kinds))
    return f"{names} ({hf_class})" if hf_class else names


def carry_task_head(
    params: dict,
    model: nn.Module,
    tensors: dict[str, np.ndarray],
    kinds: frozenset[str],
    source: str,
    *,
    hf_class: str | None = None,
    pooler: bool = False,
) -> dict:
    """``params`` (a fine-tuning model's, encoder already merged) with each head subtree outside the
    encoder taken from ``tensors`` (the checkpoint's flat head tensors: ``classifier/kernel``,
    ``head/dense/kernel``, ...) when the checkpoint's head ``kinds`` include the model's and every
    tensor of the subtree is there with the model's shape; the other subtrees stay fresh.

    Logs one line naming what was taken and what is fresh (``pooler``: the checkpoint had a pooler,
    taken with the encoder); a subtree present with other shapes (a label count that differs) is a
    warning.
    """
    kind = model_kind(model)
    encoder_name = models.architecture(model.config).encoder_name
    matches = kind is not None and kind in kinds
    out = dict(params)
    taken, fresh = [], []
    if "pooler" in params.get(encoder_name, {}):
        (taken if pooler else fresh).append("pooler")
    for name, subtree in params.items():
        if name == encoder_name:
            continue
        leaves = traverse_util.flatten_dict(nn.meta.unbox(subtree), sep="/")
        found = {p: tensors.get(f"{name}/{p}") for p in leaves}
        if not matches or all(v is None for v in found.values()):
            fresh.append(name)
            continue
        bad = [
            f"{name}/{p} has shape {None if v is None else tuple(np.shape(v))}, "
            f"the task wants {tuple(leaves[p].shape)}"
            for p, v in found.items()
            if v is None or tuple(np.shape(v)) != tuple(leaves[p].shape)
        ]
        if bad:
            log.warning(
                "init checkpoint %s: its %s head does not fit the task (%s): %s freshly "
                "initialised",
                source,
                _describe(kinds, hf_class),
                "; ".join(bad),
                name,
            )
            fresh.append(name)
            continue
        value = {p: np.asarray(v).astype(leaves[p].dtype) for p, v in found.items()}
        out[name] = traverse_util.unflatten_dict(value, sep="/")
        taken.append(name)
    if kinds and not matches:
        log.warning(
            "init checkpoint %s has a %s head; the task runs a %s head: not taken",
            source,
            _describe(kinds, hf_class),
            _KIND_NAMES.get(kind or "", kind),
        )
    log.info(
        "task head from init checkpoint %s: taken %s; freshly initialised %s",
        source,
        ", ".join(taken) or "none",
        ", ".join(fresh) or "none",
    )
    return out
