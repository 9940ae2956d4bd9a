"""Metrics against independent references: scikit-learn, SciPy, hand-checked cases, conlleval."""

import json

import numpy as np
import pytest
from scipy import stats
from sklearn import metrics as skm

from bertjax.tasks import metrics as m


@pytest.mark.parametrize("seed", range(5))
def test_classification_metrics_match_sklearn(seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, size=200)
    p = np.where(rng.random(200) < 0.7, y, 1 - y)
    assert m.accuracy(y, p) == pytest.approx(skm.accuracy_score(y, p), abs=1e-12)
    assert m.binary_f1(y, p) == pytest.approx(skm.f1_score(y, p), abs=1e-12)
    assert m.matthews_corrcoef(y, p) == pytest.approx(skm.matthews_corrcoef(y, p), abs=1e-12)
    y3, p3 = rng.integers(0, 3, size=150), rng.integers(0, 3, size=150)
    assert m.matthews_corrcoef(y3, p3) == pytest.approx(skm.matthews_corrcoef(y3, p3), abs=1e-12)


def test_degenerate_classification_cases():
    # Constant predictions: MCC is 0 (sklearn convention), F1 with no true positive is 0.
    assert m.matthews_corrcoef([0, 1, 1, 0], [1, 1, 1, 1]) == 0.0
    assert m.binary_f1([0, 0, 1], [0, 0, 0]) == 0.0
    assert m.matthews_corrcoef([0, 1, 1, 0], [0, 1, 1, 0]) == 1.0
    # Hand-checked: tp=1, fp=1, fn=1 -> F1 = 2/4.
    assert m.binary_f1([1, 0, 1, 0], [1, 1, 0, 0]) == 0.5
    with pytest.raises(ValueError, match="equal length"):
        m.accuracy([0, 1], [0])


@pytest.mark.parametrize("seed", range(4))
def test_correlations_match_scipy_with_ties(seed):
    rng = np.random.default_rng(seed)
    x = np.round(rng.normal(size=300) * 2) / 2  # many ties
    y = np.round(x + rng.normal(size=300), 1)
    assert m.pearson(x, y) == pytest.approx(stats.pearsonr(x, y).statistic, abs=1e-12)
    assert m.spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)
    assert m.spearman(x, y) != pytest.approx(m.pearson(x, y), abs=1e-6)


