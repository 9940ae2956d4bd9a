"""Streaming corpus readers: documents as lists of sentences, from files, globs, gs:// or TFDS.

A corpus spec is one or more comma-separated entries, each either
  * a path or glob (local or any `tf.io.gfile` scheme such as `gs://`); or
  * `tfds:NAME[/CONFIG]:SPLIT[:FEATURE]` (FEATURE defaults to `text`), read with
    `tfds.load(..., data_dir=tfds_data_dir, download=False)`.

Files named `*.gz` or `*.zst`/`*.zstd` are decompressed on the fly (any format).

Formats (`fmt`):
  * "bert": the original BERT format: one sentence per line, a blank line between documents.
  * "text": raw text (e.g. Project Gutenberg e-texts). A UTF-8 BOM and CRLF line ends are accepted; when a
    `*** START OF ... PROJECT GUTENBERG ...` line appears in the first `GUTENBERG_HEADER_SCAN_LINES` lines,
    everything up to it is dropped, and reading stops at the `*** END OF ...` line (the licence). Lines of a
    paragraph (blank-line separated) are joined with spaces and cut into sentences by `split_sentences`.
    A document ends at the end of the file, at a heading paragraph (CHAPTER/BOOK/PART/VOLUME/STAVE/LETTER/
    PREFACE/EPILOGUE/..., a bare Roman or Arabic numeral, `[ 12 ]`; the heading itself is dropped), or at
    a run of `DOCUMENT_BREAK_BLANK_LINES` or more blank lines. For TFDS every example is one document
    (a "text" example is split into paragraphs at newlines).
  * "jsonl": one JSON object per line, "parquet": Parquet files (`bertjax.data.formats`); every row is
    one document, its `text_column` string split into paragraphs at newlines and each paragraph into
    sentences by `split_sentences` (as a "text" TFDS example).

Everything is a generator: memory does not grow with the corpus. Empty documents are never yielded.
"""

from __future__ import annotations

import dataclasses
import glob as glob_lib
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence

from bertjax import fs
from bertjax.data import formats

FORMATS = ("bert", "text", "jsonl", "parquet")
ROW_FORMATS = ("jsonl", "parquet")  # one document per row, read from a text column
GUTENBERG_HEADER_SCAN_LINES = 400
DOCUMENT_BREAK_BLANK_LINES = 3
_MAX_HEADING_CHARS = 80

_PG_START = re.compile(r"^\s*\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG", re.IGNORECASE)
_PG_END = re.compile(
    r"^\s*(\*{3}\s*END OF (THE|THIS)|END OF (THE|THIS)) PROJECT GUTENBERG", re.IGNORECASE
)
_PG_CREDIT = re.compile(r"^(Produced by|E-?text prepared by|Transcribed from)", re.IGNORECASE)
_NUMERAL = r"([IVXLCDM]+|\d+|one|two|three|four|five|six|seven|eight|nine|ten|the (first|last))"
_HEADING = re.compile(
    r"^(?:(chapter|book|part|volume|stave|letter|adventure|preface|prologue|epilogue|introduction"
    rf"|appendix|conclusion|finale)\b\s*{_NUMERAL}?|{_NUMERAL}|\[\s*\d+\s*\])"
    r"\s*(?:$|[.:\-—]|\s{2,}|\s+(?-i:[A-Z]))",
    re.IGNORECASE,
)
# Tokens ending in "." that do not end a sentence when a capitalised word follows (titles, Latin, firms).
_ABBREVIATIONS = frozenset(
    "mr mrs ms messrs mme mlle dr prof rev revd hon st sr jr gen col capt lt sgt maj adm gov pres sen "
    "rep esq fr mt ft e.g i.e cf viz vs al inc ltd co corp bros dept univ".split()
)
_CLOSERS = "\"'”’»)]_*"
_OPENERS = "\"'“‘«([_*"
_BOUNDARY = re.compile(rf"([.?!…]+)([{re.escape(_CLOSERS)}]*)\s+(?=[{re.escape(_OPENERS)}]*(\S))")
_CJK_BOUNDARY = re.compile(r"([。！？]+[」』”’）]*)(?=\S)")


@dataclasses.dataclass(frozen=True)
class Source:
    """One unit of reading (and of parallel work): a file, or one slice of a TFDS split."""

    kind: str  # "file" | "tfds"
    path: str  # file path, or the TFDS name[/config]
    split: str = ""  # TFDS split (sub-split) string
    feature: str = "text"
    data_dir: str | None = None

    @property
    def name(self) -> str:
        """A human-readable name for messages."""
        return self.path if self.kind == "file" else f"tfds:{self.path}:{self.split}:{self.feature}"


