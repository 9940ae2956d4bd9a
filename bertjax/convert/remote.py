"""``convert`` and ``load_pretrained`` on a bucket (``gs://``, or any scheme ``bertjax.fs`` reads).

Reading: a bertjax checkpoint (a run's WORKDIR or a ``--to=bertjax`` directory) is read where it
is, by Orbax, newest complete step only; every other format (Hugging Face, sentence-transformers,
PyLate, Google's TF) is read by libraries that take local files (safetensors, torch, TensorFlow's
checkpoint reader, sentencepiece), so its directory is first copied to a local folder kept until
the process ends (``staged``). Errors name the remote path, never the local copy. A vocabulary
found in the bucket is copied beside it the same way, so that a ``Checkpoint``'s ``vocab_file`` is
always a local file.

Writing: object stores have no atomic rename of a folder, so a remote DST is written as a local
folder first (all or nothing, as locally) and then uploaded file by file with the files that make
it a checkpoint last (``MARKERS``: Orbax's ``commit_success.txt``, ``config.json``,
``modules.json``, ...). Replacing one (``--overwrite``) removes the old markers first. A failure
at any point leaves a DST that is not taken for a complete checkpoint (``detect_format`` and
Orbax both look for those markers).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from bertjax import fs

# Files whose presence makes a folder a checkpoint of some format, uploaded last (in this order:
# the one every detection starts from comes last) and removed first.
MARKERS = (
    "commit_success.txt",  # Orbax: a step is complete (on gs://, where there is no rename)
    ".index",  # TF: bert_model.ckpt.index (suffix)
    "bert_config.json",
    "config_sentence_transformers.json",
    "config.json",
    "modules.json",
)

_STAGING_ROOT: str | None = None


def _marker_rank(name: str) -> int:
    """0 for an ordinary file; 1 + the position in MARKERS for a marker (uploaded after)."""
    base = name.rsplit("/", 1)[-1]
    for rank, marker in enumerate(MARKERS, start=1):
        if base == marker or (marker.startswith(".") and base.endswith(marker)):
            return rank
    return 0


def _staging_root() -> str:
    """A local folder for the copies of remote checkpoints, removed when the process ends."""
    global _STAGING_ROOT
    if _STAGING_ROOT is None or not os.path.isdir(_STAGING_ROOT):
        _STAGING_ROOT = tempfile.mkdtemp(prefix="bertjax-remote-")
        atexit.register(shutil.rmtree, _STAGING_ROOT, True)
    return _STAGING_ROOT


def stage(path: str) -> str:
    """A local copy of the remote checkpoint ``path``: its folder, recursively, or, for a TF
    checkpoint prefix (``gs://b/dir/model.ckpt``), the prefix's files and the files of its
    folder (config, vocabulary). Returns the local path standing for ``path``."""
    path = str(path).rstrip("/")
    local = tempfile.mkdtemp(dir=_staging_root())
    if fs.isdir(path):
        target = os.path.join(local, path.rsplit("/", 1)[-1])
        for name in fs.list_files(path):
            fs.download(f"{path}/{name}", os.path.join(target, name))
        return target
    folder, base = path.rsplit("/", 1)
    for remote in fs.glob(f"{folder}/*"):
        name = remote.rsplit("/", 1)[-1]
        if name.startswith(base) or not fs.isdir(remote):
            fs.download(remote, os.path.join(local, name))
    return os.path.join(local, base)


def stage_file(path: str) -> str:
    """A local copy of one remote file (a vocabulary), with the same name."""
    local = os.path.join(tempfile.mkdtemp(dir=_staging_root()), str(path).rsplit("/", 1)[-1])
    fs.download(path, local)
    return local


def stage_vocab(vocab_file: str | None) -> str | None:
    """``vocab_file`` when local; else a local copy (a tokenizer.json with its sidecars)."""
    if not vocab_file or not fs.is_remote(vocab_file):
        return vocab_file
    from bertjax.convert.checkpoint import TOKENIZER_SIDECARS

    local = stage_file(vocab_file)
    if vocab_file.endswith(".json"):
        folder = vocab_file.rsplit("/", 1)[0]
        for name in TOKENIZER_SIDECARS:
            if fs.exists(f"{folder}/{name}"):
                fs.download(f"{folder}/{name}", os.path.join(os.path.dirname(local), name))
    return local


def renamed(err: BaseException, local: str, remote: str) -> BaseException:
    """``err`` with the local copy's path replaced by the remote one in its message (same type)."""
    text = str(err.args[0]) if len(err.args) == 1 and isinstance(err.args[0], str) else None
    if text is None or local not in text:
        return err
    try:
        return type(err)(text.replace(local, remote))
    except Exception:  # noqa: BLE001  (an exception type that takes other arguments)
        return err


def is_nonempty(path: str) -> bool:
    """Whether the remote ``path`` exists as a file or as a folder holding anything."""
    return bool(fs.list_files(path)) or (fs.exists(path) and not fs.isdir(path))


def upload_folder(local: str, remote: str, overwrite: bool = False) -> None:
    """Uploads the local folder ``local`` as ``remote``, markers last (see the module docstring);
    an existing ``remote`` is refused unless ``overwrite``, and then its markers go first."""
    remote = str(remote).rstrip("/")
    if is_nonempty(remote):
        if not overwrite:
            raise FileExistsError(
                f"{remote}: output already exists (pass --overwrite to replace it)"
            )
        old = fs.list_files(remote)
        for name in sorted((n for n in old if _marker_rank(n)), key=_marker_rank, reverse=True):
            fs.remove(f"{remote}/{name}")  # no longer a checkpoint from here on
        fs.rmtree(remote)
    # Markers last; among markers of a kind the deepest first: an Orbax step's own
    # commit_success.txt after those of its items (state/, data/, config/).
    names = sorted(fs.list_files(local), key=lambda n: (_marker_rank(n), -n.count("/"), n))
    for name in names:
        fs.upload(os.path.join(local, name), f"{remote}/{name}")
