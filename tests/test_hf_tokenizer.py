"""HFTokenizer: ids equal to transformers' fast tokenizer and to bertjax's WordPieceTokenizer, on
tokenizer.json files built here (no network): a ModernBERT-style byte-level BPE, a RoBERTa-style
BPE and a BERT WordPiece; word-start tables, in-graph encode, errors."""

import glob
import importlib
import json
import pydoc

import numpy as np
import pytest
import tensorflow as tf
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from bertjax.text.hf_tokenizer import HFTokenizer, load_hf_tokenizer
from bertjax.text.tokenization import SPECIAL_TOKENS, WordPieceTokenizer

transformers = pytest.importorskip("transformers")

TRAIN_MODULES = (
    "argparse",
    "collections",
    "json",
    "re",
    "typing",
    "unittest",
    "logging",
    "pathlib",
)
HELD_OUT_MODULES = ("email.message", "http.client", "inspect", "subprocess", "datetime", "decimal")
MODERNBERT_SPECIALS = ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]")  # appended after training
ROBERTA_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")  # ids 0-4, as in RoBERTa
UNICODE_LINES = [
    "Café naïve résumé ÉCOLE Ångström façade Ærøskøbing",
    "中文字符测试 日本語のテキスト 한국어 漢字かな交じり文",
    "emoji 😀🎉👍🏽 🥲 ❤️ ©®™ — dash – en … «guillemets» ¿qué? ¡sí!",
    "tab\there\r\nnew\u2028line\u00a0nbsp\u3000ideo e\u0301 a\u0308 ctrl\x00a\x7fb",
    "a" * 150 + " " + "é" * 101 + " the [MASK] token and [CLS] in text",
    "",
    "   ",
]


def _docs(modules) -> str:
    """Plain-text pydoc pages of standard-library modules: real English prose and code."""
    return "\n".join(
        pydoc.render_doc(importlib.import_module(m), renderer=pydoc.plaintext) for m in modules
    )


@pytest.fixture(scope="module")
def train_text() -> str:
    return _docs(TRAIN_MODULES)  # ~400 KB


@pytest.fixture(scope="module")
def held_out_lines() -> list[str]:
    lines = [line for line in _docs(HELD_OUT_MODULES).splitlines() if line.strip()]
    return lines + UNICODE_LINES


@pytest.fixture(scope="module")
def gutenberg_lines(shared_data) -> list[str]:
    """Every 100th raw line (CRLF, BOM kept) of each Gutenberg novel."""
    paths = sorted(glob.glob(str(shared_data / "corpus" / "gutenberg" / "*.txt")))
    if not paths:
        pytest.skip(f"no novels under {shared_data / 'corpus' / 'gutenberg'}")
    lines = []
    for path in paths:
        with open(path, encoding="utf-8", newline="") as f:
            lines += f.read().split("\n")[::100]
    return lines


def _train_bpe(text: str, specials: tuple[str, ...], add_prefix_space: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=3000,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(), trainer=trainer)
    return tok


def _write(directory, tok: Tokenizer, config: dict | None = None, name="tokenizer_config.json"):
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / name).write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def modernbert_dir(tmp_path_factory, train_text):
    """ModernBERT-style: NFC + ByteLevel(no prefix space) BPE, specials added after the merges,
    [MASK] with lstrip, post-processor [CLS] $A [SEP]."""
    tok = _train_bpe(train_text, (), add_prefix_space=False)
    tok.add_special_tokens(
        [AddedToken(t, special=True, lstrip=t == "[MASK]") for t in MODERNBERT_SPECIALS]
    )
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    tok.enable_truncation(8192)  # stored in the file; encode must ignore it
    names = dict(zip(("unk", "cls", "sep", "pad", "mask"), MODERNBERT_SPECIALS))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192}
    config |= {f"{k}_token": v for k, v in names.items()}
    return _write(tmp_path_factory.mktemp("modernbert"), tok, config)


@pytest.fixture(scope="module")
def roberta_dir(tmp_path_factory, train_text):
    """RoBERTa-style: ByteLevel(prefix space) BPE, <s> <pad> </s> <unk> <mask> = ids 0-4."""
    tok = _train_bpe(train_text[:150_000], ROBERTA_SPECIALS, add_prefix_space=True)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    special_map = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    special_map |= {"sep_token": "</s>", "pad_token": "<pad>", "cls_token": "<s>"}
    special_map["mask_token"] = {"content": "<mask>", "lstrip": True, "special": True}
    return _write(tmp_path_factory.mktemp("roberta"), tok, special_map, "special_tokens_map.json")


