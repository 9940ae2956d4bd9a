"""Continued pretraining from a transformers ``BertForPreTraining`` directory: the encoder and BOTH
pretraining heads (MLM and NSP) come from the checkpoint, so the first loss is transformers' own."""

import logging

import jax
import numpy as np
import pytest
from hf_random import random_bert_for_pretraining
from train_fixtures import VOCAB_SIZE, read_metrics, tiny_config, write_vocab

from bertjax import train

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def _transformers_losses(model, batch) -> tuple[float, float]:
    """transformers' masked-LM and NSP losses on a bertjax pretraining batch."""
    ids = torch.tensor(np.asarray(batch["input_ids"]), dtype=torch.long)
    labels = torch.full_like(ids, -100)
    positions = np.asarray(batch["masked_lm_positions"])
    weights = np.asarray(batch["masked_lm_weights"])
    for row in range(ids.shape[0]):
        for p, label, w in zip(
            positions[row], np.asarray(batch["masked_lm_ids"])[row], weights[row]
        ):
            if w > 0:
                labels[row, int(p)] = int(label)
    with torch.no_grad():
        out = model(
            input_ids=ids,
            token_type_ids=torch.tensor(np.asarray(batch["segment_ids"]), dtype=torch.long),
            attention_mask=torch.tensor(np.asarray(batch["input_mask"]), dtype=torch.long),
        )
    ce = torch.nn.functional.cross_entropy
    mlm = ce(out.prediction_logits.reshape(-1, out.prediction_logits.shape[-1]), labels.reshape(-1))
    nsp_labels = torch.tensor(np.asarray(batch["next_sentence_labels"]).reshape(-1))
    nsp = ce(out.seq_relationship_logits, nsp_labels.long())
    return float(mlm), float(nsp)


def test_first_loss_from_bert_for_pretraining_equals_transformers(tmp_path, caplog):
    write_vocab(tmp_path / "vocab.txt")
    model = random_bert_for_pretraining(tmp_path / "hf", VOCAB_SIZE)
    c = tiny_config(tmp_path, steps=1)
    c.init_checkpoint = str(tmp_path / "hf")
    c.train.global_batch_size = 16  # the whole eval split (16 records) in one batch
    c.train.eval_every = 1
    c.train.eval_steps = 1
    with caplog.at_level(logging.INFO, logger="bertjax"):
        train.train_and_evaluate(c, str(tmp_path / "run"))
    first = read_metrics(tmp_path / "run", "eval")[0]
    assert first["step"] == 0
    task = train.prepared_task(c, str(tmp_path / "run"))
    setup = train.build(c, str(tmp_path / "run"), task)
    batch = next(task.eval_batches(setup.phases[0], 0, 1))
    mlm, nsp = _transformers_losses(model, batch)
    assert first["mlm_loss"] == pytest.approx(mlm, rel=1e-5)
    assert first["nsp_loss"] == pytest.approx(nsp, rel=1e-5)  # 3e-2 away with a fresh NSP head
    logged = [r.getMessage() for r in caplog.records if "started from" in r.getMessage()]
    assert "'predictions', 'seq_relationship'" in logged[0] and "fresh none" in logged[0]
    state = setup.init_state(jax.random.key_data(jax.random.key(0)))
    kernel = model.cls.seq_relationship.weight.detach().numpy().T
    np.testing.assert_allclose(state.params["seq_relationship"]["kernel"], kernel, rtol=1e-6)


def test_a_run_from_an_init_checkpoint_records_the_model_it_trained(tmp_path):
    """The config file names preset "tiny" (L2/H128), the init checkpoint is 2 x 32: the run's
    checkpoint records the 2 x 32 model it trained, so convert, load_pretrained and a run
    started from it rebuild that model (they failed: "missing 160 tensor(s)")."""
    from bertjax import convert
    from bertjax.pretrained import load_pretrained

    write_vocab(tmp_path / "vocab.txt")
    random_bert_for_pretraining(tmp_path / "hf", VOCAB_SIZE)
    c = tiny_config(tmp_path, steps=2)
    c.init_checkpoint = str(tmp_path / "hf")
    assert c.model.preset == "tiny"
    train.train_and_evaluate(c, str(tmp_path / "run"))
    ckpt = convert.load_checkpoint(str(tmp_path / "run"))
    assert (ckpt.config.hidden_size, ckpt.config.num_layers) == (32, 2)
    assert ckpt.heads == ("pooler", "mlm", "nsp")
    convert.save_checkpoint(ckpt, str(tmp_path / "export"), "hf")
    again = transformers.BertForPreTraining.from_pretrained(tmp_path / "export")
    assert again.config.hidden_size == 32
    loaded = load_pretrained(str(tmp_path / "run"))
    assert loaded.config.hidden_size == 32
    follow = tiny_config(tmp_path, steps=2)
    follow.init_checkpoint = str(tmp_path / "run")  # continued again from the run itself
    result = train.train_and_evaluate(follow, str(tmp_path / "run2"))
    assert result["step"] == 2 and np.isfinite(result["train"]["loss"])
