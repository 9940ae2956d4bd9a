"""CoNLL-2003 NER column files and word-piece labels; SWAG CSV files and choice encoding."""

import numpy as np
import pytest
from tiny_tokenizer import TinyTokenizer

from bertjax.tasks import metrics
from bertjax.tasks import ner_data as td
from bertjax.tasks import swag_data as cd

WORDS = [
    "eu",
    "rejects",
    "german",
    "call",
    "to",
    "boycott",
    "british",
    "lamb",
    ".",
    "peter",
    "black",
    "##burn",
    "he",
    "runs",
    "a",
    "man",
    "is",
    "sitting",
    "on",
    "the",
    "roof",
    "then",
    "jumps",
]
TOK = TinyTokenizer(WORDS)

# CoNLL-2003 layout (IOB1 tags as in the original release), last sentence without a blank line.
CONLL = """-DOCSTART- -X- -X- O

EU NNP I-NP I-ORG
rejects VBZ I-VP O
German JJ I-NP I-MISC
call NN I-NP O
to TO I-VP O
boycott VB I-VP O
British JJ I-NP I-MISC
lamb NN I-NP O
. . O O

Peter NNP I-NP I-PER
Blackburn NNP I-NP I-PER

-DOCSTART- -X- -X- O

He PRP B-NP O
runs VBZ B-VP O"""


def test_read_conll_and_labels(tmp_path):
    path = tmp_path / "eng.testa"
    path.write_text(CONLL)
    sentences = td.read_conll(path)
    assert [len(s.words) for s in sentences] == [9, 2, 2]
    assert sentences[1] == td.TaggedSentence(("Peter", "Blackburn"), ("I-PER", "I-PER"))
    assert td.iob1_to_bio(sentences[0].tags) == [
        "B-ORG",
        "O",
        "B-MISC",
        "O",
        "O",
        "O",
        "B-MISC",
        "O",
        "O",
    ]
    assert td.iob1_to_bio(["I-LOC", "B-LOC", "I-LOC", "I-PER"]) == [
        "B-LOC",
        "B-LOC",
        "I-LOC",
        "B-PER",
    ]
    assert td.build_label_list(sentences) == ["O", "I-MISC", "I-ORG", "I-PER"]
    bio = [td.TaggedSentence(s.words, tuple(td.iob1_to_bio(s.tags))) for s in sentences]
    assert td.build_label_list(bio) == ["O", "B-MISC", "B-ORG", "B-PER", "I-PER"]
    # IOB1 and its BIO conversion describe the same entities.
    for s, b in zip(sentences, bio):
        assert metrics.get_entities(s.tags) == metrics.get_entities(b.tags)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("EU NNP I-ORG\nrejects\n", r":2: expected a token and a tag"),
        ("EU NNP I-ORG\nrejects VBZ X-ORG\n", r":2: tag 'X-ORG' is not"),
        ("-DOCSTART- -X- O\n\n", "no sentences"),
    ],
)
def test_bad_conll_input(tmp_path, content, message):
    path = tmp_path / "bad.conll"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        td.read_conll(path)
    assert str(path) in str(err.value)


def test_first_piece_labels_and_back_to_word_tags(tmp_path):
    path = tmp_path / "eng.train"
    path.write_text(CONLL)
    sentences = td.read_conll(path)
    labels = list(td.CONLL2003_LABELS)
    out = td.encode_tagged(TOK, sentences, labels, max_seq_length=12)
    assert all(v.shape == (3, 12) and v.dtype == np.int32 for v in out.values())
    # "Peter Blackburn" -> [CLS] peter black ##burn [SEP]: label at "peter" and "black" only.
    np.testing.assert_array_equal(out["label_ids"][1, :6], [-1, 2, 2, -1, -1, -1])
    np.testing.assert_array_equal(out["word_ids"][1, :6], [-1, 0, 1, -1, -1, -1])
    np.testing.assert_array_equal(out["input_mask"][1], [1] * 5 + [0] * 7)
    assert TOK.vocab[out["input_ids"][1, 3]] == "##burn"
    # Sentence 0 has 9 words / 9 pieces and fits into 12 - 2 = 10 positions.
    assert (out["label_ids"][0] >= 0).sum() == 9
    # Predictions equal to the labels give back the gold tags and a perfect conlleval score.
    preds = np.where(out["label_ids"] >= 0, out["label_ids"], 0)
    tags = td.predictions_to_tags(preds, out["word_ids"], labels, [len(s.words) for s in sentences])
    assert tags == [list(s.tags) for s in sentences]
    assert metrics.ner_metrics([s.tags for s in sentences], tags)["f1"] == 1.0


