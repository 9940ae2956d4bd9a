"""Official fine-tuning metrics: GLUE (accuracy, F1, Matthews, Pearson, Spearman), SQuAD v1.1/v2.0, CoNLL NER.

Every function here reproduces a reference exactly:
  * classification / regression metrics match scikit-learn and SciPy (Spearman ranks ties by their
    average rank, as `scipy.stats.spearmanr` does); GLUE scores are fractions in [0, 1];
  * `evaluate_squad_v1` is the official `evaluate-v1.1.py`, `evaluate_squad_v2` the official
    `evaluate-v2.0.py`: in percent by default, as the official scripts print them (`bertjax
    evaluate squad`), as fractions with `percent=False` (what training logs);
  * `ner_metrics` is the chunk-level precision / recall / F1 of `conlleval`, with its chunk
    start / end rules, so BIO (IOB2) and IOB1 tag sequences are both scored correctly; as fractions,
    as `seqeval` gives them (conlleval prints these times 100).

A training run logs, writes (metrics.jsonl, eval_results.json) and selects its best checkpoint by
fractions for every task.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

# ----------------------------------------------------------------------------------------------
# Classification and regression metrics.
# ----------------------------------------------------------------------------------------------


def _pair(labels: Sequence, preds: Sequence, dtype=None) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(labels, dtype=dtype)
    p = np.asarray(preds, dtype=dtype)
    if y.shape != p.shape or y.ndim != 1:
        raise ValueError(
            f"labels and predictions must be 1-D of equal length, got {y.shape} and {p.shape}"
        )
    if y.size == 0:
        raise ValueError("cannot compute a metric over zero examples")
    return y, p


def _has_nan(*arrays: np.ndarray) -> bool:
    """Whether a floating input holds a NaN (a diverged model): its metric is then NaN, as SciPy's
    statistics are with nan_policy='propagate', so that NaN never scores and never wins a selection."""
    return any(np.issubdtype(a.dtype, np.floating) and bool(np.isnan(a).any()) for a in arrays)


def accuracy(labels: Sequence, preds: Sequence) -> float:
    """Fraction of predictions equal to the label (NaN when a prediction is NaN)."""
    y, p = _pair(labels, preds)
    if _has_nan(y, p):
        return float("nan")
    return float(np.mean(y == p))


def binary_f1(labels: Sequence[int], preds: Sequence[int], positive: int = 1) -> float:
    """F1 of the `positive` class (sklearn `f1_score(average="binary")`; 0.0 when undefined, NaN
    when a prediction is NaN)."""
    y, p = _pair(labels, preds)
    if _has_nan(y, p):
        return float("nan")
    tp = int(np.sum((p == positive) & (y == positive)))
    fp = int(np.sum((p == positive) & (y != positive)))
    fn = int(np.sum((p != positive) & (y == positive)))
    if tp == 0:
        return 0.0
    return 2.0 * tp / (2.0 * tp + fp + fn)


def matthews_corrcoef(labels: Sequence[int], preds: Sequence[int]) -> float:
    """Matthews correlation coefficient, multi-class form (sklearn; 0.0 when a marginal is constant,
    NaN when a prediction is NaN)."""
    y, p = _pair(labels, preds)
    if _has_nan(y, p):
        return float("nan")
    classes, inverse = np.unique(np.concatenate([y, p]), return_inverse=True)
    k, n = len(classes), len(y)
    confusion = np.zeros((k, k), dtype=np.float64)  # [true, predicted]
    np.add.at(confusion, (inverse[:n], inverse[n:]), 1.0)
    t_sum = confusion.sum(axis=1)
    p_sum = confusion.sum(axis=0)
    correct = np.trace(confusion)
    cov_ytyp = correct * n - np.dot(t_sum, p_sum)
    cov_ypyp = n * n - np.dot(p_sum, p_sum)
    cov_ytyt = n * n - np.dot(t_sum, t_sum)
    if cov_ypyp * cov_ytyt == 0:
        return 0.0
    return float(cov_ytyp / np.sqrt(cov_ytyt * cov_ypyp))


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation (scipy.stats.pearsonr statistic; NaN when either input is constant or
    holds a NaN)."""
    a, b = _pair(x, y, dtype=np.float64)
    if _has_nan(a, b):
        return float("nan")
    a = a - a.mean()
    b = b - b.mean()
    denom = np.sqrt(np.dot(a, a) * np.dot(b, b))
    if denom == 0.0:
        return float("nan")
    return float(np.clip(np.dot(a, b) / denom, -1.0, 1.0))


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks with ties given their average rank (scipy.stats.rankdata(method='average'))."""
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    # Start index of each run of equal values in the sorted array.
    new_run = np.concatenate([[True], sorted_x[1:] != sorted_x[:-1]])
    run_id = np.cumsum(new_run) - 1
    run_start = np.flatnonzero(new_run)
    run_end = np.concatenate([run_start[1:], [len(x)]])  # exclusive
    avg = (run_start + run_end + 1) / 2.0  # mean of 1-based ranks start+1 .. end
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = avg[run_id]
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation with average ranks for ties (scipy.stats.spearmanr statistic; NaN
    when an input holds a NaN, which ranking would otherwise order arbitrarily)."""
    a, b = _pair(x, y, dtype=np.float64)
    if _has_nan(a, b):
        return float("nan")
    return pearson(_average_ranks(a), _average_ranks(b))