def split_sentences(text: str) -> list[str]:
    """Cuts a paragraph into sentences with rules for abbreviations, initials, decimals and quotes.

    A boundary is `.`, `?`, `!` or `…` (optionally followed by closing quotes/brackets) then whitespace then
    an upper-case letter (possibly after opening quotes/brackets); `.` after a known abbreviation
    (Mr., Dr., e.g., ...) or a single-letter initial (other than "I") is not a boundary. Decimals and
    `e.g.`-style inner periods have no whitespace after the period and are never cut. CJK `。！？` always
    end a sentence.
    """
    text = " ".join(text.split())
    if not text:
        return []
    cuts = []
    for match in _BOUNDARY.finditer(text):
        if not match.group(3).isupper():
            continue
        if match.group(1) == "." and not match.group(2):
            word_start = text.rfind(" ", 0, match.start()) + 1
            word = text[word_start : match.start()].lstrip(_OPENERS)
            if word.lower() in _ABBREVIATIONS or (
                len(word) == 1 and word.isalpha() and word != "I"
            ):
                continue
            if "." in word and all(len(p) <= 2 for p in word.split(".")):
                continue  # U.S., a.m., Ph.D-style dotted abbreviations.
        cuts.append(match.end(2))
    cuts.extend(m.end() for m in _CJK_BOUNDARY.finditer(text))
    sentences, start = [], 0
    for cut in sorted(set(cuts)):
        piece = text[start:cut].strip()
        if piece:
            sentences.append(piece)
        start = cut
    tail = text[start:].strip()
    if tail:
        sentences.append(tail)
    return sentences


def is_heading(line: str) -> bool:
    """True for a short chapter/book/part heading line such as `CHAPTER IV.` or `[ 3 ]`."""
    line = line.strip()
    return 0 < len(line) <= _MAX_HEADING_CHARS and _HEADING.match(line) is not None


def _expand_files(pattern: str) -> list[str]:
    """The files matching one glob (sorted), through bertjax.fs for remote schemes."""
    if formats.is_remote(pattern):
        return sorted(fs.glob(pattern))
    if glob_lib.has_magic(pattern):
        return sorted(p for p in glob_lib.glob(pattern, recursive=True) if os.path.isfile(p))
    if os.path.isdir(pattern):
        raise ValueError(
            f"corpus path {pattern} is a directory; give a glob such as {pattern}/*.txt"
        )
    if not os.path.isfile(pattern):
        raise FileNotFoundError(f"corpus file {pattern} does not exist")
    return [pattern]


def _tfds_sources(entry: str, data_dir: str | None) -> list[Source]:
    parts = entry.split(":")
    if len(parts) not in (3, 4) or not parts[1] or not parts[2]:
        raise ValueError(
            f"bad TFDS corpus spec {entry!r}: expected tfds:NAME[/CONFIG]:SPLIT[:FEATURE]"
        )
    import tensorflow_datasets as tfds

    name, split = parts[1], parts[2]
    feature = parts[3] if len(parts) == 4 else "text"
    try:
        info = tfds.builder(name, data_dir=data_dir).info
    except Exception as err:  # noqa: BLE001 - TFDS raises many types; re-raise as one clear line.
        raise ValueError(f"TFDS dataset {name!r} not found in data_dir={data_dir}: {err}") from err
    if feature not in info.features:
        raise ValueError(f"TFDS dataset {name!r} has no feature {feature!r}: {list(info.features)}")
    num_shards = info.splits[split].num_shards if split in info.splits else 1
    subsplits = tfds.even_splits(split, n=max(1, num_shards)) if num_shards > 1 else [split]
    return [Source("tfds", name, str(s), feature, data_dir) for s in subsplits]


def list_sources(spec: str | Sequence[str], *, tfds_data_dir: str | None = None) -> list[Source]:
    """Expands a corpus spec (comma-separated entries, or a list of such) into ordered work units."""
    parts = [spec] if isinstance(spec, str) else list(spec)
    entries = [e.strip() for part in parts for e in str(part).split(",") if e.strip()]
    if not entries:
        raise ValueError("empty corpus spec: give --input as files, globs or tfds:NAME:SPLIT")
    sources: list[Source] = []
    for entry in entries:
        if entry.startswith("tfds:"):
            sources.extend(_tfds_sources(entry, tfds_data_dir))
            continue
        files = _expand_files(entry)
        if not files:
            raise FileNotFoundError(f"corpus glob {entry} matches no files")
        sources.extend(Source("file", f) for f in files)
    return sources


def iter_lines(path: str, on_bytes: Callable[[int], None] | None = None) -> Iterator[str]:
    """Lines of a UTF-8 text file without line ends (BOM and CRLF handled), local or tf.io.gfile,
    `.gz`/`.zst` decompressed.

    `on_bytes(n)` (optional) is called with the stored (compressed) bytes read, for progress bars.
    """
    with formats.open_stream(path) as (stream, raw):
        for number, raw_line in formats.numbered_lines(stream, raw, on_bytes):
            if number == 1 and raw_line.startswith(b"\xef\xbb\xbf"):
                raw_line = raw_line[3:]
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid UTF-8 ({err.reason})") from None
            yield line.rstrip("\r\n")