@pytest.fixture(scope="module")
def wordpiece_setup(tmp_path_factory, request, train_text, held_out_lines):
    """(tokenizer.json dir, vocab.txt, comparison lines): BERT's uncased vocab with Gutenberg and
    stdlib lines when ../shared/data is present, else a WordPieceTrainer vocab on stdlib docs."""
    directory = tmp_path_factory.mktemp("wordpiece")
    try:
        vocab = request.getfixturevalue("uncased_vocab")
        lines = request.getfixturevalue("gutenberg_lines") + held_out_lines[::2]
    except pytest.skip.Exception:
        trained = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        trained.normalizer = normalizers.BertNormalizer(lowercase=True)
        trained.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(
            vocab_size=3000, special_tokens=list(SPECIAL_TOKENS), show_progress=False
        )
        trained.train_from_iterator(train_text.splitlines(), trainer=trainer)
        vocab = directory / "vocab.txt"
        by_id = sorted(trained.get_vocab().items(), key=lambda kv: kv[1])
        vocab.write_text("".join(t + "\n" for t, _ in by_id), encoding="utf-8")
        lines = held_out_lines
    tok = Tokenizer(models.WordPiece.from_file(str(vocab), unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.BertProcessing(("[SEP]", sep), ("[CLS]", cls))
    return _write(directory, tok), vocab, lines


def _assert_same_as_transformers(tok: HFTokenizer, hf, lines: list[str]) -> None:
    ours = tok.encode_batch(lines)
    want = hf(lines, add_special_tokens=False)["input_ids"]
    bad = [(line, a, b) for line, a, b in zip(lines, ours, want) if a != b]
    assert not bad, f"{len(bad)} of {len(lines)} lines differ from transformers, first: {bad[0]}"
    sub = lines[::25]
    assert [tok.encode(line) for line in sub] == ours[::25]
    with_specials = hf(sub, add_special_tokens=True)["input_ids"]
    assert with_specials == [[tok.cls_id, *ids, tok.sep_id] for ids in ours[::25]]
    assert tok.tokenize(sub[3]) == hf.convert_ids_to_tokens(ours[::25][3])
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (
        hf.pad_token_id,
        hf.unk_token_id,
        hf.cls_token_id,
        hf.sep_token_id,
        hf.mask_token_id,
    )
    assert tok.vocab_size == len(hf) and tok.convert_ids_to_tokens(range(len(hf))) == [
        hf.convert_ids_to_tokens(i) for i in range(len(hf))
    ]


def test_modernbert_bpe_matches_transformers(modernbert_dir, held_out_lines):
    tok = load_hf_tokenizer(modernbert_dir)
    hf = transformers.AutoTokenizer.from_pretrained(str(modernbert_dir), local_files_only=True)
    assert tok.kind == "hf" and not tok.do_lower_case
    assert tok.vocab[tok.cls_id] == "[CLS]" and tok.vocab[tok.mask_id] == "[MASK]"
    assert tok.vocab_file == str(modernbert_dir / "tokenizer.json")
    assert len(held_out_lines) > 5000
    _assert_same_as_transformers(tok, hf, held_out_lines)
    long_line = " ".join(held_out_lines)  # > 8192 tokens: the file's truncation is off
    assert len(tok.encode(long_line)) > 10_000
    assert tok.encode("a [MASK] b") == [*tok.encode("a"), tok.mask_id, *tok.encode(" b")]
    line = "Return the Decimal value of x, rounded (half-even) to 12 places."
    assert tok.decode([tok.pad_id, *tok.encode(line), tok.pad_id]) == line
    assert tok.decode([tok.cls_id, *tok.encode(line)]) == "[CLS]" + line


@pytest.mark.shared_data
def test_modernbert_bpe_matches_transformers_on_novels(modernbert_dir, gutenberg_lines):
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(modernbert_dir / "tokenizer.json"),
        **{f"{n}_token": f"[{n.upper()}]" for n in ("unk", "cls", "sep", "pad", "mask")},
    )
    assert len(gutenberg_lines) > 3000
    _assert_same_as_transformers(
        HFTokenizer(modernbert_dir / "tokenizer.json"), hf, gutenberg_lines
    )


def test_roberta_bpe_specials_and_ids(roberta_dir, held_out_lines):
    tok = load_hf_tokenizer(roberta_dir / "tokenizer.json")
    assert tok.special_ids == (1, 3, 0, 2, 4)  # pad unk cls sep mask
    hf = transformers.AutoTokenizer.from_pretrained(str(roberta_dir), local_files_only=True)
    _assert_same_as_transformers(tok, hf, held_out_lines[::4])


def test_wordpiece_equals_bertjax_and_transformers(wordpiece_setup):
    directory, vocab, lines = wordpiece_setup
    tok = load_hf_tokenizer(directory)
    ref = WordPieceTokenizer(str(vocab), do_lower_case=True)
    assert tok.do_lower_case and tok.vocab == ref.vocab and tok.special_ids == ref.special_ids
    assert len(lines) > 3000
    ours = tok.encode_batch(lines)
    bad = [(line, a, b) for line, a, b in zip(lines, ours, map(ref.encode, lines)) if a != b]
    # Known divergences: literal "[MASK]" in text is the special token here, text in bertjax;
    # the Rust BertNormalizer lower-cases per character (upper-case final sigma).
    bad = [b for b in bad if not any(s in b[0] for s in (*SPECIAL_TOKENS, "\u03a3"))]
    assert not bad, f"{len(bad)} of {len(lines)} lines differ from bertjax, first: {bad[0]}"
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"),
        **{f"{n}_token": f"[{n.upper()}]" for n in ("unk", "cls", "sep", "pad", "mask")},
    )
    _assert_same_as_transformers(tok, hf, lines)
    assert tok.decode(tok.encode("Hello, world!")) == "hello, world!"
    np.testing.assert_array_equal(tok.word_start_table(), ref.word_start_table())


