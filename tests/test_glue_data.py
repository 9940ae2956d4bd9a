"""GLUE readers (real files, local MNLI/QQP/AX files, TFDS mock), pair encoding, submission writer."""

import json

import numpy as np
import pytest
from tiny_tokenizer import TinyTokenizer

from bertjax.commands import score as evaluate
from bertjax.tasks import glue_data as g
from bertjax.text import features

TOK = TinyTokenizer(["the", "cat", "sat", "on", "mat", "dog", "run", "##s", ".", "a"])

# Official row counts (shared/data/README.md).
REAL_COUNTS = {
    ("cola", "train"): 8551,
    ("cola", "dev"): 1043,
    ("cola", "test"): 1063,
    ("sst2", "train"): 67349,
    ("sst2", "dev"): 872,
    ("sst2", "test"): 1821,
    ("mrpc", "train"): 3668,
    ("mrpc", "dev"): 408,
    ("mrpc", "test"): 1725,
    ("stsb", "train"): 5749,
    ("stsb", "dev"): 1500,
    ("stsb", "test"): 1379,
    ("rte", "train"): 2490,
    ("rte", "dev"): 277,
    ("rte", "test"): 3000,
    ("wnli", "train"): 635,
    ("wnli", "dev"): 71,
    ("wnli", "test"): 146,
    ("qnli", "dev"): 5463,
    ("qnli", "test"): 5463,
}


@pytest.mark.parametrize(("task", "split"), sorted(REAL_COUNTS))
def test_real_glue_files_load_with_official_counts(shared_data, task, split):
    examples = g.read_glue_split(shared_data / "glue", task, split)
    assert len(examples) == REAL_COUNTS[task, split]
    spec = g.get_task(task)
    for ex in examples:
        assert ex.text_a and (ex.text_b is None) == (spec.text_b is None)
        if split == "test":
            assert ex.label is None
        elif spec.is_regression:
            assert isinstance(ex.label, float) and 0.0 <= ex.label <= 5.0
        else:
            assert ex.label in spec.labels


def test_real_glue_quirks(shared_data):
    glue = shared_data / "glue"
    cola_dev = g.read_glue_split(glue, "cola", "dev")  # headerless, no final newline
    assert cola_dev[0].text_a == "The sailors rode the breeze clear of the rocks."
    assert cola_dev[-1].text_a == "John talked to Bill about himself." and cola_dev[-1].label == "1"
    mrpc = g.read_glue_split(glue / "MRPC", "MRPC", "train")  # BOM before "Quality"
    assert mrpc[0].label == "1" and mrpc[0].text_a.startswith("Amrozi accused his brother")
    assert '" the witness "' in mrpc[0].text_a  # quotes are text (QUOTE_NONE)
    stsb = g.read_glue_split(glue, "STS-B", "dev")
    assert stsb[1].label == 4.75 and stsb[1].text_b == "A child is riding a horse."
    untok = g.read_glue_split(glue / "MRPC" / "msi_untokenized_variant", "mrpc", "dev")
    assert len(untok) == 408


MNLI_TRAIN = (
    "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
    "sentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label\n"
    '0\t31193\t31193n\tgovernment\t( a )\t( b )\t(ROOT a)\t(ROOT b)\tThe "cat" sat.\t'
    "A dog runs.\tneutral\tneutral\n"
    "1\t101457\t101457e\ttelephone\t( a )\t( b )\t(ROOT a)\t(ROOT b)\tyou know\tI know\t"
    "entailment\tentailment\n"
)
MNLI_DEV = (
    "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
    "sentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tlabel2\tlabel3\tlabel4\t"
    "label5\tgold_label\n"
    "0\t63735\t63735n\tslate\t( a )\t( b )\t(ROOT a)\t(ROOT b)\tA cat.\tNo cat.\tcontradiction\t"
    "contradiction\tneutral\tcontradiction\tcontradiction\tcontradiction\n"
)
MNLI_TEST = (
    "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
    "sentence1_parse\tsentence2_parse\tsentence1\tsentence2\n"
    "0\t31493\t31493\ttravel\t( a )\t( b )\t(ROOT a)\t(ROOT b)\tHey.\tHi.\n"
)


