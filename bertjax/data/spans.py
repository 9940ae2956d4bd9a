"""The original BERT instance algorithm on token arrays: instances as spans of documents.

`document_spans` is `instances.create_instances_from_document` (the reference, on lists) with the
same rules and distributions, but a document is a `Document` (its token ids in one array and the
sentence bounds) and an instance is a pair of spans, so the per-document work is one Python step per
instance (a `bisect` finds where a chunk reaches the target length) instead of per sentence or token:

* the target length is max_num_tokens, or with prob short_seq_prob uniform in [2, max_num_tokens];
* a chunk takes sentences up to the target; A is its first `a_end` sentences (uniform in
  [1, sentences - 1]); B is the rest, or with prob 0.5 (always for one sentence) sentences of a random
  other document (10 tries) from a random start up to the remaining target, the unused sentences of
  the chunk being put back;
* truncation trims the longer side one token at a time, each time from the front or the back with
  prob 0.5: how many tokens each side loses is fixed by the lengths (`trims`), and how many of them
  come off the front is Binomial(trimmed, 0.5), drawn for all the document's instances at once.

The uniform draws come from one `rng.random(k)` per document (integers as floor(u * n)), so the
random stream differs from the reference's, not the distributions (tests/test_spans.py).
The random-next coin is only drawn for chunks of two or more sentences, as in the original.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import NamedTuple

import numpy as np


class Document(NamedTuple):
    """A tokenized document: ids [tokens] int32 and bounds [sentences + 1] (sentence i is
    ids[bounds[i]:bounds[i + 1]]; every sentence non-empty)."""

    ids: np.ndarray
    bounds: list[int]


class Span(NamedTuple):
    """An instance (truncated): A = a[a_start:a_stop], B = b[b_start:b_stop] (empty without NSP),
    a and b being documents' id arrays."""

    a: np.ndarray
    a_start: int
    a_stop: int
    b: np.ndarray
    b_start: int
    b_stop: int
    is_random_next: bool


def trims(len_a: int, len_b: int, max_num_tokens: int) -> tuple[int, int]:
    """Tokens `truncate_seq_pair` takes off A and B (it trims the longer side, B on a tie)."""
    excess = len_a + len_b - max_num_tokens
    if excess <= 0:
        return 0, 0
    trim_a = trim_b = 0
    if len_a > len_b:
        trim_a = min(excess, len_a - len_b)
    else:
        trim_b = min(excess, len_b - len_a)
    excess -= trim_a + trim_b
    return trim_a + excess // 2, trim_b + (excess + 1) // 2


_EMPTY = np.zeros(0, np.int32)


def document_spans(
    pool, index: int, *, max_seq_length: int, short_seq_prob: float, nsp: bool, rng
) -> list[Span]:
    """The instances of document pool[index] as spans (see the module docstring).

    pool: a sequence of `Document`s (random next segments come from pool[j], j != index).
    """
    doc = pool[index]
    bounds, n = doc.bounds, len(doc.bounds) - 1
    max_num_tokens = max_seq_length - (3 if nsp else 2)
    # Uniform draws u in [0, 1); an int in [0, m) is int(u * m), which is < m for every double
    # u < 1 and m < 2**53. At most 3 draws per instance (13 with all 10 random-document tries).
    draws = rng.random(2 + 3 * n + 16).tolist()
    target = max_num_tokens
    if draws[0] < short_seq_prob:
        target = 2 + int(draws[1] * (max_num_tokens - 1))
    k = 2
    ids, num_docs = doc.ids, len(pool)
    spans: list[tuple] = []
    cut: list[tuple[int, int]] = []  # tokens to trim off A and B
    i = 0
    while i < n:
        start = bounds[i]
        j = min(bisect_left(bounds, start + target, i + 1), n) - 1  # the chunk is sentences i..j
        if not nsp:
            length = bounds[j + 1] - start
            cut.append((max(0, length - max_num_tokens), 0))
            spans.append((ids, start, bounds[j + 1], _EMPTY, 0, 0, False))
            i = j + 1
            continue
        if k + 16 > len(draws):  # only after many random-document retries
            draws, k = draws[k:] + rng.random(3 * (n - i) + 16).tolist(), 0
        sentences = j - i + 1
        if sentences >= 2:
            a_end = 1 + int(draws[k] * (sentences - 1))
            k += 1
        else:
            a_end = 1
        a_stop = bounds[i + a_end]
        if sentences == 1 or draws[k] < 0.5:
            k += sentences > 1
            for _ in range(10):
                other = int(draws[k] * num_docs)
                k += 1
                if other != index:
                    break
            rb = pool[other].bounds
            rn = len(rb) - 1
            s = int(draws[k] * rn)
            k += 1
            e = min(bisect_left(rb, rb[s] + target - (a_stop - start), s + 1), rn)
            b, b_start, b_stop, is_random = pool[other].ids, rb[s], rb[e], True
            i += a_end  # the chunk's unused sentences are put back
        else:
            k += 1
            b, b_start, b_stop, is_random = ids, a_stop, bounds[j + 1], False
            i = j + 1
        cut.append(trims(a_stop - start, b_stop - b_start, max_num_tokens))
        spans.append((ids, start, a_stop, b, b_start, b_stop, is_random))
    return _truncate(spans, cut, rng)


def _truncate(spans: list, cut: list, rng) -> list[Span]:
    """Spans with (trim A, trim B) tokens off, Binomial(trim, 0.5) of them off the front."""
    if not spans:
        return []
    a, a0, a1, b, b0, b1, label = zip(*spans)
    trim = np.array(cut, np.int64)  # [spans, 2]
    if trim.any():
        (front_a, front_b), (trim_a, trim_b) = rng.binomial(trim, 0.5).T, trim.T
        a0 = (np.array(a0) + front_a).tolist()
        a1 = (np.array(a1) - trim_a + front_a).tolist()
        b0 = (np.array(b0) + front_b).tolist()
        b1 = (np.array(b1) - trim_b + front_b).tolist()
    return list(map(Span, a, a0, a1, b, b0, b1, label))
