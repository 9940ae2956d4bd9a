"""CoNLL-2003 style token tagging (NER) data: column files, BIO/IOB1 tags, word-piece labelling.

File format: one token per line, columns separated by whitespace, the token in the first column and
its tag in the last; blank lines end sentences; `-DOCSTART-` lines mark documents and are dropped.
The original CoNLL-2003 release uses IOB1 tags (I-X unless two X chunks touch); many copies use BIO
(IOB2). Both are read as they are; `iob1_to_bio` converts. The metrics (`metrics.ner_metrics`) score
either scheme with conlleval's chunk rules.

Encoding labels the first word piece of every word and gives continuation pieces, [CLS], [SEP] and
padding the ignore index -1; `word_ids` records which word each labelled piece starts, so model
predictions map back to one tag per word (`predictions_to_tags`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
from collections.abc import Sequence

import numpy as np

from bertjax import fs

IGNORE_INDEX = -1
CONLL2003_LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")
_TAG_RE = re.compile(r"^(O|[BIES]-\S+)$")


@dataclasses.dataclass(frozen=True)
class TaggedSentence:
    """One sentence: words and their tags (equal length)."""

    words: tuple[str, ...]
    tags: tuple[str, ...]


def read_conll(path: str | os.PathLike) -> list[TaggedSentence]:
    """Read a CoNLL column file; raises ValueError naming file and line for a malformed line or tag."""
    path = pathlib.Path(path)
    sentences: list[TaggedSentence] = []
    words: list[str] = []
    tags: list[str] = []

    def flush() -> None:
        if words:
            sentences.append(TaggedSentence(tuple(words), tuple(tags)))
            words.clear()
            tags.clear()

    try:
        with open(path, encoding="utf-8-sig", newline="\n") as f:
            for lineno, line in enumerate(f, start=1):
                fields = line.split()
                if not fields:
                    flush()
                    continue
                if fields[0] == "-DOCSTART-":
                    flush()
                    continue
                if len(fields) < 2:
                    raise ValueError(
                        f"{path}:{lineno}: expected a token and a tag, got {line.strip()!r}"
                    )
                if not _TAG_RE.match(fields[-1]):
                    raise ValueError(
                        f"{path}:{lineno}: tag {fields[-1]!r} is not O, B-X, I-X, E-X or S-X"
                    )
                words.append(fields[0])
                tags.append(fields[-1])
    except UnicodeDecodeError as err:
        raise fs.utf8_error(path, err) from None
    flush()
    if not sentences:
        raise ValueError(f"{path}: no sentences")
    return sentences


def iob1_to_bio(tags: Sequence[str]) -> list[str]:
    """IOB1 -> BIO (IOB2): an I-X that starts a chunk (after O or another type) becomes B-X."""
    out = []
    prev = "O"
    for tag in tags:
        if tag.startswith("I-") and (prev == "O" or prev[2:] != tag[2:]):
            out.append("B-" + tag[2:])
        else:
            out.append(tag)
        prev = tag
    return out


def load_conll2003_tfds(
    split: str, data_dir: str | os.PathLike | None = None
) -> list[TaggedSentence]:
    """Read TFDS `conll2003` ("train", "dev" or "test") as `read_conll` reads the column files.

    Words come from the `tokens` feature and tags from the `ner` ClassLabel (names O, B-PER, I-PER,
    ..., converted to strings through the feature itself), in BIO (`iob1_to_bio`, a no-op on BIO).
    """
    import tensorflow_datasets as tfds

    from bertjax.tasks import tfds_offline

    if split not in ("train", "dev", "test"):
        raise ValueError(f"CoNLL-2003 split {split!r} is not one of ['train', 'dev', 'test']")
    builder = tfds.builder("conll2003", data_dir=None if data_dir is None else str(data_dir))
    tfds_offline.require_prepared_or_online(
        builder, "train.txt, valid.txt and test.txt (CoNLL-2003 columns; or eng.train, ...)"
    )
    ner = builder.info.features["ner"].feature
    ds = tfds.load(
        "conll2003",
        split=split,
        data_dir=None if data_dir is None else str(data_dir),
        shuffle_files=False,
    )
    sentences = []
    for record in tfds.as_numpy(ds):
        words = tuple(w.decode("utf-8") for w in record["tokens"])
        tags = [ner.int2str(int(t)) for t in record["ner"]]
        if len(tags) != len(words):
            raise ValueError(
                f"tfds:conll2003/{split}: sentence {len(sentences)} has {len(words)} tokens "
                f"and {len(tags)} ner tags"
            )
        if words:
            sentences.append(TaggedSentence(words, tuple(iob1_to_bio(tags))))
    if not sentences:
        raise ValueError(f"tfds:conll2003/{split}: no sentences")
    return sentences


def build_label_list(sentences: Sequence[TaggedSentence]) -> list[str]:
    """Label list with "O" first, then the other tags sorted by entity type and prefix (B before I)."""
    tags = {t for s in sentences for t in s.tags}
    rest = sorted(tags - {"O"}, key=lambda t: (t[2:], t[:1]))
    return ["O", *rest]


def encode_tagged(
    tokenizer, sentences: Sequence[TaggedSentence], labels: Sequence[str], max_seq_length: int
) -> dict[str, np.ndarray]:
    """Encode sentences into {input_ids, input_mask, segment_ids, label_ids, word_ids} [n, seq] int32.

    label_ids holds the tag id at each word's first piece and -1 elsewhere; word_ids holds the word
    index at each word's first piece and -1 elsewhere. Words whose pieces do not fit in
    max_seq_length - 2 are cut (they get no label, and "O" from predictions_to_tags); a word that
    tokenizes to nothing gets [UNK] so every word keeps one labelled piece.
    """
    label_to_id = {label: i for i, label in enumerate(labels)}
    n = len(sentences)
    shape = (n, max_seq_length)  # [n, seq]
    out = {
        "input_ids": np.full(shape, tokenizer.pad_id, dtype=np.int32),
        "input_mask": np.zeros(shape, dtype=np.int32),
        "segment_ids": np.zeros(shape, dtype=np.int32),
        "label_ids": np.full(shape, IGNORE_INDEX, dtype=np.int32),
        "word_ids": np.full(shape, IGNORE_INDEX, dtype=np.int32),
    }
    budget = max_seq_length - 2
    for i, sentence in enumerate(sentences):
        ids = [tokenizer.cls_id]
        for w, (word, tag) in enumerate(zip(sentence.words, sentence.tags)):
            if tag not in label_to_id:
                raise ValueError(
                    f"sentence {i} word {w}: tag {tag!r} not in the label list {list(labels)}"
                )
            pieces = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(word)) or [tokenizer.unk_id]
            if len(ids) - 1 + len(pieces) > budget:
                break
            out["label_ids"][i, len(ids)] = label_to_id[tag]
            out["word_ids"][i, len(ids)] = w
            ids.extend(pieces)
        ids.append(tokenizer.sep_id)
        out["input_ids"][i, : len(ids)] = ids
        out["input_mask"][i, : len(ids)] = 1
    return out


def predictions_to_tags(
    pred_ids: np.ndarray, word_ids: np.ndarray, labels: Sequence[str], num_words: Sequence[int]
) -> list[list[str]]:
    """Word-level tags from piece-level predicted ids [n, seq] (read at each word's first piece).

    Words cut by truncation (no first piece in the sequence) are tagged "O".
    """
    pred_ids = np.asarray(pred_ids)  # [n, seq]
    word_ids = np.asarray(word_ids)  # [n, seq]
    if pred_ids.shape != word_ids.shape or pred_ids.shape[0] != len(num_words):
        raise ValueError(
            f"pred_ids {pred_ids.shape}, word_ids {word_ids.shape} and {len(num_words)} sentences differ"
        )
    out = []
    for i, count in enumerate(num_words):
        tags = ["O"] * count
        for pos in np.flatnonzero(word_ids[i] >= 0):
            tags[int(word_ids[i, pos])] = labels[int(pred_ids[i, pos])]
        out.append(tags)
    return out