def test_average_ranks_and_constant_input():
    np.testing.assert_array_equal(
        m._average_ranks(np.array([3.0, 1.0, 3.0, 2.0])), [3.5, 1, 3.5, 2]
    )
    assert np.isnan(m.pearson([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))


def test_glue_metric_sets():
    y, p = [1, 0, 1, 1], [1, 0, 0, 1]
    assert set(m.glue_metrics("cola", y, p)) == {"mcc"}
    assert set(m.glue_metrics("MRPC", y, p)) == {"accuracy", "f1", "acc_and_f1"}
    assert set(m.glue_metrics("qqp", y, p)) == {"accuracy", "f1", "acc_and_f1"}
    assert set(m.glue_metrics("STS-B", [0.1, 2.0, 3.5], [0.3, 1.0, 4.0])) == {
        "pearson",
        "spearman",
        "corr",
    }
    for task in ("sst2", "SST-2", "glue/qnli", "rte", "wnli", "mnli", "MNLI-mm", "ax"):
        assert m.glue_metrics(task, y, p) == {"accuracy": 0.75}
    mrpc = m.glue_metrics("mrpc", y, p)
    assert mrpc["f1"] == pytest.approx(0.8) and mrpc["acc_and_f1"] == pytest.approx(0.775)
    with pytest.raises(ValueError, match="unknown GLUE task"):
        m.glue_metrics("squad", y, p)


def test_squad_normalization_and_f1_hand_cases():
    assert m.normalize_answer("The  Denver Broncos!") == "denver broncos"
    assert m.normalize_answer("an apple, a pear") == "apple pear"
    assert m.normalize_answer("theatre") == "theatre"  # article removal is whole-word only
    assert m.squad_exact_match("the Broncos.", "Broncos") == 1.0
    # pred tokens [denver, broncos, team], gold [broncos]: p=1/3, r=1 -> f1=0.5
    assert m.squad_f1("Denver Broncos team", "the Broncos") == pytest.approx(0.5)
    assert m.squad_f1("", "") == 1.0 and m.squad_f1("", "x") == 0.0


def test_squad_v1_hand_case():
    data = [
        {
            "paragraphs": [
                {
                    "qas": [
                        {"id": "a", "answers": [{"text": "Denver Broncos"}, {"text": "Broncos"}]},
                        {"id": "b", "answers": [{"text": "blue sky"}]},
                        {"id": "c", "answers": [{"text": "x"}]},
                    ]
                }
            ]
        }
    ]
    # a: exact via 2nd gold; b: "the blue" vs "blue sky" -> p=1, r=1/2 -> 2/3; c: missing -> 0.
    out = m.evaluate_squad_v1(data, {"a": "broncos", "b": "the blue"})
    assert out["exact_match"] == pytest.approx(100 / 3)
    assert out["f1"] == pytest.approx(100 * (1 + 2 / 3) / 3)
    # Training logs fractions: the same scores, not scaled back from percent.
    fractions = m.evaluate_squad_v1(data, {"a": "broncos", "b": "the blue"}, percent=False)
    assert fractions == {"exact_match": 1 / 3, "f1": (1 + 2 / 3) / 3}
    # v1.1: an empty prediction scores F1 0 even against an empty normalized gold.
    assert m.evaluate_squad_v1(
        [{"paragraphs": [{"qas": [data[0]["paragraphs"][0]["qas"][2]]}]}], {"c": ""}
    ) == {
        "exact_match": 0.0,
        "f1": 0.0,
    }


def test_squad_v1_full_dev_first_gold_is_perfect(shared_data):
    with open(shared_data / "squad" / "v1.1" / "dev-v1.1.json", encoding="utf-8") as f:
        dataset = json.load(f)["data"]
    preds = {
        qa["id"]: qa["answers"][0]["text"]
        for article in dataset
        for p in article["paragraphs"]
        for qa in p["qas"]
    }
    assert len(preds) == 10570
    assert m.evaluate_squad_v1(dataset, preds) == {"exact_match": 100.0, "f1": 100.0}


def _v2_dataset():
    qas = [
        {"id": "q1", "answers": [{"text": "Denver Broncos"}], "is_impossible": False},
        {"id": "q2", "answers": [], "is_impossible": True},
        {"id": "q3", "answers": [{"text": "dark blue"}], "is_impossible": False},
        {"id": "q4", "answers": [], "is_impossible": True},
    ]
    return [{"paragraphs": [{"qas": qas}]}]


def test_squad_v2_hand_case_with_threshold_search():
    preds = {"q1": "Denver Broncos", "q2": "", "q3": "the blue sky", "q4": "something"}
    na = {"q1": 0.1, "q2": 0.9, "q3": 0.4, "q4": 0.6}
    out = m.evaluate_squad_v2(_v2_dataset(), preds, na)
    # raw exact (1,1,0,0), f1 (1,1,0.5,0); sweep from "all null" (score 2) over q1,q3,q4,q2.
    expected = {
        "exact": 50.0,
        "f1": 62.5,
        "total": 4,
        "HasAns_exact": 50.0,
        "HasAns_f1": 75.0,
        "HasAns_total": 2,
        "NoAns_exact": 50.0,
        "NoAns_f1": 50.0,
        "NoAns_total": 2,
        "best_exact": 75.0,
        "best_exact_thresh": 0.1,
        "best_f1": 87.5,
        "best_f1_thresh": 0.4,
    }
    assert out == pytest.approx(expected)
    assert list(out) == list(expected)  # the official key order
    fractions = m.evaluate_squad_v2(_v2_dataset(), preds, na, percent=False)
    unscaled = ("total", "HasAns_total", "NoAns_total", "best_exact_thresh", "best_f1_thresh")
    assert list(fractions) == list(expected)
    assert fractions == pytest.approx(
        {k: v if k in unscaled else v / 100 for k, v in expected.items()}
    )
    assert fractions["exact"] == 0.5 and fractions["best_f1"] == 0.875
    # na_prob_thresh 0.5: q2 and q4 become "no answer" -> correct for both.
    assert m.evaluate_squad_v2(_v2_dataset(), preds, na, na_prob_thresh=0.5)["exact"] == 75.0
    assert "best_f1" not in m.evaluate_squad_v2(_v2_dataset(), preds)
    with pytest.raises(ValueError, match="no no-answer probability for question q4"):
        m.evaluate_squad_v2(_v2_dataset(), preds, {"q1": 0.1, "q2": 0.9, "q3": 0.4})


def test_get_entities_bio_and_iob1():
    bio = ["B-PER", "I-PER", "O", "B-LOC", "B-LOC", "I-LOC", "I-ORG"]
    assert m.get_entities(bio) == [("PER", 0, 1), ("LOC", 3, 3), ("LOC", 4, 5), ("ORG", 6, 6)]
    iob1 = ["I-PER", "I-PER", "O", "I-LOC", "B-LOC", "I-LOC", "I-MISC"]
    assert m.get_entities(iob1) == [("PER", 0, 1), ("LOC", 3, 3), ("LOC", 4, 5), ("MISC", 6, 6)]


def _conlleval_reference(gold_seqs, pred_seqs):
    """Independent port of conlleval's streaming counter (inCorrect state machine)."""

    def split(t):
        return ("O", "") if t == "O" else tuple(t.split("-", 1))

    def end(pt, t, ptype, ty):
        return (pt, t) in {("B", "B"), ("B", "O"), ("I", "B"), ("I", "O")} or (
            pt != "O" and ptype != ty
        )

    def start(pt, t, ptype, ty):
        return (pt, t) in {("B", "B"), ("I", "B"), ("O", "B"), ("O", "I")} or (
            t != "O" and ptype != ty
        )

    correct = found_g = found_p = 0
    for gold, pred in zip(gold_seqs, pred_seqs):
        in_correct = False
        lg = lp = ("O", "")
        for g_tag, p_tag in [*zip(gold, pred), ("O", "O")]:
            g, p = split(g_tag), split(p_tag)
            if in_correct:
                ge = end(lg[0], g[0], lg[1], g[1])
                pe = end(lp[0], p[0], lp[1], p[1])
                if ge and pe and lg[1] == lp[1]:
                    in_correct = False
                    correct += 1
                elif ge != pe or g[1] != p[1]:
                    in_correct = False
            gs, ps = start(lg[0], g[0], lg[1], g[1]), start(lp[0], p[0], lp[1], p[1])
            if gs and ps and g[1] == p[1]:
                in_correct = True
            found_g += gs
            found_p += ps
            lg, lp = g, p
    return correct, found_g, found_p


@pytest.mark.parametrize("seed", range(3))
def test_ner_metrics_match_conlleval_reference(seed):
    rng = np.random.default_rng(seed)
    tags = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "I-ORG"]
    gold = [list(rng.choice(tags, size=rng.integers(1, 15))) for _ in range(60)]
    pred = [[t if rng.random() < 0.7 else str(rng.choice(tags)) for t in s] for s in gold]
    correct, found_g, found_p = _conlleval_reference(gold, pred)
    out = m.ner_metrics(gold, pred)
    assert out["precision"] == pytest.approx(correct / found_p)  # fractions, as seqeval's
    assert out["recall"] == pytest.approx(correct / found_g)
    assert 0 < out["f1"] < 1
    seqeval = pytest.importorskip("seqeval.metrics")
    assert out["f1"] == pytest.approx(seqeval.f1_score(gold, pred))
    assert out["precision"] == pytest.approx(seqeval.precision_score(gold, pred))
    assert out["recall"] == pytest.approx(seqeval.recall_score(gold, pred))
    assert out["accuracy"] == pytest.approx(seqeval.accuracy_score(gold, pred))


