"""BEIR-format retrieval sets: ``corpus.jsonl``, ``queries.jsonl`` and ``qrels/<split>.tsv``.

As BEIR's ``GenericDataLoader`` and MTEB read them: ids are strings, a document's text is its
title, a space and its text, stripped (``(title + " " + text).strip()``, the title may be absent),
and only the queries the split judges are kept (in ``queries.jsonl`` order). Errors are one line
naming the file and line.
"""

from __future__ import annotations

import dataclasses
import json
import os

from bertjax import fs
from bertjax.retrieval import trec_format


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


def read_jsonl(path: str, fields: tuple[str, ...]) -> list[tuple[str, dict]]:
    """(id, record) per line of a JSON-lines file; each record needs ``_id`` and ``fields``."""
    if not fs.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    records, first_line = [], {}
    try:
        with fs.open_file(path, "r") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number}: invalid JSON: {err.msg}") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{path}:{number}: expected a JSON object")
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
                records.append((doc_id, record))
    except UnicodeDecodeError as err:
        raise fs.utf8_error(path, err) from None
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
    queries = dict(read_jsonl(queries_path, ("text",)))
    missing = [qid for qid in qrels if qid not in queries]
    if missing:
        raise ValueError(
            f"{qrels_path}: {len(missing)} judged queries are not in {queries_path} "
            f"(first: {missing[0]!r})"
        )
    query_ids = [qid for qid in queries if qid in qrels]
    corpus = read_jsonl(os.path.join(folder, "corpus.jsonl"), ("text",))
    return BeirSet(
        doc_ids=[doc_id for doc_id, _ in corpus],
        doc_texts=[document_text(doc.get("title"), doc["text"]) for _, doc in corpus],
        query_ids=query_ids,
        query_texts=[queries[qid]["text"] for qid in query_ids],
        qrels={qid: qrels[qid] for qid in query_ids},
    )
