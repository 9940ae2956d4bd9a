"""The texts ``bertjax embed`` reads, with their ids: JSON lines, Parquet or plain text, local or
any ``tf.io.gfile`` scheme (``gs://``), ``.gz``/``.zst`` decompressed.

* JSON lines (``.jsonl``, ``.json``, ``.ndjson``): one object per line (blank lines skipped) with
  the id key (default ``_id``) and the text key (default ``text``); where the title key (default
  ``title``) is there, the text embedded is the title, a space and the text, stripped, as BEIR and
  MTEB embed a document (:func:`bertjax.retrieval.beir.document_text`).
* Parquet (``.parquet``): the same as columns; the title column is optional.
* Plain text (any other name): one text per line, its id the line number (1-based, counted on
  over the files of a glob in name order, as ``cat`` would number them).

An empty id key (``id_field=""``) numbers the JSONL lines / Parquet rows the same way. Ids are
strings (a JSON number id becomes its decimal text). Bad input is one ValueError naming the file
and its line (JSONL, text) or row (Parquet, 1-based): invalid JSON, a missing or non-string text,
an empty line of a plain-text file, a missing id, an id seen before (with where it was first).

A JSONL or Parquet record whose text (and title) is empty is a document all the same: real BEIR
corpora hold some (Cranfield's ``corpus.jsonl`` line 471), and it is embedded as the empty text,
as ``evaluate retrieval``, training and sentence-transformers embed it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import bertjax.fs as fs
from bertjax.data import formats
from bertjax.retrieval.beir import document_text

FORMATS = ("auto", "jsonl", "parquet", "text")
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


@dataclasses.dataclass(frozen=True)
class Fields:
    """Which keys / columns hold the id, the text and the (optional) title; ``id=""``: numbered,
    ``title=""``: no title."""

    text: str = "text"
    id: str = "_id"
    title: str = "title"


@dataclasses.dataclass
class Corpus:
    ids: list[str]
    texts: list[str]
    files: list[str]
    fingerprint: str  # sha256 of the ids and texts, in order


def input_files(pattern: str) -> list[str]:
    """The files of a path or glob (``*``, ``?``, ``[``), sorted by name."""
    if any(c in pattern for c in "*?["):
        found = sorted(fs.glob(pattern))
        if not found:
            raise FileNotFoundError(f"{pattern}: no file matches")
        return found
    if not fs.exists(pattern):
        raise FileNotFoundError(f"{pattern}: no such file")
    if fs.isdir(pattern):
        raise ValueError(f"{pattern}: a folder; give a file or a glob (e.g. {pattern}/*.jsonl)")
    return [pattern]


def file_format(path: str, requested: str = "auto") -> str:
    """``requested``, or for "auto" the format the name says (compression suffixes ignored)."""
    if requested not in FORMATS:
        raise ValueError(f"input format {requested!r} is not one of {', '.join(FORMATS)}")
    if requested != "auto":
        return requested
    name = path
    for suffix in formats.COMPRESSED:
        name = name.removesuffix(suffix)
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    return "parquet" if name.endswith(".parquet") else "text"


class _Collector:
    """Ids and texts in order, duplicate ids refused with where each was first seen."""

    def __init__(self):
        self.ids: list[str] = []
        self.texts: list[str] = []
        self.first: dict[str, str] = {}
        self.digest = hashlib.sha256()

    def add(self, doc_id: str, text: str, where: str, allow_empty: bool = False) -> None:
        if not allow_empty and not text.strip():
            raise ValueError(f"{where}: empty text")
        if doc_id in self.first:
            raise ValueError(f"{where}: id {doc_id!r} again (first at {self.first[doc_id]})")
        self.first[doc_id] = where
        self.ids.append(doc_id)
        self.texts.append(text)
        for part in (doc_id, text):
            data = part.encode("utf-8")
            self.digest.update(len(data).to_bytes(8, "little") + data)


def _id_text(doc_id) -> str | None:
    """An id value as a string (strings and integers; None for anything else)."""
    if isinstance(doc_id, str) and doc_id:
        return doc_id
    if isinstance(doc_id, int) and not isinstance(doc_id, bool):
        return str(doc_id)
    return None


def _record_text(record: dict, fields: Fields, where: str, kind: str) -> str:
    text = record.get(fields.text)
    if fields.text not in record:
        keys = ", ".join(map(repr, record)) or "none"
        raise ValueError(f"{where}: no {fields.text!r} {kind} (--text_field); it has {keys}")
    if not isinstance(text, str):
        raise ValueError(f"{where}: {fields.text!r} is {type(text).__name__}, not a string")
    title = record.get(fields.title) if fields.title else None
    if title is not None and not isinstance(title, str):
        raise ValueError(f"{where}: {fields.title!r} is {type(title).__name__}, not a string")
    return document_text(title, text) if fields.title else text


def _record_id(record: dict, fields: Fields, where: str, number: int, kind: str) -> str:
    if not fields.id:
        return str(number)
    if fields.id not in record:
        raise ValueError(f"{where}: no {fields.id!r} {kind} (--id_field)")
    doc_id = _id_text(record[fields.id])
    if doc_id is None:
        raise ValueError(f"{where}: id {record[fields.id]!r} is not a non-empty string or integer")
    return doc_id


def _read_jsonl(path: str, fields: Fields, out: _Collector, start: int) -> int:
    count = 0
    with formats.open_stream(path) as (stream, raw):
        for number, line in formats.numbered_lines(stream, raw):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except UnicodeDecodeError as err:
                raise ValueError(f"{where}: not valid UTF-8 ({err.reason})") from None
            except ValueError as err:
                raise fs.json_error(path, err, number) from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            count += 1
            text = _record_text(record, fields, where, "key")
            out.add(_record_id(record, fields, where, start + count, "key"), text, where, True)
    return count


def _read_text(path: str, out: _Collector, start: int) -> int:
    number = 0
    with formats.open_stream(path) as (stream, raw):
        for number, line in formats.numbered_lines(stream, raw):
            where = f"{path}:{number}"
            try:
                text = line.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as err:
                raise ValueError(f"{where}: not valid UTF-8 ({err.reason})") from None
            out.add(str(start + number), text, where)
    return number


def _read_parquet(path: str, fields: Fields, out: _Collector, start: int) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        source = path if not fs.is_remote(path) else pa.BufferReader(fs.read_bytes(path))
        parquet = pq.ParquetFile(source)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{path}: not a Parquet file ({str(err).splitlines()[0]})") from None
    names = parquet.schema_arrow.names
    wanted = [fields.text, *([fields.id] if fields.id else [])]
    for column, flag in zip(wanted, ("--text_field", "--id_field")):
        if column not in names:
            columns = ", ".join(map(repr, names))
            raise ValueError(f"{path}: no column {column!r} ({flag}); the columns are {columns}")
    columns = [*wanted, *([fields.title] if fields.title and fields.title in names else [])]
    row = 0
    for batch in parquet.iter_batches(batch_size=4096, columns=columns):
        for record in batch.to_pylist():
            row += 1
            where = f"{path}: row {row}"
            text = _record_text(record, fields, where, "column")
            out.add(_record_id(record, fields, where, start + row, "column"), text, where, True)
    return row


def read_corpus(pattern: str, fields: Fields = Fields(), input_format: str = "auto") -> Corpus:
    """Every text of the files ``pattern`` names (see the module docstring), in file-name order."""
    files = input_files(pattern)
    out = _Collector()
    numbered = 0  # lines / rows before this file, for numbered ids
    for path in files:
        kind = file_format(path, input_format)
        try:
            if kind == "jsonl":
                numbered += _read_jsonl(path, fields, out, numbered)
            elif kind == "parquet":
                numbered += _read_parquet(path, fields, out, numbered)
            else:
                numbered += _read_text(path, out, numbered)
        except UnicodeDecodeError as err:
            raise fs.utf8_error(path, err) from None
    if not out.ids:
        raise ValueError(f"{pattern}: no texts")
    return Corpus(out.ids, out.texts, [os.fspath(f) for f in files], out.digest.hexdigest())
