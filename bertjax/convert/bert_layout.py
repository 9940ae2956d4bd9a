"""BERT's checkpoint layout: every tensor a config implies, with its bertjax shape, its name in the
original Google checkpoint and its *role*, which says how the array is reshaped between layouts.
Hugging Face names are derived from the original names (``bertjax.convert.hf``), so one table
serves all three formats.
"""

from __future__ import annotations

import numpy as np

from bertjax.convert.checkpoint import HEADS, Entry
from bertjax.models.bert import BertConfig

# Roles: how a bertjax array maps onto the original (TF, [in, out] kernels) layout.
#   copy: same array; kernel: same [in, out]; kernel_t: original stores [out, in];
#   heads_in: [H, N, D] <-> [H, N*D]; heads_bias: [N, D] <-> [N*D];
#   heads_out: [N, D, H] <-> [N*D, H].
MATRIX_ROLES = ("kernel", "heads_in", "heads_out")


def layout(config: BertConfig, heads=HEADS, num_labels: int = 0) -> list[Entry]:
    """Every tensor of the encoder plus the given heads (classifier only when num_labels > 0)."""
    h, n, d = config.hidden_size, config.num_heads, config.head_dim
    v, inter = config.vocab_size, config.intermediate_size
    out: list[Entry] = []

    def add(path, original, shape, role, head="encoder"):
        out.append(Entry(path, original, tuple(shape), role, head))

    def norm(path, original, head="encoder"):
        add(f"{path}/scale", f"{original}/gamma", (h,), "copy", head)
        add(f"{path}/bias", f"{original}/beta", (h,), "copy", head)

    def dense(path, original, n_in, n_out, head="encoder"):
        add(f"{path}/kernel", f"{original}/kernel", (n_in, n_out), "kernel", head)
        add(f"{path}/bias", f"{original}/bias", (n_out,), "copy", head)

    emb = "bert/embeddings"
    for name, rows in (
        ("word_embeddings", v),
        ("position_embeddings", config.max_position_embeddings),
        ("token_type_embeddings", config.type_vocab_size),
    ):
        add(f"{emb}/{name}/embedding", f"{emb}/{name}", (rows, h), "copy")
    norm(f"{emb}/LayerNorm", f"{emb}/LayerNorm")
    for i in range(config.num_layers):
        src, dst = f"bert/encoder/layer_{i}", f"bert/encoder/layer_{i}"
        for proj in ("query", "key", "value"):
            add(
                f"{dst}/attention/{proj}/kernel",
                f"{src}/attention/self/{proj}/kernel",
                (h, n, d),
                "heads_in",
            )
            add(
                f"{dst}/attention/{proj}/bias",
                f"{src}/attention/self/{proj}/bias",
                (n, d),
                "heads_bias",
            )
        add(
            f"{dst}/attention/output/kernel",
            f"{src}/attention/output/dense/kernel",
            (n, d, h),
            "heads_out",
        )
        add(f"{dst}/attention/output/bias", f"{src}/attention/output/dense/bias", (h,), "copy")
        norm(f"{dst}/attention_norm", f"{src}/attention/output/LayerNorm")
        dense(f"{dst}/intermediate", f"{src}/intermediate/dense", h, inter)
        dense(f"{dst}/output", f"{src}/output/dense", inter, h)
        norm(f"{dst}/output_norm", f"{src}/output/LayerNorm")
    if "pooler" in heads:
        dense("bert/pooler", "bert/pooler/dense", h, h, "pooler")
    if "mlm" in heads:
        dense("predictions/dense", "cls/predictions/transform/dense", h, h, "mlm")
        norm("predictions/LayerNorm", "cls/predictions/transform/LayerNorm", "mlm")
        add("predictions/output_bias", "cls/predictions/output_bias", (v,), "copy", "mlm")
    if "nsp" in heads:
        add(
            "seq_relationship/kernel",
            "cls/seq_relationship/output_weights",
            (h, 2),
            "kernel_t",
            "nsp",
        )
        add("seq_relationship/bias", "cls/seq_relationship/output_bias", (2,), "copy", "nsp")
    if "classifier" in heads and num_labels > 0:
        add("classifier/kernel", "output_weights", (h, num_labels), "kernel_t", "classifier")
        add("classifier/bias", "output_bias", (num_labels,), "copy", "classifier")
    if "qa" in heads:  # run_squad.py's span head; HF's qa_outputs
        add("qa_outputs/kernel", "cls/squad/output_weights", (h, 2), "kernel_t", "qa")
        add("qa_outputs/bias", "cls/squad/output_bias", (2,), "copy", "qa")
    return out


def to_original(x: np.ndarray, role: str) -> np.ndarray:
    """A bertjax array in the original Google layout ([in, out] kernels, fused heads)."""
    if role == "kernel_t":
        return np.ascontiguousarray(x.T)
    if role == "heads_in":
        return x.reshape(x.shape[0], -1)  # [H, N, D] -> [H, N*D]
    if role == "heads_bias":
        return x.reshape(-1)
    if role == "heads_out":
        return x.reshape(-1, x.shape[-1])  # [N, D, H] -> [N*D, H]
    return x


def original_shape(entry: Entry) -> tuple[int, ...]:
    """The shape an entry has in the original layout."""
    return tuple(to_original(np.empty(entry.shape, np.uint8), entry.role).shape)


def from_original(x: np.ndarray, entry: Entry) -> np.ndarray:
    """Inverse of :func:`to_original` (``x`` already checked to have ``original_shape``)."""
    if entry.role == "kernel_t":
        return np.ascontiguousarray(x.T)
    return np.ascontiguousarray(x.reshape(entry.shape))
