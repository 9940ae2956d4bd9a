"""One way to write a file that never looks complete before it is: locally a temporary name in the
same folder, then a rename; on ``gs://``, which has no rename, the whole file in one upload (an
object appears complete or not at all); other schemes through ``tf.io.gfile`` as locally."""

from __future__ import annotations

import contextlib
import io
import json
import os
import uuid
from collections.abc import Iterator
from typing import Any, BinaryIO, TextIO

import bertjax.fs as fs


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w") -> Iterator[TextIO | BinaryIO]:
    """A file handle on a temporary sibling of ``path``, renamed to ``path`` when the block ends
    without an error (removed otherwise). ``mode`` is ``"w"`` (UTF-8 text) or ``"wb"``."""
    path = os.fspath(path)
    if fs.is_gcs(path):
        buffer = io.BytesIO() if "b" in mode else io.StringIO()
        yield buffer
        data = buffer.getvalue()
        fs.write_bytes(path, data if isinstance(data, bytes) else data.encode("utf-8"))
        return
    folder = os.path.dirname(path)
    if folder:
        fs.makedirs(folder)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        with fs.open_file(tmp, mode) as f:
            yield f
        fs.rename(tmp, path)
    finally:
        if fs.exists(tmp):
            fs.remove(tmp)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Writes ``text`` atomically."""
    with atomic_open(path, "w") as f:
        f.write(text)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Writes ``data`` atomically."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def write_json(path: str | os.PathLike, value: Any, *, indent: int = 2, sort_keys: bool = True):
    """Writes ``value`` as JSON (non-JSON numbers such as NumPy floats as floats) atomically."""
    text = json.dumps(value, indent=indent, sort_keys=sort_keys, default=float) + "\n"
    write_text(path, text)
