"""ModernBERT through bertjax's user-facing paths: ``load_pretrained`` and ``convert`` on a
directory written by transformers, and continued pretraining from it."""

import jax
import numpy as np
import pytest
from train_fixtures import read_metrics, tiny_config, write_prepared, write_vocab

import bertjax
from bertjax import train
from bertjax.commands.mlm_eval import evaluate_mlm
from bertjax.convert import load_checkpoint, save_checkpoint
from bertjax.data import pipeline

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def _hf_dir(path, vocab_size=40, **extra):
    """A random transformers ModernBertForMaskedLM (odd sizes, window shorter than the input)."""
    config = transformers.ModernBertConfig(
        vocab_size=vocab_size,
        hidden_size=48,
        num_hidden_layers=2,  # a global and a local layer
        num_attention_heads=3,
        intermediate_size=56,
        max_position_embeddings=64,
        global_attn_every_n_layers=2,
        local_attention=6,
        pad_token_id=0,
        cls_token_id=2,
        sep_token_id=3,
        bos_token_id=2,
        eos_token_id=3,
        **extra,
    )
    torch.manual_seed(0)
    model = transformers.ModernBertForMaskedLM(config).eval()
    model.save_pretrained(path)
    return model


def _batch(vocab_size):
    rng = np.random.default_rng(0)
    ids = rng.integers(5, vocab_size, (2, 20)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, 13:] = 0
    ids[1, 13:] = 0
    return ids, mask


