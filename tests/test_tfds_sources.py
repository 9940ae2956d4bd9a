"""TFDS sources of SQuAD, CoNLL-2003 and SWAG, offline through `tfds.testing.mock_data`.

The mocked datasets are built from records encoded and decoded by the real builder's own features
(`builder.info.features`), so they have the structure, dtypes and ClassLabel ids TFDS would give.
"""

import json

import pytest

from bertjax.tasks import ner_data as td
from bertjax.tasks import squad_data as sd
from bertjax.tasks import swag_data as cd
from bertjax.tasks import tfds_offline
from bertjax.tasks.metrics import evaluate_squad_v1, evaluate_squad_v2

tfds = pytest.importorskip("tensorflow_datasets")
tf = pytest.importorskip("tensorflow")


def _tensors(value, info):
    """An encoded example (nested dicts of lists / arrays) as tensors of its TensorInfo dtypes."""
    if isinstance(info, dict):
        return {k: _tensors(value[k], info[k]) for k in info}
    return tf.constant(value, dtype=info.tf_dtype)


def _mock(records_by_split):
    """An `as_dataset_fn` serving `records_by_split[split]` through the builder's features."""
    seen = []

    def as_dataset(self, split, **kwargs):
        features = self.info.features
        records = records_by_split[str(split)]
        assert all(set(r) == set(features) for r in records)  # every feature, no extra key
        info = features.get_tensor_info()
        datasets = [
            tf.data.Dataset.from_tensors(_tensors(features.encode_example(r), info))
            for r in records
        ]
        seen.append((self.name, self.builder_config.name, str(split)))
        ds = datasets[0]
        for more in datasets[1:]:
            ds = ds.concatenate(more)
        return ds

    return as_dataset, seen


CTX1 = "The cat sat on the mat. It was happy."
CTX2 = "Paris is the capital of France."


def _squad_record(qid, title, context, question, answers, v2=False, impossible=False, plausible=()):
    def span(items):
        return {"text": [t for t, _ in items], "answer_start": [s for _, s in items]}

    record = {
        "id": qid,
        "title": title,
        "context": context,
        "question": question,
        "answers": span(answers),
    }
    if v2:
        record["is_impossible"] = impossible
        record["plausible_answers"] = span(plausible)
    return record


def test_squad_v1_tfds_matches_json_reader(tmp_path):
    train = [
        _squad_record("q1", "Cats", CTX1, "Where did the cat sit?", [("the mat", 15)]),
        _squad_record("q2", "Paris", CTX2, "Capital of?", [("France", 24)]),
    ]
    dev = [
        _squad_record("d1", "Cats", CTX1, "Who sat?", [("The cat", 0), ("cat", 4)]),
        _squad_record("d2", "Cats", CTX1, "Mood?", [("happy", 32)]),
        _squad_record("d3", "Paris", CTX2, "What is Paris?", [("the capital of France", 9)]),
    ]
    as_dataset, seen = _mock({"train": train, "validation": dev})
    with tfds.testing.mock_data(as_dataset_fn=as_dataset):
        tr, tr_skipped, tr_data = sd.load_squad_tfds("1.1", "train", True, data_dir=tmp_path)
        ev, ev_skipped, data = sd.load_squad_tfds("1.1", "dev", False, data_dir=tmp_path)
    assert seen == [("squad", "v1.1", "train"), ("squad", "v1.1", "validation")]
    assert tr_skipped == ev_skipped == []
    # Grouped back into the official JSON layout: article by title, paragraph by context.
    assert data == [
        {
            "title": "Cats",
            "paragraphs": [
                {
                    "context": CTX1,
                    "qas": [
                        {
                            "id": "d1",
                            "question": "Who sat?",
                            "answers": [
                                {"text": "The cat", "answer_start": 0},
                                {"text": "cat", "answer_start": 4},
                            ],
                        },
                        {
                            "id": "d2",
                            "question": "Mood?",
                            "answers": [{"text": "happy", "answer_start": 32}],
                        },
                    ],
                }
            ],
        },
        {
            "title": "Paris",
            "paragraphs": [
                {
                    "context": CTX2,
                    "qas": [
                        {
                            "id": "d3",
                            "question": "What is Paris?",
                            "answers": [{"text": "the capital of France", "answer_start": 9}],
                        },
                    ],
                }
            ],
        },
    ]
    # The same examples as the JSON reader gives for the same data written as a file.
    for records, examples, training in ((tr_data, tr, True), (data, ev, False)):
        path = tmp_path / f"{training}.json"
        path.write_text(json.dumps({"version": "1.1", "data": records}))
        from_json, _ = sd.read_squad_examples(path, is_training=training)
        assert examples == from_json
    assert [(e.qas_id, e.orig_answer_text, e.start_position, e.end_position) for e in tr] == [
        ("q1", "the mat", 4, 5),
        ("q2", "France", 5, 5),
    ]
    assert ev[0].answers == ["The cat", "cat"] and ev[0].doc_tokens[:2] == ["The", "cat"]
    scores = evaluate_squad_v1(data, {"d1": "cat", "d2": "sad", "d3": "the capital of France"})
    assert scores["exact_match"] == pytest.approx(200 / 3)


