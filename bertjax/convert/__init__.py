"""Checkpoint conversion between Hugging Face, original Google (TF) and bertjax formats.

Every format is read into one in-memory :class:`Checkpoint`: the model config plus a flat dict of
NumPy arrays keyed by bertjax parameter paths (``bert/encoder/layer_0/attention/query/kernel``,
layers unrolled, dtypes as stored). :func:`layout` lists every tensor a config implies, with its
bertjax shape, its name in the original Google checkpoint and its *role*, which says how the
array is reshaped between layouts. Hugging Face names are derived from the original names
(``bertjax.convert.hf``), so one table serves all three formats.

``bertjax convert --from=hf|tf|bertjax SRC --to=hf|tf|bertjax DST`` reads everything, validates
it (missing/unexpected tensors, shapes, vocabulary size) and only then writes DST through a
temporary directory that is renamed at the end: a failed conversion leaves nothing behind.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator

import numpy as np

from bertjax.model_config import BertConfig

log = logging.getLogger("bertjax")

HEADS = ("pooler", "mlm", "nsp", "classifier")
FORMATS = ("hf", "tf", "bertjax")
# Roles: how a bertjax array maps onto the original (TF, [in, out] kernels) layout.
#   copy: same array; kernel: same [in, out]; kernel_t: original stores [out, in];
#   heads_in: [H, N, D] <-> [H, N*D]; heads_bias: [N, D] <-> [N*D];
#   heads_out: [N, D, H] <-> [N*D, H].
MATRIX_ROLES = ("kernel", "heads_in", "heads_out")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of the model: bertjax path, original (Google) name, bertjax shape, role."""

    path: str
    original: str
    shape: tuple[int, ...]
    role: str
    head: str  # "encoder" or one of HEADS


@dataclasses.dataclass
class Checkpoint:
    """A loaded checkpoint in any format: config, flat bertjax tensors, vocabulary file."""

    config: BertConfig
    tensors: dict[str, np.ndarray]  # bertjax path -> array (layers unrolled)
    vocab_file: str | None = None
    do_lower_case: bool | None = None
    source: str = ""

    @property
    def heads(self) -> tuple[str, ...]:
        """The heads present (pooler, mlm, nsp, classifier), in HEADS order."""
        return heads_in({e.path: e.head for e in layout(self.config, HEADS, 1)}, self.tensors)

    @property
    def num_labels(self) -> int:
        kernel = self.tensors.get("classifier/kernel")
        return 0 if kernel is None else int(kernel.shape[-1])


def heads_in(head_of: dict[str, str], names) -> tuple[str, ...]:
    """Which heads have at least one tensor among ``names`` (given name -> head)."""
    found = {head_of[n] for n in names if n in head_of}
    return tuple(h for h in HEADS if h in found)


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


