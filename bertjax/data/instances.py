"""The original BERT instance algorithm: segment pairs from a document, truncation, serialization.

The options (`PrepareConfig`) and the document window of ``prepare``, and the algorithm on lists of
token lists with the original script's order of random calls: the reference that tests compare
``spans`` (what ``prepare`` runs, on token arrays with bulk draws) and ``example_batch`` with. See
``prepare``'s docstring for the algorithm and the differences from google-research/bert.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from bertjax.data import corpus, masking, packing
from bertjax.data.records import example_bytes, float_feature, int64_feature


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """Every option that changes the records (num_workers does not), and `text_column_setting`,
    which changes none (compare=False: not a setting of the prepared data): what errors call the
    option that chose `text_column` (`--text_column` for `bertjax prepare`, `data.text_column` for
    a pretraining run)."""

    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    dupe_factor: int = 5
    nsp: bool = True
    masking: str = "static"
    whole_word_mask: bool = False
    seed: int = 12345
    num_shards: int = 16
    eval_fraction: float = 0.0
    random_document_buffer: int = 1000
    corpus_format: str = "bert"
    packing: bool = False
    text_column: str = "text"  # the JSON key / Parquet column of the row formats
    text_column_setting: str = dataclasses.field(default="text_column", compare=False)

    def validate(self) -> None:
        """One-line ValueError naming the first bad option."""
        checks = [
            ("max_seq_length", self.max_seq_length >= (5 if self.nsp else 4), "too small"),
            ("max_predictions_per_seq", self.max_predictions_per_seq >= 1, "must be >= 1"),
            ("masked_lm_prob", 0.0 < self.masked_lm_prob < 1.0, "must be in (0, 1)"),
            ("short_seq_prob", 0.0 <= self.short_seq_prob <= 1.0, "must be in [0, 1]"),
            ("dupe_factor", self.dupe_factor >= 1, "must be >= 1"),
            ("masking", self.masking in ("static", "dynamic"), "must be 'static' or 'dynamic'"),
            ("num_shards", self.num_shards >= 1, "must be >= 1"),
            ("eval_fraction", 0.0 <= self.eval_fraction < 1.0, "must be in [0, 1)"),
            ("random_document_buffer", self.random_document_buffer >= 1, "must be >= 1"),
            ("corpus_format", self.corpus_format in corpus.FORMATS, f"not in {corpus.FORMATS}"),
            ("packing", not (self.packing and self.nsp), "needs nsp=False (pairs are not packed)"),
            ("text_column", bool(self.text_column), "must not be empty"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"prepare option {name}={getattr(self, name)!r}: {why}")

    def shard_counts(self) -> dict[str, int]:
        """Number of shards per split (eval: about eval_fraction of num_shards, at least 1)."""
        num_eval = max(1, round(self.num_shards * self.eval_fraction)) if self.eval_fraction else 0
        return {"train": self.num_shards, "eval": num_eval}


def truncate_seq_pair(tokens_a: list, tokens_b: list, max_num_tokens: int, rng) -> None:
    """Trims the longer list (front or back at random) until both fit in max_num_tokens, in place.

    One token goes per step, so the steps' uniform draws are taken in one call (`rng.random(k)`
    gives the same values as k calls of `rng.random()`) and the lists are cut once at the end.
    """
    excess = len(tokens_a) + len(tokens_b) - max_num_tokens
    if excess <= 0:
        return
    len_a, len_b = len(tokens_a), len(tokens_b)
    cut = [0, 0, 0, 0]  # front of a, back of a, front of b, back of b
    for u in rng.random(excess).tolist():
        if len_a > len_b:
            cut[u >= 0.5] += 1
            len_a -= 1
        else:
            cut[2 + (u >= 0.5)] += 1
            len_b -= 1
    for tokens, front, back in ((tokens_a, cut[0], cut[1]), (tokens_b, cut[2], cut[3])):
        if front or back:
            tokens[:] = tokens[front : len(tokens) - back]


def create_instances_from_document(
    pool: Sequence[Sequence[list[int]]],
    index: int,
    *,
    max_seq_length: int,
    short_seq_prob: float,
    nsp: bool,
    rng: np.random.Generator,
) -> list[tuple[list[int], list[int], bool]]:
    """Instances (tokens_a, tokens_b, is_random_next) of document pool[index] (original algorithm).

    A document is a list of non-empty token-id lists (sentences). Random next segments come from
    pool[j], j != index (10 tries, as in the original). With nsp=False tokens_b is empty.
    """
    document = pool[index]
    max_num_tokens = max_seq_length - (3 if nsp else 2)
    target = max_num_tokens
    if rng.random() < short_seq_prob:
        target = int(rng.integers(2, max_num_tokens + 1))
    instances = []
    chunk: list[list[int]] = []
    length = 0
    i = 0
    while i < len(document):
        chunk.append(document[i])
        length += len(document[i])
        if i == len(document) - 1 or length >= target:
            if not nsp:
                tokens_a = [t for segment in chunk for t in segment]
                truncate_seq_pair(tokens_a, [], max_num_tokens, rng)
                instances.append((tokens_a, [], False))
                chunk, length, i = [], 0, i + 1
                continue
            a_end = int(rng.integers(1, len(chunk))) if len(chunk) >= 2 else 1
            tokens_a = [t for segment in chunk[:a_end] for t in segment]
            tokens_b: list[int] = []
            is_random_next = len(chunk) == 1 or rng.random() < 0.5
            if is_random_next:
                target_b = target - len(tokens_a)
                for _ in range(10):
                    other = int(rng.integers(0, len(pool)))
                    if other != index:
                        break
                random_doc = pool[other]
                for segment in random_doc[int(rng.integers(0, len(random_doc))) :]:
                    tokens_b.extend(segment)
                    if len(tokens_b) >= target_b:
                        break
                i -= len(chunk) - a_end  # put the unused segments back
            else:
                tokens_b = [t for segment in chunk[a_end:] for t in segment]
            truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
            instances.append((tokens_a, tokens_b, is_random_next))
            chunk, length = [], 0
        i += 1
    return instances


def instance_to_example(
    tokens_a: list[int],
    tokens_b: list[int],
    is_random_next: bool,
    *,
    cfg: PrepareConfig,
    consts: dict,
    rng: np.random.Generator,
) -> bytes:
    """Serialized tf.train.Example of one instance (masked here when cfg.masking == "static")."""
    ids = [consts["cls_id"], *tokens_a, consts["sep_id"]]
    segment_ids = [0] * len(ids)
    if tokens_b:
        ids += [*tokens_b, consts["sep_id"]]
        segment_ids += [1] * (len(tokens_b) + 1)
    return _serialize(ids, segment_ids, {}, int(is_random_next), cfg=cfg, consts=consts, rng=rng)


def packed_to_example(
    segments: list[list[int]], *, cfg: PrepareConfig, consts: dict, rng: np.random.Generator
) -> bytes:
    """Serialized tf.train.Example of a packed row: ``[CLS] tokens [SEP]`` per segment, with
    pack_ids and position_ids (``bertjax.data.packing``); masked as one row when static."""
    ids = [t for tokens in segments for t in (consts["cls_id"], *tokens, consts["sep_id"])]
    pack_ids, position_ids, _ = packing.row_layout([len(t) + 2 for t in segments], len(ids))
    extra = {"pack_ids": pack_ids.tolist(), "position_ids": position_ids.tolist()}
    return _serialize(ids, [0] * len(ids), extra, 0, cfg=cfg, consts=consts, rng=rng)


def _serialize(
    ids: list[int],
    segment_ids: list[int],
    extra: dict[str, list[int]],
    next_sentence_label: int,
    *,
    cfg: PrepareConfig,
    consts: dict,
    rng: np.random.Generator,
) -> bytes:
    """Masks (static) and pads one row of real tokens; ``extra`` are more [seq] int features."""
    seq = cfg.max_seq_length
    n = len(ids)
    features = {}
    if cfg.masking == "static":
        masked = masking.create_masked_lm_predictions(
            ids,
            rng,
            vocab_size=consts["vocab_size"],
            mask_id=consts["mask_id"],
            special_ids=consts["special_ids"],
            masked_lm_prob=cfg.masked_lm_prob,
            max_predictions_per_seq=cfg.max_predictions_per_seq,
            word_start=consts["word_start"],
        )
        ids = masked.input_ids.tolist()
        k, pad = len(masked.positions), cfg.max_predictions_per_seq - len(masked.positions)
        features["masked_lm_positions"] = int64_feature(masked.positions.tolist() + [0] * pad)
        features["masked_lm_ids"] = int64_feature(masked.labels.tolist() + [0] * pad)
        features["masked_lm_weights"] = float_feature([1.0] * k + [0.0] * pad)
    features["input_ids"] = int64_feature(ids + [consts["pad_id"]] * (seq - n))
    features["input_mask"] = int64_feature([1] * n + [0] * (seq - n))
    features["segment_ids"] = int64_feature(segment_ids + [0] * (seq - n))
    for key, values in extra.items():
        features[key] = int64_feature(values + [0] * (seq - len(values)))
    features["next_sentence_labels"] = int64_feature([next_sentence_label])
    return example_bytes(features)  # = tf.train.Example(...).SerializeToString(deterministic=True)


class DocumentWindow:
    """Feeds documents through create_instances with a bounded pool of neighbours for random next."""

    def __init__(self, buffer: int, make: Callable[[Sequence, int], None]):
        self.buffer, self.make = buffer, make
        self.docs: collections.deque = collections.deque()
        self.next = 0  # index in self.docs of the next document to turn into instances

    def push(self, doc: list[list[int]]) -> None:
        self.docs.append(doc)
        while len(self.docs) - self.next > self.buffer:
            self._step()

    def finish(self) -> None:
        while self.next < len(self.docs):
            self._step()

    def _step(self) -> None:
        self.make(self.docs, self.next)
        self.next += 1
        while self.next > self.buffer:
            self.docs.popleft()
            self.next -= 1
