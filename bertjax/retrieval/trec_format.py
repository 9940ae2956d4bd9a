"""TREC conventions: run files, qrels files and trec_eval's ranking order.

A run maps query id -> {document id: score}; qrels map query id -> {document id: relevance} (an
integer; >= 1 is relevant, higher is better). ``ranked`` orders a query's documents as trec_eval
does before any measure: score descending, ties broken by document id in DEcreasing byte order
(``comp_sim_docno`` in trec_eval's ``form_res_rels.c``); the rank column of a run file is ignored.

Files: a run is ``qid Q0 docid rank score tag`` per line (whitespace-separated, six fields); qrels
are BEIR's TSV (``query-id<TAB>corpus-id<TAB>score`` with that header) or TREC's ``qid 0 docid rel``.
Errors are one line naming the file and line.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

from bertjax import atomic, fs

Run = dict[str, dict[str, float]]
Qrels = dict[str, dict[str, int]]

BEIR_QRELS_HEADER = ("query-id", "corpus-id", "score")


def ranked(docs: Mapping[str, float]) -> list[tuple[str, float]]:
    """(document id, score) pairs in trec_eval's order: score descending, then id descending.

    Python compares ``str`` by code point, which is the byte order of their UTF-8 (C's strcmp).
    """
    return sorted(docs.items(), key=lambda item: (item[1], item[0]), reverse=True)


def tie_order(doc_ids: Sequence[str]) -> list[int]:
    """The positions of ``doc_ids`` sorted by id descending: a corpus put in this order and
    searched with "ties to the lower index" ranks ties as ``ranked`` (trec_eval) does."""
    return sorted(range(len(doc_ids)), key=doc_ids.__getitem__, reverse=True)


def _lines(path: str | os.PathLike):
    """(line number, line without its newline) of a UTF-8 text file."""
    path = os.fspath(path)
    if not fs.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    try:
        with fs.open_file(path, "r") as f:
            for number, line in enumerate(f, start=1):
                yield number, line.rstrip("\r\n")
    except UnicodeDecodeError as err:
        raise fs.utf8_error(path, err) from None


def read_qrels(path: str | os.PathLike) -> Qrels:
    """Qrels from BEIR's TSV (header optional) or TREC's four-column file.

    A row repeated with the same relevance is kept once; with another relevance it is an error.
    """
    path = os.fspath(path)
    qrels: Qrels = {}
    seen: dict[tuple[str, str], int] = {}
    for number, line in _lines(path):
        if not line.strip():
            continue
        if "\t" in line:
            fields = line.split("\t")
            if len(fields) != 3:
                raise ValueError(
                    f"{path}:{number}: expected 3 tab-separated fields "
                    f"(query-id, corpus-id, score), found {len(fields)}"
                )
            if number == 1 and tuple(f.strip() for f in fields) == BEIR_QRELS_HEADER:
                continue
            qid, docid, rel = (f.strip() for f in fields)
        else:
            fields = line.split()
            if len(fields) != 4:
                raise ValueError(
                    f"{path}:{number}: expected BEIR's 'query-id<TAB>corpus-id<TAB>score' or "
                    f"TREC's 'qid 0 docid relevance', found {len(fields)} fields"
                )
            qid, _, docid, rel = fields
        try:
            relevance = int(rel)
        except ValueError:
            raise ValueError(f"{path}:{number}: relevance {rel!r} is not an integer") from None
        if not qid or not docid:
            raise ValueError(f"{path}:{number}: empty query or document id")
        first = seen.setdefault((qid, docid), number)
        if first != number and qrels[qid][docid] != relevance:
            raise ValueError(
                f"{path}:{number}: query {qid!r} document {docid!r} judged {relevance} here "
                f"and {qrels[qid][docid]} at line {first}"
            )
        qrels.setdefault(qid, {})[docid] = relevance
    return qrels


def read_run(path: str | os.PathLike) -> Run:
    """A TREC run file (``qid Q0 docid rank score tag``); a document twice for a query is an
    error, as in trec_eval."""
    path = os.fspath(path)
    run: Run = {}
    first_line: dict[tuple[str, str], int] = {}
    for number, line in _lines(path):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 6:
            raise ValueError(
                f"{path}:{number}: expected 6 fields 'qid Q0 docid rank score tag', "
                f"found {len(fields)}"
            )
        qid, _, docid, _, score_text, _ = fields
        try:
            score = float(score_text)
        except ValueError:
            raise ValueError(f"{path}:{number}: score {score_text!r} is not a number") from None
        if not math.isfinite(score):
            raise ValueError(f"{path}:{number}: score {score_text!r} is not finite")
        first = first_line.setdefault((qid, docid), number)
        if first != number:
            raise ValueError(
                f"{path}:{number}: document {docid!r} appears twice for query {qid!r} "
                f"(first at line {first})"
            )
        run.setdefault(qid, {})[docid] = score
    return run


def _check_id(kind: str, value: str) -> None:
    if not value or any(c.isspace() for c in value):
        raise ValueError(f"{kind} id {value!r} cannot be written to a TREC file (empty or spaces)")


def write_run(
    path: str | os.PathLike, run: Mapping[str, Mapping[str, float]], tag: str = "bertjax"
):
    """Writes ``run`` as a TREC run file, each query's documents ranked as trec_eval ranks them;
    scores are written so that they read back as the same floats."""
    _check_id("run tag", tag)
    lines = []
    for qid, docs in run.items():
        _check_id("query", qid)
        for rank, (docid, score) in enumerate(ranked(docs), start=1):
            _check_id("document", docid)
            lines.append(f"{qid} Q0 {docid} {rank} {float(score)!r} {tag}\n")
    atomic.write_text(path, "".join(lines))


def write_qrels(path: str | os.PathLike, qrels: Mapping[str, Mapping[str, int]]) -> None:
    """Writes BEIR's qrels TSV (with its header)."""
    lines = ["\t".join(BEIR_QRELS_HEADER) + "\n"]
    for qid, docs in qrels.items():
        lines += [f"{qid}\t{docid}\t{int(rel)}\n" for docid, rel in docs.items()]
    atomic.write_text(path, "".join(lines))