def _fmt_shape(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _listing(items: list[str], limit: int = 12) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def match_tensors(
    named: dict[str, np.ndarray], entries_by_name: dict[str, Entry], source: str, shape_of=None
) -> dict[str, np.ndarray]:
    """Checks ``named`` (external name -> array, in original layout after ``shape_of``) against the
    layout entries of the heads found, and returns flat bertjax tensors.

    Raises one ValueError naming ``source`` and listing every missing, unexpected and mis-shaped
    tensor with its shape. ``shape_of(entry)`` gives the external shape (default: original).
    """
    shape_of = shape_of or original_shape
    heads = heads_in({k: e.head for k, e in entries_by_name.items()}, named)
    wanted = {k: e for k, e in entries_by_name.items() if e.head == "encoder" or e.head in heads}
    missing = [f"{k} {_fmt_shape(shape_of(e))}" for k, e in wanted.items() if k not in named]
    extra = [f"{k} {_fmt_shape(a.shape)}" for k, a in named.items() if k not in wanted]
    bad = [
        f"{k} {_fmt_shape(named[k].shape)} (config implies {_fmt_shape(shape_of(e))})"
        for k, e in wanted.items()
        if k in named and tuple(named[k].shape) != shape_of(e)
    ]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {_listing(missing)}")
    if extra:
        problems.append(f"unexpected {len(extra)} tensor(s): {_listing(extra)}")
    if bad:
        problems.append(f"shape mismatch in {len(bad)} tensor(s): {_listing(bad)}")
    if problems:
        raise ValueError(f"{source}: checkpoint does not match its config: " + "; ".join(problems))
    return {e.path: named[k] for k, e in wanted.items()}


# ---------------------------------------------------------------------------------------------
# Dtypes, vocabulary and atomic output directories.
# ---------------------------------------------------------------------------------------------
def with_param_dtype(config: BertConfig, tensors: dict[str, np.ndarray]) -> BertConfig:
    """Sets ``param_dtype`` to the stored float dtype when every float tensor shares one."""
    kinds = {np.dtype(a.dtype).name for a in tensors.values()}
    if len(kinds) == 1 and next(iter(kinds)) in ("float32", "bfloat16", "float16"):
        return config.replace(param_dtype=next(iter(kinds)))
    return config


def find_vocab(*directories: str) -> str | None:
    """The first vocab.txt / vocab.model / spiece.model found in the given directories."""
    for directory in directories:
        for name in ("vocab.txt", "vocab.model", "spiece.model"):
            if directory and os.path.isfile(os.path.join(directory, name)):
                return os.path.join(directory, name)
    return None


def check_vocab(ckpt: Checkpoint) -> None:
    """The vocabulary file must have exactly as many tokens as the word-embedding table."""
    if ckpt.vocab_file is None:
        return
    from bertjax.tokenization import load_tokenizer

    size = load_tokenizer(ckpt.vocab_file, ckpt.do_lower_case).vocab_size
    table = ckpt.tensors["bert/embeddings/word_embeddings/embedding"].shape
    if size != table[0]:
        raise ValueError(
            f"{ckpt.vocab_file}: vocabulary has {size} tokens but the checkpoint {ckpt.source} has "
            f"bert/embeddings/word_embeddings {_fmt_shape(table)}"
        )


@contextlib.contextmanager
def atomic_directory(path: str, overwrite: bool = False) -> Iterator[str]:
    """Yields a temporary sibling directory that becomes ``path`` only if the block succeeds."""
    path = os.path.abspath(path)
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)) and not overwrite:
        raise FileExistsError(f"{path}: output already exists (pass --overwrite to replace it)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if os.path.exists(path):
        old = f"{tmp}.old"
        os.rename(path, old)
    os.rename(tmp, path)
    if old:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# bertjax (Orbax) checkpoints.
# ---------------------------------------------------------------------------------------------
def flatten_params(tree, prefix: str = "") -> dict[str, np.ndarray]:
    """Nested param dicts -> {"a/b/c": np.ndarray}."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) or hasattr(value, "items"):
            flat.update(flatten_params(value, name + "/"))
        else:
            flat[name] = np.asarray(value)
    return flat


def unflatten_params(flat: dict[str, np.ndarray]) -> dict:
    """{"a/b/c": array} -> nested dicts (what Flax's ``apply`` takes)."""
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def unstack_layers(flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Scanned params (``bert/encoder/layers/...``, leading [layers] axis) -> ``layer_{i}``."""
    stacked = "bert/encoder/layers/"
    out = {}
    for name, value in flat.items():
        if name.startswith(stacked):
            for i in range(value.shape[0]):
                out[f"bert/encoder/layer_{i}/{name[len(stacked) :]}"] = value[i]
        else:
            out[name] = value
    return out


def _bertjax_model_config(values: dict, vocab_size: int, source: str) -> BertConfig:
    """The model config saved by ``convert`` (key model_config) or by a training run (key model)."""
    if "model_config" in values:
        return BertConfig.from_dict(dict(values["model_config"]))
    if "model" in values:
        import ml_collections

        from bertjax.tasks.pretraining import model_config_from

        return model_config_from(ml_collections.ConfigDict(values), vocab_size)
    raise ValueError(f"{source}: checkpoint config has neither 'model_config' nor 'model'")


def load_bertjax(path: str) -> Checkpoint:
    """Reads the newest step of a bertjax checkpoint directory (or a run's WORKDIR)."""
    from bertjax.checkpointing import restore_params

    directory = os.path.abspath(path)
    steps = [n for n in os.listdir(directory) if n.isdigit()]
    if not steps and os.path.isdir(os.path.join(directory, "checkpoints")):
        directory = os.path.join(directory, "checkpoints")
    params, values, step = restore_params(directory)
    flat = unstack_layers(flatten_params(params))
    source = f"{directory} (step {step})"
    word = flat.get("bert/embeddings/word_embeddings/embedding")
    if word is None:
        raise ValueError(f"{source}: no bert/embeddings/word_embeddings/embedding in the params")
    config = _bertjax_model_config(values, int(word.shape[0]), source)
    config = config.replace(scan_layers=False, remat="none")
    num_labels = int(flat["classifier/kernel"].shape[-1]) if "classifier/kernel" in flat else 0
    entries = {e.path: e for e in layout(config, HEADS, num_labels)}
    tensors = match_tensors(flat, entries, source, shape_of=lambda e: e.shape)
    data = values.get("data") or {}
    run_dir = os.path.dirname(directory)
    vocab = find_vocab(directory, data.get("prepared_dir", ""), os.path.join(run_dir, "data"))
    if vocab is None and data.get("vocab") and os.path.isfile(data["vocab"]):
        vocab = data["vocab"]
    lower = values.get("do_lower_case", data.get("do_lower_case"))
    return Checkpoint(with_param_dtype(config, tensors), tensors, vocab, lower, source)


def write_bertjax(ckpt: Checkpoint, directory: str) -> None:
    """Writes step 0 of an Orbax checkpoint: state.params, config JSON with "model_config"."""
    from bertjax.checkpointing import Checkpointer

    vocab = None
    if ckpt.vocab_file:
        vocab = "vocab.model" if ckpt.vocab_file.endswith(".model") else "vocab.txt"
    meta = {
        "model_config": ckpt.config.to_dict(),
        "heads": list(ckpt.heads),
        "vocab": vocab,
        "do_lower_case": ckpt.do_lower_case,
        "source": ckpt.source,
    }
    manager = Checkpointer(directory, keep=1, async_save=False)
    try:
        manager.save(0, {"params": unflatten_params(ckpt.tensors)}, {}, json.dumps(meta), True)
    finally:
        manager.close()


# ---------------------------------------------------------------------------------------------
# Loading and saving any format.
# ---------------------------------------------------------------------------------------------
def detect_format(path: str) -> str:
    """hf (config.json + weights), tf (bert_config.json / *.ckpt.index) or bertjax (Orbax steps)."""
    if os.path.isdir(path):
        names = set(os.listdir(path))
        weights = {
            "model.safetensors",
            "model.safetensors.index.json",
            "pytorch_model.bin",
            "pytorch_model.bin.index.json",
        }
        if "config.json" in names and names & weights:
            return "hf"
        if "bert_config.json" in names or any(n.endswith(".ckpt.index") for n in names):
            return "tf"
        if any(n.isdigit() and os.path.isdir(os.path.join(path, n)) for n in names):
            return "bertjax"
        if os.path.isdir(os.path.join(path, "checkpoints")):
            return "bertjax"
    elif os.path.isfile(path + ".index"):
        return "tf"
    raise ValueError(
        f"{path}: not a recognised checkpoint (expected a Hugging Face directory with config.json "
        "and model.safetensors/pytorch_model.bin, a Google directory with bert_config.json and "
        "bert_model.ckpt.*, or a bertjax checkpoint directory)"
    )


def load_checkpoint(path: str, fmt: str | None = None, vocab: str | None = None) -> Checkpoint:
    """Reads a checkpoint of any format into a validated :class:`Checkpoint`.

    ``vocab`` overrides the vocabulary file found beside the checkpoint.
    """
    path = str(path)
    if not os.path.exists(path) and not os.path.exists(path + ".index"):
        raise FileNotFoundError(f"{path}: checkpoint not found")
    fmt = fmt or detect_format(path)
    if fmt == "hf":
        from bertjax.convert.hf import load_hf as loader
    elif fmt == "tf":
        from bertjax.convert.tf import load_tf as loader
    elif fmt == "bertjax":
        loader = load_bertjax
    else:
        raise ValueError(f"unknown checkpoint format {fmt!r}; choose one of {FORMATS}")
    ckpt = loader(path)
    if vocab:
        ckpt.vocab_file = str(vocab)
    check_vocab(ckpt)
    return ckpt


def save_checkpoint(ckpt: Checkpoint, directory: str, fmt: str, overwrite: bool = False) -> None:
    """Writes ``ckpt`` as a directory of format ``fmt`` (atomically: all or nothing)."""
    if fmt == "hf":
        from bertjax.convert.hf import write_hf as writer
    elif fmt == "tf":
        from bertjax.convert.tf import write_tf as writer
    elif fmt == "bertjax":
        writer = write_bertjax
    else:
        raise ValueError(f"unknown output format {fmt!r}; choose one of {FORMATS}")
    with atomic_directory(directory, overwrite) as tmp:
        writer(ckpt, tmp)
        if ckpt.vocab_file:
            suffix = ".model" if ckpt.vocab_file.endswith(".model") else ".txt"
            shutil.copyfile(ckpt.vocab_file, os.path.join(tmp, "vocab" + suffix))


def main(argv: list[str]) -> None:
    """``bertjax convert --from=FMT SRC --to=FMT DST``."""
    parser = argparse.ArgumentParser(
        prog="bertjax convert", description="Convert BERT checkpoints between formats."
    )
    parser.add_argument("--from", dest="src_format", choices=FORMATS, help="default: detected")
    parser.add_argument("--to", dest="dst_format", choices=FORMATS, required=True)
    parser.add_argument("--vocab", help="vocabulary file (default: the one beside SRC)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    parser.add_argument("src")
    parser.add_argument("dst")
    args = parser.parse_args(argv)
    ckpt = load_checkpoint(args.src, args.src_format, args.vocab)
    save_checkpoint(ckpt, args.dst, args.dst_format, args.overwrite)
    log.info(
        "converted %s (%d tensors, heads: %s) -> %s (%s)",
        args.src,
        len(ckpt.tensors),
        ", ".join(ckpt.heads) or "none",
        args.dst,
        args.dst_format,
    )