GLUE_TASK_METRICS: dict[str, tuple[str, ...]] = {
    "cola": ("mcc",),
    "sst2": ("accuracy",),
    "mrpc": ("accuracy", "f1"),
    "stsb": ("pearson", "spearman"),
    "qqp": ("accuracy", "f1"),
    "mnli": ("accuracy",),
    "mnli_matched": ("accuracy",),
    "mnli_mismatched": ("accuracy",),
    "qnli": ("accuracy",),
    "rte": ("accuracy",),
    "wnli": ("accuracy",),
    "ax": ("accuracy",),
}


def glue_metrics(task: str, labels: Sequence, preds: Sequence) -> dict[str, float]:
    """The official metric set of a GLUE task (see GLUE_TASK_METRICS), as fractions.

    Classification tasks take integer label ids (label 1 is the positive class for F1); STS-B takes
    float scores. MRPC/QQP also report `acc_and_f1` and STS-B `corr`, the averages GLUE ranks by.
    """
    key = task.lower().removeprefix("glue/")
    key = {"mnli-m": "mnli_matched", "mnli-mm": "mnli_mismatched"}.get(key, key).replace("-", "")
    if key not in GLUE_TASK_METRICS:
        raise ValueError(f"unknown GLUE task {task!r}; known: {sorted(GLUE_TASK_METRICS)}")
    fns = {
        "mcc": matthews_corrcoef,
        "accuracy": accuracy,
        "f1": binary_f1,
        "pearson": pearson,
        "spearman": spearman,
    }
    out = {name: fns[name](labels, preds) for name in GLUE_TASK_METRICS[key]}
    if key in ("mrpc", "qqp"):
        out["acc_and_f1"] = (out["accuracy"] + out["f1"]) / 2.0
    if key == "stsb":
        out["corr"] = (out["pearson"] + out["spearman"]) / 2.0
    return out


# ----------------------------------------------------------------------------------------------
# SQuAD v1.1 and v2.0 (official evaluation scripts).
# ----------------------------------------------------------------------------------------------

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def normalize_answer(s: str) -> str:
    """Lower-case, drop punctuation, drop articles a/an/the and collapse whitespace (official)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def squad_exact_match(prediction: str, ground_truth: str) -> float:
    """1.0 when the normalized strings are equal, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def squad_f1(prediction: str, ground_truth: str) -> float:
    """Token-overlap F1 of the normalized strings.

    Empty-vs-empty follows evaluate-v2.0 (1.0 when both are empty, 0.0 when only one is); for
    non-empty gold answers this equals evaluate-v1.1's f1_score.
    """
    pred_toks = normalize_answer(prediction).split()
    gold_toks = normalize_answer(ground_truth).split()
    if not pred_toks or not gold_toks:
        return float(pred_toks == gold_toks)
    common = collections.Counter(pred_toks) & collections.Counter(gold_toks)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_toks)
    recall = num_same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def _squad_questions(dataset: Sequence[Mapping]) -> Iterable[Mapping]:
    for article in dataset:
        for paragraph in article["paragraphs"]:
            yield from paragraph["qas"]