def _strip_gutenberg(lines: Iterator[str]) -> Iterator[str]:
    """Drops a Project Gutenberg header (when its START line is near the top) and the END licence."""
    head = []
    for line in lines:
        head.append(line)
        if _PG_START.match(line):
            head = []
            break
        if len(head) >= GUTENBERG_HEADER_SCAN_LINES:
            break
    for line in _chain(head, lines):
        if _PG_END.match(line):
            return
        yield line


def _chain(first: Iterable[str], rest: Iterator[str]) -> Iterator[str]:
    yield from first
    yield from rest


def text_documents(lines: Iterable[str]) -> Iterator[list[str]]:
    """Documents from raw text lines (the "text" format rules in the module docstring)."""
    doc: list[str] = []
    paragraph: list[str] = []
    blank_run = 0
    seen_text = False

    def flush() -> Iterator[list[str]]:
        nonlocal doc, seen_text
        if not paragraph:
            return
        if all(is_heading(p) for p in paragraph):
            if doc:
                yield doc
            doc = []
        elif not (not seen_text and _PG_CREDIT.match(paragraph[0])):
            sentences = split_sentences(" ".join(paragraph))
            doc.extend(sentences)
            seen_text = seen_text or bool(sentences)
        paragraph.clear()

    for line in _strip_gutenberg(iter(lines)):
        if line.strip():
            if blank_run >= DOCUMENT_BREAK_BLANK_LINES and doc:
                yield doc
                doc = []
            blank_run = 0
            paragraph.append(line.strip())
            continue
        blank_run += 1
        yield from flush()
    yield from flush()
    if doc:
        yield doc


def bert_documents(lines: Iterable[str]) -> Iterator[list[str]]:
    """Documents in the original BERT format: one sentence per line, blank lines between documents."""
    doc: list[str] = []
    for line in lines:
        line = line.strip()
        if line:
            doc.append(line)
        elif doc:
            yield doc
            doc = []
    if doc:
        yield doc


def row_document(text: str) -> list[str]:
    """The sentences of one row's text: paragraphs at newlines, each cut by `split_sentences`."""
    return [s for para in text.splitlines() for s in split_sentences(para)]


def row_documents(texts: Iterable[str]) -> Iterator[list[str]]:
    """Documents of a row corpus ("jsonl", "parquet"): one per non-empty row text."""
    for text in texts:
        doc = row_document(text)
        if doc:
            yield doc


def _tfds_documents(source: Source, fmt: str) -> Iterator[list[str]]:
    import tensorflow_datasets as tfds

    ds = tfds.load(source.path, split=source.split, data_dir=source.data_dir, download=False)
    for example in tfds.as_numpy(ds):
        value = example[source.feature]
        text = value.decode("utf-8") if isinstance(value, bytes) else str(value)
        if fmt == "bert":
            doc = [s.strip() for s in text.splitlines() if s.strip()]
        else:
            doc = row_document(text)
        if doc:
            yield doc


def iter_source_documents(
    source: Source,
    fmt: str,
    on_bytes: Callable[[int], None] | None = None,
    text_column: str = "text",
    text_column_setting: str = "text_column",
) -> Iterator[list[str]]:
    """The documents of one work unit (`on_bytes` as in `iter_lines`; unused for TFDS).

    `text_column` is the JSON key / Parquet column of the row formats (ignored by the others);
    `text_column_setting` is what errors call the option that chose it (`--text_column`,
    `data.text_column`).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown corpus format {fmt!r}; expected one of {FORMATS}")
    if source.kind == "tfds":
        return _tfds_documents(source, fmt)
    if fmt == "jsonl":
        texts = formats.jsonl_texts(source.path, text_column, on_bytes, text_column_setting)
        return row_documents(texts)
    if fmt == "parquet":
        texts = formats.parquet_texts(source.path, text_column, on_bytes, text_column_setting)
        return row_documents(texts)
    reader = bert_documents if fmt == "bert" else text_documents
    return reader(iter_lines(source.path, on_bytes))


def iter_documents(
    spec: str | Sequence[str],
    fmt: str = "bert",
    *,
    tfds_data_dir: str | None = None,
    text_column: str = "text",
    text_column_setting: str = "text_column",
) -> Iterator[list[str]]:
    """All documents (lists of sentence strings) of a corpus spec, in source order, streamed
    (`text_column`, `text_column_setting` as in `iter_source_documents`)."""
    for source in list_sources(spec, tfds_data_dir=tfds_data_dir):
        yield from iter_source_documents(
            source, fmt, text_column=text_column, text_column_setting=text_column_setting
        )
