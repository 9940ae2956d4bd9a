"""BulkWordPiece.encode_lines gives WordPieceTokenizer.encode's ids, line by line, on any text."""

import numpy as np
import pytest

from bertjax.text import load_tokenizer

TRICKY = [
    "The Quick brown fox, said Mr. O'Brien -- \"won't\" (e.g. 3.14) [CLS] #hash @at_under",
    "  leading and trailing spaces\t\ttabs  ",
    "",
    "   ",
    "\t",
    "crlf line end\r",
    "Café naïve résumé Éclair ÆSOP œuvre",
    "“Curly quotes”—em dash… ‘single’ † • £5 ½ 10°",
    "Greek ΑΣ.Β ΟΔΟΣ ς σ and capital sigma alone Σ",
    "Combining e\u0301 and a lone \u0301 mark and \u0301\u0302",
    "CJK 中文字 mixed日本",
    "no-break\u00a0space and line\u2028separator and en\u2000quad",
    "controls \x01 inside \x7f and soft\u00adhyphen zero\u200bwidth",
    "\x01",
    "\u0301",
    "a" * 99 + " " + "b" * 100 + " " + "c" * 101,
    "supercalifragilisticexpialidocious antidisestablishmentarianism 12345678901234567",
    "İstanbul ǅemal ﬁne ß",
    "🙂 emoji and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "unknownpieceszzqqxx qqqqzzzzxxxx",
]


@pytest.fixture(scope="module", params=[True, False], ids=["uncased", "cased"])
def tok(request, tiny_vocab_path):
    return load_tokenizer(tiny_vocab_path, do_lower_case=request.param)


@pytest.fixture(scope="module")
def tiny_vocab_path(tmp_path_factory):
    words = "the quick brown fox said mr o brien won t e g cls hash at under cafe naive resume"
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words.split(), "The", "Quick"]
    tokens += list(".,'\"()[]#@_-—…“”‘’†•£½°:;!?") + list("abcdefghijklmnopqrstuvwxyz0123456789")
    tokens += [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"] + ["é", "##é", "σ", "ς"]
    tokens += ["中", "文", "##s", "supercalifragilisticexpialidocious"]
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    path.write_text("\n".join(dict.fromkeys(tokens)) + "\n", encoding="utf-8")
    return str(path)


def _check(tok, lines: list[str]) -> None:
    bulk = tok.bulk_encoder()
    out = bulk.encode_lines("\n".join(lines).encode("utf-8"))
    assert len(out.counts) == len(lines) == len(out.blank)
    ends = np.cumsum(out.counts)
    for i, line in enumerate(lines):
        got = out.ids[ends[i] - out.counts[i] : ends[i]].tolist()
        assert got == tok.encode(line), repr(line)
        assert out.blank[i] == (not line.strip()), repr(line)


def test_tricky_lines_one_block_each(tok):
    for line in TRICKY:  # each alone: most take the bulk path, some the line-by-line one
        _check(tok, [line, "plain text after it", ""])


def test_tricky_lines_in_one_block(tok):
    _check(tok, TRICKY * 3)


def test_random_text(tok):
    rng = np.random.default_rng(0)
    alphabet = list("abcdeé ABC.,'-“”\t") + ["the ", "Quick ", "fox", " ς", "Σ", "\u0301"]
    lines = ["".join(rng.choice(alphabet, int(rng.integers(0, 40)))) for _ in range(400)]
    _check(tok, lines)
    _check(tok, [line for line in lines if "Σ" not in line and "\u0301" not in line])


def test_table_growth_and_long_pieces(tok):
    rng = np.random.default_rng(1)
    words = ["".join(rng.choice(list("abcxyz"), int(rng.integers(1, 30)))) for _ in range(5000)]
    _check(tok, [" ".join(words[i : i + 10]) for i in range(0, 5000, 10)])


def test_invalid_utf8_raises():
    from bertjax.text.bulk_wordpiece import BulkWordPiece

    class _Tok:
        do_lower_case, vocab = True, ["[PAD]", "a"]
        _piece_cache: dict = {}

        def encode(self, text):
            return []

    with pytest.raises(UnicodeDecodeError):
        BulkWordPiece(_Tok()).encode_lines(b"ok\n\xff\xfe bad")


@pytest.mark.shared_data
def test_equals_encode_on_gutenberg(shared_data, uncased_vocab):
    """Every line of three real novels (the bulk path takes them all) with the real vocab."""
    tok = load_tokenizer(str(uncased_vocab), do_lower_case=True)
    folder = shared_data / "corpus" / "gutenberg"
    names = ["Les-Mis-rables_135__135-0.txt", "Ulysses_4300__4300-0.txt", "Dracula_345__345.txt"]
    bulk = tok.bulk_encoder()
    for name in names:
        data = (folder / name).read_bytes().replace(b"\r\n", b"\n").removeprefix(b"\xef\xbb\xbf")
        assert bulk._kinds(data, np.frombuffer(b" " + data + b" ", np.uint8)) is not None
        lines = data.decode("utf-8").split("\n")
        out = bulk.encode_lines(data)
        ends = np.cumsum(out.counts)
        for i, line in enumerate(lines):
            assert out.ids[ends[i] - out.counts[i] : ends[i]].tolist() == tok.encode(line), line