def _tiny_bpe(tmp_path, pre_tokenizer, tokens: list[str]) -> HFTokenizer:
    """HFTokenizer on a hand-written BPE vocabulary (no merges needed for the table)."""
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizer
    tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    return load_hf_tokenizer(_write(tmp_path, tok))


def test_word_start_table_rules(tmp_path):
    # ByteLevel: "Ġ"-led, or punctuation/whitespace after decoding the bytes ("âĢĶ" is "—");
    # partial UTF-8 ("âĢ") and letters ("Ã©" is "é") continue a word.
    expected = {"Ġthe": 1, "the": 0, "Ġ": 1, "Ġ(": 1, "(": 1, ",": 1, "Ċ": 1, "âĢĶ": 1, "âĢ": 0}
    expected |= {"â": 0, "Ã©": 0, "Âł": 1, "Â«": 1, "2": 0, "Ġ2": 1}
    tok = _tiny_bpe(tmp_path / "bytes", pre_tokenizers.ByteLevel(), list(expected))
    table = tok.word_start_table()
    assert dict(zip(tok.vocab, table.tolist())) == {
        **{t: bool(v) for t, v in expected.items()},
        **dict.fromkeys(SPECIAL_TOKENS, True),
    }
    # Metaspace: "▁"-led, punctuation, CJK-led.
    expected = {"\u2581the": 1, "the": 0, ",": 1, "\u4e2d\u6587": 1, "\u2581": 1, "s,": 0}
    tok = _tiny_bpe(tmp_path / "meta", pre_tokenizers.Metaspace(), list(expected))
    assert tok.word_start_table()[:6].tolist() == [bool(v) for v in expected.values()]
    with pytest.raises(ValueError, match="cannot tell word starts"):
        _tiny_bpe(tmp_path / "ws", pre_tokenizers.Whitespace(), ["a", "b"]).word_start_table()


def test_trained_bpe_word_start_table(modernbert_dir, roberta_dir):
    tok = load_hf_tokenizer(modernbert_dir)
    table = tok.word_start_table()
    assert table.shape == (tok.vocab_size,) and table.dtype == bool
    assert table[list(tok.special_ids)].all()
    words = "the internationalization of configurable subprocesses returned unexpectedly".split()
    ids = tok.encode(" " + " ".join(words))
    assert len(ids) > len(words) and table[ids].sum() == len(words)
    text = " deserialized, (quoted) text."
    starts = [p for p, i in zip(tok.tokenize(text), tok.encode(text)) if table[i]]
    assert starts == ["Ġdes", ",", "Ġ(", ")", "Ġtext", "."]
    roberta = load_hf_tokenizer(roberta_dir)
    assert roberta.word_start_table()[roberta.encode("hello")[0]]  # add_prefix_space=True


@pytest.mark.parametrize("which", ["modernbert", "wordpiece"])
def test_tf_encode_equals_encode_in_tf_data(which, modernbert_dir, wordpiece_setup, held_out_lines):
    tok = load_hf_tokenizer(modernbert_dir if which == "modernbert" else wordpiece_setup[0])
    lines = held_out_lines[::5]
    ds = tf.data.Dataset.from_tensor_slices([line.encode("utf-8") for line in lines])
    ds = ds.batch(128).map(tok.tf_encode, num_parallel_calls=2)
    got = [row for batch in ds for row in batch.to_list()]
    assert got == tok.encode_batch(lines) == [tok.encode(line) for line in lines]
    single = tok.tf_encode(tf.constant(UNICODE_LINES[0]))  # scalar in -> [ids]
    assert single.dtype == tf.int64 and single.numpy().tolist() == tok.encode(UNICODE_LINES[0])
    empty = tok.tf_encode(tf.constant([""], tf.string))
    assert empty.shape[0] == 1 and empty.to_list() == [[]]


