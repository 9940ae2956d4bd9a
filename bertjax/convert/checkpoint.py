"""The in-memory checkpoint every format is read into, and the helpers every format shares.

A :class:`Checkpoint` is the model config plus a flat dict of NumPy arrays keyed by bertjax
parameter paths (``bert/encoder/layer_0/attention/query/kernel``, layers unrolled, dtypes as
stored). Heads are named by their subtree: ``pooler`` (inside the encoder), ``predictions``
(``mlm``), ``seq_relationship`` (``nsp``), ``classifier``, ``head`` (``token_head``: ModernBERT's
per-token transform of token classification and QA), ``qa_outputs`` (``qa``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np

import bertjax.models as models
from bertjax import fs
from bertjax.text import load_tokenizer

# token_head: ModernBERT's per-token ``head`` before a token classifier or ``qa_outputs`` (qa).
HEADS = ("pooler", "mlm", "nsp", "classifier", "token_head", "qa")
# Vocabulary files, in the order they are looked for beside a checkpoint.
VOCAB_FILES = ("vocab.txt", "vocab.model", "spiece.model", "tokenizer.json")
# Files a Hugging Face tokenizer.json may come with (copied along with it).
TOKENIZER_SIDECARS = ("tokenizer_config.json", "special_tokens_map.json")


def vocab_copies(vocab_file: str) -> dict[str, str]:
    """{file to copy: name in an output checkpoint} for a checkpoint's vocabulary."""
    if vocab_file.endswith(".json"):
        folder = os.path.dirname(vocab_file)
        extra = [os.path.join(folder, n) for n in TOKENIZER_SIDECARS]
        return {
            vocab_file: "tokenizer.json",
            **{p: os.path.basename(p) for p in extra if os.path.isfile(p)},
        }
    suffix = ".model" if vocab_file.endswith(".model") else ".txt"
    return {vocab_file: "vocab" + suffix}


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

    config: Any  # the architecture's model config (bertjax.models)
    tensors: dict[str, np.ndarray]  # bertjax path -> array (layers unrolled)
    vocab_file: str | None = None
    do_lower_case: bool | None = None
    source: str = ""
    # The Hugging Face class it was read as, where the heads alone do not tell it (a multiple-choice
    # classifier has the tensors of a one-label sequence classifier); written back by ``--to=hf``.
    hf_class: str | None = None
    # A family's head settings, as its format's reader returns them (a ``pretrained.HeadBehaviour``:
    # a sentence-transformers directory's pooling, Dense, Normalize, prompts and max_seq_length, a
    # PyLate directory's ColBERT settings); None: not one.
    embedding: Any = None
    # A bertjax fine-tuning run whose task head is feature-based (``head.features`` other than
    # ``last``, or ``head.bilstm``): that setting, e.g. "head.features=concat_last4". Its head
    # tensors are not in ``tensors`` (no transformers class runs such a head): the encoder alone.
    feature_head: str | None = None

    @property
    def heads(self) -> tuple[str, ...]:
        """The heads present (pooler, mlm, nsp, classifier, token_head, qa), in HEADS order."""
        return heads_in({name: head_of(name) for name in self.tensors}, self.tensors)

    @property
    def num_labels(self) -> int:
        kernel = self.tensors.get("classifier/kernel")
        return 0 if kernel is None else int(kernel.shape[-1])


def head_of(path: str) -> str:
    """The head a flat bertjax parameter path belongs to ("encoder" for the encoder's own)."""
    first, _, rest = path.partition("/")
    if first in ("predictions",):
        return "mlm"
    if first == "seq_relationship":
        return "nsp"
    if first == "classifier":
        return "classifier"
    if first == "head":
        return "token_head"
    if first == "qa_outputs":
        return "qa"
    if rest.startswith("pooler/"):
        return "pooler"
    return "encoder"


def heads_in(head_of: dict[str, str], names) -> tuple[str, ...]:
    """Which heads have at least one tensor among ``names`` (given name -> head)."""
    found = {head_of[n] for n in names if n in head_of}
    return tuple(h for h in HEADS if h in found)


