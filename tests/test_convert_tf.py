"""Original Google BERT checkpoints: names as in google-research/bert, equality with transformers.

The TF checkpoint is built from a transformers BertForPreTraining with a name table written
independently here (not the library's), including Adam slots and global_step as real pretraining
checkpoints have them.
"""

import json
import shutil

import numpy as np
import pytest
from helpers import TOL, make_hf_model, max_differences, sample_batch, torch_outputs

from bertjax.convert import load_checkpoint
from bertjax.convert import main as convert_main
from bertjax.convert.tf import read_tf_checkpoint, write_tf_checkpoint
from bertjax.pretrained import load_pretrained


def original_tensors(hf_model) -> dict[str, np.ndarray]:
    """HF state dict -> the google-research/bert variable names and layouts."""
    out = {}
    for name, tensor in hf_model.state_dict().items():
        if name.startswith("cls.predictions.decoder") or name.endswith("position_ids"):
            continue
        x = tensor.detach().numpy()
        tf_name = name.replace(".", "/").replace("layer/", "layer_")
        renames = {
            "cls/predictions/bias": "cls/predictions/output_bias",
            "cls/seq_relationship/weight": "cls/seq_relationship/output_weights",  # [2, hidden]
            "cls/seq_relationship/bias": "cls/seq_relationship/output_bias",
        }
        if tf_name in renames:
            tf_name = renames[tf_name]
        elif tf_name.endswith("LayerNorm/weight"):
            tf_name = tf_name[: -len("weight")] + "gamma"
        elif tf_name.endswith("LayerNorm/bias"):
            tf_name = tf_name[: -len("bias")] + "beta"
        elif tf_name.endswith("_embeddings/weight"):
            tf_name = tf_name[: -len("/weight")]
        elif tf_name.endswith("/weight"):
            tf_name, x = tf_name[: -len("weight")] + "kernel", x.T  # Linear [out, in] -> [in, out]
        out[tf_name] = np.ascontiguousarray(x)
    return out


@pytest.fixture(scope="module")
def google_checkpoint(tmp_path_factory, uncased_vocab):
    """A directory in the original release layout: bert_config.json, bert_model.ckpt.*, vocab."""
    hf_dir = tmp_path_factory.mktemp("hf")
    hf_model = make_hf_model(hf_dir, uncased_vocab, seed=1)
    tensors = original_tensors(hf_model)
    assert "bert/encoder/layer_1/attention/self/query/kernel" in tensors
    assert tensors["cls/seq_relationship/output_weights"].shape == (2, 48)
    directory = tmp_path_factory.mktemp("google")
    with_optimizer = dict(tensors)
    for name in list(tensors)[:3]:  # Adam slots and the step counter are skipped on load
        with_optimizer[f"{name}/adam_m"] = np.zeros_like(tensors[name])
        with_optimizer[f"{name}/adam_v"] = np.ones_like(tensors[name])
    with_optimizer["global_step"] = np.array(1000, np.int64)
    write_tf_checkpoint(str(directory / "bert_model.ckpt"), with_optimizer)
    config = json.loads((hf_dir / "config.json").read_text())
    keys = (
        "attention_probs_dropout_prob",
        "hidden_act",
        "hidden_dropout_prob",
        "hidden_size",
        "initializer_range",
        "intermediate_size",
        "max_position_embeddings",
        "num_attention_heads",
        "num_hidden_layers",
        "type_vocab_size",
        "vocab_size",
    )
    (directory / "bert_config.json").write_text(json.dumps({k: config[k] for k in keys}))
    shutil.copy(hf_dir / "vocab.txt", directory / "vocab.txt")
    return directory, hf_dir, hf_model, tensors


