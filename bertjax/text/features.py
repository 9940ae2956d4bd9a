"""Text to model inputs, one way for every task and model: ``[CLS] a [SEP]`` rows of single texts,
``[CLS] a [SEP] b [SEP]`` rows of pairs, an optional prefix after ``[CLS]`` (ColBERT's query and
document markers), a named truncation, and padding to a width.

Truncation strategies of a pair (``TRUNCATIONS``), each the reference's to the token:

- ``longest_first``: the original BERT's ``truncate_seq_pair``: one token at a time off the end of
  the longer text, the second on a tie (GLUE, SWAG, ``load_pretrained``'s ``encode_batch``);
- ``hf_longest_first``: Hugging Face tokenizers' ``longest_first`` (``truncate_encodings`` in its
  Rust code), the cut computed at once: what sentence-transformers' ``CrossEncoder`` feeds a
  reranker.

A single text keeps its first tokens. Rows are (ids, segment ids) lists; :func:`pad` turns them
into ``input_ids``, ``segment_ids`` and ``input_mask`` int32 arrays, the keys of training batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

TRUNCATIONS = ("longest_first", "hf_longest_first")
Row = tuple[list[int], list[int]]  # (token ids, segment ids)


def truncate_pair(
    a: Sequence[int], b: Sequence[int], budget: int, truncation: str = "longest_first"
) -> tuple[list[int], list[int]]:
    """``a`` and ``b`` cut to at most ``budget`` tokens together, by the named ``truncation``."""
    a, b = list(a), list(b)
    if truncation == "longest_first":
        while len(a) + len(b) > budget:
            (a if len(a) > len(b) else b).pop()
        return a, b
    if truncation != "hf_longest_first":
        raise ValueError(f"truncation={truncation!r} is not one of {TRUNCATIONS}")
    if len(a) + len(b) <= budget:
        return a, b
    n1, n2 = len(a), len(b)
    swap = n1 > n2
    if swap:
        n1, n2 = n2, n1
    n2 = n1 if n1 > budget else max(n1, budget - n1)
    if n1 + n2 > budget:
        n1 = budget // 2
        n2 = n1 + budget % 2
    if swap:
        n1, n2 = n2, n1
    return a[:n1], b[:n2]


def token_ids(tokenizer: Any, texts: Sequence[str], *, lower: bool = False) -> list[list[int]]:
    """Word-piece ids per text, without special tokens (batched where the tokenizer can);
    ``lower``: lower-cased first (a model whose settings fold case its tokenizer keeps)."""
    texts = [t.lower() for t in texts] if lower else list(texts)
    encode_batch = getattr(tokenizer, "encode_batch", None)
    return (
        [list(r) for r in encode_batch(texts)]
        if encode_batch
        else list(map(tokenizer.encode, texts))
    )


def rows(
    tokenizer: Any,
    items: Sequence[str | tuple[str, str]],
    max_length: int,
    *,
    truncation: str = "longest_first",
    prefix: Sequence[int] = (),
    lower: bool = False,
) -> list[Row]:
    """One (ids, segment ids) row of at most ``max_length`` tokens per item: a text is ``[CLS]
    prefix text [SEP]``, a (text, text) pair ``[CLS] a [SEP] b [SEP]`` (segments 0 then 1)."""
    items = [item if isinstance(item, str) else tuple(item) for item in items]
    if any(
        not isinstance(item, str) and (len(item) != 2 or not all(isinstance(t, str) for t in item))
        for item in items
    ):
        raise TypeError("each item must be a text or a (text, text) pair of strings")
    pairs = [not isinstance(item, str) for item in items]
    if any(pairs) and prefix:
        raise ValueError("a prefix applies to single texts, not to pairs")
    if max_length < (3 if any(pairs) else 2 + len(prefix)):
        shape = "[CLS] a [SEP] b [SEP]" if any(pairs) else "[CLS] text [SEP]"
        raise ValueError(f"max_length={max_length} leaves no room for {shape}")
    texts = [t for item in items for t in ((item,) if isinstance(item, str) else item)]
    pieces = iter(token_ids(tokenizer, texts, lower=lower))
    return [
        pair_row(tokenizer, next(pieces), next(pieces), max_length, truncation)
        if is_pair
        else single_row(tokenizer, next(pieces), max_length, prefix)
        for is_pair in pairs
    ]


def single_row(
    tokenizer: Any, a: Sequence[int], max_length: int, prefix: Sequence[int] = ()
) -> Row:
    """``[CLS] prefix a [SEP]`` of word-piece ids ``a``, cut to ``max_length`` tokens."""
    a = list(a[: max(max_length - 2 - len(prefix), 0)])
    return [tokenizer.cls_id, *prefix, *a, tokenizer.sep_id], [0] * (len(a) + 2 + len(prefix))


def pair_row(
    tokenizer: Any,
    a: Sequence[int],
    b: Sequence[int],
    max_length: int,
    truncation: str = "longest_first",
) -> Row:
    """``[CLS] a [SEP] b [SEP]`` of word-piece ids, cut to ``max_length`` tokens by ``truncation``."""
    a, b = truncate_pair(a, b, max_length - 3, truncation)
    ids = [tokenizer.cls_id, *a, tokenizer.sep_id, *b, tokenizer.sep_id]
    return ids, [0] * (len(a) + 2) + [1] * (len(b) + 1)


def pad(rows_: Sequence[Row], width: int, pad_id: int) -> dict[str, np.ndarray]:
    """``rows_`` as [n, width] int32 ``input_ids`` (``pad_id`` after each row), ``segment_ids`` and
    ``input_mask`` (1 on the row's tokens)."""
    ids = np.full((len(rows_), width), pad_id, np.int32)
    segments = np.zeros((len(rows_), width), np.int32)
    mask = np.zeros((len(rows_), width), np.int32)
    for i, (row, row_segments) in enumerate(rows_):
        if len(row) > width:
            raise ValueError(f"a row of {len(row)} tokens is longer than the width {width}")
        ids[i, : len(row)] = row
        segments[i, : len(row)] = row_segments
        mask[i, : len(row)] = 1
    return {"input_ids": ids, "segment_ids": segments, "input_mask": mask}


def longest(rows_: Sequence[Row]) -> int:
    """The length of the longest row (1 for none)."""
    return max((len(r[0]) for r in rows_), default=1)