def test_local_mnli_qqp_ax_files(tmp_path):
    mnli = tmp_path / "MNLI"
    mnli.mkdir()
    (mnli / "train.tsv").write_text(MNLI_TRAIN)
    (mnli / "dev_matched.tsv").write_text(MNLI_DEV)
    (mnli / "test_mismatched.tsv").write_text(MNLI_TEST)
    train = g.read_glue_split(tmp_path, "mnli", "train")
    assert [(e.text_a, e.text_b, e.label) for e in train] == [
        ('The "cat" sat.', "A dog runs.", "neutral"),
        ("you know", "I know", "entailment"),
    ]
    assert g.read_glue_split(tmp_path, "mnli", "dev_matched")[0].label == "contradiction"
    assert g.read_glue_split(tmp_path, "mnli", "test_mismatched")[0].label is None
    qqp = tmp_path / "QQP"
    qqp.mkdir()
    (qqp / "dev.tsv").write_text(
        "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
        '201359\t303345\t303346\tWhy are "Mac" users?\tWhat is Mac?\t0\n'
    )
    (qqp / "test.tsv").write_text("id\tquestion1\tquestion2\n0\tHow?\tWhy?\n")
    dev = g.read_glue_split(tmp_path, "qqp", "dev")
    assert dev[0] == g.InputExample("dev-0", 'Why are "Mac" users?', "What is Mac?", "0")
    assert g.read_glue_split(tmp_path, "qqp", "test")[0].text_b == "Why?"
    ax = tmp_path / "diagnostic"
    ax.mkdir()
    (ax / "diagnostic.tsv").write_text("index\tsentence1\tsentence2\n0\tThe cat sat.\tA cat sat.\n")
    assert g.read_glue_split(tmp_path, "AX", "test")[0].text_a == "The cat sat."


@pytest.mark.parametrize(
    ("content", "split", "message"),
    [
        (
            "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\ta\tb\n",
            "dev",
            r":3: expected 4",
        ),
        (
            "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tmaybe\n",
            "dev",
            r":2: label 'maybe' not in",
        ),
        ("index\tsentence1\tsentence2\tlabel\n", "dev", "has no examples"),
        ("index\tsentence\tlabel\n0\ta\tb\n", "dev", r":1: header has no column 'sentence1'"),
    ],
)
def test_bad_rte_input_gives_one_line_error(tmp_path, content, split, message):
    path = tmp_path / "dev.tsv"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        g.read_glue_tsv(path, "rte", split)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_bad_stsb_score_and_missing_file(tmp_path):
    path = tmp_path / "train.tsv"
    header = (
        "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
    )
    path.write_text(header + "0\tg\tf\ty\t0\tn\tn\ta\tb\tfive\n")
    with pytest.raises(ValueError, match=r"train.tsv:2: score 'five' is not a number"):
        g.read_glue_tsv(path, "stsb", "train")
    with pytest.raises(FileNotFoundError, match="no dev.tsv for rte"):
        g.read_glue_split(tmp_path, "rte", "dev")
    with pytest.raises(ValueError, match="unknown GLUE task"):
        g.get_task("imdb")


def test_encode_pair_layout_and_longest_first_truncation():
    out = g.encode_pair(TOK, "The cat sat", "dog runs", 10)
    ids = lambda words: TOK.convert_tokens_to_ids(words.split())
    expected = [TOK.cls_id, *ids("the cat sat"), TOK.sep_id, *ids("dog run ##s"), TOK.sep_id, 0]
    np.testing.assert_array_equal(out["input_ids"], expected)
    np.testing.assert_array_equal(out["input_mask"], [1] * 9 + [0])
    np.testing.assert_array_equal(out["segment_ids"], [0] * 5 + [1] * 4 + [0])
    assert out["input_ids"].dtype == np.int32
    # 3 + 3 pieces into 7 - 3 = 4: longest-first removes from b on ties, then a, then b.
    short = g.encode_pair(TOK, "the cat sat", "dog runs", 7)
    np.testing.assert_array_equal(short["input_ids"], [2, *ids("the cat"), 3, *ids("dog run"), 3])
    single = g.encode_pair(TOK, "the cat sat on the mat", None, 5)
    np.testing.assert_array_equal(single["input_ids"], [2, *ids("the cat sat"), 3])
    assert features.truncate_pair(list("aaaaa"), list("bb"), 4) == (["a", "a"], ["b", "b"])


def test_encode_examples_arrays():
    examples = [
        g.InputExample("d-0", "the cat", "a dog", "not_entailment"),
        g.InputExample("d-1", "the mat", "a cat", None),
    ]
    out = g.encode_examples(TOK, examples, g.get_task("rte").labels, 8)
    assert {k: (v.shape, v.dtype) for k, v in out.items()} == {
        "input_ids": ((2, 8), np.int32),
        "input_mask": ((2, 8), np.int32),
        "segment_ids": ((2, 8), np.int32),
        "label": ((2,), np.int32),
    }
    np.testing.assert_array_equal(out["label"], [1, -1])
    reg = g.encode_examples(TOK, [g.InputExample("d-0", "a", "b", 3.8)], None, 8)
    assert reg["label"].dtype == np.float32 and reg["label"][0] == pytest.approx(3.8)
    with pytest.raises(ValueError, match="label 'x' not in"):
        g.encode_examples(TOK, [g.InputExample("d-0", "a", "b", "x")], ("0", "1"), 8)