def test_writer_keeps_the_original_names(google_checkpoint):
    tf = pytest.importorskip("tensorflow")
    directory, _, _, tensors = google_checkpoint
    listed = dict(tf.train.list_variables(str(directory / "bert_model.ckpt")))
    assert listed["global_step"] == []
    assert listed["cls/seq_relationship/output_weights"] == [2, 48]
    assert listed["bert/encoder/layer_0/intermediate/dense/kernel"] == [48, 80]
    model_vars = {k: v for k, v in listed.items() if not k.endswith(("adam_m", "adam_v"))}
    assert sorted(model_vars) == sorted([*tensors, "global_step"])


@pytest.mark.shared_data
def test_google_checkpoint_matches_transformers(google_checkpoint, shared_data):
    directory, _, hf_model, _ = google_checkpoint
    model = load_pretrained(str(directory))
    assert model.missing == () and model.config.type_vocab_size == 3
    batch = sample_batch(model, shared_data)
    diffs = max_differences(model, batch, torch_outputs(hf_model, batch))
    assert set(diffs) == {"sequence_output", "pooled_output", "mlm_logits", "nsp_logits"}
    assert max(diffs.values()) < TOL, diffs


def test_hf_to_tf_gives_the_original_names_and_values(google_checkpoint, tmp_path):
    directory, hf_dir, _, tensors = google_checkpoint
    convert_main(["--from=hf", str(hf_dir), "--to=tf", str(tmp_path / "tf")])
    written = read_tf_checkpoint(str(tmp_path / "tf" / "bert_model.ckpt"))
    assert sorted(written) == sorted(tensors)
    for name, value in tensors.items():
        assert written[name].dtype == value.dtype and np.array_equal(written[name], value), name
    config = json.loads((tmp_path / "tf" / "bert_config.json").read_text())
    assert config == json.loads((directory / "bert_config.json").read_text())
    # and back: tf -> bertjax -> hf reproduces the transformers weights bit for bit
    convert_main([str(tmp_path / "tf"), "--to=bertjax", str(tmp_path / "bj")])
    a, b = load_checkpoint(str(hf_dir)), load_checkpoint(str(tmp_path / "bj"))
    assert sorted(a.tensors) == sorted(b.tensors)
    assert all(a.tensors[k].tobytes() == b.tensors[k].tobytes() for k in a.tensors)


def test_missing_and_unknown_variables_are_listed(google_checkpoint, tmp_path):
    directory, _, _, tensors = google_checkpoint
    broken = dict(tensors)
    broken.pop("bert/pooler/dense/bias")
    broken["bert/encoder/layer_0/attention/self/rotary"] = np.zeros((4,), np.float32)
    broken["bert/embeddings/word_embeddings"] = tensors["bert/embeddings/word_embeddings"][:-1]
    src = tmp_path / "src"
    src.mkdir()
    write_tf_checkpoint(str(src / "bert_model.ckpt"), broken)
    shutil.copy(directory / "bert_config.json", src / "bert_config.json")
    with pytest.raises(ValueError) as err:
        convert_main([str(src), "--to=hf", str(tmp_path / "out")])
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(src / "bert_model.ckpt"))
    assert "missing 1 tensor(s): bert/pooler/dense/bias [48]" in message
    assert "unexpected 1 tensor(s): bert/encoder/layer_0/attention/self/rotary [4]" in message
    assert "bert/embeddings/word_embeddings [1000, 48] (config implies [1001, 48])" in message
    assert not (tmp_path / "out").exists()


def test_config_errors_name_the_file(google_checkpoint, tmp_path):
    directory, _, _, _ = google_checkpoint
    shutil.copytree(directory, tmp_path / "src")
    config = json.loads((tmp_path / "src" / "bert_config.json").read_text())
    config["hidden_act"] = "tanh"
    (tmp_path / "src" / "bert_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"bert_config.json: hidden_act 'tanh' is not one of"):
        load_pretrained(str(tmp_path / "src"))
    del config["num_hidden_layers"]
    (tmp_path / "src" / "bert_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"missing config key\(s\) \['num_hidden_layers'\]"):
        load_pretrained(str(tmp_path / "src"))