def evaluate_squad_v1(
    dataset: Sequence[Mapping], predictions: Mapping[str, str], *, percent: bool = True
) -> dict[str, float]:
    """evaluate-v1.1.py: {'exact_match', 'f1'} in percent (fractions when not `percent`), max over
    gold answers.

    `dataset` is the JSON's "data" list. A question without a prediction scores 0 (and counts).
    """
    exact = f1 = 0.0
    total = 0
    for qa in _squad_questions(dataset):
        total += 1
        if qa["id"] not in predictions:
            continue
        golds = [a["text"] for a in qa["answers"]]
        pred = predictions[qa["id"]]
        exact += max(squad_exact_match(pred, g) for g in golds)
        # v1.1's f1_score: an empty normalized prediction or gold scores 0 (no overlap).
        f1 = f1 + max(
            (squad_f1(pred, g) if normalize_answer(pred) and normalize_answer(g) else 0.0)
            for g in golds
        )
    if total == 0:
        raise ValueError("the SQuAD dataset holds no questions")
    scale = _scale(percent)
    return {"exact_match": scale * exact / total, "f1": scale * f1 / total}


def _scale(percent: bool) -> float:
    """100 for percent (the official scripts' `100.0 * x / total`, bit for bit), else 1."""
    return 100.0 if percent else 1.0


def _make_eval_dict(
    exact: Mapping[str, float], f1: Mapping[str, float], scale: float, qids=None
) -> dict:
    if qids is None:
        total = len(exact)
        return {
            "exact": scale * sum(exact.values()) / total,
            "f1": scale * sum(f1.values()) / total,
            "total": total,
        }
    total = len(qids)
    return {
        "exact": scale * sum(exact.get(k, 0.0) for k in qids) / total,
        "f1": scale * sum(f1.get(k, 0.0) for k in qids) / total,
        "total": total,
    }


def _find_best_thresh(preds, scores, na_probs, qid_to_has_ans, scale) -> tuple[float, float]:
    """Sweep the no-answer threshold over the sorted na_probs (official find_best_thresh)."""
    cur_score = sum(1 for k in qid_to_has_ans if not qid_to_has_ans[k])
    best_score = cur_score
    best_thresh = 0.0
    for qid in sorted(na_probs, key=lambda k: na_probs[k]):
        if qid not in scores:
            continue
        if qid_to_has_ans[qid]:
            diff = scores[qid]
        else:
            diff = -1 if preds[qid] else 0
        cur_score += diff
        if cur_score > best_score:
            best_score = cur_score
            best_thresh = na_probs[qid]
    return scale * best_score / len(scores), best_thresh


def evaluate_squad_v2(
    dataset: Sequence[Mapping],
    predictions: Mapping[str, str],
    na_probs: Mapping[str, float] | None = None,
    na_prob_thresh: float = 1.0,
    *,
    percent: bool = True,
) -> dict[str, float]:
    """evaluate-v2.0.py: exact/f1/total, HasAns_* and NoAns_* splits, and best_* with `na_probs`;
    scores in percent (fractions when not `percent`; counts and thresholds are the same either way).

    Questions without a prediction are left out of the overall totals (as the official script does)
    and count 0 in the HasAns/NoAns splits (where the official script would crash).
    """
    qid_to_has_ans = {qa["id"]: bool(qa["answers"]) for qa in _squad_questions(dataset)}
    exact_raw: dict[str, float] = {}
    f1_raw: dict[str, float] = {}
    for qa in _squad_questions(dataset):
        qid = qa["id"]
        golds = [a["text"] for a in qa["answers"] if normalize_answer(a["text"])] or [""]
        if qid not in predictions:
            continue
        pred = predictions[qid]
        exact_raw[qid] = max(squad_exact_match(pred, g) for g in golds)
        f1_raw[qid] = max(squad_f1(pred, g) for g in golds)
    if not exact_raw:
        raise ValueError("no SQuAD question has a prediction")
    given_probs = na_probs is not None
    probs = dict(na_probs) if given_probs else {k: 0.0 for k in predictions}
    missing = [qid for qid in exact_raw if qid not in probs]
    if missing:
        raise ValueError(
            f"no no-answer probability for question {missing[0]} ({len(missing)} missing)"
        )

    def threshold(scores):
        out = {}
        for qid, s in scores.items():
            out[qid] = float(not qid_to_has_ans[qid]) if probs[qid] > na_prob_thresh else s
        return out

    exact_t, f1_t = threshold(exact_raw), threshold(f1_raw)
    scale = _scale(percent)
    result = _make_eval_dict(exact_t, f1_t, scale)
    has_ans = [k for k, v in qid_to_has_ans.items() if v]
    no_ans = [k for k, v in qid_to_has_ans.items() if not v]
    for prefix, qids in (("HasAns", has_ans), ("NoAns", no_ans)):
        if qids:
            for k, v in _make_eval_dict(exact_t, f1_t, scale, qids).items():
                result[f"{prefix}_{k}"] = v
    if given_probs:
        result["best_exact"], result["best_exact_thresh"] = _find_best_thresh(
            predictions, exact_raw, probs, qid_to_has_ans, scale
        )
        result["best_f1"], result["best_f1_thresh"] = _find_best_thresh(
            predictions, f1_raw, probs, qid_to_has_ans, scale
        )
    return result