def test_submission_writer_names_and_round_trip(tmp_path):
    expected = {
        ("cola", "test"): "CoLA.tsv",
        ("sst2", "test"): "SST-2.tsv",
        ("mrpc", "test"): "MRPC.tsv",
        ("stsb", "test"): "STS-B.tsv",
        ("qqp", "test"): "QQP.tsv",
        ("mnli", "test_matched"): "MNLI-m.tsv",
        ("mnli", "test_mismatched"): "MNLI-mm.tsv",
        ("qnli", "test"): "QNLI.tsv",
        ("rte", "test"): "RTE.tsv",
        ("wnli", "test"): "WNLI.tsv",
        ("ax", "test"): "AX.tsv",
    }
    for (task, split), name in expected.items():
        preds = [1.25, 4.0] if task == "stsb" else [0, 1]
        path = g.write_glue_predictions(tmp_path, task, split, preds)
        assert path.name == name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(expected.values())  # no temp files
    assert (
        tmp_path / "MNLI-m.tsv"
    ).read_text() == "index\tprediction\n0\tcontradiction\n1\tentailment\n"
    assert (tmp_path / "STS-B.tsv").read_text() == "index\tprediction\n0\t1.250\n1\t4.000\n"
    assert g.read_glue_predictions(tmp_path / "QNLI.tsv", "qnli") == [
        "entailment",
        "not_entailment",
    ]
    with pytest.raises(ValueError, match="label id 3 outside"):
        g.write_glue_predictions(tmp_path, "rte", "test", [3])
    with pytest.raises(ValueError, match="submits splits"):
        g.write_glue_predictions(tmp_path, "mnli", "test", [0])


def test_evaluate_glue_cli(shared_data, tmp_path, capsys):
    dev = g.read_glue_split(shared_data / "glue", "mrpc", "dev")
    gold = [int(ex.label) for ex in dev]
    preds = [1 - y if i % 5 == 0 else y for i, y in enumerate(gold)]
    # write_glue_predictions names test files; an evaluation file can have any name.
    path = g.write_glue_predictions(tmp_path, "mrpc", "test", preds)
    assert (
        evaluate.main(
            [
                "glue",
                "--task",
                "MRPC",
                "--labels",
                str(shared_data / "glue" / "MRPC"),
                "--predictions",
                str(path),
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    from sklearn.metrics import accuracy_score, f1_score

    assert out["accuracy"] == pytest.approx(accuracy_score(gold, preds))
    assert out["f1"] == pytest.approx(f1_score(gold, preds))
    bad = tmp_path / "short.tsv"
    bad.write_text("index\tprediction\n0\t1\n")
    with pytest.raises(SystemExit, match="2"):
        evaluate.main(
            [
                "glue",
                "--task",
                "mrpc",
                "--labels",
                str(shared_data / "glue" / "MRPC"),
                "--predictions",
                str(bad),
            ]
        )
    assert "1 predictions for 408 examples" in capsys.readouterr().err


def test_tfds_source_maps_labels_without_network(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")
    import tensorflow as tf

    def as_dataset(self, split, **kwargs):
        test = str(split).startswith("test")
        records = {
            "premise": ["A cat sat.", "Dogs run."],
            "hypothesis": ["An animal sat.", "Cats run."],
            "label": [-1, -1] if test else [0, 2],  # TFDS order: entailment, neutral, contradiction
            "idx": [0, 1],
        }
        return tf.data.Dataset.from_tensor_slices(records)

    with tfds.testing.mock_data(as_dataset_fn=as_dataset):
        dev = g.load_glue_tfds("mnli", "dev_matched", data_dir=tmp_path)
        test = g.load_glue_tfds("mnli", "test_matched", data_dir=tmp_path)
    assert [(e.text_a, e.text_b, e.label) for e in dev] == [
        ("A cat sat.", "An animal sat.", "entailment"),
        ("Dogs run.", "Cats run.", "contradiction"),
    ]
    assert [e.label for e in test] == [None, None]
    with tfds.testing.mock_data(num_examples=3):
        sst2 = g.load_glue_tfds("sst2", "train", data_dir=tmp_path)
    assert len(sst2) == 3 and all(e.label in ("0", "1") and e.text_b is None for e in sst2)
