"""Tokenized documents of a corpus unit, a block of text at a time: `spans.Document`s.

A "bert"-format file is read in blocks of about `BLOCK_BYTES` that end at a line end and tokenized a
block at a time (`BulkWordPiece.encode_lines`); blank lines (`str.strip`) end documents, as in
`corpus.bert_documents`. The other formats' documents (lists of sentences, `corpus`) are joined into
the same layout (a sentence per line, a blank line after each document) and tokenized the same way.
Sentences without ids are dropped and documents without sentences skipped. A tokenizer without a
bulk encoder (SentencePiece) encodes sentence by sentence. Memory is bounded by the block size.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from bertjax.data import corpus, formats
from bertjax.data.spans import Document

BLOCK_BYTES = 1 << 20
_BOM = b"\xef\xbb\xbf"


def _bert_blocks(path: str, on_bytes: Callable[[int], None] | None) -> Iterator[bytes]:
    """The file's bytes in blocks of whole lines (the b"\\n" between blocks dropped)."""
    with formats.open_stream(path) as (stream, raw):
        rest, done, first = b"", 0, True
        while True:
            data = stream.read(BLOCK_BYTES)
            if on_bytes is not None:
                position = raw.tell()
                on_bytes(position - done)
                done = position
            if first and data.startswith(_BOM):
                data = data[3:]
            first = False
            if not data:
                if rest:
                    yield rest
                return
            data = rest + data
            cut = data.rfind(b"\n")
            if cut < 0:
                rest = data
                continue
            yield data[:cut]
            rest = data[cut + 1 :]


def _joined_blocks(documents: Iterable[list[str]]) -> Iterator[bytes]:
    """Documents (lists of sentences) as blocks of lines, a blank line after each document."""
    texts: list[str] = []
    size = 0
    for doc in documents:
        texts.append("\n".join(doc))
        size += sum(map(len, doc))
        if size >= BLOCK_BYTES // 4:
            yield ("\n\n".join(texts) + "\n").encode("utf-8")  # ends with a blank line
            texts, size = [], 0
    if texts:
        yield ("\n\n".join(texts) + "\n").encode("utf-8")


def _check_utf8(block: bytes, path: str, first_line: int) -> None:
    """ValueError naming the first line of a block that is not valid UTF-8."""
    for number, line in enumerate(block.split(b"\n"), start=first_line):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid UTF-8 ({err.reason})") from None


def _line_documents(blocks: Iterable) -> Iterator[Document]:
    """Documents from the tokenized blocks (`Lines`); a document may span blocks."""
    pending_ids: list[np.ndarray] = []
    pending_counts: list[np.ndarray] = []

    def document() -> Document | None:
        counts = np.concatenate(pending_counts) if pending_counts else np.zeros(0, np.int64)
        counts = counts[counts > 0]
        if not len(counts):
            return None
        ids = np.concatenate(pending_ids) if len(pending_ids) > 1 else pending_ids[0]
        return Document(ids, [0, *np.cumsum(counts).tolist()])

    for lines in blocks:
        ends = np.cumsum(lines.counts)
        breaks = np.flatnonzero(lines.blank).tolist()
        lo = 0
        for hi in [*breaks, len(lines.counts)]:
            if hi > lo:
                start = int(ends[lo - 1]) if lo else 0
                pending_ids.append(lines.ids[start : int(ends[hi - 1])])
                pending_counts.append(lines.counts[lo:hi])
            if hi < len(lines.counts):  # a blank line: the document ends
                doc = document()
                if doc is not None:
                    yield doc
                pending_ids, pending_counts = [], []
            lo = hi + 1
    doc = document()
    if doc is not None:
        yield doc


def _sentence_documents(documents: Iterable[list[str]], tok) -> Iterator[Document]:
    """Sentence by sentence, for tokenizers without a bulk encoder."""
    for doc in documents:
        ids = [s for s in map(tok.encode, doc) if s]
        if ids:
            flat = np.fromiter(itertools.chain.from_iterable(ids), np.int32)
            yield Document(flat, [0, *itertools.accumulate(map(len, ids))])


def tokenized_documents(
    source: corpus.Source,
    fmt: str,
    tok,
    on_bytes: Callable[[int], None] | None = None,
    text_column: str = "text",
    text_column_setting: str = "text_column",
) -> Iterator[Document]:
    """The non-empty tokenized documents of one work unit, in corpus order (`text_column`,
    `text_column_setting` as in `corpus.iter_source_documents`)."""
    bulk = tok.bulk_encoder() if hasattr(tok, "bulk_encoder") else None
    if bulk is None or not (fmt == "bert" and source.kind == "file"):
        documents = corpus.iter_source_documents(
            source, fmt, on_bytes, text_column, text_column_setting
        )
        if bulk is None:
            return _sentence_documents(documents, tok)
        return _line_documents(map(bulk.encode_lines, _joined_blocks(documents)))

    def blocks() -> Iterator:
        line = 1
        for block in _bert_blocks(source.path, on_bytes):
            try:
                yield bulk.encode_lines(block)
            except UnicodeDecodeError:
                _check_utf8(block, source.path, line)
                raise
            line += block.count(b"\n") + 1

    return _line_documents(blocks())
