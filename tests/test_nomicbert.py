"""NomicBERT: bertjax.models.nomicbert against transformers' NomicBertModel / NomicBertForMaskedLM /
NomicBertForSequenceClassification / NomicBertForTokenClassification on padded batches with two
segments (tied and untied decoders, SiLU and GELU, default and linear RoPE schedules, one and two
token types), the conversion table both ways through directories that transformers loads, and
continued pretraining from a transformers NomicBERT directory."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from helpers import (
    apply_flat,
    assert_close,
    encoder_and_mlm,
    exports_load_in_transformers,
    heads_on_one_encoder,
    pretrains_from_hf_dir,
    torch_long,
)
from hf_random import randomize
from train_fixtures import write_vocab

import bertjax
from bertjax.convert import nomicbert_hf as nhf
from bertjax.convert import unflatten_params
from bertjax.models import nomicbert
from bertjax.models.heads import SequenceClassifier, TokenClassifier

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

TOL = 1e-5
LENGTHS = (21, 14)  # a padded batch
NUM_LABELS = 3
VARIANTS = {
    # the checkpoints' layout: tied decoder, SiLU, RoPE base 1000, two token types, 4 heads
    "tied": dict(num_attention_heads=4),
    # an untied decoder, a GELU MLP and transform, 3 heads, another base and LayerNorm eps
    "untied": dict(
        num_attention_heads=3,
        tie_word_embeddings=False,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    ),
    # 2 heads, one token type, a linear RoPE schedule
    "linear": dict(
        num_attention_heads=2,
        type_vocab_size=1,
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
        num_labels=NUM_LABELS,
        attn_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    values.update(VARIANTS[variant], **extra)
    return transformers.NomicBertConfig(**values)


def _batch(vocab: int, lengths=LENGTHS, seed: int = 0, types: int = 2):
    """ids, mask and token types (a second segment from position 8 when there are two types)."""
    rng = np.random.default_rng(seed)
    seq = max(lengths)
    ids = rng.integers(4, vocab, (len(lengths), seq)).astype(np.int32)
    mask = (np.arange(seq)[None, :] < np.array(lengths)[:, None]).astype(np.int32)
    ids[:, 0] = 2  # [CLS]
    segments = np.where((np.arange(seq)[None, :] >= 8) & (mask > 0) & (types > 1), 1, 0)
    return np.where(mask > 0, ids, 0), mask, segments.astype(np.int32)


@functools.cache
def _reference(variant: str):
    """HF ForMaskedLM, ForSequenceClassification and ForTokenClassification sharing one random
    encoder, their state dicts (as save_pretrained writes them) and outputs on the padded batch."""
    torch.manual_seed(0)
    hfc = _hf_config(variant)
    mlm = transformers.NomicBertForMaskedLM(hfc).eval()
    randomize(mlm, seed=1)
    if not hfc.tie_word_embeddings:  # the bias transformers' forward never reads: as exported
        with torch.no_grad():
            mlm.cls.predictions.bias.copy_(mlm.cls.predictions.decoder.bias)
    ids, mask, types = _batch(hfc.vocab_size, types=hfc.type_vocab_size)
    out, logits, state = heads_on_one_encoder(
        mlm,
        {
            "clf": transformers.NomicBertForSequenceClassification,
            "tok": transformers.NomicBertForTokenClassification,
        },
        "nomic_bert.",
        ("nomic_bert.pooler.", "classifier."),
        torch_long(input_ids=ids, attention_mask=mask, token_type_ids=types),
    )
    if hfc.tie_word_embeddings:  # what save_pretrained writes: the tied decoder is dropped
        state["mlm"].pop("cls.predictions.decoder.weight")
        state["mlm"].pop("cls.predictions.decoder.bias")
    return dict(
        config=hfc,
        ids=ids,
        mask=mask,
        types=types,
        state=state,
        hidden=[h.numpy() for h in out.hidden_states],
        logits=logits,
    )


def _converted(variant: str, which: str):
    ref = _reference(variant)
    cfg = nhf.config_from_hf(ref["config"].to_dict())
    flat, heads = nhf.from_hf_tensors(cfg, ref["state"][which], f"hf-{which}")
    return cfg, flat, heads


def close(name, got, want, tol=TOL, report=None):
    assert_close(name, got, want, tol, report)


# ---------------------------------------------------------------------------------------------
# Numerical identity with transformers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_encoder_and_heads_match_transformers(variant):
    ref = _reference(variant)
    ids, mask, types = ref["ids"], ref["mask"], ref["types"]
    real = mask.astype(bool)
    diffs: dict[str, float] = {}

    cfg, flat, heads = _converted(variant, "mlm")
    assert heads == ("mlm",) and cfg.num_layers == 3
    assert cfg.tie_word_embeddings == ("predictions/decoder" not in flat)
    positions = np.array([[0, 5, 20, 13], [1, 8, 13, 3]], np.int32)
    out, full, at = encoder_and_mlm(cfg, unflatten_params(flat), ids, types, mask, positions)
    assert len(out.hidden_states) == len(ref["hidden"]) == cfg.num_layers + 1
    for i, (got, want) in enumerate(zip(out.hidden_states, ref["hidden"])):
        close(f"hidden_states[{i}]", np.asarray(got)[real], want[real], report=diffs)
    close("last", np.asarray(out.sequence_output)[real], ref["hidden"][-1][real], report=diffs)

    want = ref["logits"]["mlm"][real]
    close("mlm_logits", np.asarray(full["mlm_logits"])[real], want, report=diffs)
    want = np.take_along_axis(ref["logits"]["mlm"], positions[:, :, None], axis=1)
    close("mlm_logits_at_positions", at, want, report=diffs)

    cfg, flat, heads = _converted(variant, "clf")
    assert heads == ("pooler", "classifier")
    logits = apply_flat(SequenceClassifier(cfg, num_labels=NUM_LABELS), flat, ids, types, mask)
    close("classifier", logits, ref["logits"]["clf"], report=diffs)

    cfg, flat, heads = _converted(variant, "tok")
    assert heads == ("classifier",)
    logits = apply_flat(TokenClassifier(cfg, num_labels=NUM_LABELS), flat, ids, types, mask)
    close("token_classifier", np.asarray(logits)[real], ref["logits"]["tok"][real], report=diffs)
    print(variant, {k: f"{v:.1e}" for k, v in diffs.items()})


@pytest.mark.parametrize("variant", ["tied", "untied"])
def test_export_round_trip_loads_in_transformers(variant, tmp_path):
    ref = _reference(variant)
    inputs = torch_long(
        input_ids=ref["ids"], attention_mask=ref["mask"], token_type_ids=ref["types"]
    )
    converted = functools.partial(_converted, variant)
    exports_load_in_transformers(nhf, converted, ref, inputs, "nomic_bert.", tmp_path)


def _original_keys(hf: dict) -> dict:
    """A transformers NomicBERT config.json as nomic-ai's own code writes it (GPT-2's key names,
    rotary_emb_*, activation_function, the bias and layout switches)."""
    act = {"silu": "swiglu", "gelu": "geglu"}[hf["hidden_act"]]
    return dict(
        model_type="nomic_bert",
        architectures=["NomicBertForPreTraining"],
        vocab_size=hf["vocab_size"],
        n_embd=hf["hidden_size"],
        n_head=hf["num_attention_heads"],
        n_layer=hf["num_hidden_layers"],
        n_inner=hf["intermediate_size"],
        n_positions=hf["max_position_embeddings"],
        layer_norm_epsilon=hf["layer_norm_eps"],
        initializer_range=hf["initializer_range"],
        type_vocab_size=hf["type_vocab_size"],
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        pad_token_id=hf["pad_token_id"],
        activation_function=act,
        rotary_emb_base=hf["rope_parameters"]["rope_theta"],
        rotary_emb_fraction=1.0,
        rotary_emb_interleaved=False,
        rotary_emb_scale_base=None,
        rotary_scaling_factor=None,
        qkv_proj_bias=False,
        mlp_fc1_bias=False,
        mlp_fc2_bias=False,
        prenorm=False,
        parallel_block=False,
        causal=False,
        pad_vocab_size_multiple=1,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )


@pytest.mark.parametrize("variant", ["tied", "untied"])
def test_original_config_keys_load(variant, tmp_path):
    """A directory whose config.json has the original code's keys (as nomic-ai/nomic-bert-2048's)
    loads as the transformers config does and gives transformers' logits; settings of that code
    which transformers does not compute are one-line errors."""
    ref = _reference(variant)
    model = transformers.NomicBertForMaskedLM(ref["config"]).eval()
    state = {k: torch.from_numpy(v) for k, v in ref["state"]["mlm"].items()}
    model.load_state_dict(state, strict=False)
    model.save_pretrained(tmp_path)  # the original weight names
    hf = json.loads((tmp_path / "config.json").read_text())
    original = _original_keys(hf)
    (tmp_path / "config.json").write_text(json.dumps(original))
    bert = bertjax.load_pretrained(str(tmp_path))
    assert bert.config == nhf.config_from_hf(hf)
    ids, mask, types = ref["ids"], ref["mask"], ref["types"]
    real = mask.astype(bool)
    got = np.asarray(bert(ids, segment_ids=types, input_mask=mask).mlm_logits)
    close("original keys mlm_logits", got[real], ref["logits"]["mlm"][real])
    padded = nhf.config_from_hf({**original, "vocab_size": 300, "pad_vocab_size_multiple": 64})
    assert padded.vocab_size == 320
    scaled = nhf.config_from_hf(
        {**original, "rotary_scaling_factor": 2.0, "max_trained_positions": 32}
    )
    assert json.loads(scaled.rope_scaling) == {"rope_type": "dynamic", "factor": 2.0}
    assert scaled.max_position_embeddings == 32
    for key, value in (
        ("rotary_emb_fraction", 0.5),
        ("qkv_proj_bias", True),
        ("prenorm", True),
        ("activation_function", "gelu"),
    ):
        with pytest.raises(ValueError, match=f"{key}=") as info:
            nhf.config_from_hf({**original, key: value})
        assert "\n" not in str(info.value)


def test_config_round_trip_presets_and_errors():
    cfg = nomicbert.get_preset("nomic-embed-text-v1.5")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.intermediate_size) == (
        12,
        768,
        12,
        3072,
    )
    assert cfg.vocab_size == 30528 and cfg.rope_theta == 1000.0 and cfg.tie_word_embeddings
    hf = transformers.NomicBertConfig(**nhf.config_to_hf(cfg))
    assert hf.rope_parameters["rope_theta"] == 1000.0
    assert nhf.config_from_hf(hf.to_dict()) == cfg
    # transformers' defaults are the nomic-embed-text-v1.5 shapes, as the preset's
    assert nhf.config_from_hf(transformers.NomicBertConfig().to_dict()) == cfg
    # The published shapes: the parameter counts are the transformers models'.
    small = cfg.replace(num_layers=2)
    for tied in (True, False):
        c = small.replace(tie_word_embeddings=tied)
        with torch.device("meta"):
            ref = transformers.NomicBertForMaskedLM(
                transformers.NomicBertConfig(**nhf.config_to_hf(c))
            )
            clf = transformers.NomicBertForSequenceClassification(
                transformers.NomicBertConfig(**nhf.config_to_hf(c, ("pooler", "classifier")))
            )
        want = sum(p.numel() for p in ref.parameters())
        assert c.num_params() + (0 if tied else c.vocab_size) == want  # + the unread bias
        encoder = sum(p.numel() for n, p in clf.named_parameters() if n.startswith("nomic_bert."))
        assert c.num_params(include_heads=False, include_pooler=True) == encoder
    with pytest.raises(ValueError, match="head_dim=32 is not hidden_size"):
        nhf.config_from_hf({"model_type": "nomic_bert", "head_dim": 32})
    with pytest.raises(ValueError, match="no Hugging Face NomicBERT class holds exactly"):
        nhf.hf_architecture(("qa",))
    with pytest.raises(ValueError, match="gives an odd head_dim"):
        nomicbert.get_preset("nomicbert-tiny", hidden_size=132, num_heads=4)


# ---------------------------------------------------------------------------------------------
# Through the user-facing paths
# ---------------------------------------------------------------------------------------------
def _hf_dir(path, vocab_size: int, variant: str = "untied"):
    torch.manual_seed(0)
    model = transformers.NomicBertForMaskedLM(_hf_config(variant, vocab_size)).eval()
    randomize(model, seed=4)
    model.save_pretrained(path)
    return model


def test_load_pretrained_and_continued_pretraining(tmp_path):
    """load_pretrained gives transformers' logits; hf -> bertjax -> hf is exact; pretraining from
    the directory starts from its weights (encoder and untied decoder) and trains."""
    vocab = write_vocab(tmp_path / "vocab.txt")
    size = len(vocab.read_text().split())
    model = _hf_dir(tmp_path / "hf", size)
    ids, mask, types = _batch(size, seed=1)
    with torch.no_grad():
        t_ids, t_mask, t_types = (torch.from_numpy(a).long() for a in (ids, mask, types))
        want = model(t_ids, attention_mask=t_mask, token_type_ids=t_types).logits
    bert = bertjax.load_pretrained(str(tmp_path / "hf"))
    assert bert.config.architecture == "nomicbert" and "mlm" in bert.heads
    real = mask.astype(bool)
    close(
        "load_pretrained",
        np.asarray(bert(ids, segment_ids=types, input_mask=mask).mlm_logits)[real],
        want.numpy()[real],
        1e-4,
    )
    cfg = pretrains_from_hf_dir(tmp_path, "nomic_bert")
    assert cfg.architecture == "nomicbert" and not cfg.tie_word_embeddings
