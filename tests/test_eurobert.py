"""EuroBERT: bertjax.models.eurobert against transformers' EuroBertModel / EuroBertForMaskedLM /
EuroBertForSequenceClassification (bos, mean and late pooling) / EuroBertForTokenClassification
on padded batches (grouped-query attention with 2 and 1 key-value heads, tied and untied
decoders, with and without biases), the conversion table both ways through directories that
transformers loads, an architecture bertjax lacks, and continued pretraining
from a transformers EuroBERT directory (fine-tuning: tests/test_family_fine_tuning.py)."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from helpers import (
    apply_flat,
    assert_close,
    exports_load_in_transformers,
    heads_on_one_encoder,
    pretrains_from_hf_dir,
    torch_long,
)
from hf_random import randomize
from train_fixtures import write_vocab

import bertjax
from bertjax.convert import eurobert_hf as ehf
from bertjax.convert import load_checkpoint
from bertjax.models import eurobert
from bertjax.models.heads import PreTrainingModel, SequenceClassifier, TokenClassifier

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

TOL = 1e-5
LENGTHS = (21, 14)  # a padded batch
NUM_LABELS = 3
VARIANTS = {
    # grouped-query attention (4 heads, 2 key-value heads), no biases, untied decoder, late pooling
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2, classifier_pooling="late"),
    # one key-value head, every bias, the decoder tied, mean pooling, another RoPE base
    "biased": dict(
        num_attention_heads=4,
        num_key_value_heads=1,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        classifier_pooling="mean",
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    ),
    # multi-head attention (3 of 3), [BOS] pooling, a GELU MLP, a linear RoPE schedule
    "mha": dict(
        num_attention_heads=3,
        num_key_value_heads=3,
        classifier_pooling="bos",
        hidden_act="gelu",
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
    ),
}


def _hf_config(variant: str, vocab_size: int = 301, **extra):
    values = dict(
        vocab_size=vocab_size,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        mask_token_id=3,
        num_labels=NUM_LABELS,
        attn_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    )
    values.update(VARIANTS[variant], **extra)
    return transformers.EuroBertConfig(**values)


def _batch(vocab: int, lengths=LENGTHS, seed: int = 0):
    rng = np.random.default_rng(seed)
    seq = max(lengths)
    ids = rng.integers(4, vocab, (len(lengths), seq)).astype(np.int32)
    mask = (np.arange(seq)[None, :] < np.array(lengths)[:, None]).astype(np.int32)
    ids[:, 0] = 1  # <|begin_of_text|>
    return np.where(mask > 0, ids, 0), mask


@functools.cache
def _reference(variant: str):
    """HF ForMaskedLM, ForSequenceClassification and ForTokenClassification sharing one random
    encoder, their state dicts and their outputs on the padded batch."""
    torch.manual_seed(0)
    hfc = _hf_config(variant)
    mlm = transformers.EuroBertForMaskedLM(hfc).eval()
    randomize(mlm, seed=1)
    ids, mask = _batch(hfc.vocab_size)
    out, logits, state = heads_on_one_encoder(
        mlm,
        {
            "clf": transformers.EuroBertForSequenceClassification,
            "tok": transformers.EuroBertForTokenClassification,
        },
        "model.",
        ("dense.", "classifier."),
        torch_long(input_ids=ids, attention_mask=mask),
    )
    if hfc.tie_word_embeddings:  # what save_pretrained writes: the tied decoder is dropped
        state["mlm"].pop("lm_head.weight")
    return dict(
        config=hfc,
        ids=ids,
        mask=mask,
        state=state,
        hidden=[h.numpy() for h in out.hidden_states],
        logits=logits,
    )


def _converted(variant: str, which: str):
    ref = _reference(variant)
    cfg = ehf.config_from_hf(ref["config"].to_dict())
    flat, heads = ehf.from_hf_tensors(cfg, ref["state"][which], f"hf-{which}")
    return cfg, flat, heads


def close(name, got, want, tol=TOL, report=None):
    assert_close(name, got, want, tol, report)


# ---------------------------------------------------------------------------------------------
# Numerical identity with transformers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_encoder_and_heads_match_transformers(variant):
    ref = _reference(variant)
    ids, mask = ref["ids"], ref["mask"]
    real = mask.astype(bool)

    cfg, flat, heads = _converted(variant, "mlm")
    assert heads == ("mlm",) and cfg.num_layers == 3
    assert cfg.kv_heads == VARIANTS[variant]["num_key_value_heads"]
    encoder_flat = {k[len("model/") :]: v for k, v in flat.items() if k.startswith("model/")}
    out = apply_flat(
        eurobert.EuroBertModel(cfg, add_pooler=False),
        encoder_flat,
        ids,
        None,
        mask,
        output_hidden_states=True,
    )
    assert len(out.hidden_states) == len(ref["hidden"]) == cfg.num_layers + 1
    for i, (got, want) in enumerate(zip(out.hidden_states, ref["hidden"])):
        close(f"{variant}/hidden_states[{i}]", np.asarray(got)[real], want[real])
    close(f"{variant}/last", np.asarray(out.sequence_output)[real], ref["hidden"][-1][real])

    model = PreTrainingModel(cfg, nsp=False)
    full = apply_flat(model, flat, ids, None, mask)
    close(f"{variant}/mlm_logits", np.asarray(full["mlm_logits"])[real], ref["logits"]["mlm"][real])
    positions = np.array([[0, 5, 20, 13], [1, 8, 13, 3]], np.int32)
    at = apply_flat(model, flat, ids, None, mask, positions)["mlm_logits"]
    want = np.take_along_axis(ref["logits"]["mlm"], positions[:, :, None], axis=1)
    close(f"{variant}/mlm_logits_at_positions", at, want)

    cfg, flat, heads = _converted(variant, "clf")
    assert heads == ("pooler", "classifier")
    logits = apply_flat(SequenceClassifier(cfg, num_labels=NUM_LABELS), flat, ids, None, mask)
    close(f"{variant}/classifier ({cfg.classifier_pooling})", logits, ref["logits"]["clf"])

    cfg, flat, heads = _converted(variant, "tok")
    assert heads == ("classifier",)
    logits = apply_flat(TokenClassifier(cfg, num_labels=NUM_LABELS), flat, ids, None, mask)
    close(f"{variant}/token_classifier", np.asarray(logits)[real], ref["logits"]["tok"][real])


@pytest.mark.parametrize("variant", ["gqa", "biased"])
def test_export_round_trip_loads_in_transformers(variant, tmp_path):
    ref = _reference(variant)
    inputs = torch_long(input_ids=ref["ids"], attention_mask=ref["mask"])
    converted = functools.partial(_converted, variant)
    exports_load_in_transformers(ehf, converted, ref, inputs, "model.", tmp_path)


def test_config_round_trip_presets_and_errors(tmp_path):
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, mask_token_id=3)
    cfg = eurobert.get_preset("eurobert-610m", vocab_size=1000, **ids)
    assert cfg.kv_heads == 6 and cfg.head_dim == 64
    hf = transformers.EuroBertConfig(**ehf.config_to_hf(cfg))
    assert hf.num_key_value_heads == 6 and hf.rope_parameters["rope_theta"] == 250_000.0
    assert ehf.config_from_hf(hf.to_dict()) == cfg
    # The published shapes: the parameter count is the transformers model's.
    small = cfg.replace(num_layers=2, vocab_size=64)
    with torch.device("meta"):
        ref = transformers.EuroBertForMaskedLM(
            transformers.EuroBertConfig(**ehf.config_to_hf(small))
        )
    assert small.num_params() == sum(p.numel() for p in ref.parameters())
    with pytest.raises(ValueError, match="num_kv_heads=5 does not divide num_heads=12"):
        eurobert.get_preset("eurobert-210m", num_kv_heads=5)
    with pytest.raises(ValueError, match="classifier_pooling='cls' is not one of"):
        ehf.config_from_hf({"model_type": "eurobert", "classifier_pooling": "cls"})
    with pytest.raises(ValueError, match="no Hugging Face EuroBERT class holds exactly the heads"):
        ehf.hf_architecture(("qa",))
    # An architecture bertjax does not have: one line naming it and the ones it has.
    folder = tmp_path / "roberta"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "roberta"}))
    from safetensors.numpy import save_file

    save_file({"x": np.zeros(1, np.float32)}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError) as info:
        load_checkpoint(str(folder))
    message = str(info.value)
    assert "\n" not in message and "model_type='roberta'" in message
    assert "'bert', 'modernbert', 'eurobert'" in message


# ---------------------------------------------------------------------------------------------
# Through the user-facing paths
# ---------------------------------------------------------------------------------------------
def _hf_dir(path, vocab_size: int, variant: str = "gqa"):
    torch.manual_seed(0)
    model = transformers.EuroBertForMaskedLM(_hf_config(variant, vocab_size)).eval()
    randomize(model, seed=4)
    model.save_pretrained(path)
    return model


def test_load_pretrained_and_continued_pretraining(tmp_path):
    """load_pretrained gives transformers' logits; hf -> bertjax -> hf is exact; pretraining from
    the directory starts from its weights (encoder and untied decoder, its layers scanned) and
    trains."""
    vocab = write_vocab(tmp_path / "vocab.txt")
    size = len(vocab.read_text().split())
    model = _hf_dir(tmp_path / "hf", size)
    ids, mask = _batch(size, seed=1)
    with torch.no_grad():
        want = model(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask)).logits
    bert = bertjax.load_pretrained(str(tmp_path / "hf"))
    assert bert.config.architecture == "eurobert" and "mlm" in bert.heads
    real = mask.astype(bool)
    close(
        "load_pretrained",
        np.asarray(bert(ids, input_mask=mask).mlm_logits)[real],
        want.numpy()[real],
        1e-4,
    )
    cfg = pretrains_from_hf_dir(tmp_path, "model", scan_layers=True)
    assert cfg.architecture == "eurobert" and cfg.kv_heads == 2 and cfg.scan_layers
