"""SQuAD post-processing: start/end logits -> answer texts, as the original BERT `run_squad.py`.

For each question, the `n_best_size` best start and end positions of every feature are paired, invalid
pairs are dropped (outside the document, not the token's max-context span, end before start, longer
than `max_answer_length`), the survivors are ranked by start+end logit, mapped back to the original
text with `get_final_text`, and de-duplicated into the n-best list. For v2.0 the null answer is the
[CLS] score of the feature where it is smallest; the answer is "" when
null_score - best_non_null_score > null_score_diff_threshold. Outputs are written in the official
formats: predictions.json, nbest_predictions.json and (v2.0) null_odds.json.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from bertjax import atomic
from bertjax.tasks.squad_data import SquadExample, SquadFeatures
from bertjax.text.chars import basic_tokenize


@dataclasses.dataclass
class SquadPredictions:
    """predictions: qid -> answer text; nbest: qid -> n-best entries (text, probability, start_logit,
    end_logit); null_odds: qid -> null score minus best non-null score (v2.0 only); best_non_null:
    qid -> best non-empty answer text (used to re-threshold v2.0 predictions)."""

    predictions: dict[str, str]
    nbest: dict[str, list[dict]]
    null_odds: dict[str, float] | None
    best_non_null: dict[str, str]


def _strip_spaces(text: str) -> tuple[str, dict[int, int]]:
    """Text without spaces and the map from its character indices to indices in `text`."""
    chars: list[str] = []
    ns_to_s: dict[int, int] = {}
    for i, c in enumerate(text):
        if c == " ":
            continue
        ns_to_s[len(chars)] = i
        chars.append(c)
    return "".join(chars), ns_to_s


def _default_basic_tokenize() -> Callable[[str, bool], list[str]]:
    return basic_tokenize


def get_final_text(
    pred_text: str,
    orig_text: str,
    do_lower_case: bool,
    basic_tokenize: Callable[[str, bool], list[str]] | None = None,
) -> str:
    """Project normalized predicted text back onto the original text (official alignment heuristic).

    `orig_text` is basic-tokenized; when its space-free characters align one-to-one with the
    original's, the characters of `pred_text` are mapped back, so "steve smith" inside "Steve
    Smith's" gives "Steve Smith". When the alignment fails, `orig_text` is returned whole.
    """
    basic_tokenize = basic_tokenize or _default_basic_tokenize()
    tok_text = " ".join(basic_tokenize(orig_text, do_lower_case))
    start_position = tok_text.find(pred_text)
    if start_position == -1:
        return orig_text
    end_position = start_position + len(pred_text) - 1
    orig_ns_text, orig_ns_to_s = _strip_spaces(orig_text)
    tok_ns_text, tok_ns_to_s = _strip_spaces(tok_text)
    if len(orig_ns_text) != len(tok_ns_text):
        return orig_text
    tok_s_to_ns = {s: ns for ns, s in tok_ns_to_s.items()}
    orig_start = orig_ns_to_s.get(tok_s_to_ns.get(start_position, -1))
    if orig_start is None:
        return orig_text
    orig_end = orig_ns_to_s.get(tok_s_to_ns.get(end_position, -1))
    if orig_end is None:
        return orig_text
    return orig_text[orig_start : orig_end + 1]


def _softmax(scores: Sequence[float]) -> list[float]:
    if not scores:
        return []
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = sum(exps)
    return [e / total for e in exps]


def _best_indexes(logits: np.ndarray, n_best_size: int) -> list[int]:
    """Indices of the n largest logits, ties in index order (as Python's stable sort)."""
    return [int(i) for i in np.argsort(-logits, kind="stable")[:n_best_size]]


def compute_predictions(
    examples: Sequence[SquadExample],
    features: SquadFeatures,
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    n_best_size: int = 20,
    max_answer_length: int = 30,
    do_lower_case: bool = True,
    version_2_with_negative: bool = False,
    null_score_diff_threshold: float = 0.0,
    basic_tokenize: Callable[[str, bool], list[str]] | None = None,
) -> SquadPredictions:
    """Answers for every example from per-feature logits.

    start_logits / end_logits: [num_features, seq], row i belonging to feature i of `features`.
    `basic_tokenize(text, do_lower_case)` defaults to bertjax.text.tokenization.basic_tokenize.
    """
    start_logits = np.asarray(start_logits, dtype=np.float32)  # [features, seq]
    end_logits = np.asarray(end_logits, dtype=np.float32)  # [features, seq]
    if start_logits.shape != end_logits.shape or start_logits.shape[0] != len(features):
        raise ValueError(
            f"logits {start_logits.shape} / {end_logits.shape} do not match {len(features)} features"
        )
    basic_tokenize = basic_tokenize or _default_basic_tokenize()
    by_example: dict[int, list[int]] = {}
    for f, ex in enumerate(features.example_index.tolist()):
        by_example.setdefault(ex, []).append(f)

    predictions: dict[str, str] = {}
    nbest_json: dict[str, list[dict]] = {}
    null_odds: dict[str, float] = {}
    best_non_null: dict[str, str] = {}
    for example_index, example in enumerate(examples):
        # (feature, start, end, start_logit, end_logit)
        prelim: list[tuple[int, int, int, float, float]] = []
        score_null = 1000000.0
        null_feature, null_start, null_end = 0, 0.0, 0.0
        for f in by_example.get(example_index, []):
            starts, ends = start_logits[f], end_logits[f]
            tokens = features.tokens[f]
            to_orig = features.token_to_orig_map[f]
            max_ctx = features.token_is_max_context[f]
            if version_2_with_negative:
                feature_null = float(starts[0]) + float(ends[0])
                if feature_null < score_null:
                    score_null = feature_null
                    null_feature, null_start, null_end = f, float(starts[0]), float(ends[0])
            for s in _best_indexes(starts, n_best_size):
                for e in _best_indexes(ends, n_best_size):
                    if s >= len(tokens) or e >= len(tokens):
                        continue
                    if s not in to_orig or e not in to_orig or not max_ctx.get(s, False):
                        continue
                    if e < s or e - s + 1 > max_answer_length:
                        continue
                    prelim.append((f, s, e, float(starts[s]), float(ends[e])))
        if version_2_with_negative:
            prelim.append((null_feature, 0, 0, null_start, null_end))
        prelim.sort(key=lambda p: p[3] + p[4], reverse=True)

        seen: set[str] = set()
        nbest: list[tuple[str, float, float]] = []
        for f, s, e, s_logit, e_logit in prelim:
            if len(nbest) >= n_best_size:
                break
            if s > 0:  # a non-null answer
                to_orig = features.token_to_orig_map[f]
                tok_text = " ".join(features.tokens[f][s : e + 1])
                tok_text = tok_text.replace(" ##", "").replace("##", "")
                tok_text = " ".join(tok_text.strip().split())
                orig_text = " ".join(example.doc_tokens[to_orig[s] : to_orig[e] + 1])
                text = get_final_text(tok_text, orig_text, do_lower_case, basic_tokenize)
                if text in seen:
                    continue
            else:
                text = ""
            seen.add(text)
            nbest.append((text, s_logit, e_logit))
        if version_2_with_negative and "" not in seen:
            nbest.append(("", null_start, null_end))
        if not nbest:  # no valid span at all (very rare): the official placeholder
            nbest.append(("empty", 0.0, 0.0))

        probs = _softmax([s + e for _, s, e in nbest])
        entries = [
            {"text": text, "probability": p, "start_logit": s, "end_logit": e}
            for (text, s, e), p in zip(nbest, probs)
        ]
        qid = example.qas_id
        nbest_json[qid] = entries
        non_null = next((entry for entry in nbest if entry[0]), None)
        best_non_null[qid] = non_null[0] if non_null else ""
        if not version_2_with_negative:
            predictions[qid] = entries[0]["text"]
        else:
            # With only the null answer left there is no non-null entry; its score counts as -inf.
            diff = score_null - (non_null[1] + non_null[2]) if non_null else math.inf
            null_odds[qid] = diff
            predictions[qid] = "" if diff > null_score_diff_threshold else best_non_null[qid]
    return SquadPredictions(
        predictions=predictions,
        nbest=nbest_json,
        null_odds=null_odds if version_2_with_negative else None,
        best_non_null=best_non_null,
    )


def predictions_at_threshold(
    best_non_null: Mapping[str, str], null_odds: Mapping[str, float], threshold: float
) -> dict[str, str]:
    """v2.0 answers for another null_score_diff_threshold (e.g. best_f1_thresh of the evaluation)."""
    return {qid: "" if null_odds[qid] > threshold else text for qid, text in best_non_null.items()}


def write_predictions(
    output_dir: str | os.PathLike, preds: SquadPredictions
) -> dict[str, pathlib.Path]:
    """Write predictions.json, nbest_predictions.json and (v2.0) null_odds.json; returns their paths."""
    output_dir = pathlib.Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "predictions": output_dir / "predictions.json",
        "nbest_predictions": output_dir / "nbest_predictions.json",
    }
    atomic.write_json(paths["predictions"], preds.predictions, indent=4, sort_keys=False)
    atomic.write_json(paths["nbest_predictions"], preds.nbest, indent=4, sort_keys=False)
    if preds.null_odds is not None:
        paths["null_odds"] = output_dir / "null_odds.json"
        atomic.write_json(paths["null_odds"], preds.null_odds, indent=4, sort_keys=False)
    return paths