def fmt_shape(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def listing(items: list[str], limit: int = 12) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def mismatch_report(missing: list[str], extra: list[str], bad: list[str]) -> str:
    """One line listing missing, unexpected and mis-shaped tensors ("" when all match)."""
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {listing(missing)}")
    if extra:
        problems.append(f"unexpected {len(extra)} tensor(s): {listing(extra)}")
    if bad:
        problems.append(f"shape mismatch in {len(bad)} tensor(s): {listing(bad)}")
    return "; ".join(problems)


def match_tensors(
    named: dict[str, np.ndarray], entries_by_name: dict[str, Entry], source: str, shape_of
) -> dict[str, np.ndarray]:
    """Checks ``named`` (external name -> array, in original layout after ``shape_of``) against the
    layout entries of the heads found, and returns flat bertjax tensors.

    Raises one ValueError naming ``source`` and listing every missing, unexpected and mis-shaped
    tensor with its shape. ``shape_of(entry)`` gives the external shape.
    """
    heads = heads_in({k: e.head for k, e in entries_by_name.items()}, named)
    wanted = {k: e for k, e in entries_by_name.items() if e.head == "encoder" or e.head in heads}
    missing = [f"{k} {fmt_shape(shape_of(e))}" for k, e in wanted.items() if k not in named]
    extra = [f"{k} {fmt_shape(a.shape)}" for k, a in named.items() if k not in wanted]
    bad = [
        f"{k} {fmt_shape(named[k].shape)} (config implies {fmt_shape(shape_of(e))})"
        for k, e in wanted.items()
        if k in named and tuple(named[k].shape) != shape_of(e)
    ]
    report = mismatch_report(missing, extra, bad)
    if report:
        raise ValueError(f"{source}: checkpoint does not match its config: {report}")
    return {e.path: named[k] for k, e in wanted.items()}


def with_param_dtype(config: Any, tensors: dict[str, np.ndarray]) -> Any:
    """Sets ``param_dtype`` to the stored float dtype when every float tensor shares one."""
    kinds = {np.dtype(a.dtype).name for a in tensors.values()}
    if len(kinds) == 1 and next(iter(kinds)) in ("float32", "bfloat16", "float16"):
        return config.replace(param_dtype=next(iter(kinds)))
    return config


def read_json_object(path: str, what: str) -> dict:
    """A JSON object file (a model config, a weights index, a tokenizer config); a ValueError
    naming ``path`` when it cannot be read, is not JSON or holds no object."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: invalid JSON or not UTF-8
        raise ValueError(f"{path}: cannot read the {what} ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: the {what} is a JSON {type(value).__name__}, not an object")
    return value


def find_vocab(*directories: str) -> str | None:
    """The first vocab.txt / vocab.model / spiece.model / tokenizer.json in the given directories."""
    for directory in directories:
        for name in VOCAB_FILES:
            if directory and fs.isfile(os.path.join(directory, name)):
                return os.path.join(directory, name)
    return None


def check_vocab(ckpt: Checkpoint) -> None:
    """The vocabulary file must have exactly as many tokens as the word-embedding table."""
    if ckpt.vocab_file is None:
        return
    size = load_tokenizer(ckpt.vocab_file, ckpt.do_lower_case).vocab_size
    arch = models.architecture(ckpt.config)
    table = "/".join((arch.encoder_name, *arch.word_embeddings))
    shape = ckpt.tensors[table].shape
    if size != shape[0]:
        raise ValueError(
            f"{ckpt.vocab_file}: vocabulary has {size} tokens but the checkpoint {ckpt.source} has "
            f"{table.rsplit('/', 1)[0]} {fmt_shape(shape)}"
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
    """Scanned params (``.../layers/...`` with a leading [layers] axis) -> ``.../layer_{i}/...``."""
    out = {}
    for name, value in flat.items():
        head, sep, tail = name.partition("/layers/")
        if sep:
            for i in range(value.shape[0]):
                out[f"{head}/layer_{i}/{tail}"] = value[i]
        else:
            out[name] = value
    return out