def test_squad_v2_tfds_keeps_impossible_questions(tmp_path):
    dev = [
        _squad_record("a", "Paris", CTX2, "Capital of?", [("France", 24)], v2=True),
        _squad_record(
            "b",
            "Paris",
            CTX2,
            "Capital of Spain?",
            [],
            v2=True,
            impossible=True,
            plausible=[("France", 24)],
        ),
    ]
    as_dataset, _ = _mock({"train": dev, "validation": dev})
    with tfds.testing.mock_data(as_dataset_fn=as_dataset):
        tr, _, _ = sd.load_squad_tfds("2.0", "train", True, data_dir=tmp_path)
        ev, _, data = sd.load_squad_tfds("2.0", "dev", False, data_dir=tmp_path)
    qas = data[0]["paragraphs"][0]["qas"]
    assert [(q["id"], q["is_impossible"], q["answers"], q["plausible_answers"]) for q in qas] == [
        ("a", False, [{"text": "France", "answer_start": 24}], []),
        ("b", True, [], [{"text": "France", "answer_start": 24}]),
    ]
    assert [(e.is_impossible, e.start_position, e.orig_answer_text) for e in tr] == [
        (False, 5, "France"),
        (True, -1, ""),
    ]
    assert [e.answers for e in ev] == [["France"], []]
    scores = evaluate_squad_v2(data, {"a": "France", "b": ""}, {"a": -1.0, "b": 1.0})
    assert scores["exact"] == 100.0 and scores["HasAns_total"] == 1 and scores["NoAns_total"] == 1


def test_conll2003_tfds_gives_bio_tagged_sentences(tmp_path):
    builder = tfds.builder("conll2003", data_dir=tmp_path)
    assert tuple(builder.info.features["ner"].feature.names) == td.CONLL2003_LABELS

    def sentence(words, ner):
        return {
            "tokens": words,
            "pos": ["NNP"] * len(words),
            "chunks": ["B-NP"] * len(words),
            "ner": ner,  # ClassLabel strings, encoded to ids by the builder's feature
        }

    records = {
        "train": [sentence(["EU", "rejects", "German", "call"], ["B-ORG", "O", "B-MISC", "O"])],
        "dev": [sentence(["Peter", "Blackburn"], ["B-PER", "I-PER"])],
        "test": [sentence(["in", "New", "York"], ["O", "I-LOC", "I-LOC"])],  # IOB1 -> BIO
    }
    as_dataset, seen = _mock(records)
    with tfds.testing.mock_data(as_dataset_fn=as_dataset):
        got = {split: td.load_conll2003_tfds(split, data_dir=tmp_path) for split in records}
    assert [s for _, _, s in seen] == ["train", "dev", "test"]
    assert got == {
        "train": [
            td.TaggedSentence(("EU", "rejects", "German", "call"), ("B-ORG", "O", "B-MISC", "O"))
        ],
        "dev": [td.TaggedSentence(("Peter", "Blackburn"), ("B-PER", "I-PER"))],
        "test": [td.TaggedSentence(("in", "New", "York"), ("O", "B-LOC", "I-LOC"))],
    }
    with pytest.raises(ValueError, match="split 'valid' is not one of"):
        td.load_conll2003_tfds("valid")


def test_swag_has_no_tfds_source():
    assert "swag" not in tfds.list_builders(with_community_datasets=False)
    with pytest.raises(ValueError, match="^config key data_dir is empty and TFDS has no SWAG"):
        cd.load_swag_tfds("train")


@pytest.mark.parametrize("task", ["glue", "squad", "conll2003"])
def test_tfds_without_data_or_network_is_one_line_naming_local_files(tmp_path, monkeypatch, task):
    """No prepared TFDS data and no network: one line at once, not minutes of download retries."""
    from bertjax.tasks import glue_data

    hosts = []
    monkeypatch.setattr(tfds_offline, "network_reachable", lambda host: hosts.append(host) or False)
    load, files = {
        "glue": (lambda: glue_data.load_glue_tfds("sst2", "train", tmp_path), "SST-2/train.tsv"),
        "squad": (lambda: sd.load_squad_tfds("1.1", "train", True, tmp_path), "train-v1.1.json"),
        "conll2003": (lambda: td.load_conll2003_tfds("train", tmp_path), "train.txt"),
    }[task]
    with pytest.raises(ValueError) as err:
        load()
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"tfds:{task}")
    assert "unreachable" in message and "--config.data_dir=" in message and files in message
    assert len(hosts) == 1