# ----------------------------------------------------------------------------------------------
# CoNLL entity-level NER metrics (conlleval).
# ----------------------------------------------------------------------------------------------


def _split_tag(tag: str) -> tuple[str, str]:
    """'B-PER' -> ('B', 'PER'); 'O' -> ('O', '')."""
    if tag == "O":
        return "O", ""
    prefix, sep, kind = tag.partition("-")
    if not sep:
        return tag, ""
    return prefix, kind


def _chunk_end(prev_tag: str, tag: str, prev_type: str, kind: str) -> bool:
    """conlleval endOfChunk: did a chunk end between the previous and this token?"""
    if prev_tag in ("E", "S"):
        return True
    if prev_tag in ("B", "I") and tag in ("B", "S", "O"):
        return True
    return prev_tag != "O" and prev_type != kind


def _chunk_start(prev_tag: str, tag: str, prev_type: str, kind: str) -> bool:
    """conlleval startOfChunk: does a chunk start at this token?"""
    if tag in ("B", "S"):
        return True
    if prev_tag in ("E", "S", "O") and tag in ("I", "E"):
        return True
    return tag != "O" and prev_type != kind


def get_entities(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """Chunks of a BIO / IOB1 (or IOBES) tag sequence as (type, first, last) with inclusive ends."""
    chunks = []
    prev_tag, prev_type, start = "O", "", None
    for i, tag in enumerate([*tags, "O"]):
        cur_tag, cur_type = _split_tag(tag)
        if start is not None and _chunk_end(prev_tag, cur_tag, prev_type, cur_type):
            chunks.append((prev_type, start, i - 1))
            start = None
        if _chunk_start(prev_tag, cur_tag, prev_type, cur_type):
            start = i
        prev_tag, prev_type = cur_tag, cur_type
    return chunks


def _prf(correct: int, found_pred: int, found_gold: int) -> dict[str, float]:
    precision = correct / found_pred if found_pred else 0.0
    recall = correct / found_gold if found_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


def ner_metrics(
    gold_sequences: Sequence[Sequence[str]], pred_sequences: Sequence[Sequence[str]]
) -> dict:
    """conlleval scores as fractions (seqeval's scale; conlleval prints them in percent): overall
    precision/recall/f1, token accuracy and per-type scores.

    Each sentence is scored separately (a sentence break ends every chunk, as in conlleval); a
    predicted chunk is correct when its type, first and last token equal a gold chunk's.
    """
    if len(gold_sequences) != len(pred_sequences):
        raise ValueError(
            f"{len(gold_sequences)} gold sentences but {len(pred_sequences)} predicted ones"
        )
    correct = collections.Counter()
    found_gold = collections.Counter()
    found_pred = collections.Counter()
    tokens = correct_tokens = 0
    for i, (gold, pred) in enumerate(zip(gold_sequences, pred_sequences)):
        if len(gold) != len(pred):
            raise ValueError(f"sentence {i}: {len(gold)} gold tags but {len(pred)} predicted tags")
        gold_chunks = set(get_entities(gold))
        pred_chunks = set(get_entities(pred))
        for kind, _, _ in gold_chunks:
            found_gold[kind] += 1
        for kind, _, _ in pred_chunks:
            found_pred[kind] += 1
        for kind, _, _ in gold_chunks & pred_chunks:
            correct[kind] += 1
        tokens += len(gold)
        correct_tokens += sum(g == p for g, p in zip(gold, pred))
    result = _prf(sum(correct.values()), sum(found_pred.values()), sum(found_gold.values()))
    result["accuracy"] = correct_tokens / tokens if tokens else 0.0
    result["per_type"] = {
        kind: _prf(correct[kind], found_pred[kind], found_gold[kind])
        for kind in sorted(set(found_gold) | set(found_pred))
    }
    return result