def test_errors(tmp_path, modernbert_dir):
    spec = json.loads((modernbert_dir / "tokenizer.json").read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "[MASK]"]
    spec["model"]["vocab"] = {t: i for t, i in spec["model"]["vocab"].items() if t != "[MASK]"}
    path = tmp_path / "no_mask" / "tokenizer.json"
    path.parent.mkdir()
    path.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"no_mask/tokenizer.json: .*no \[MASK\] token") as e:
        HFTokenizer(path)
    assert "\n" not in str(e.value)
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"mask_token": "<mask>"}))
    with pytest.raises(ValueError, match=r"no \[MASK\] token \(tried <mask>, \[MASK\]\)"):
        load_hf_tokenizer(path.parent)
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": 1}')
    with pytest.raises(ValueError, match=r"bad.json: not a tokenizers JSON file") as e:
        HFTokenizer(bad)
    assert "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_hf_tokenizer(tmp_path)
    with pytest.raises(ValueError, match=r"do_lower_case=True but .* keeps case"):
        load_hf_tokenizer(modernbert_dir, do_lower_case=True)
    tok = load_hf_tokenizer(modernbert_dir, do_lower_case=False)
    with pytest.raises(IndexError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_prepare_and_pretrain_with_a_bpe_tokenizer_json(modernbert_dir, train_text, tmp_path):
    """A ModernBERT-style tokenizer.json drives `prepare` (whole-word masking at BPE word starts)
    and a modernbert pretraining run, with ids equal to the tokenizer's own."""
    import sys

    from bertjax import train
    from bertjax.data import prepare
    from bertjax.text import load_tokenizer

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent.parent))
    from configs import base

    corpus = tmp_path / "corpus.txt"
    docs = [" ".join(p.split()) for p in train_text.split("\n\n") if len(p.split()) > 8][:300]
    corpus.write_text("\n\n".join(d.replace(". ", ".\n") for d in docs) + "\n")
    tok = load_tokenizer(str(modernbert_dir / "tokenizer.json"))
    assert tok.kind == "hf"
    meta = prepare.prepare(
        str(corpus),
        str(tmp_path / "data"),
        tok,
        corpus_format="bert",
        max_seq_length=32,
        max_predictions_per_seq=10,
        masked_lm_prob=0.3,
        nsp=False,
        whole_word_mask=True,
        dupe_factor=1,
        num_shards=1,
        eval_fraction=0.1,
        num_workers=1,
        show_progress=False,
    )
    assert meta["vocab_size"] == tok.vocab_size and meta["examples"]["train"] > 20
    starts = tok.word_start_table()
    record = next(
        iter(tf.data.TFRecordDataset(str(tmp_path / "data" / meta["shard_files"]["train"][0])))
    )
    example = tf.train.Example.FromString(record.numpy()).features.feature
    ids = list(example["input_ids"].int64_list.value)
    positions = [p for p in example["masked_lm_positions"].int64_list.value if p]
    labels = list(example["masked_lm_ids"].int64_list.value)[: len(positions)]
    original = list(ids)
    for p, label in zip(positions, labels):
        original[p] = label
    for p in positions:  # whole words: a masked continuation's word start is masked too
        q = p
        while q > 0 and not starts[original[q]] and original[q - 1] not in (tok.cls_id, tok.sep_id):
            q -= 1
            assert q in positions, (p, q)
    c = base.get_config()
    c.model.architecture, c.model.preset = "modernbert", "modernbert-tiny"
    c.data.prepared_dir, c.data.vocab = (
        str(tmp_path / "data"),
        str(modernbert_dir / "tokenizer.json"),
    )
    c.data.nsp, c.data.max_seq_length, c.data.max_predictions_per_seq = False, 32, 10
    c.data.masked_lm_prob = 0.3
    c.train.steps, c.train.global_batch_size, c.train.log_every = 2, 8, 1
    c.optimizer.warmup_steps = 1  # not longer than the run
    c.train.eval_every, c.train.eval_steps, c.train.async_checkpoints = 0, 0, False
    c.mesh.num_devices = 1
    c.tensorboard = False
    c.data.streams = 2  # each is a tf.data pipeline to build (8, the default, in multihost)
    c.model.num_layers = 2  # a global and a local layer (the preset's 4: twice the compile)
    result = train.train_and_evaluate(c, str(tmp_path / "run"))
    assert result["step"] == 2 and np.isfinite(result["train"]["loss"])
