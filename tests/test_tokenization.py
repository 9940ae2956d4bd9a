"""Tokenizers: BERT rules, equality with transformers' BertTokenizer, in-graph == Python, errors."""

import glob
import time

import numpy as np
import pytest
import tensorflow as tf

from bertjax.text import load_tokenizer, tokenization
from bertjax.text.tokenization import WordPieceTokenizer, basic_tokenize, load_vocab

# Hand-written corner cases: accents, punctuation, CJK, emoji, controls, zero-width, long words.
HARD_LINES = [
    "Café naïve résumé ÉCOLE Ångström façade Ærøskøbing",
    "$5^2 `code` ~tilde +plus= a|b <c> @d #e 50% {x} [y] \\z",
    "中文字符测试 日本語のテキスト 한국어 漢字かな交じり文",
    "emoji 😀🎉👍🏽 🥲 🫠 ❤️ ©®™",
    "ctrl\x00a\x01b\x7fc\x0bd\x0ce\x1cf\x85g\x9fh",
    "zero\u200bwidth\u200cnon\u200djoin\ufeffbom\u2060wj\u00adsoft",
    "a" * 150 + " " + "b" * 100 + " " + "é" * 101 + " " + "x" * 101 + ".",
    "ΟΔΟΣ ΣΟΦΟΣ. Σ ΑΣ- ὈΔΥΣΣΕΎΣ",
    "İstanbul ǅemal ﬁne ß ẞ Ǆ ǈ ΐ",
    "tab\there\r\nnew\u2028line\u2029para\u00a0nbsp\u3000ideo\u2009thin",
    "e\u0301 a\u0308 \u0301\u0301 x\u20dd n\u0303o",
    "\ufffdreplacement\ufffd \U0010fffd private\ue000use",
    "",
    "   ",
    'don\'t "quoted" — dash – en … ellipsis «guillemets» ¿qué? ¡sí!',
]


def _sample_lines(shared_data, every: int = 120) -> list[str]:
    """Every `every`-th line of each Gutenberg book (raw, CRLF and BOM kept) + GLUE dev sentences."""
    lines = []
    for path in sorted(glob.glob(str(shared_data / "corpus" / "gutenberg" / "*.txt"))):
        with open(path, encoding="utf-8", newline="") as f:
            lines += f.read().split("\n")[::every]
    for path in sorted(glob.glob(str(shared_data / "glue" / "*" / "dev.tsv"))):
        with open(path, encoding="utf-8", newline="") as f:
            for row in f.read().split("\n")[:150]:
                lines += row.split("\t")
    return lines


@pytest.fixture(scope="module")
def sample_lines(shared_data):
    return _sample_lines(shared_data) + HARD_LINES


@pytest.mark.parametrize(
    ("text", "lower", "expected"),
    [
        ("Hello, World!", True, ["hello", ",", "world", "!"]),
        ("Hello, World!", False, ["Hello", ",", "World", "!"]),
        ("$5^2 `a` ~b+c", True, ["$", "5", "^", "2", "`", "a", "`", "~", "b", "+", "c"]),
        ("Café ÉCOLE", True, ["cafe", "ecole"]),
        ("Café ÉCOLE", False, ["Café", "ÉCOLE"]),
        ("中文abc字", True, ["中", "文", "abc", "字"]),
        ("zero\u200bwidth a\x00b\x7fc", True, ["zerowidth", "abc"]),
        ("tab\tnew\nline\u00a0nbsp\u2028x", True, ["tab", "new", "line", "nbsp", "x"]),
        ("e\u0301", False, ["\u00e9"]),  # NFC, as transformers' Python BertTokenizer
        ("ΟΔΟΣ.", True, ["οδος", "."]),  # final sigma (Python's str.lower)
        ("", True, []),
    ],
)
def test_basic_tokenize_rules(text, lower, expected):
    assert basic_tokenize(text, lower) == expected


def _reference(vocab, lower):
    transformers = pytest.importorskip("transformers")
    legacy = pytest.importorskip("transformers.models.bert.tokenization_bert_legacy")
    return (
        legacy.BertTokenizerLegacy(str(vocab), do_lower_case=lower),
        transformers.BertTokenizer(str(vocab), do_lower_case=lower),
    )


@pytest.mark.shared_data
@pytest.mark.parametrize("lower", [True, False], ids=["uncased", "cased"])
def test_encode_matches_transformers(uncased_vocab, sample_lines, lower):
    """encode == transformers' Python BertTokenizerLegacy on every line, and == the Rust-backed
    BertTokenizer except its one known divergence: it lower-cases per character, so an upper-case
    final sigma becomes "σ" where Python's str.lower() (and the Python reference) gives "ς"."""
    python_ref, rust_ref = _reference(uncased_vocab, lower)
    tok = WordPieceTokenizer(str(uncased_vocab), do_lower_case=lower)
    assert len(sample_lines) > 3000
    ours = [tok.encode(line) for line in sample_lines]
    want = [python_ref.convert_tokens_to_ids(python_ref.tokenize(line)) for line in sample_lines]
    bad = [(line, a, b) for line, a, b in zip(sample_lines, ours, want) if a != b]
    assert not bad, f"{len(bad)} of {len(sample_lines)} lines differ, first: {bad[0]}"
    # Rust diverges only on upper-case sigma when uncased: give it Python-lower-cased text there.
    rust_in = [line.lower() if lower and "\u03a3" in line else line for line in sample_lines]
    rust = rust_ref(rust_in, add_special_tokens=False)["input_ids"]
    bad = [(line, a, b) for line, a, b in zip(sample_lines, ours, rust) if a != b]
    assert not bad, f"{len(bad)} of {len(sample_lines)} lines differ from Rust, first: {bad[0]}"
    assert tok.tokenize(sample_lines[-1]) == python_ref.tokenize(sample_lines[-1])


