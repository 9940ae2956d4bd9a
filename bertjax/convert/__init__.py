"""Checkpoint conversion between Hugging Face, original Google (TF) and bertjax formats.

Every format is read into one in-memory :class:`~bertjax.convert.checkpoint.Checkpoint` (model
config + flat bertjax tensors). Layouts: ``bert_layout`` (BERT's table: bertjax path, original
Google name, role; HF names derive from it), ``layouts.param_layout`` for any architecture.

``bertjax convert --from=FMT SRC --to=FMT DST`` (hf, tf, bertjax, sentence-transformers, pylate) reads
everything, validates it (missing/unexpected tensors, shapes, vocabulary size) and only then writes
DST through a temporary directory that is renamed at the end: a failed conversion leaves nothing
behind. ``--to=sentence-transformers`` keeps a sentence-transformers source's pooling, Dense,
Normalize and prompts, and pools by ``--pooling`` (default mean) otherwise.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile

from bertjax import fs
from bertjax.convert import remote
from bertjax.convert.bert_layout import layout
from bertjax.convert.checkpoint import (
    HEADS,
    Checkpoint,
    atomic_directory,
    check_vocab,
    flatten_params,
    unflatten_params,
    vocab_copies,
)
from bertjax.convert.hf import load_hf, write_hf
from bertjax.convert.orbax_format import load_bertjax, write_bertjax
from bertjax.convert.tf import load_tf, write_tf
from bertjax.retrieval.bi_encoder.pooling import POOLING_MODES
from bertjax.retrieval.bi_encoder.sentence_transformers import (
    is_sentence_transformers_dir,
    load_sentence_transformers,
    with_pooling,
    write_sentence_transformers,
)
from bertjax.retrieval.colbert.pylate import is_pylate_dir, load_pylate, write_pylate

log = logging.getLogger("bertjax")

ST = "sentence-transformers"
FORMATS = ("hf", "tf", "bertjax", ST, "pylate")
LOADERS = {
    "hf": load_hf,
    "tf": load_tf,
    "bertjax": load_bertjax,
    ST: load_sentence_transformers,
    "pylate": load_pylate,
}
WRITERS = {
    "hf": write_hf,
    "tf": write_tf,
    "bertjax": write_bertjax,
    ST: write_sentence_transformers,
    "pylate": write_pylate,
}

__all__ = [
    "FORMATS",
    "HEADS",
    "Checkpoint",
    "flatten_params",
    "layout",
    "load_checkpoint",
    "save_checkpoint",
    "unflatten_params",
]


def detect_format(path: str) -> str:
    """pylate (modules.json with a PyLate Dense), sentence-transformers (modules.json), hf
    (config.json + weights), tf (bert_config.json / *.ckpt.index) or bertjax (Orbax steps)."""
    if os.path.isdir(path):
        if is_pylate_dir(path):
            return "pylate"
        if is_sentence_transformers_dir(path):
            return ST
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
    if fs.is_remote(path):
        return _load_remote(path.rstrip("/"), fmt, vocab)
    if not os.path.exists(path) and not os.path.exists(path + ".index"):
        raise FileNotFoundError(f"{path}: checkpoint not found")
    fmt = fmt or detect_format(path)
    if fmt not in LOADERS:
        raise ValueError(f"unknown checkpoint format {fmt!r}; choose one of {FORMATS}")
    ckpt = LOADERS[fmt](path)
    if vocab:
        ckpt.vocab_file = str(vocab)
    check_vocab(ckpt)
    return ckpt


def _is_remote_bertjax(path: str) -> bool:
    """A bertjax checkpoint in a bucket: numbered step folders, or a run's ``checkpoints``."""
    names = [p.rsplit("/", 1)[-1] for p in fs.glob(f"{path}/*")]
    return any(n.isdigit() for n in names) or "checkpoints" in names


