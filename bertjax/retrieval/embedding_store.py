"""Embedding shards on disk (what ``bertjax embed`` writes) and :func:`load_embeddings`.

An output folder holds, per shard ``k`` of ``n`` (shard ``k`` is the texts ``k * shard_size`` up
to ``(k + 1) * shard_size`` of the input, in input order):

* ``npy`` format: ``embeddings-KKKKK-of-NNNNN.npy`` ([rows, dim] float16 or float32, NumPy's own
  format, no pickle) and ``embeddings-KKKKK-of-NNNNN.ids.json`` (a JSON list of the rows' ids);
* ``parquet`` format: ``embeddings-KKKKK-of-NNNNN.parquet`` with a string column ``id`` and a
  ``fixed_size_list<float16|float32>[dim]`` column ``embedding``.

Every file is written under a temporary name and renamed (``bertjax.atomic``). ``run.json``
(written first) says what the folder is the output of (model, input, settings: see
``embed_corpus``) and ``manifest.json`` (written last, when every shard is there) lists the shards
with their row counts: a folder with a manifest is complete.
"""

from __future__ import annotations

import io
import json
import os

import numpy as np

import bertjax.fs as fs
from bertjax import atomic

FORMATS = ("npy", "parquet")
DTYPES = ("float16", "float32")
MANIFEST = "manifest.json"
RUN = "run.json"


def shard_files(fmt: str, index: int, count: int) -> tuple[str, ...]:
    """The file names of shard ``index`` of ``count`` (the embeddings file first)."""
    stem = f"embeddings-{index:05d}-of-{count:05d}"
    return (f"{stem}.parquet",) if fmt == "parquet" else (f"{stem}.npy", f"{stem}.ids.json")


def shard_done(folder: str, fmt: str, index: int, count: int) -> bool:
    """Whether every file of the shard is there (each one is renamed into place whole)."""
    return all(fs.exists(os.path.join(folder, f)) for f in shard_files(fmt, index, count))


def _parquet_bytes(ids: list[str], matrix: np.ndarray) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    vectors = pa.FixedSizeListArray.from_arrays(pa.array(matrix.reshape(-1)), matrix.shape[1])
    table = pa.table({"id": pa.array(ids, pa.string()), "embedding": vectors})
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    return buffer.getvalue().to_pybytes()


def write_shard(
    folder: str, fmt: str, index: int, count: int, ids: list[str], matrix: np.ndarray
) -> list[str]:
    """Writes one shard (``matrix`` [len(ids), dim] in the dtype to store); returns its files.
    The ids file of an ``npy`` shard is written last: a shard is done when all its files are."""
    names = shard_files(fmt, index, count)
    if fmt == "parquet":
        atomic.write_bytes(os.path.join(folder, names[0]), _parquet_bytes(ids, matrix))
    else:
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(matrix), allow_pickle=False)
        atomic.write_bytes(os.path.join(folder, names[0]), buffer.getvalue())
        atomic.write_text(os.path.join(folder, names[1]), json.dumps(ids, ensure_ascii=False))
    return list(names)


def read_shard(folder: str, fmt: str, files: list[str]) -> tuple[list[str], np.ndarray]:
    """(ids, matrix) of one shard's files."""
    path = os.path.join(folder, files[0])
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pq.read_table(pa.BufferReader(fs.read_bytes(path)))
        column = table.column("embedding").combine_chunks()
        dim = column.type.list_size
        matrix = np.asarray(column.values.to_numpy(zero_copy_only=False)).reshape(-1, dim)
        return table.column("id").to_pylist(), matrix
    matrix = np.load(io.BytesIO(fs.read_bytes(path)), allow_pickle=False)
    ids_path = os.path.join(folder, files[1])
    return json.loads(fs.read_bytes(ids_path).decode("utf-8")), matrix


def read_json(path: str) -> dict | None:
    """A JSON object file, None when absent; a one-line error when it is not JSON."""
    if not fs.exists(path):
        return None
    try:
        value = json.loads(fs.read_bytes(path).decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a JSON file ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object")
    return value


def load_embeddings(
    folder: str | os.PathLike, dtype: str | np.dtype | None = None
) -> tuple[list[str], np.ndarray]:
    """(ids, matrix [n, dim]) of a finished ``bertjax embed`` output folder, in input order;
    ``matrix`` in the stored dtype, or cast to ``dtype``."""
    folder = os.fspath(folder)
    manifest = read_json(os.path.join(folder, MANIFEST))
    if manifest is None:
        hint = (
            " (an unfinished run: the same command finishes it)"
            if fs.exists(os.path.join(folder, RUN))
            else ""
        )
        raise FileNotFoundError(f"{folder}: no {MANIFEST}{hint}")
    fmt, dim = manifest["format"], int(manifest["dim"])
    ids: list[str] = []
    parts = []
    for shard in manifest["shards"]:
        shard_ids, matrix = read_shard(folder, fmt, shard["files"])
        where = os.path.join(folder, shard["files"][0])
        if matrix.ndim != 2 or matrix.shape[1] != dim:
            raise ValueError(f"{where}: shape {matrix.shape}, the manifest says [*, {dim}]")
        if not len(shard_ids) == len(matrix) == int(shard["count"]):
            raise ValueError(
                f"{where}: {len(matrix)} vectors and {len(shard_ids)} ids, the manifest says "
                f"{shard['count']}"
            )
        ids += shard_ids
        parts.append(matrix)
    matrix = np.concatenate(parts) if parts else np.zeros((0, dim), manifest["dtype"])
    return ids, matrix if dtype is None else matrix.astype(dtype)
