"""Every parameter a model config implies, for any architecture: BERT's table (with its original
Google names) or, for the other architectures, the shapes of the model's own initialisation."""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util

import bertjax.models as models
from bertjax.convert.bert_layout import layout as bert_layout
from bertjax.convert.checkpoint import HEADS, Entry, head_of
from bertjax.models.heads import PreTrainingModel


def param_layout(config, num_labels: int = 0) -> list[Entry]:
    """Entries (path, shape, head) of the encoder and every head a checkpoint may hold."""
    if config.architecture == "bert":
        return bert_layout(config, HEADS, num_labels)
    ids = np.zeros((1, 2), np.int32)
    shapes = jax.eval_shape(
        lambda: PreTrainingModel(config, nsp=True).init(jax.random.key(0), ids, ids, ids)
    )
    flat = traverse_util.flatten_dict(nn.meta.unbox(shapes["params"]), sep="/")
    entries = [Entry(p, p, tuple(a.shape), "copy", head_of(p)) for p, a in flat.items()]
    h = config.hidden_size
    token_head = models.architecture(config).token_head  # token classification / QA transform
    if token_head is not None:
        x = np.zeros((1, h), np.float32)
        shapes = jax.eval_shape(lambda: token_head(config).init(jax.random.key(0), x))
        flat = traverse_util.flatten_dict(nn.meta.unbox(shapes["params"]), sep="/")
        entries += [
            Entry(f"head/{p}", "", tuple(a.shape), "copy", "token_head") for p, a in flat.items()
        ]
    entries.append(Entry("qa_outputs/kernel", "", (h, 2), "copy", "qa"))
    entries.append(Entry("qa_outputs/bias", "", (2,), "copy", "qa"))
    if num_labels:
        entries.append(Entry("classifier/kernel", "", (h, num_labels), "copy", "classifier"))
        entries.append(Entry("classifier/bias", "", (num_labels,), "copy", "classifier"))
    return entries
