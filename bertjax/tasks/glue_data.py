"""GLUE readers (official TSV layout or TFDS), BERT pair encoding and the test-set submission writer.

The official TSV files have quirks the readers handle: MRPC headers start with a UTF-8 BOM, CoLA's
train/dev files have no header (4 columns: source, label, original judgement, sentence) and dev has
no final newline, STS-B labels are float scores, and quote characters are plain text (QUOTE_NONE:
a line is split on tabs only). Columns are found by header name, so the 10-column STS-B files and the
12/16-column MNLI files need no positional tables. Test splits carry no labels (label None).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Sequence

import numpy as np

from bertjax import atomic, fs
from bertjax.text import features

__all__ = [
    "GLUE_TASKS",
    "GlueTask",
    "InputExample",
    "encode_examples",
    "encode_pair",
    "get_task",
    "load_glue_tfds",
    "read_glue_split",
    "read_glue_tsv",
    "read_glue_predictions",
    "write_glue_predictions",
]


@dataclasses.dataclass(frozen=True)
class InputExample:
    """One sentence (pair) example; `label` is a label string, a float (STS-B) or None (test)."""

    guid: str
    text_a: str
    text_b: str | None
    label: str | float | None


@dataclasses.dataclass(frozen=True)
class GlueTask:
    """How one GLUE task is laid out on disk and in TFDS."""

    name: str  # registry name, e.g. "sst2"
    dir_name: str  # folder in the GLUE download, e.g. "SST-2"
    labels: tuple[str, ...] | None  # None for regression (STS-B)
    text_a: str  # header name of the first text column
    text_b: str | None  # header name of the second text column
    label_column: str | None  # header name of the label column
    splits: dict[str, str]  # split name -> file name
    submission: dict[str, str]  # test split name -> GLUE server file stem
    tfds_name: str
    headerless_splits: tuple[str, ...] = ()  # CoLA train/dev

    @property
    def is_regression(self) -> bool:
        return self.labels is None


def encode_pair(
    tokenizer, text_a: str, text_b: str | None, max_seq_length: int
) -> dict[str, np.ndarray]:
    """BERT input for one text (pair): [CLS] a [SEP] (b [SEP]), zero-padded to `max_seq_length`.

    Returns {input_ids, input_mask, segment_ids}, each int32 [max_seq_length]. A pair is cut to
    max_seq_length - 3 word pieces by the original BERT's longest-first truncation (see
    :mod:`bertjax.text.features`), a single text to max_seq_length - 2.
    """
    item = text_a if text_b is None else (text_a, text_b)
    rows = features.rows(tokenizer, [item], max_seq_length)
    return {k: v[0] for k, v in features.pad(rows, max_seq_length, tokenizer.pad_id).items()}


_STD = {"train": "train.tsv", "dev": "dev.tsv", "test": "test.tsv"}
_BINARY = ("0", "1")
_NLI3 = ("contradiction", "entailment", "neutral")  # original BERT label order
_NLI2 = ("entailment", "not_entailment")

GLUE_TASKS: dict[str, GlueTask] = {
    t.name: t
    for t in [
        GlueTask("cola", "CoLA", _BINARY, "sentence", None, "label", _STD, {"test": "CoLA"}, "cola",
                 headerless_splits=("train", "dev")),
        GlueTask("sst2", "SST-2", _BINARY, "sentence", None, "label", _STD, {"test": "SST-2"}, "sst2"),
        GlueTask("mrpc", "MRPC", _BINARY, "#1 String", "#2 String", "Quality", _STD,
                 {"test": "MRPC"}, "mrpc"),
        GlueTask("stsb", "STS-B", None, "sentence1", "sentence2", "score", _STD, {"test": "STS-B"},
                 "stsb"),
        GlueTask("qqp", "QQP", _BINARY, "question1", "question2", "is_duplicate", _STD,
                 {"test": "QQP"}, "qqp"),
        GlueTask("mnli", "MNLI", _NLI3, "sentence1", "sentence2", "gold_label",
                 {"train": "train.tsv", "dev_matched": "dev_matched.tsv",
                  "dev_mismatched": "dev_mismatched.tsv", "test_matched": "test_matched.tsv",
                  "test_mismatched": "test_mismatched.tsv"},
                 {"test_matched": "MNLI-m", "test_mismatched": "MNLI-mm"}, "mnli"),
        GlueTask("qnli", "QNLI", _NLI2, "question", "sentence", "label", _STD, {"test": "QNLI"},
                 "qnli"),
        GlueTask("rte", "RTE", _NLI2, "sentence1", "sentence2", "label", _STD, {"test": "RTE"}, "rte"),
        GlueTask("wnli", "WNLI", _BINARY, "sentence1", "sentence2", "label", _STD, {"test": "WNLI"},
                 "wnli"),
        GlueTask("ax", "diagnostic", _NLI3, "sentence1", "sentence2", None,
                 {"test": "diagnostic.tsv"}, {"test": "AX"}, "ax"),
    ]
}  # fmt: skip

_ALIASES = {
    "sst-2": "sst2",
    "sts-b": "stsb",
    "diagnostic": "ax",
    "mnli-m": "mnli",
    "mnli-mm": "mnli",
}


def get_task(name: str) -> GlueTask:
    """The GlueTask for a name such as 'sst2', 'SST-2', 'glue/sst2' or 'STS-B'."""
    key = name.lower().removeprefix("glue/")
    key = _ALIASES.get(key, key)
    if key not in GLUE_TASKS:
        raise ValueError(f"unknown GLUE task {name!r}; known: {', '.join(GLUE_TASKS)}")
    return GLUE_TASKS[key]


def _read_tsv_rows(path: pathlib.Path) -> list[tuple[int, list[str]]]:
    """(1-based line number, fields) for every non-empty line; tabs only, no quoting, BOM dropped."""
    rows = []
    try:
        with open(path, encoding="utf-8-sig", newline="\n") as f:
            for lineno, line in enumerate(f, start=1):
                line = line.rstrip("\n").rstrip("\r")
                if line:
                    rows.append((lineno, line.split("\t")))
    except UnicodeDecodeError as err:
        raise fs.utf8_error(path, err) from None
    return rows


def read_glue_tsv(path: str | os.PathLike, task: str | GlueTask, split: str) -> list[InputExample]:
    """Read one official GLUE TSV file of `task`; `split` decides the layout and the guid prefix.

    Raises ValueError naming the file and line for a row with the wrong number of columns, a label
    outside the task's label set, an unparsable STS-B score or a missing header column, and for a
    file without data rows.
    """
    spec = task if isinstance(task, GlueTask) else get_task(task)
    path = pathlib.Path(path)
    rows = _read_tsv_rows(path)
    is_test = split.startswith("test")
    if split in spec.headerless_splits:
        # CoLA: source, label, original judgement, sentence.
        header_line, ncols = 0, 4
        col_a, col_b, col_label = 3, None, 1
    else:
        if not rows:
            raise ValueError(f"{path}: empty file, expected a header line")
        header_line, header = rows[0]
        rows = rows[1:]
        ncols = len(header)

        def col(name: str | None) -> int | None:
            if name is None:
                return None
            if name not in header:
                raise ValueError(f"{path}:{header_line}: header has no column {name!r}: {header}")
            return header.index(name)

        col_a, col_b = col(spec.text_a), col(spec.text_b)
        col_label = None if is_test or spec.label_column is None else col(spec.label_column)
    if not rows:
        raise ValueError(f"{path}: split {split!r} has no examples")
    examples = []
    for lineno, fields in rows:
        if len(fields) != ncols:
            raise ValueError(
                f"{path}:{lineno}: expected {ncols} tab-separated columns, got {len(fields)}"
            )
        label: str | float | None = None
        if col_label is not None:
            raw = fields[col_label]
            if spec.is_regression:
                try:
                    label = float(raw)
                except ValueError:
                    raise ValueError(f"{path}:{lineno}: score {raw!r} is not a number") from None
            elif raw not in spec.labels:
                raise ValueError(f"{path}:{lineno}: label {raw!r} not in {list(spec.labels)}")
            else:
                label = raw
        examples.append(
            InputExample(
                guid=f"{split}-{len(examples)}",
                text_a=fields[col_a],
                text_b=fields[col_b] if col_b is not None else None,
                label=label,
            )
        )
    return examples


def read_glue_split(data_dir: str | os.PathLike, task: str, split: str) -> list[InputExample]:
    """Read `split` of `task` from a GLUE folder: either the task folder or the GLUE root above it."""
    spec = get_task(task)
    if split not in spec.splits:
        raise ValueError(f"task {spec.name} has splits {list(spec.splits)}, not {split!r}")
    data_dir = pathlib.Path(data_dir)
    candidates = [data_dir / spec.dir_name / spec.splits[split], data_dir / spec.splits[split]]
    for path in candidates:
        if path.is_file():
            return read_glue_tsv(path, spec, split)
    raise FileNotFoundError(f"no {spec.splits[split]} for {spec.name} under {data_dir}")


_TFDS_SPLITS = {
    "dev": "validation",
    "dev_matched": "validation_matched",
    "dev_mismatched": "validation_mismatched",
}


def load_glue_tfds(
    task: str, split: str, data_dir: str | os.PathLike | None = None
) -> list[InputExample]:
    """Read a GLUE split through TensorFlow Datasets (`glue/<task>`), labels mapped to ours.

    `split` uses this module's names ("train", "dev", "dev_matched", "test", ...). TFDS label ids are
    converted through their class names (its MNLI order differs from BERT's); test labels (-1) -> None.
    """
    import tensorflow_datasets as tfds

    from bertjax.tasks import tfds_offline

    spec = get_task(task)
    builder = tfds.builder(
        f"glue/{spec.tfds_name}", data_dir=None if data_dir is None else str(data_dir)
    )
    tfds_offline.require_prepared_or_online(
        builder, ", ".join(f"{spec.dir_name}/{name}" for name in spec.splits.values())
    )
    text_keys = list(builder.builder_config.text_features)
    label_feature = builder.info.features["label"]
    ds = tfds.load(
        f"glue/{spec.tfds_name}",
        split=_TFDS_SPLITS.get(split, split),
        data_dir=None if data_dir is None else str(data_dir),
        shuffle_files=False,
    )
    examples = []
    for record in tfds.as_numpy(ds):
        texts = [record[k].decode("utf-8") for k in text_keys]
        raw = record["label"]
        label: str | float | None
        if spec.is_regression:
            label = float(raw)
        elif int(raw) < 0:
            label = None
        elif spec.labels == _BINARY:
            label = str(int(raw))  # TFDS class 1 (acceptable/positive/equivalent/...) is "1"
        else:
            label = label_feature.int2str(int(raw))
        examples.append(
            InputExample(
                guid=f"{split}-{int(record['idx'])}",
                text_a=texts[0],
                text_b=texts[1] if len(texts) > 1 else None,
                label=label,
            )
        )
    if not examples:
        raise ValueError(f"TFDS glue/{spec.tfds_name} split {split!r} has no examples")
    return examples


def encode_examples(
    tokenizer, examples: Sequence[InputExample], labels: Sequence[str] | None, max_seq_length: int
) -> dict[str, np.ndarray]:
    """Encode examples into {input_ids, input_mask, segment_ids: [n, seq] int32, label: [n]}.

    `labels` is the task's label list (label ids index it, int32, -1 for unlabelled examples) or
    None for regression (float32, NaN for unlabelled examples).
    """
    n = len(examples)
    out = {
        key: np.zeros((n, max_seq_length), dtype=np.int32)  # [n, seq]
        for key in ("input_ids", "input_mask", "segment_ids")
    }
    if labels is None:
        out["label"] = np.full((n,), np.nan, dtype=np.float32)  # [n]
    else:
        out["label"] = np.full((n,), -1, dtype=np.int32)  # [n]
        label_to_id = {label: i for i, label in enumerate(labels)}
    for i, ex in enumerate(examples):
        encoded = encode_pair(tokenizer, ex.text_a, ex.text_b, max_seq_length)
        for key in ("input_ids", "input_mask", "segment_ids"):
            out[key][i] = encoded[key]
        if ex.label is None:
            continue
        if labels is None:
            out["label"][i] = float(ex.label)
        elif ex.label not in label_to_id:
            raise ValueError(f"example {ex.guid}: label {ex.label!r} not in {list(labels)}")
        else:
            out["label"][i] = label_to_id[ex.label]
    return out


def write_glue_predictions(
    output_dir: str | os.PathLike,
    task: str,
    split: str,
    predictions: Sequence,
    file_name: str | None = None,
) -> pathlib.Path:
    """Write GLUE server predictions `{output_dir}/{TASK}.tsv` ("index\\tprediction" lines).

    `predictions` are label ids (classification; written as the label strings the server expects)
    or float scores (STS-B). `split` picks the file for MNLI ("test_matched" -> MNLI-m.tsv,
    "test_mismatched" -> MNLI-mm.tsv); other tasks use "test". `file_name` writes that file
    instead (any split, e.g. dev predictions). Returns the written path.
    """
    spec = get_task(task)
    if file_name is None and split not in spec.submission:
        raise ValueError(f"task {spec.name} submits splits {list(spec.submission)}, not {split!r}")
    lines = ["index\tprediction"]
    for i, pred in enumerate(predictions):
        if spec.is_regression:
            value = f"{float(pred):.3f}"
        else:
            label_id = int(pred)
            if not 0 <= label_id < len(spec.labels):
                raise ValueError(
                    f"prediction {i}: label id {label_id} outside 0..{len(spec.labels) - 1}"
                )
            value = spec.labels[label_id]
        lines.append(f"{i}\t{value}")
    output_dir = pathlib.Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / (file_name or f"{spec.submission[split]}.tsv")
    atomic.write_text(path, "\n".join(lines) + "\n")
    return path


def read_glue_predictions(path: str | os.PathLike, task: str) -> list[str | float]:
    """Read an "index\\tprediction" file (as written by write_glue_predictions) in index order."""
    spec = get_task(task)
    path = pathlib.Path(path)
    rows = _read_tsv_rows(path)
    if not rows or rows[0][1] != ["index", "prediction"]:
        raise ValueError(f"{path}:1: expected the header 'index<TAB>prediction'")
    preds: list[str | float] = []
    for lineno, fields in rows[1:]:
        if len(fields) != 2:
            raise ValueError(
                f"{path}:{lineno}: expected 2 tab-separated columns, got {len(fields)}"
            )
        if fields[0] != str(len(preds)):
            raise ValueError(f"{path}:{lineno}: index {fields[0]!r}, expected {len(preds)}")
        if spec.is_regression:
            try:
                preds.append(float(fields[1]))
            except ValueError:
                raise ValueError(
                    f"{path}:{lineno}: prediction {fields[1]!r} is not a number"
                ) from None
        elif fields[1] not in spec.labels:
            raise ValueError(
                f"{path}:{lineno}: prediction {fields[1]!r} not in {list(spec.labels)}"
            )
        else:
            preds.append(fields[1])
    if not preds:
        raise ValueError(f"{path}: no predictions")
    return preds
