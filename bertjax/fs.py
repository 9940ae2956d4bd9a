"""File-system calls: the standard library for local paths, `tf.io.gfile` for remote ones (gs://,
s3://, ...), so that code working on local files (data preparation) never imports TensorFlow."""

from __future__ import annotations

import errno
import glob as glob_lib
import json
import os
import shutil
from typing import IO


def is_remote(path: str) -> bool:
    """True for a path with a scheme (gs://, s3://, ...), handled by tf.io.gfile."""
    return "://" in str(path)


def _gfile():
    import tensorflow as tf  # remote paths only

    return tf.io.gfile


def open_file(path: str, mode: str = "rb") -> IO:
    """A file object (binary modes: "rb", "wb"; text: "r", "w" as UTF-8)."""
    if is_remote(path):
        return _gfile().GFile(path, mode)
    return open(path, mode, **({} if "b" in mode else {"encoding": "utf-8"}))  # noqa: SIM115


def exists(path: str) -> bool:
    return _gfile().exists(path) if is_remote(path) else os.path.exists(path)


def isdir(path: str) -> bool:
    return _gfile().isdir(path) if is_remote(path) else os.path.isdir(path)


def read_bytes(path: str) -> bytes:
    with open_file(path, "rb") as f:
        return f.read()


def glob(pattern: str) -> list[str]:
    return _gfile().glob(pattern) if is_remote(pattern) else glob_lib.glob(pattern)


def remove(path: str) -> None:
    if is_remote(path):
        _gfile().remove(path)
    else:
        os.remove(path)


def makedirs(path: str) -> None:
    if is_remote(path):
        _gfile().makedirs(path)
    else:
        os.makedirs(path, exist_ok=True)


def size(path: str) -> int:
    return _gfile().stat(path).length if is_remote(path) else os.path.getsize(path)


def rename(source: str, target: str) -> None:
    """Renames, replacing target (atomic for local paths)."""
    if is_remote(source) or is_remote(target):
        _gfile().rename(source, target, overwrite=True)
    else:
        os.replace(source, target)


def rmtree(path: str) -> None:
    if is_remote(path):
        if _gfile().exists(path):
            _gfile().rmtree(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def not_found_errors(path: str) -> tuple[type[BaseException], ...]:
    """What reading a missing ``path`` raises (remote paths: TensorFlow's NotFoundError too)."""
    if is_remote(path):
        import tensorflow as tf  # remote paths only

        return (FileNotFoundError, tf.errors.NotFoundError)
    return (FileNotFoundError,)


def io_errors(path: str) -> tuple[type[BaseException], ...]:
    """What a failed read or write of ``path`` raises (remote paths: TensorFlow's OpError too)."""
    if is_remote(path):
        import tensorflow as tf  # remote paths only

        return (OSError, tf.errors.OpError)
    return (OSError,)


_REFUSALS = {
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


def write_refusal(path: str, err: BaseException) -> str | None:
    """Why writing ``path`` failed when its file system refuses writes there ("read-only file
    system", "permission denied", ...); None for any other failure (a full disk, a bad path)."""
    if isinstance(err, OSError):
        return _REFUSALS.get(err.errno)
    if is_remote(path):
        import tensorflow as tf  # remote paths only

        if isinstance(err, tf.errors.PermissionDeniedError):
            return "permission denied"
    return None


def utf8_error(path: str | os.PathLike, err: UnicodeDecodeError) -> ValueError:
    """The one-line error for a text file that is not UTF-8: ``path:line: not valid UTF-8``,
    naming the first bad line (a decoder's ``err`` only knows an offset in its buffer)."""
    path = os.fspath(path)
    with open_file(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as bad:
                return ValueError(f"{path}:{number}: not valid UTF-8 ({bad.reason})")
    return ValueError(f"{path}: not valid UTF-8 ({err.reason})")


def json_error(path: str | os.PathLike, err: ValueError, line: int | None = None) -> ValueError:
    """The one-line error for text that is not JSON: ``path:line: invalid JSON at column C: why``.
    ``line``: the file's line of a JSON-lines record (its columns counted in the record, a record
    cut short ending at its last character); without it, the decoder's line of a whole file."""
    path = os.fspath(path)
    if not isinstance(err, json.JSONDecodeError):  # e.g. bytes that are not UTF-8
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        return ValueError(f"{path}{'' if line is None else f':{line}'}: invalid JSON: {reason}")
    if line is None:
        line, column = err.lineno, err.colno
    else:
        column = min(err.pos, len(err.doc.rstrip("\r\n"))) + 1
    return ValueError(f"{path}:{line}: invalid JSON at column {column}: {err.msg}")


def missing_folders(path: str) -> list[str]:
    """The folders ``makedirs(path)`` would create, ``path`` first, then its missing parents (none
    for a remote path, whose folders are not things of their own)."""
    if is_remote(path):
        return []
    missing, path = [], os.path.abspath(path)
    while not os.path.lexists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def remove_empty_folders(folders: list[str]) -> None:
    """Removes each of ``folders`` (deepest first, as ``missing_folders`` lists them) that holds
    nothing but empty folders; the first that holds anything is kept, and so are the rest. Only
    empty folders are ever removed (``os.rmdir``): never a file, whoever wrote it."""
    for folder in folders:
        for root, _, _ in os.walk(folder, topdown=False):
            try:
                os.rmdir(root)
            except OSError:  # not empty (a file, a link, a folder holding one) or already gone
                pass
        if os.path.lexists(folder):
            return
