"""Vocabulary training: WordPiece learner == tensorflow-text's, both kinds on real text, CLI, errors."""

import glob
import os

import pytest
import tensorflow as tf

from bertjax.data import vocab
from bertjax.text import load_tokenizer, tokenization
from bertjax.text.tokenization import SentencePieceTokenizer, WordPieceTokenizer


def _gutenberg(shared_data) -> str:
    return str(shared_data / "corpus" / "gutenberg" / "A-Tale-of-Two-Cities_98__98-0.txt")


@pytest.fixture(scope="module")
def held_out(shared_data) -> list[str]:
    """Lines of another book, not seen in training."""
    path = glob.glob(str(shared_data / "corpus" / "gutenberg" / "Pride-and-Prejudice*.txt"))[0]
    with open(path, encoding="utf-8-sig") as f:
        return [line for line in f.read().splitlines()[2000:3000] if line.strip()]


@pytest.fixture(scope="module")
def wordpiece_vocab(shared_data, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("wp") / "sub" / "vocab.txt")
    assert vocab.train_vocab([_gutenberg(shared_data)], out, 2000, max_lines=2000) == out
    return out


@pytest.fixture(scope="module")
def sp_model(shared_data, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("sp") / "spm")
    path = vocab.train_vocab(
        [_gutenberg(shared_data)], out, 1000, kind="sentencepiece", max_lines=2000
    )
    assert path == out + ".model"
    return path


def _unk_rate(tok, lines) -> float:
    ids = [i for line in lines for i in tok.encode(line)]
    return sum(i == tok.unk_id for i in ids) / len(ids)


def test_learner_equals_tensorflow_text(shared_data):
    """Our WordPiece learner gives exactly tensorflow-text's learn_with_thresh vocabulary."""
    learner = pytest.importorskip(
        "tensorflow_text.tools.wordpiece_vocab.wordpiece_tokenizer_learner_lib"
    )
    counts = vocab.count_words(vocab.corpus_lines([_gutenberg(shared_data)], max_lines=800), True)
    words = [(w, c) for w, c in counts.most_common() if len(w) <= vocab.MAX_PIECE_CHARS]
    specials = list(tokenization.SPECIAL_TOKENS)
    params = learner.Params(None, 1, 4, -1, 50, 1000, 1000, 0.05, True, "##", specials)
    chars = {ch for w, _ in words for ch in w}
    first = vocab._piece_counts(words, None)
    for thresh in (2, 7):
        ours = vocab._final_vocab(chars, vocab._learn_at_threshold(words, first, chars, thresh))
        assert ours == learner.learn_with_thresh(words, thresh, params)


@pytest.mark.shared_data
def test_wordpiece_vocab_on_real_text(wordpiece_vocab, held_out):
    tokens = tokenization.load_vocab(wordpiece_vocab)
    assert len(tokens) == 2000
    assert tokens[:5] == list(tokenization.SPECIAL_TOKENS)
    assert any(t.startswith("##") and len(t) > 3 for t in tokens)
    assert not [p for p in os.listdir(os.path.dirname(wordpiece_vocab)) if ".tmp-" in p]
    tok = load_tokenizer(wordpiece_vocab)
    assert isinstance(tok, WordPieceTokenizer) and tok.do_lower_case
    assert _unk_rate(tok, held_out) < 0.005
    line = "It was the best of times, it was the worst of times."
    assert tok.decode(tok.encode(line)) == " ".join(tokenization.basic_tokenize(line, True))
    assert tok.tf_encode(tf.constant([line])).to_list() == [tok.encode(line)]


@pytest.mark.shared_data
def test_sentencepiece_vocab_and_tokenizer(sp_model, held_out):
    assert os.path.exists(sp_model.removesuffix(".model") + ".vocab")
    tok = load_tokenizer(sp_model)
    assert isinstance(tok, SentencePieceTokenizer) and tok.kind == "sentencepiece"
    assert tok.vocab_size == 1000 and tok.do_lower_case
    assert tok.special_ids == (0, 1, 2, 3, 4)
    assert tok.vocab[:5] == list(tokenization.SPECIAL_TOKENS)
    assert _unk_rate(tok, held_out) < 0.005
    known = [line for line in held_out[:100] if tok.unk_id not in tok.encode(line)]
    assert len(known) > 90
    for line in known:
        assert tok.decode(tok.encode(line)) == " ".join(line.lower().split())
    assert tok.encode("[MASK]") != [tok.mask_id]  # literal text is not a special token
    assert tok.decode([tok.cls_id, *tok.encode("hello world"), tok.sep_id, 0]) == (
        "[CLS] hello world [SEP]"
    )
    ds = tf.data.Dataset.from_tensor_slices(held_out[:200]).batch(64).map(tok.tf_encode)
    got = [row for batch in ds for row in batch.to_list()]
    assert got == [tok.encode(line) for line in held_out[:200]]
    table = tok.word_start_table()
    assert table[list(tok.special_ids)].all()
    pieces = tok.tokenize("Hello wonderful world")
    starts = [table[i] for i in tok.encode("Hello wonderful world")]
    assert starts == [p.startswith("\u2581") for p in pieces]
    with pytest.raises(ValueError, match="folds case"):
        load_tokenizer(sp_model, do_lower_case=False)


@pytest.mark.shared_data
def test_cli_cased_wordpiece(shared_data, tmp_path, capsys):
    out = str(tmp_path / "cased.txt")
    src = _gutenberg(shared_data)
    vocab.main(
        [
            "--input",
            src,
            "--input",
            f"{src},{src}",
            "--output",
            out,
            "--vocab_size",
            "600",
            "--nolower_case",
            "--max_lines",
            "500",
        ]
    )
    assert "600 tokens, do_lower_case=False" in capsys.readouterr().out
    tok = load_tokenizer(out)
    assert not tok.do_lower_case and "The" in tok.vocab


def test_bad_input_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n   \n\n")
    for kind in vocab.KINDS:
        with pytest.raises(ValueError, match="no text"):
            vocab.train_vocab([str(empty)], str(tmp_path / "v"), 100, kind=kind)
    with pytest.raises(FileNotFoundError, match="missing-\\*.txt matches no files"):
        vocab.train_vocab([str(tmp_path / "missing-*.txt")], str(tmp_path / "v"), 100)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"good line\nbad \xff line\n")
    with pytest.raises(ValueError, match="bad.txt:2: not valid UTF-8"):
        vocab.train_vocab([str(bad)], str(tmp_path / "v"), 100)
    with pytest.raises(ValueError, match="kind='bpe'"):
        vocab.train_vocab([str(bad)], str(tmp_path / "v"), 100, kind="bpe")
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="junk.model: not a SentencePiece model") as err:
        load_tokenizer(str(junk))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="too small"):
        text = tmp_path / "t.txt"
        text.write_text("abcdefghij klmnopqrst\n" * 3)
        vocab.train_vocab([str(text)], str(tmp_path / "v"), 20)