def test_truncated_sentence_words_become_o(tmp_path):
    path = tmp_path / "eng.train"
    path.write_text(CONLL)
    sentences = td.read_conll(path)[:1]
    out = td.encode_tagged(TOK, sentences, td.CONLL2003_LABELS, max_seq_length=6)
    assert out["word_ids"][0].tolist() == [-1, 0, 1, 2, 3, -1]  # 4 words fit, then [SEP]
    assert TOK.vocab[out["input_ids"][0, 5]] == "[SEP]"
    tags = td.predictions_to_tags(
        np.ones((1, 6), np.int32), out["word_ids"], td.CONLL2003_LABELS, [9]
    )
    assert tags == [["B-PER"] * 4 + ["O"] * 5]
    with pytest.raises(ValueError, match="tag 'I-ORG' not in the label list"):
        td.encode_tagged(TOK, sentences, ["O"], max_seq_length=6)


SWAG_TRAIN = """,video-id,fold-ind,startphrase,sent1,sent2,gold-source,ending0,ending1,ending2,ending3,label
0,anetv_jkn6uvmqwh4,3416,"A man is sitting on the roof. He","A man is sitting on the roof.",He,gold,runs.,"jumps, then runs.",is sitting.,"man, a man.",1
1,lsmdc3001_21_JUMP_STREET-422,11783,"He runs. The man","He runs.",The man,gen,jumps.,runs.,sits.,is.,0
"""
SWAG_TEST = """video-id,fold-ind,startphrase,sent1,sent2,gold-source,ending0,ending1,ending2,ending3
anetv_x,1,"He runs. A man","He runs.",A man,gen,jumps.,runs.,sits.,is.
"""


def test_read_swag_train_and_test(tmp_path):
    (tmp_path / "train.csv").write_text(SWAG_TRAIN)
    (tmp_path / "test.csv").write_text(SWAG_TEST)
    train = cd.read_swag(tmp_path / "train.csv")
    assert train[0] == cd.ChoiceExample(
        guid="anetv_jkn6uvmqwh4-3416",
        context="A man is sitting on the roof.",
        start_ending="He",
        endings=("runs.", "jumps, then runs.", "is sitting.", "man, a man."),
        label=1,
    )
    assert train[1].label == 0
    test = cd.read_swag(tmp_path / "test.csv")
    assert test[0].label is None and test[0].endings[3] == "is."


def test_bad_swag_input(tmp_path):
    path = tmp_path / "val.csv"
    path.write_text(SWAG_TRAIN.replace(",is sitting.,", ",is sitting.,extra,", 1))
    with pytest.raises(ValueError, match=r"val.csv:2: expected 12 columns, got 13"):
        cd.read_swag(path)
    path.write_text(SWAG_TRAIN.replace('man, a man.",1', 'man, a man.",7'))
    with pytest.raises(ValueError, match=r"val.csv:2: label '7' not in 0..3"):
        cd.read_swag(path)
    path.write_text("video-id,sent1\n")
    with pytest.raises(ValueError, match=r"val.csv:1: header lacks columns"):
        cd.read_swag(path)


def test_encode_choices(tmp_path):
    (tmp_path / "train.csv").write_text(SWAG_TRAIN)
    examples = cd.read_swag(tmp_path / "train.csv")
    out = cd.encode_choices(TOK, examples, max_seq_length=16)
    assert out["input_ids"].shape == (2, 4, 16) and out["input_ids"].dtype == np.int32
    np.testing.assert_array_equal(out["label"], [1, 0])
    ids = TOK.convert_tokens_to_ids
    # Choice 1: [CLS] a man is sitting on the roof . [SEP] he jumps , then runs . [SEP]
    a = TOK.tokenize("A man is sitting on the roof.")
    b = TOK.tokenize("He jumps, then runs.")
    assert len(a) + len(b) == 8 + 6 and 14 + 3 > 16  # needs truncation to 13 pieces
    np.testing.assert_array_equal(
        out["input_ids"][0, 1],
        [2, *ids(a[:7]), 3, *ids(b), 3],  # longest-first: a loses 1
    )
    np.testing.assert_array_equal(out["segment_ids"][0, 1], [0] * 9 + [1] * 7)
    np.testing.assert_array_equal(out["input_mask"][1, 0], [1] * 10 + [0] * 6)
