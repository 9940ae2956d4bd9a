"""token_docs: the bulk-tokenized documents equal sentence-by-sentence encoding, across blocks."""

import gzip

import numpy as np
import pytest

from bertjax.data import corpus, token_docs
from bertjax.text import load_tokenizer

WORDS = "the a of and to in it was he she said that his her on at with for as had you".split()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", "“", "”", *WORDS]
    tokens += list("abcdefghijklmnopqrstuvwxyz") + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    path.write_text("\n".join(dict.fromkeys(tokens)) + "\n", encoding="utf-8")
    return load_tokenizer(str(path), do_lower_case=True)


def _expected(documents, tok):
    """(ids, bounds) of every document with a non-empty sentence, sentence by sentence."""
    out = []
    for doc in documents:
        ids = [s for s in map(tok.encode, doc) if s]
        if ids:
            out.append(([t for s in ids for t in s], [0, *np.cumsum([len(s) for s in ids])]))
    return out


def _got(source, fmt, tok):
    return [
        (d.ids.tolist(), list(d.bounds)) for d in token_docs.tokenized_documents(source, fmt, tok)
    ]


def _write_bert(path, rng, docs=40):
    lines = []
    for d in range(docs):
        for _ in range(int(rng.integers(1, 12))):
            words = rng.choice(WORDS + ["zq", "“x”", "\u0301", "\x01"], int(rng.integers(1, 15)))
            lines.append(" ".join(words).capitalize() + ".")
        lines += [""] * int(rng.integers(1, 3))  # one or two blank lines between documents
        if d % 7 == 3:
            lines.append("   ")  # a whitespace-only line: a document break too
    data = "\ufeff" + "\r\n".join(lines)
    if str(path).endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8", newline="") as f:
            f.write(data)
    else:
        path.write_text(data, encoding="utf-8", newline="")


@pytest.mark.parametrize("block", [64, 1000, 1 << 20])
@pytest.mark.parametrize("name", ["corpus.txt", "corpus.txt.gz"])
def test_bert_format_blocks(tmp_path, tok, monkeypatch, block, name):
    monkeypatch.setattr(token_docs, "BLOCK_BYTES", block)
    _write_bert(tmp_path / name, np.random.default_rng(block))
    source = corpus.Source("file", str(tmp_path / name))
    expected = _expected(corpus.iter_source_documents(source, "bert"), tok)
    assert len(expected) > 30
    assert _got(source, "bert", tok) == expected


@pytest.mark.parametrize("block", [64, 4000, 1 << 20])
def test_text_format_blocks(tmp_path, tok, monkeypatch, block):
    """The other formats' documents are joined into blocks: no two documents ever merge."""
    monkeypatch.setattr(token_docs, "BLOCK_BYTES", block)
    rng = np.random.default_rng(0)
    paragraphs = []
    for chapter in range(12):
        paragraphs.append(f"CHAPTER {chapter + 1}.")
        for _ in range(int(rng.integers(1, 6))):
            words = rng.choice(WORDS, int(rng.integers(5, 40)))
            paragraphs.append(". ".join(" ".join(words).split(" the ")).capitalize() + ".")
    (tmp_path / "book.txt").write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    source = corpus.Source("file", str(tmp_path / "book.txt"))
    expected = _expected(corpus.iter_source_documents(source, "text"), tok)
    assert len(expected) == 12
    assert _got(source, "text", tok) == expected


def test_invalid_utf8_names_the_line(tmp_path, tok):
    (tmp_path / "bad.txt").write_bytes(b"good line.\n\nanother.\nbad \xff here.\n")
    source = corpus.Source("file", str(tmp_path / "bad.txt"))
    with pytest.raises(ValueError, match=r"bad.txt:4: not valid UTF-8"):
        _got(source, "bert", tok)


@pytest.mark.shared_data
def test_gutenberg_documents_equal_sentence_encoding(shared_data, uncased_vocab):
    tok = load_tokenizer(str(uncased_vocab), do_lower_case=True)
    path = shared_data / "corpus" / "gutenberg" / "A-Tale-of-Two-Cities_98__98-0.txt"
    source = corpus.Source("file", str(path))
    expected = _expected(corpus.iter_source_documents(source, "text"), tok)
    assert _got(source, "text", tok) == expected
