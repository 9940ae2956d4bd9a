"""BEIR-format retrieval sets: ``corpus.jsonl``, ``queries.jsonl`` and ``qrels/<split>.tsv``.

As BEIR's ``GenericDataLoader`` and MTEB read them: ids are strings, a document's text is its
title, a space and its text, stripped (``(title + " " + text).strip()``, the title may be absent),
and only the queries the split judges are kept (in ``queries.jsonl`` order). Errors are one line
naming the file and line.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

from bertjax import fs
from bertjax.retrieval import trec_format

log = logging.getLogger("bertjax")


@dataclasses.dataclass(frozen=True)
class BeirSet:
    doc_ids: list[str]
    doc_texts: list[str]
    query_ids: list[str]  # the judged queries only
    query_texts: list[str]
    qrels: trec_format.Qrels


def document_text(title: str | None, text: str) -> str:
    """What is embedded for a document (MTEB's and BEIR's convention)."""
    return f"{title or ''} {text}".strip()


def json_objects(path: str):
    """(line number, object) per non-blank line of a JSON-lines file; bad JSON, a line that is
    not an object or bad UTF-8 is a one-line error naming the file and line."""
    if not fs.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    try:
        with fs.open_file(path, "r") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise fs.json_error(path, err, number) from None
                if not isinstance(record, dict):
                    raise ValueError(f"{path}:{number}: expected a JSON object")
                yield number, record
    except UnicodeDecodeError as err:
        raise fs.utf8_error(path, err) from None


def read_jsonl(path: str, fields: tuple[str, ...]) -> list[tuple[str, dict]]:
    """(id, record) per line of a JSON-lines file; each record needs ``_id`` and ``fields`` and
    gains ``__line__``, its line number."""
    records, first_line = [], {}
    for number, record in json_objects(path):
        for key in ("_id", *fields):
            if record.get(key) is None:
                raise ValueError(f"{path}:{number}: no {key!r} key")
            if key != "_id" and not isinstance(record[key], str):
                raise ValueError(f"{path}:{number}: {key!r} is not a string")
        doc_id = str(record["_id"])
        if doc_id in first_line:
            raise ValueError(
                f"{path}:{number}: id {doc_id!r} again (first at line {first_line[doc_id]})"
            )
        first_line[doc_id] = number
        records.append((doc_id, {**record, "__line__": number}))
    return records


def load(folder: str | os.PathLike, split: str = "test") -> BeirSet:
    """The corpus, the judged queries of ``split`` and their qrels from a BEIR folder."""
    folder = os.fspath(folder)
    if not fs.isdir(folder):
        raise FileNotFoundError(f"{folder}: no such folder (a BEIR set: corpus.jsonl, ...)")
    qrels_path = os.path.join(folder, "qrels", f"{split}.tsv")
    if not fs.exists(qrels_path):
        found = sorted(
            os.path.basename(p)[: -len(".tsv")]
            for p in fs.glob(os.path.join(folder, "qrels", "*.tsv"))
        )
        raise FileNotFoundError(
            f"{qrels_path}: no such file (splits in {folder}/qrels: {', '.join(found) or 'none'})"
        )
    qrels = trec_format.read_qrels(qrels_path)
    if not qrels:
        raise ValueError(f"{qrels_path}: no judgements")
    queries_path = os.path.join(folder, "queries.jsonl")
    records = read_jsonl(queries_path, ("text",))
    queries = dict(records)
    query_lines = {qid: record["__line__"] for qid, record in records}
    missing = [qid for qid in qrels if qid not in queries]
    if missing:
        raise ValueError(
            f"{qrels_path}: {len(missing)} judged queries are not in {queries_path} "
            f"(first: {missing[0]!r})"
        )
    query_ids = [qid for qid in queries if qid in qrels]
    for qid in query_ids:
        if not queries[qid]["text"].strip():
            raise ValueError(f"{queries_path}:{query_lines[qid]}: query {qid!r} is empty")
    corpus = read_jsonl(os.path.join(folder, "corpus.jsonl"), ("text",))
    known = {doc_id for doc_id, _ in corpus}
    absent = [(q, d) for q in query_ids for d in qrels[q] if d not in known]
    if absent:  # BEIR's ArguAna has five; trec_eval counts them as relevant all the same
        log.warning(
            "%s: %d judgements name documents that %s lacks (first: query %r, document %r); "
            "they still count as relevant, as in pytrec_eval",
            qrels_path,
            len(absent),
            os.path.join(folder, "corpus.jsonl"),
            *absent[0],
        )
    return BeirSet(
        doc_ids=[doc_id for doc_id, _ in corpus],
        doc_texts=[document_text(doc.get("title"), doc["text"]) for _, doc in corpus],
        query_ids=query_ids,
        query_texts=[queries[qid]["text"] for qid in query_ids],
        qrels={qid: qrels[qid] for qid in query_ids},
    )
