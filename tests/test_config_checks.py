"""Errors that need only the config (and the init checkpoint) come before any data work: a key
that does not apply to the architecture, a vocabulary that is not the init checkpoint's, a sequence
longer than the position table. At real scale the data work takes hours."""

import pathlib

import pytest
from hf_random import random_bert_for_pretraining

from bertjax import train
from configs import base, glue

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(35))]


def _vocab(path: pathlib.Path, n: int) -> str:
    path.write_text("\n".join(WORDS[:n]) + "\n")
    return str(path)


def _demo_pretraining(tmp_path: pathlib.Path, **model):
    """The demo pretraining (a corpus to build, a vocabulary to train, data to prepare)."""
    c = base.get_config()
    c.data.demo_corpus = True
    c.data.vocab_size = 64
    for key, value in model.items():
        c.model[key] = value
    return c


def test_a_model_key_of_another_architecture_fails_before_preparing_data(tmp_path):
    c = _demo_pretraining(tmp_path, local_attention=64)  # a ModernBERT field on BERT
    with pytest.raises(ValueError, match="model.local_attention=64 does not apply"):
        train.prepared_task(c, str(tmp_path / "run"))
    assert not (tmp_path / "run" / "data").exists()  # no corpus, vocabulary or records written


def test_a_sequence_beyond_the_position_table_fails_before_preparing_data(tmp_path):
    c = _demo_pretraining(tmp_path, max_position_embeddings=64)
    c.data.max_seq_length = 128
    with pytest.raises(ValueError, match="data.max_seq_length=128 exceeds"):
        train.prepared_task(c, str(tmp_path / "run"))
    assert not (tmp_path / "run" / "data").exists()


@pytest.mark.parametrize("words", [30, 40])  # another size; the same size, other tokens
def test_another_vocabulary_than_the_init_checkpoints_fails_before_preparing_data(tmp_path, words):
    ckpt = tmp_path / "ckpt"
    random_bert_for_pretraining(ckpt, vocab_size=40)
    (ckpt / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    c = _demo_pretraining(tmp_path)
    c.init_checkpoint = str(ckpt)
    c.data.vocab = _vocab(tmp_path / "vocab.txt", words)
    if words == 40:
        (tmp_path / "vocab.txt").write_text("\n".join([*WORDS[:-1], "other"]) + "\n")
    match = "has 30 tokens but the init checkpoint" if words == 30 else "token 39 is 'other'"
    with pytest.raises(ValueError, match=match):
        train.prepared_task(c, str(tmp_path / "run"))
    assert not (tmp_path / "run" / "data").exists()


def test_finetuning_reports_a_bad_model_key_before_reading_its_data(tmp_path):
    c = glue.get_config()
    c.task = "glue/sst2"
    c.data.vocab = _vocab(tmp_path / "vocab.txt", 40)
    c.data_dir = str(tmp_path / "no-such-folder")  # reading the data would fail first
    c.model.local_attention = 8
    with pytest.raises(ValueError, match="model.local_attention=8 does not apply"):
        train.prepared_task(c, str(tmp_path / "run"))


@pytest.mark.parametrize("old", ["vocab", "do_lower_case"])
def test_finetuning_keys_of_bertjax_0_2_are_errors_naming_the_new_key(tmp_path, old):
    c = glue.get_config()
    c[old] = _vocab(tmp_path / "b.txt", 40) if old == "vocab" else True  # a config file's key
    c.data_dir = str(tmp_path)
    with pytest.raises(
        ValueError, match=f"^config key {old} was renamed data.{old} in bertjax 0.3"
    ):
        train.prepared_task(c, str(tmp_path / "run"))
