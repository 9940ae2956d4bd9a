"""Byte streams of corpus files (local, gs:// or any `tf.io.gfile` scheme, `.gz`/`.zst` decompressed) and
the texts of row corpora: JSONL (one JSON object per line) and Parquet, one document per row.

Everything streams: JSONL line by line, Parquet one record batch of a row group at a time, so memory
stays flat in the file's size. Bad input is a one-line ValueError naming the file and the line
(JSONL) or row (Parquet), or the available columns when the text column is missing.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
from collections.abc import Callable, Iterator
from typing import BinaryIO

import bertjax.fs as fs

COMPRESSED = (".gz", ".zst", ".zstd")
_PARQUET_BATCH_ROWS = 1024


def is_remote(path: str) -> bool:
    """True for a path with a scheme (gs://, s3://, ...), read through bertjax.fs."""
    return "://" in path


def open_raw(path: str) -> BinaryIO:
    """The file's bytes: builtin open for local paths, ``bertjax.fs`` for remote ones (gcsfs for
    gs://, tf.io.gfile for other schemes: workers stay TensorFlow-free for local and gs://)."""
    if is_remote(path):
        return fs.open_file(path, "rb")
    return open(path, "rb")  # noqa: SIM115 - the caller closes it


class _RandomAccess(io.RawIOBase):
    """A remote file (gcsfs or tf.io.gfile) as the seekable raw file pyarrow reads Parquet from."""

    def __init__(self, gfile):
        super().__init__()
        self._file = gfile

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self._file.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._file.seek(offset, whence)
        return self._file.tell()

    def tell(self) -> int:
        return self._file.tell()


def _zstd_reader(raw: BinaryIO, path: str) -> BinaryIO:
    try:
        import zstandard
    except ImportError:
        raise ValueError(
            f"{path}: reading .zst files needs the zstandard package "
            "(pip install zstandard, or bertjax[zstd])"
        ) from None
    reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    return io.BufferedReader(reader, 1 << 20)  # line-iterable


@contextlib.contextmanager
def open_stream(path: str) -> Iterator[tuple[BinaryIO, BinaryIO]]:
    """(decompressed byte stream, raw file) of a corpus file; `.gz`/`.zst`/`.zstd` by name.

    The raw file's position (`tell()`) is how far into the file's stored bytes reading got, for
    progress bars.
    """
    raw = open_raw(path)
    with raw:
        if path.endswith(".gz"):
            stream = gzip.GzipFile(fileobj=raw, mode="rb")
        elif path.endswith((".zst", ".zstd")):
            stream = _zstd_reader(raw, path)
        else:
            yield raw, raw
            return
        with stream:
            yield stream, raw


def numbered_lines(
    stream: BinaryIO, raw: BinaryIO, on_bytes: Callable[[int], None] | None = None
) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line) of an ``open_stream`` pair; ``on_bytes(n)`` (optional) is told
    the stored (compressed) bytes each line took, for progress bars."""
    done = 0
    for number, line in enumerate(stream, start=1):
        if on_bytes is not None:
            position = raw.tell() if raw is not stream else done + len(line)
            on_bytes(position - done)
            done = position
        yield number, line


def jsonl_texts(
    path: str,
    column: str = "text",
    on_bytes: Callable[[int], None] | None = None,
    setting: str = "text_column",
) -> Iterator[str]:
    """The `column` string of every JSON object line of a JSONL file (blank lines skipped).

    A row whose value is null is skipped (an empty document). Raises ValueError naming
    `path:line` for invalid JSON, a non-object line, a missing key (listing the keys the row has,
    and naming `setting`, what the caller calls the option that chose `column`: `--text_column`,
    `data.text_column`) or a value that is not a string.
    """
    with open_stream(path) as (stream, raw):
        for number, line in numbered_lines(stream, raw, on_bytes):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                raise fs.json_error(path, err, number) from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}:{number}: expected a JSON object, got {type(row).__name__}"
                )
            if column not in row:
                raise ValueError(
                    f"{path}:{number}: no key {column!r} ({setting}); the row has keys "
                    f"{', '.join(map(repr, row)) or 'none'}"
                )
            text = row[column]
            if text is None:
                continue
            if not isinstance(text, str):
                raise ValueError(
                    f"{path}:{number}: {column!r} is a {type(text).__name__}, not a string"
                )
            yield text


def parquet_texts(
    path: str,
    column: str = "text",
    on_bytes: Callable[[int], None] | None = None,
    setting: str = "text_column",
) -> Iterator[str]:
    """The `column` strings of a Parquet file, one record batch of a row group at a time.

    Null values are skipped. Raises ValueError for a file that is not Parquet, a missing column
    (listing the columns there are, and naming `setting` as `jsonl_texts` does) or a column that
    does not hold strings.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open_raw(path) as raw:
        try:
            parquet = pq.ParquetFile(raw if not is_remote(path) else _RandomAccess(raw))
        except (pa.ArrowException, OSError) as err:
            raise ValueError(f"{path}: not a Parquet file ({str(err).splitlines()[0]})") from None
        names = parquet.schema_arrow.names
        if column not in names:
            raise ValueError(
                f"{path}: no column {column!r} ({setting}); the columns are "
                f"{', '.join(map(repr, names))}"
            )
        field = parquet.schema_arrow.field(column)
        if not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)):
            raise ValueError(f"{path}: column {column!r} holds {field.type}, not strings")
        total_rows = max(parquet.metadata.num_rows, 1)
        size = fs.size(path) if on_bytes is not None else 0
        rows = reported = 0
        for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[column]):
            for text in batch.column(0).to_pylist():
                if text is not None:
                    yield text
            rows += batch.num_rows
            if on_bytes is not None:
                position = size * rows // total_rows
                on_bytes(position - reported)
                reported = position
