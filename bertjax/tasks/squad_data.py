"""SQuAD v1.1 / v2.0 examples and features, following the original BERT `run_squad.py` exactly.

Pipeline: the context is split on whitespace into "doc tokens" (with a char -> word offset table), the
answer's character span is projected onto words, each word is split into word pieces, the answer's
piece span is tightened with `improve_answer_span`, and long documents become several features by a
sliding window of `max_seq_length` with `doc_stride`. Each feature records which span is the "max
context" for each of its tokens (`check_is_max_context`), used by post-processing.

Answers whose text cannot be found at their character offsets (rare Unicode quirks) are skipped in
training mode with a warning naming the question id, as the official code does; the ids of the
skipped questions are returned so callers can count them. In evaluation mode such a question is kept
(it is scored against its gold texts) and only loses its training positions.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
from collections.abc import Sequence

import numpy as np

from bertjax import fs

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SquadExample:
    """One question. Positions are whitespace-word indices into `doc_tokens` (None when unknown)."""

    qas_id: str
    question_text: str
    doc_tokens: list[str]
    orig_answer_text: str | None = None
    start_position: int | None = None
    end_position: int | None = None
    is_impossible: bool = False
    answers: list[str] = dataclasses.field(default_factory=list)  # all gold answer texts


@dataclasses.dataclass
class SquadFeatures:
    """Features of many examples; row i of every array belongs to feature i.

    Arrays: unique_ids [n] int64; example_index / doc_span_index / start_positions / end_positions /
    is_impossible [n] int32, input_ids / input_mask / segment_ids [n, seq] int32. Per-feature lists:
    tokens (word pieces incl. [CLS]/[SEP]), token_to_orig_map and token_is_max_context (dicts keyed by
    the position in `tokens` of each document piece).
    """

    unique_ids: np.ndarray
    example_index: np.ndarray
    doc_span_index: np.ndarray
    input_ids: np.ndarray
    input_mask: np.ndarray
    segment_ids: np.ndarray
    start_positions: np.ndarray
    end_positions: np.ndarray
    is_impossible: np.ndarray
    tokens: list[list[str]]
    token_to_orig_map: list[dict[int, int]]
    token_is_max_context: list[dict[int, bool]]

    def __len__(self) -> int:
        return len(self.tokens)

    def arrays(self) -> dict[str, np.ndarray]:
        """The model inputs and targets as a dict of arrays (for batching)."""
        return {
            "unique_ids": self.unique_ids,
            "input_ids": self.input_ids,
            "input_mask": self.input_mask,
            "segment_ids": self.segment_ids,
            "start_positions": self.start_positions,
            "end_positions": self.end_positions,
            "is_impossible": self.is_impossible,
        }


def _is_whitespace(c: str) -> bool:
    return c in (" ", "\t", "\r", "\n") or ord(c) == 0x202F


def split_doc_tokens(text: str) -> tuple[list[str], list[int]]:
    """Whitespace doc tokens of `text` and, for every character, the index of its word."""
    doc_tokens: list[str] = []
    char_to_word_offset: list[int] = []
    prev_is_whitespace = True
    for c in text:
        if _is_whitespace(c):
            prev_is_whitespace = True
        else:
            if prev_is_whitespace:
                doc_tokens.append(c)
            else:
                doc_tokens[-1] += c
            prev_is_whitespace = False
        char_to_word_offset.append(len(doc_tokens) - 1)
    return doc_tokens, char_to_word_offset


def load_squad_json(path: str | os.PathLike) -> list[dict]:
    """The "data" list of a SQuAD JSON file (one-line error for invalid JSON or a missing key)."""
    path = pathlib.Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise fs.json_error(path, e) from None
    except UnicodeDecodeError as e:
        raise fs.utf8_error(path, e) from None
    if not isinstance(data, dict) or "data" not in data:
        raise ValueError(f"{path}: not a SQuAD file (no top-level 'data' key)")
    check_squad_data(data["data"], str(path))
    return data["data"]


_SQUAD_FIELDS = {  # level -> (key, types, what) of the keys every item of that level needs
    "article": (("paragraphs", list, "a list"),),
    "paragraph": (("context", str, "a string"), ("qas", list, "a list")),
    "question": (
        ("id", (str, int), "a string"),
        ("question", str, "a string"),
        ("answers", list, "a list"),
    ),
    "answer": (("text", str, "a string"), ("answer_start", int, "an integer")),
}
_SCORED = {"paragraphs", "qas", "id", "answers", "text"}  # what the official scorers read


def check_squad_data(data, source: str, scoring: bool = False) -> None:
    """ValueError naming the place (``data[0].paragraphs[1].qas[2]``, the question id) and the key
    of the first item of a SQuAD "data" list without a key it needs or with one of the wrong type
    (JSON has no line numbers once parsed; the path finds it in any editor or ``jq``).
    ``scoring``: only the keys the official scorers read (a dataset file without contexts)."""

    def check(item, level: str, where: str) -> None:
        if not isinstance(item, dict):
            raise ValueError(f"{source}: {where} is a {type(item).__name__}, not a {level} object")
        for key, kind, what in _SQUAD_FIELDS[level]:
            if scoring and key not in _SCORED:
                continue
            if key not in item:
                raise ValueError(f"{source}: {where} has no {key!r}")
            value = item[key]
            if not isinstance(value, kind) or isinstance(value, bool):
                shown = json.dumps(value)
                shown = shown if len(shown) <= 40 else shown[:37] + "..."
                raise ValueError(f"{source}: {where}: {key!r} is {shown}, not {what}")

    if not isinstance(data, list):
        raise ValueError(f"{source}: 'data' is a {type(data).__name__}, not a list of articles")
    for a, article in enumerate(data):
        check(article, "article", f"data[{a}]")
        for p, paragraph in enumerate(article["paragraphs"]):
            check(paragraph, "paragraph", f"data[{a}].paragraphs[{p}]")
            for q, qa in enumerate(paragraph["qas"]):
                place = f"data[{a}].paragraphs[{p}].qas[{q}]"
                named = isinstance(qa, dict) and "id" in qa
                check(qa, "question", f"question {qa['id']} ({place})" if named else place)
                for field in ("answers", "plausible_answers"):
                    for i, answer in enumerate(qa.get(field) or ()):
                        where = f"question {qa['id']} ({place}.{field}[{i}])"
                        check(answer, "answer", where)


def read_squad_examples(
    path: str | os.PathLike, is_training: bool
) -> tuple[list[SquadExample], list[str]]:
    """Read a SQuAD v1.1 or v2.0 file into examples; returns (examples, ids of skipped questions).

    Answer positions come from the first answer when there is one. In training mode a question must
    have exactly one answer unless `is_impossible` (v2.0), as in run_squad.py, and a question whose
    answer text is not found at its offsets is skipped (logged with its id and returned).
    """
    path = pathlib.Path(path)
    return squad_examples_from_data(load_squad_json(path), is_training, str(path))


def squad_examples_from_data(
    data: Sequence[dict], is_training: bool, source: str
) -> tuple[list[SquadExample], list[str]]:
    """`read_squad_examples` on an already-loaded SQuAD "data" list; `source` names it in errors."""
    path = source
    examples: list[SquadExample] = []
    skipped: list[str] = []
    for article in data:
        for paragraph in article["paragraphs"]:
            doc_tokens, char_to_word = split_doc_tokens(paragraph["context"])
            for qa in paragraph["qas"]:
                try:
                    qas_id, question, answers = qa["id"], qa["question"], qa["answers"]
                except KeyError as e:
                    raise ValueError(f"{path}: question {qa.get('id', '?')} has no {e}") from None
                is_impossible = bool(qa.get("is_impossible", False))
                if is_training and not is_impossible and len(answers) != 1:
                    raise ValueError(
                        f"{path}: question {qas_id}: training needs exactly 1 answer, got {len(answers)}"
                    )
                example = SquadExample(
                    qas_id=qas_id,
                    question_text=question,
                    doc_tokens=doc_tokens,
                    is_impossible=is_impossible,
                    answers=[a["text"] for a in answers],
                )
                if is_impossible:
                    example.start_position = example.end_position = -1
                    example.orig_answer_text = ""
                elif answers:
                    text, offset = answers[0]["text"], answers[0]["answer_start"]
                    if not text or offset < 0 or offset + len(text) > len(char_to_word):
                        raise ValueError(
                            f"{path}: question {qas_id}: answer {text!r} at {offset} lies outside "
                            f"its {len(char_to_word)}-character context"
                        )
                    start = char_to_word[offset]
                    end = char_to_word[offset + len(text) - 1]
                    actual = " ".join(doc_tokens[start : end + 1])
                    cleaned = " ".join(text.split())
                    if actual.find(cleaned) == -1:
                        logger.warning(
                            "question %s: could not find answer %r in %r", qas_id, cleaned, actual
                        )
                        if is_training:
                            skipped.append(qas_id)
                            continue
                    else:
                        example.orig_answer_text = text
                        example.start_position, example.end_position = start, end
                examples.append(example)
    if skipped:
        logger.warning("%s: skipped %d questions whose answers were not found", path, len(skipped))
    return examples, skipped


_TFDS_SPLITS = {"train": "train", "dev": "validation"}


def squad_data_from_tfds_records(records, version_2: bool) -> list[dict]:
    """Regroup flat TFDS `squad` records (numpy, bytes strings) into the SQuAD JSON "data" list.

    Articles are grouped by title and paragraphs by context, in first-seen order, so the result is
    what `load_squad_json` returns for the official file (v2.0 keeps `is_impossible` and
    `plausible_answers`): `squad_examples_from_data` and the official metrics read it unchanged.
    """

    def text(value) -> str:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)

    def answers(field) -> list[dict]:
        return [
            {"text": text(t), "answer_start": int(s)}
            for t, s in zip(field["text"], field["answer_start"], strict=True)
        ]

    articles: dict[str, dict] = {}
    paragraphs: dict[tuple[str, str], dict] = {}
    for record in records:
        title, context = text(record["title"]), text(record["context"])
        article = articles.setdefault(title, {"title": title, "paragraphs": []})
        paragraph = paragraphs.get((title, context))
        if paragraph is None:
            paragraph = paragraphs[(title, context)] = {"context": context, "qas": []}
            article["paragraphs"].append(paragraph)
        qa = {
            "id": text(record["id"]),
            "question": text(record["question"]),
            "answers": answers(record["answers"]),
        }
        if version_2:
            qa["is_impossible"] = bool(record["is_impossible"])
            qa["plausible_answers"] = answers(record["plausible_answers"])
        paragraph["qas"].append(qa)
    return list(articles.values())


def load_squad_tfds(
    version: str, split: str, is_training: bool, data_dir: str | os.PathLike | None = None
) -> tuple[list[SquadExample], list[str], list[dict]]:
    """Read `squad/v<version>` ("1.1" or "2.0") from TensorFlow Datasets; `split` "train" or "dev".

    Returns (examples, ids of skipped questions, the SQuAD "data" list), exactly as
    `read_squad_examples` and `load_squad_json` give for the official JSON file of that split.
    """
    import tensorflow_datasets as tfds

    from bertjax.tasks import tfds_offline

    if version not in ("1.1", "2.0"):
        raise ValueError(f"SQuAD version {version!r} is not 1.1 or 2.0")
    if split not in _TFDS_SPLITS:
        raise ValueError(f"SQuAD split {split!r} is not one of {list(_TFDS_SPLITS)}")
    name = f"squad/v{version}"
    builder = tfds.builder(name, data_dir=None if data_dir is None else str(data_dir))
    tfds_offline.require_prepared_or_online(
        builder, f"train-v{version}.json and dev-v{version}.json"
    )
    ds = tfds.load(
        name,
        split=_TFDS_SPLITS[split],
        data_dir=None if data_dir is None else str(data_dir),
        shuffle_files=False,
    )
    data = squad_data_from_tfds_records(tfds.as_numpy(ds), version_2=version == "2.0")
    source = f"tfds:{name}/{_TFDS_SPLITS[split]}"
    examples, skipped = squad_examples_from_data(data, is_training, source)
    return examples, skipped, data


def improve_answer_span(
    doc_tokens: Sequence[str], input_start: int, input_end: int, tokenizer, orig_answer_text: str
) -> tuple[int, int]:
    """The smallest sub-span of word pieces [input_start, input_end] that spells the answer."""
    tok_answer_text = " ".join(tokenizer.tokenize(orig_answer_text))
    for new_start in range(input_start, input_end + 1):
        for new_end in range(input_end, new_start - 1, -1):
            if " ".join(doc_tokens[new_start : new_end + 1]) == tok_answer_text:
                return new_start, new_end
    return input_start, input_end


def check_is_max_context(
    doc_spans: Sequence[tuple[int, int]], cur_span_index: int, position: int
) -> bool:
    """Whether span `cur_span_index` gives piece `position` the most context (min of left/right)."""
    best_score = None
    best_span_index = None
    for span_index, (start, length) in enumerate(doc_spans):
        end = start + length - 1
        if position < start or position > end:
            continue
        score = min(position - start, end - position) + 0.01 * length
        if best_score is None or score > best_score:
            best_score = score
            best_span_index = span_index
    return cur_span_index == best_span_index


def convert_examples_to_features(
    examples: Sequence[SquadExample],
    tokenizer,
    max_seq_length: int = 384,
    doc_stride: int = 128,
    max_query_length: int = 64,
    first_unique_id: int = 1000000000,
) -> SquadFeatures:
    """Sliding-window features: [CLS] query [SEP] doc-span [SEP], zero-padded to max_seq_length.

    start/end positions index the answer's pieces in the feature (0 = [CLS] when the answer lies
    outside the span, the question is impossible, or its positions are unknown).
    """
    if max_seq_length <= max_query_length + 3:
        raise ValueError(
            f"max_seq_length ({max_seq_length}) must be greater than max_query_length "
            f"({max_query_length}) + 3"
        )
    cls, sep = tokenizer.cls_id, tokenizer.sep_id
    rows: dict[str, list] = {
        k: [] for k in ("example_index", "doc_span_index", "start", "end", "imp")
    }
    ids_rows: list[list[int]] = []
    seg_rows: list[list[int]] = []
    all_tokens, all_maps, all_max_ctx = [], [], []
    for example_index, example in enumerate(examples):
        query_tokens = tokenizer.tokenize(example.question_text)[:max_query_length]
        tok_to_orig_index: list[int] = []
        orig_to_tok_index: list[int] = []
        all_doc_tokens: list[str] = []
        for i, token in enumerate(example.doc_tokens):
            orig_to_tok_index.append(len(all_doc_tokens))
            for sub_token in tokenizer.tokenize(token):
                tok_to_orig_index.append(i)
                all_doc_tokens.append(sub_token)

        tok_start = tok_end = None
        if not example.is_impossible and example.start_position is not None:
            tok_start = orig_to_tok_index[example.start_position]
            if example.end_position < len(example.doc_tokens) - 1:
                tok_end = orig_to_tok_index[example.end_position + 1] - 1
            else:
                tok_end = len(all_doc_tokens) - 1
            tok_start, tok_end = improve_answer_span(
                all_doc_tokens, tok_start, tok_end, tokenizer, example.orig_answer_text
            )

        max_tokens_for_doc = max_seq_length - len(query_tokens) - 3  # [CLS], [SEP], [SEP]
        doc_spans: list[tuple[int, int]] = []  # (start, length)
        start_offset = 0
        while start_offset < len(all_doc_tokens):
            length = min(len(all_doc_tokens) - start_offset, max_tokens_for_doc)
            doc_spans.append((start_offset, length))
            if start_offset + length == len(all_doc_tokens):
                break
            start_offset += min(length, doc_stride)

        query_ids = tokenizer.convert_tokens_to_ids(query_tokens)
        for span_index, (span_start, span_length) in enumerate(doc_spans):
            tokens = ["[CLS]", *query_tokens, "[SEP]"]
            token_to_orig_map: dict[int, int] = {}
            token_is_max_context: dict[int, bool] = {}
            for i in range(span_length):
                split_token_index = span_start + i
                token_to_orig_map[len(tokens)] = tok_to_orig_index[split_token_index]
                token_is_max_context[len(tokens)] = check_is_max_context(
                    doc_spans, span_index, split_token_index
                )
                tokens.append(all_doc_tokens[split_token_index])
            tokens.append("[SEP]")
            doc_pieces = all_doc_tokens[span_start : span_start + span_length]
            ids_rows.append(
                [cls, *query_ids, sep, *tokenizer.convert_tokens_to_ids(doc_pieces), sep]
            )
            seg_rows.append([0] * (len(query_tokens) + 2) + [1] * (span_length + 1))

            start_position = end_position = 0
            if tok_start is not None:
                span_end = span_start + span_length - 1
                if tok_start >= span_start and tok_end <= span_end:
                    doc_offset = len(query_tokens) + 2
                    start_position = tok_start - span_start + doc_offset
                    end_position = tok_end - span_start + doc_offset
            rows["example_index"].append(example_index)
            rows["doc_span_index"].append(span_index)
            rows["start"].append(start_position)
            rows["end"].append(end_position)
            rows["imp"].append(int(example.is_impossible))
            all_tokens.append(tokens)
            all_maps.append(token_to_orig_map)
            all_max_ctx.append(token_is_max_context)

    n = len(ids_rows)
    input_ids = np.full((n, max_seq_length), tokenizer.pad_id, dtype=np.int32)  # [n, seq]
    input_mask = np.zeros((n, max_seq_length), dtype=np.int32)  # [n, seq]
    segment_ids = np.zeros((n, max_seq_length), dtype=np.int32)  # [n, seq]
    for i, (ids, segs) in enumerate(zip(ids_rows, seg_rows)):
        input_ids[i, : len(ids)] = ids
        input_mask[i, : len(ids)] = 1
        segment_ids[i, : len(segs)] = segs
    as_int = lambda values: np.asarray(values, dtype=np.int32).reshape(n)  # [n]
    return SquadFeatures(
        unique_ids=np.arange(first_unique_id, first_unique_id + n, dtype=np.int64),
        example_index=as_int(rows["example_index"]),
        doc_span_index=as_int(rows["doc_span_index"]),
        input_ids=input_ids,
        input_mask=input_mask,
        segment_ids=segment_ids,
        start_positions=as_int(rows["start"]),
        end_positions=as_int(rows["end"]),
        is_impossible=as_int(rows["imp"]),
        tokens=all_tokens,
        token_to_orig_map=all_maps,
        token_is_max_context=all_max_ctx,
    )