def test_ner_metrics_hand_case():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    pred = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG", "O"]]
    out = m.ner_metrics(gold, pred)
    # gold chunks 3, predicted 3, correct 2 (PER, ORG in sentence 2).
    assert out["precision"] == pytest.approx(2 / 3) and out["recall"] == pytest.approx(2 / 3)
    assert out["accuracy"] == pytest.approx(5 / 6)
    assert out["per_type"]["PER"]["f1"] == 1.0 and out["per_type"]["LOC"]["recall"] == 0.0
    with pytest.raises(ValueError, match="sentence 0"):
        m.ner_metrics([["O"]], [["O", "O"]])


def test_nan_predictions_give_nan_metrics_as_scipy_does():
    labels = [0.0, 1.0, 2.0, 3.0]
    nans = [float("nan")] * 4
    assert np.isnan(stats.spearmanr(labels, nans).statistic)
    assert np.isnan(m.spearman(labels, nans)) and np.isnan(m.pearson(labels, nans))
    some = [0.1, float("nan"), 2.2, 2.9]  # one diverged prediction
    assert np.isnan(stats.spearmanr(labels, some).statistic)
    assert np.isnan(m.spearman(labels, some)) and np.isnan(m.pearson(labels, some))
    stsb = m.glue_metrics("stsb", labels, some)
    assert all(np.isnan(v) for v in stsb.values())
    for fn in (m.accuracy, m.binary_f1, m.matthews_corrcoef):
        assert np.isnan(fn([0, 1, 1, 0], [0.0, 1.0, float("nan"), 0.0])), fn.__name__
    assert m.accuracy([0, 1], [0, 0]) == 0.5  # integer inputs are untouched