@pytest.mark.shared_data
@pytest.mark.parametrize("lower", [True, False], ids=["uncased", "cased"])
def test_tf_encode_equals_encode_in_tf_data(uncased_vocab, sample_lines, lower):
    tok = WordPieceTokenizer(str(uncased_vocab), do_lower_case=lower)
    lines = sample_lines[::6] + HARD_LINES
    ds = tf.data.Dataset.from_tensor_slices([line.encode("utf-8") for line in lines])
    ds = ds.batch(256).map(tok.tf_encode)
    got = [row for batch in ds for row in batch.to_list()]
    bad = [(line, a) for line, a, b in zip(lines, got, map(tok.encode, lines)) if a != b]
    assert not bad, f"{len(bad)} of {len(lines)} lines differ, first: {bad[0]}"
    single = tok.tf_encode(tf.constant(HARD_LINES[0]))  # scalar in -> [ids]
    assert single.numpy().tolist() == tok.encode(HARD_LINES[0])


def test_tf_encode_unicode_corner_cases(uncased_vocab):
    """Every code point class the in-graph path patches: sigma, Unicode-version lower-casing."""
    tok = WordPieceTokenizer(str(uncased_vocab), do_lower_case=True)
    cases = ["ΑΣ", "ΑΣΣ", "Α.Σ", "ΑΣ.Σ", "1Σ", "Α\u0898Σ", "ΑΣ\u0301", "Ⱟ", "\U00010570x", "ΣΑ"]
    got = tok.tf_encode(tf.constant(cases)).to_list()
    assert got == [tok.encode(c) for c in cases]


def test_wordpiece_details(uncased_vocab):
    tok = WordPieceTokenizer(str(uncased_vocab), max_chars_per_word=10)
    assert tok.kind == "wordpiece" and tok.vocab_size == 30522
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 100, 101, 102, 103)
    assert tok.tokenize("unaffable") == ["una", "##ffa", "##ble"]
    assert tok.tokenize("abcdefghijk ok") == ["[UNK]", "ok"]  # 11 chars > 10
    assert tok.convert_tokens_to_ids(["the", "not-a-token"]) == [1996, 100]
    assert tok.convert_ids_to_tokens([101, 1996]) == ["[CLS]", "the"]
    assert tok.decode(tok.encode("Unaffable people, too.")) == "unaffable people , too ."
    with pytest.raises(IndexError, match="30522"):
        tok.convert_ids_to_tokens([30522])
    table = tok.word_start_table()
    assert table.shape == (30522,) and table.dtype == np.bool_
    ids = tok.convert_tokens_to_ids(["the", "##ing", "[CLS]", "[MASK]", "中", "##中", "!", "##"])
    assert table[ids].tolist() == [True, False, True, True, True, False, True, True]
    assert table.sum() == sum(not t.startswith("##") or t == "##" for t in tok.vocab)


@pytest.mark.shared_data
def test_python_speed(uncased_vocab, shared_data):
    """The Python path must prepare > 5k lines/s on one core (cold cache, real English)."""
    path = sorted(glob.glob(str(shared_data / "corpus" / "gutenberg" / "*.txt")))[0]
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")[:20000]
    tok = WordPieceTokenizer(str(uncased_vocab))
    start = time.process_time()
    for line in lines:
        tok.encode(line)
    rate = len(lines) / max(time.process_time() - start, 1e-9)
    assert rate > 5000, f"{rate:.0f} lines/s"


def test_load_tokenizer_infers_case(tmp_path):
    specials = list(tokenization.SPECIAL_TOKENS)
    (tmp_path / "uncased.txt").write_text("\n".join([*specials, "the", "##s", "[unused0]"]) + "\n")
    (tmp_path / "cased.txt").write_text("\n".join([*specials, "The", "the"]) + "\n")
    assert load_tokenizer(str(tmp_path / "uncased.txt")).do_lower_case is True
    assert load_tokenizer(str(tmp_path / "cased.txt")).do_lower_case is False
    assert load_tokenizer(str(tmp_path / "cased.txt"), do_lower_case=True).do_lower_case is True


def test_real_uncased_vocab_is_inferred_uncased(uncased_vocab):
    # The uncased vocab holds a few symbols Python calls upper case ('ℝ'); it is still uncased.
    tok = load_tokenizer(str(uncased_vocab))
    assert tok.do_lower_case is True
    assert tok.tokenize("Peyton Manning") == ["peyton", "manning"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", r"v\.txt: vocabulary file is empty"),
        (b"[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\nthe\n", r"v\.txt:7: duplicate .*'the'.*line 6"),
        (b"[PAD]\n[UNK]\n\n[CLS]\n[SEP]\n[MASK]\n", r"v\.txt:3: empty vocabulary token"),
        (b"[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\na b\n", r"v\.txt:6: .*contains whitespace"),
        (b"[PAD]\n[UNK]\n[CLS]\n[SEP]\nthe\n", r"v\.txt: vocabulary lacks .*\[MASK\]"),
        (b"[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n\xff\n", r"v\.txt:6: invalid UTF-8"),
    ],
)
def test_load_vocab_errors(tmp_path, content, message):
    path = tmp_path / "v.txt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as err:
        load_vocab(str(path))
    assert "\n" not in str(err.value)


def test_load_vocab_missing_file_and_crlf(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_vocab(str(tmp_path / "nope.txt"))
    path = tmp_path / "v.txt"
    path.write_bytes(b"\xef\xbb\xbf[PAD]\r\n[UNK]\r\n[CLS]\r\n[SEP]\r\n[MASK]\r\nthe")
    assert load_vocab(str(path)) == [*tokenization.SPECIAL_TOKENS, "the"]
