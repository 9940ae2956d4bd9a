"""Checkpoint conversion between Hugging Face, original Google (TF) and bertjax formats.

Every format is read into one in-memory :class:`~bertjax.convert.checkpoint.Checkpoint` (model
config + flat bertjax tensors). Layouts: ``bert_layout`` (BERT's table: bertjax path, original
Google name, role; HF names derive from it), ``layouts.param_layout`` for any architecture.

``bertjax convert --from=FMT SRC --to=FMT DST`` (hf, tf, bertjax, and the families' formats:
sentence-transformers, pylate) reads everything, validates it (missing/unexpected tensors, shapes,
vocabulary size) and only then writes DST through a temporary directory that is renamed at the end:
a failed conversion leaves nothing behind.

Formats are chosen by name from a registry (:class:`Format`: name, reader, writer, detector,
``--to`` options). The core registers hf, tf and bertjax here; a family registers its own with
:func:`register_format` (``bertjax.families``; the retrieval family's sentence-transformers format
adds ``--pooling``), and :func:`formats` loads the families before it answers.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import tempfile
from collections.abc import Callable

from bertjax import families, fs
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

log = logging.getLogger("bertjax")

__all__ = [
    "FORMATS",
    "HEADS",
    "Checkpoint",
    "Format",
    "Option",
    "flatten_params",
    "formats",
    "layout",
    "load_checkpoint",
    "register_format",
    "save_checkpoint",
    "unflatten_params",
]


@dataclasses.dataclass(frozen=True)
class Option:
    """A ``bertjax convert`` option of one output format (``--to=<format>`` only), e.g.
    sentence-transformers' ``--pooling``: ``apply(ckpt, value)`` sets it on the checkpoint read
    before it is written."""

    flag: str
    help: str
    apply: Callable[[Checkpoint, str], None]
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


@dataclasses.dataclass(frozen=True)
class Format:
    """A checkpoint format: its name (``--from`` / ``--to``), reader and writer.

    ``detect`` (a family's format): whether a local directory is of this format. Such formats are
    asked before the core's own checks, the last registered first: a format built on another's
    layout (PyLate's on sentence-transformers', which holds a Hugging Face directory) registers
    after it. ``options``: its ``--to`` options. ``encoder_only``: it stores the encoder (and its
    own head) without any task head, so a checkpoint whose task head is feature-based exports to
    it as the encoder alone.
    """

    name: str
    load: Callable[[str], Checkpoint]
    write: Callable[[Checkpoint, str], None]
    detect: Callable[[str], bool] | None = None
    options: tuple[Option, ...] = ()
    encoder_only: bool = False


_REGISTERED: dict[str, Format] = {}


def register_format(fmt: Format) -> None:
    """Adds ``fmt`` to the formats ``load_checkpoint``, ``save_checkpoint`` and ``convert`` know."""
    _REGISTERED[fmt.name] = fmt


def formats() -> dict[str, Format]:
    """Every format by name, in registration order: the core's, then the families' (which it
    loads first)."""
    families.load()
    return dict(_REGISTERED)


register_format(Format("hf", load_hf, write_hf))
register_format(Format("tf", load_tf, write_tf))
register_format(Format("bertjax", load_bertjax, write_bertjax))


def __getattr__(name):
    if name == "FORMATS":  # every format's name, the families' included
        return tuple(formats())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def detect_format(path: str) -> str:
    """A family's format whose detector claims the directory (pylate: modules.json with a PyLate
    Dense; sentence-transformers: modules.json), else hf (config.json + weights), tf
    (bert_config.json / *.ckpt.index) or bertjax (Orbax steps)."""
    if os.path.isdir(path):
        for fmt in reversed(formats().values()):
            if fmt.detect is not None and fmt.detect(path):
                return fmt.name
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
    ckpt = _format(fmt, "checkpoint").load(path)
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
    if fmt is not None:
        _format(fmt, "checkpoint")
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
    writer = _format(fmt, "output")
    if ckpt.feature_head and not writer.encoder_only:
        takers = " or ".join(f"--to={f.name}" for f in formats().values() if f.encoder_only)
        raise ValueError(
            f"{ckpt.source}: its task head is feature-based ({ckpt.feature_head}), which no {fmt} "
            f"model runs (their task heads read the last layer); only its encoder exports: {takers}"
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
        writer.write(ckpt, tmp)
        if ckpt.vocab_file:
            for source, name in vocab_copies(ckpt.vocab_file).items():
                shutil.copyfile(source, os.path.join(tmp, name))


def _format(name: str, kind: str) -> Format:
    """The registered format ``name``; ValueError listing the known ones (``kind``: checkpoint
    or output, for the message)."""
    known = formats()
    if name not in known:
        raise ValueError(f"unknown {kind} format {name!r}; choose one of {tuple(known)}")
    return known[name]


def main(argv: list[str]) -> None:
    """``bertjax convert --from=FMT SRC --to=FMT DST``."""
    known = formats()
    parser = argparse.ArgumentParser(
        prog="bertjax convert", description="Convert BERT checkpoints between formats."
    )
    parser.add_argument("--from", dest="src_format", choices=tuple(known), help="default: detected")
    parser.add_argument("--to", dest="dst_format", choices=tuple(known), required=True)
    parser.add_argument("--vocab", help="vocabulary file (default: the one beside SRC)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    options = [(fmt.name, option) for fmt in known.values() for option in fmt.options]
    for name, option in options:
        parser.add_argument(
            option.flag, choices=option.choices, help=f"--to={name} only: {option.help}"
        )
    parser.add_argument("src")
    parser.add_argument("dst")
    args = parser.parse_args(argv)
    for name, option in options:
        if getattr(args, option.dest) and args.dst_format != name:
            parser.error(f"{option.flag} applies to --to={name} only")
    ckpt = load_checkpoint(args.src, args.src_format, args.vocab)
    for _, option in options:
        if getattr(args, option.dest):
            option.apply(ckpt, getattr(args, option.dest))
    save_checkpoint(ckpt, args.dst, args.dst_format, args.overwrite)
    log.info(
        "converted %s (%d tensors, heads: %s) -> %s (%s)",
        args.src,
        len(ckpt.tensors),
        ", ".join(ckpt.heads) or "none",
        args.dst,
        args.dst_format,
    )
