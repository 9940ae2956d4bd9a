"""SWAG multiple-choice data: the official CSV files and [n, num_choices, seq] BERT encoding.

The SWAG release (train.csv, val.csv, test.csv) is a quoted, comma-separated file with the header
`[,]video-id,fold-ind,startphrase,sent1,sent2,gold-source,ending0,ending1,ending2,ending3[,label]`
(the leading unnamed pandas index column and, for test.csv, the label column may be absent). Each
choice is encoded as the pair (sent1, sent2 + " " + ending_i), as the BERT SWAG baseline does.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import pathlib
from collections.abc import Sequence
from typing import NoReturn

import numpy as np

from bertjax import fs
from bertjax.text import features

NUM_SWAG_CHOICES = 4
_REQUIRED = ("video-id", "fold-ind", "sent1", "sent2", "ending0", "ending1", "ending2", "ending3")


@dataclasses.dataclass(frozen=True)
class ChoiceExample:
    """One multiple-choice question: a context, a shared ending start and the candidate endings."""

    guid: str
    context: str
    start_ending: str
    endings: tuple[str, ...]
    label: int | None


def read_swag(path: str | os.PathLike) -> list[ChoiceExample]:
    """Read a SWAG CSV file; raises ValueError naming the file and line for a malformed row or label."""
    path = pathlib.Path(path)
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                raise ValueError(f"{path}: empty file, expected a header line")
            missing = [c for c in _REQUIRED if c not in header]
            if missing:
                raise ValueError(f"{path}:1: header lacks columns {missing}")
            col = {name: header.index(name) for name in header if name}
            label_col = col.get("label")
            examples = []
            for row in reader:
                lineno = reader.line_num
                if not row:
                    continue
                if len(row) != len(header):
                    raise ValueError(
                        f"{path}:{lineno}: expected {len(header)} columns, got {len(row)}"
                    )
                label = None
                if label_col is not None:
                    raw = row[label_col]
                    if raw not in {str(i) for i in range(NUM_SWAG_CHOICES)}:
                        raise ValueError(
                            f"{path}:{lineno}: label {raw!r} not in 0..{NUM_SWAG_CHOICES - 1}"
                        )
                    label = int(raw)
                examples.append(
                    ChoiceExample(
                        guid=f"{row[col['video-id']]}-{row[col['fold-ind']]}",
                        context=row[col["sent1"]],
                        start_ending=row[col["sent2"]],
                        endings=tuple(row[col[f"ending{i}"]] for i in range(NUM_SWAG_CHOICES)),
                        label=label,
                    )
                )
    except UnicodeDecodeError as err:
        raise fs.utf8_error(path, err) from None
    if not examples:
        raise ValueError(f"{path}: no examples")
    return examples


def load_swag_tfds(split: str, data_dir: str | os.PathLike | None = None) -> NoReturn:
    """SWAG through TensorFlow Datasets: the installed TFDS has no `swag` builder, so this raises.

    (TFDS has `hellaswag`, a different data set.) The error tells the user to set data_dir.
    """
    import tensorflow_datasets as tfds

    del split, data_dir
    found = "swag" in tfds.list_builders(with_community_datasets=False)
    raise ValueError(
        "config key data_dir is empty and "
        + ("TFDS 'swag' is not supported" if found else "TFDS has no SWAG data set")
        + ": set data_dir to the folder with the SWAG train.csv and val.csv files"
    )


def encode_choices(
    tokenizer, examples: Sequence[ChoiceExample], max_seq_length: int
) -> dict[str, np.ndarray]:
    """Encode into {input_ids, input_mask, segment_ids: [n, choices, seq] int32, label: [n] int32}.

    Choice i is [CLS] context [SEP] start_ending ending_i [SEP], longest-first truncated to
    max_seq_length - 3 pieces; unlabelled examples get label -1.
    """
    if not examples:
        raise ValueError("no examples to encode")
    num_choices = len(examples[0].endings)
    shape = (len(examples), num_choices, max_seq_length)  # [n, choices, seq]
    out = {
        "input_ids": np.full(shape, tokenizer.pad_id, dtype=np.int32),
        "input_mask": np.zeros(shape, dtype=np.int32),
        "segment_ids": np.zeros(shape, dtype=np.int32),
        "label": np.full((len(examples),), -1, dtype=np.int32),  # [n]
    }
    for i, ex in enumerate(examples):
        if len(ex.endings) != num_choices:
            raise ValueError(
                f"example {ex.guid}: {len(ex.endings)} endings, expected {num_choices}"
            )
        context, start, *endings = features.token_ids(
            tokenizer, [ex.context, ex.start_ending, *ex.endings]
        )
        # [CLS] context [SEP] start ending [SEP] per choice: the ending is the second segment
        rows = [
            features.pair_row(tokenizer, context, start + ending, max_seq_length)
            for ending in endings
        ]
        padded = features.pad(rows, max_seq_length, tokenizer.pad_id)
        for key in ("input_ids", "input_mask", "segment_ids"):
            out[key][i] = padded[key]
        if ex.label is not None:
            out["label"][i] = ex.label
    return out