def _torch_logits(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    return out.logits.numpy()


def test_load_pretrained_matches_transformers_and_converts_both_ways(tmp_path):
    model = _hf_dir(tmp_path / "hf")
    ids, mask = _batch(40)
    want = _torch_logits(model, ids, mask)
    bert = bertjax.load_pretrained(str(tmp_path / "hf"))
    assert bert.config.architecture == "modernbert" and "mlm" in bert.heads
    got = np.asarray(bert(ids, input_mask=mask).mlm_logits)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-4)
    # hf -> bertjax -> hf: transformers loads the result and computes the same logits
    save_checkpoint(load_checkpoint(str(tmp_path / "hf")), str(tmp_path / "bj"), "bertjax")
    save_checkpoint(load_checkpoint(str(tmp_path / "bj")), str(tmp_path / "back"), "hf")
    again = transformers.ModernBertForMaskedLM.from_pretrained(tmp_path / "back").eval()
    np.testing.assert_allclose(_torch_logits(again, ids, mask)[real], want[real], atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_continued_pretraining_starts_from_the_checkpoint(tmp_path, tied):
    """pretrain --config.init_checkpoint=<HF ModernBERT>: step-0 MLM loss equals the checkpoint's
    own loss on the same batch, and training goes on from there (the decoder tied to the word
    embeddings or, tie_word_embeddings=False, its own, predictions/decoder)."""
    vocab = write_vocab(tmp_path / "vocab.txt")
    size = len(vocab.read_text().split())
    _hf_dir(tmp_path / "hf", vocab_size=size, tie_word_embeddings=tied)
    c = tiny_config(tmp_path, steps=2)
    c.init_checkpoint = str(tmp_path / "hf")
    c.data.nsp = False
    c.model.preset = "base"  # ignored: the checkpoint defines the architecture
    c.train.eval_every = 1
    c.train.eval_steps = 1
    train.train_and_evaluate(c, str(tmp_path / "run"))
    first = read_metrics(tmp_path / "run", "eval")[0]
    task = train.prepared_task(c, str(tmp_path / "run"))
    setup = train.build(c, str(tmp_path / "run"), task)
    assert setup.model.config.architecture == "modernbert"
    assert setup.model.config.num_layers == 2
    assert np.isfinite(first["mlm_loss"]) and first["step"] == 0
    state = setup.init_state(jax.random.key_data(jax.random.key(0)))
    want = task.source.pretrained.params
    assert ("decoder" in state.params["predictions"]) == (not tied)
    for head in ("model", "predictions"):  # the encoder and the MLM head come from the checkpoint
        for a, b in zip(jax.tree.leaves(want[head]), jax.tree.leaves(state.params[head])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_context_extension_phase_changes_the_rope_base_not_the_params(tmp_path):
    """data.phases with model options: phase 2 trains the same params with a larger global RoPE
    base (ModernBERT's context extension), and a checkpoint of each phase loads with that phase's
    base; an option that changes parameter shapes is refused."""
    c = tiny_config(tmp_path, steps=4)
    write_prepared(tmp_path / "prepared" / "seq16")
    write_prepared(tmp_path / "prepared" / "seq32", seq=32, pred=6)
    c.model.architecture = "modernbert"
    c.model.preset = "modernbert-tiny"
    c.model.num_layers = 2  # a global and a local layer (the preset's 4: twice the compiles)
    c.model.max_position_embeddings = None
    c.model.global_rope_theta = 10_000.0
    c.data.phases = (
        dict(until_step=2, max_seq_length=16, max_predictions_per_seq=3),
        dict(
            until_step=4,
            max_seq_length=32,
            max_predictions_per_seq=6,
            model=dict(global_rope_theta=160_000.0),
        ),
    )
    task = train.prepared_task(c, str(tmp_path / "run"))
    setup = train.build(c, str(tmp_path / "run"), task)
    first, second = (train.phase_setup(setup, p) for p in setup.phases)
    assert first.model.config.global_rope_theta == 10_000.0
    assert second.model.config.global_rope_theta == 160_000.0
    # each phase's checkpoint records that phase's base (both used to load with the config
    # file's): stop at the phase boundary (no step of phase 2 before the halt), then resume
    c.train.checkpoint_every = 2
    c.train.stop_at_step = 2
    assert train.train_and_evaluate(c, str(tmp_path / "run"))["step"] == 2
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2"]
    assert load_checkpoint(str(tmp_path / "run")).config.global_rope_theta == 10_000.0
    assert bertjax.load_pretrained(str(tmp_path / "run")).config.global_rope_theta == 10_000.0
    c.train.stop_at_step = 0
    result = train.train_and_evaluate(c, str(tmp_path / "run"))  # resumes into phase 2
    assert result["step"] == 4 and np.isfinite(result["train"]["loss"])
    assert load_checkpoint(str(tmp_path / "run")).config.global_rope_theta == 160_000.0
    bad = task.phases()[1]
    bad.options["model"] = dict(num_layers=1)
    with pytest.raises(ValueError, match="change the parameters"):
        train.phase_setup(setup, bad)


def test_evaluate_mlm_compares_checkpoints_on_the_same_records(tmp_path):
    """evaluate-mlm of a transformers ModernBERT on prepared records equals the loss computed
    from transformers' own logits at the masked positions."""
    vocab = write_vocab(tmp_path / "vocab.txt")
    size = len(vocab.read_text().split())
    model = _hf_dir(tmp_path / "hf", vocab_size=size)
    data = write_prepared(tmp_path / "prepared")
    got = evaluate_mlm(str(tmp_path / "hf"), str(data), batch_size=8)
    batches = pipeline.PretrainingData(
        str(data),
        "eval",
        8,
        seed=0,
        process_index=0,
        process_count=1,
        repeat=False,
        shuffle=False,
        drop_remainder=False,
    )
    nll, weight = 0.0, 0.0
    for b in batches:
        logits = _torch_logits(model, b["input_ids"].astype(np.int64), b["input_mask"])
        logp = torch.log_softmax(torch.tensor(logits), -1).numpy()  # [b, seq, vocab]
        at = np.take_along_axis(logp, b["masked_lm_positions"][..., None], 1)  # [b, k, vocab]
        picked = np.take_along_axis(at, b["masked_lm_ids"][..., None], -1)[..., 0]  # [b, k]
        nll -= float((picked * b["masked_lm_weights"]).sum())
        weight += float(b["masked_lm_weights"].sum())
    np.testing.assert_allclose(got["mlm_loss"], nll / weight, rtol=1e-4)
    assert got["masked_positions"] == int(weight)