def _load_remote(path: str, fmt: str | None, vocab: str | None) -> Checkpoint:
    """``load_checkpoint`` of a checkpoint in a bucket (see ``bertjax.convert.remote``): a
    bertjax one read where it is, any other format from a local copy."""
    if not fs.exists(path) and not fs.exists(path + ".index"):
        raise FileNotFoundError(f"{path}: checkpoint not found")
    if fmt is not None and fmt not in LOADERS:
        raise ValueError(f"unknown checkpoint format {fmt!r}; choose one of {FORMATS}")
    if fmt == "bertjax" or (fmt is None and fs.isdir(path) and _is_remote_bertjax(path)):
        ckpt = load_bertjax(path)
        ckpt.vocab_file = remote.stage_vocab(str(vocab) if vocab else ckpt.vocab_file)
        check_vocab(ckpt)
        return ckpt
    local = remote.stage(path)
    try:
        ckpt = load_checkpoint(local, fmt, remote.stage_vocab(str(vocab)) if vocab else None)
    except (OSError, ValueError) as err:
        raise remote.renamed(err, local, path) from None
    ckpt.source = ckpt.source.replace(local, path)
    return ckpt


def save_checkpoint(ckpt: Checkpoint, directory: str, fmt: str, overwrite: bool = False) -> None:
    """Writes ``ckpt`` as a directory of format ``fmt`` (atomically: all or nothing; in a bucket,
    written locally then uploaded with the files that make it a checkpoint last)."""
    if fmt not in WRITERS:
        raise ValueError(f"unknown output format {fmt!r}; choose one of {FORMATS}")
    if ckpt.feature_head and fmt != ST:
        raise ValueError(
            f"{ckpt.source}: its task head is feature-based ({ckpt.feature_head}), which no {fmt} "
            "model runs (their task heads read the last layer); only its encoder exports: "
            f"--to={ST}"
        )
    if fs.is_remote(directory):
        directory = str(directory).rstrip("/")
        if remote.is_nonempty(directory) and not overwrite:
            raise FileExistsError(
                f"{directory}: output already exists (pass --overwrite to replace it)"
            )
        with tempfile.TemporaryDirectory(prefix="bertjax-convert-") as tmp:
            local = os.path.join(tmp, directory.rsplit("/", 1)[-1])
            save_checkpoint(ckpt, local, fmt)
            remote.upload_folder(local, directory, overwrite)
        return
    with atomic_directory(directory, overwrite) as tmp:
        WRITERS[fmt](ckpt, tmp)
        if ckpt.vocab_file:
            for source, name in vocab_copies(ckpt.vocab_file).items():
                shutil.copyfile(source, os.path.join(tmp, name))


def main(argv: list[str]) -> None:
    """``bertjax convert --from=FMT SRC --to=FMT DST``."""
    parser = argparse.ArgumentParser(
        prog="bertjax convert", description="Convert BERT checkpoints between formats."
    )
    parser.add_argument("--from", dest="src_format", choices=FORMATS, help="default: detected")
    parser.add_argument("--to", dest="dst_format", choices=FORMATS, required=True)
    parser.add_argument("--vocab", help="vocabulary file (default: the one beside SRC)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    parser.add_argument(
        "--pooling",
        choices=POOLING_MODES,
        help=f"--to={ST} only: pool token embeddings this way (default: the source's, else mean)",
    )
    parser.add_argument("src")
    parser.add_argument("dst")
    args = parser.parse_args(argv)
    if args.pooling and args.dst_format != ST:
        parser.error(f"--pooling applies to --to={ST} only")
    ckpt = load_checkpoint(args.src, args.src_format, args.vocab)
    if args.pooling:
        ckpt.embedding = with_pooling(ckpt.embedding, args.pooling)
    save_checkpoint(ckpt, args.dst, args.dst_format, args.overwrite)
    log.info(
        "converted %s (%d tensors, heads: %s) -> %s (%s)",
        args.src,
        len(ckpt.tensors),
        ", ".join(ckpt.heads) or "none",
        args.dst,
        args.dst_format,
    )
