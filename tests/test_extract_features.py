"""bertjax extract-features: original JSON format, values equal to transformers' hidden states."""

import json

import numpy as np
import pytest
from helpers import hf_inputs, make_hf_model, sst2_sentences

from bertjax.commands.extract_features import main, parse_layers, read_examples
from bertjax.pretrained import encode_batch
from bertjax.text import load_tokenizer

LAYERS = [-1, 0, 1]  # last layer, embeddings, first layer


@pytest.fixture(scope="module")
def setup(tmp_path_factory, uncased_vocab, shared_data):
    directory = tmp_path_factory.mktemp("model")
    hf_model = make_hf_model(directory, uncased_vocab, seed=2)
    sentences = sst2_sentences(shared_data, 5)
    lines = [sentences[0], f"{sentences[1]} ||| {sentences[2]}", sentences[3], "", sentences[4]]
    text = tmp_path_factory.mktemp("input") / "input.txt"
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return directory, hf_model, text


def _reference(hf_model, directory, text, max_len):
    """transformers' hidden states of each line, unpadded: [tokens, len(LAYERS), hidden]."""
    import torch

    tok = load_tokenizer(str(directory / "vocab.txt"))
    batch = encode_batch(tok, read_examples(str(text)), max_len)
    with torch.no_grad():
        out = hf_model.bert(**hf_inputs(batch), output_hidden_states=True)
    hidden = np.stack([out.hidden_states[i].numpy() for i in LAYERS], axis=2)
    lengths = batch["input_mask"].sum(1)
    tokens = [tok.convert_ids_to_tokens(ids[:n]) for ids, n in zip(batch["input_ids"], lengths)]
    return tokens, [hidden[i, :n] for i, n in enumerate(lengths)], batch


@pytest.mark.shared_data
def test_jsonl_and_npz_equal_transformers_hidden_states(setup, tmp_path, capsys, monkeypatch):
    directory, hf_model, text = setup
    monkeypatch.setenv("BERTJAX_PROGRESS_SECONDS", "0")  # a progress line for every record
    args = [
        "--checkpoint",
        str(directory),
        "--input",
        str(text),
        "--layers=-1,0,1",
        "--max_seq_length=32",
        "--batch_size=2",
    ]
    main([*args, "--output", str(tmp_path / "f.jsonl")])
    main([*args, "--output", str(tmp_path / "f.npz")])
    err = capsys.readouterr().err
    assert "bertjax: extracting features: 5/5 lines (100%)" in err, err
    tokens, expected, batch = _reference(hf_model, directory, text, 32)
    records = [json.loads(line) for line in (tmp_path / "f.jsonl").read_text().splitlines()]
    assert [r["linex_index"] for r in records] == [0, 1, 2, 3, 4]
    assert [f["token"] for f in records[3]["features"]] == ["[CLS]", "[SEP]"]  # empty line
    worst = 0.0
    for record, toks, want in zip(records, tokens, expected):
        assert [f["token"] for f in record["features"]] == toks
        for t, feature in enumerate(record["features"]):
            assert [layer["index"] for layer in feature["layers"]] == LAYERS
            got = np.array([layer["values"] for layer in feature["layers"]])
            worst = max(worst, float(np.abs(got - want[t]).max()))
    assert worst < 1e-4, worst
    npz = np.load(tmp_path / "f.npz")
    assert npz["features"].shape == (5, 32, 3, 48) and npz["layers"].tolist() == LAYERS
    assert npz["lengths"].tolist() == [len(t) for t in tokens]
    for i, (toks, want) in enumerate(zip(tokens, expected)):
        assert npz["tokens"][i, : len(toks)].tolist() == toks
        np.testing.assert_allclose(npz["features"][i, : len(toks)], want, atol=1e-4)
        assert not npz["features"][i, len(toks) :].any()
    pair = batch["segment_ids"][1]
    assert npz["segment_ids"][1, : len(pair)].tolist() == pair.tolist() and pair.sum() > 0


def test_read_examples_and_layer_indices(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("one sentence\nleft side ||| right side\nno|||split\n", encoding="utf-8")
    assert read_examples(str(path)) == ["one sentence", ("left side", "right side"), "no|||split"]
    assert parse_layers("-1,-2,0,12", 12) == (-1, -2, 0, 12)
    with pytest.raises(ValueError, match=r"has 2 layers, so indices must lie in \[-3, 2\]"):
        parse_layers("-1,3", 2)
    with pytest.raises(ValueError, match="comma-separated integers"):
        parse_layers("last", 2)


@pytest.mark.shared_data
def test_bad_requests_write_nothing(setup, tmp_path):
    directory, _, text = setup
    out = tmp_path / "f.jsonl"
    base = ["--checkpoint", str(directory), "--input", str(text), "--output", str(out)]
    with pytest.raises(ValueError, match=r"--layers='-4'"):
        main([*base, "--layers=-4"])
    with pytest.raises(ValueError, match=r"sequence length 65 exceeds .*=64"):
        main([*base, "--layers=-1", "--max_seq_length=65"])
    assert list(tmp_path.iterdir()) == []
