"""GTE: bertjax.models.gte against transformers' GteModel / GteForMaskedLM /
GteForSequenceClassification / GteForTokenClassification on padded batches (tied and untied
decoders, no, one and two token types, GELU and SiLU MLPs, default and linear (NTK) RoPE schedules,
a gte-base-en-v1.5-wide model), the conversion table both ways through directories that
transformers loads, the original code's checkpoints (``model_type: "new"``, NTK RoPE, fused
projections), the presets against the released config.json files and transformers' parameter
counts, and continued pretraining from a transformers GTE directory."""

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
    torch_state,
)
from hf_random import randomize
from safetensors.numpy import load_file, save_file
from train_fixtures import write_vocab

import bertjax
from bertjax.convert import gte_hf, unflatten_params
from bertjax.models import gte
from bertjax.models.heads import SequenceClassifier, TokenClassifier

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

TOL = 1e-5
LENGTHS = (21, 14)  # a padded batch
NUM_LABELS = 3


def _ntk(base, factor, head_dim):
    """transformers' rope_parameters of the original code's NTK scaling (gte.ntk_rope)."""
    rope = gte.ntk_rope(base, factor, head_dim)
    return {**json.loads(rope["rope_scaling"]), "rope_theta": rope["rope_theta"]}


VARIANTS = {
    # gte-base-en-v1.5's layout: no token types, tied decoder, NTK-scaled RoPE, 4 heads
    "base-en": dict(num_attention_heads=4, type_vocab_size=0, rope_parameters=_ntk(500.0, 2.0, 12)),
    # gte-multilingual-base's: one token type, NTK factor 8, 2 heads of 24
    "multilingual": dict(num_attention_heads=2, rope_parameters=_ntk(200.0, 8.0, 24)),
    # an untied decoder, a SiLU MLP (the MLM transform stays GELU), two token types, 3 heads,
    # default RoPE and another LayerNorm eps
    "untied": dict(
        num_attention_heads=3,
        type_vocab_size=2,
        tie_word_embeddings=False,
        hidden_act="silu",
        layer_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
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
    )
    values.update(VARIANTS[variant], **extra)
    return transformers.GteConfig(**values)


def _batch(vocab: int, lengths=LENGTHS, seed: int = 0, types: int = 2):
    """ids, mask and token types (a second segment from position 8 when there are two types)."""
    rng = np.random.default_rng(seed)
    seq = max(lengths)
    ids = rng.integers(4, vocab, (len(lengths), seq)).astype(np.int32)
    mask = (np.arange(seq)[None, :] < np.array(lengths)[:, None]).astype(np.int32)
    ids[:, 0] = 2  # [CLS]
    segments = np.where((np.arange(seq)[None, :] >= 8) & (mask > 0) & (types > 1), 1, 0)
    return np.where(mask > 0, ids, 0), mask, segments.astype(np.int32)


def _small_words(model) -> None:
    """Word embeddings 0.125 N instead of hf_random's 0.5 N: the tied decoder reads them, and at
    0.5 N logits reach 15, where float32 alone moves transformers' own logits by 1.5e-5 from a
    float64 run (bertjax's by 1.1e-5); the embeddings' LayerNorm takes the scale out elsewhere."""
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(0.25)


@functools.cache
def _reference(variant: str):
    """HF ForMaskedLM, ForSequenceClassification and ForTokenClassification sharing one random
    encoder, their state dicts (transformers' module names) and outputs on the padded batch."""
    torch.manual_seed(0)
    hfc = _hf_config(variant)
    mlm = transformers.GteForMaskedLM(hfc).eval()
    randomize(mlm, seed=1)
    _small_words(mlm)
    ids, mask, types = _batch(hfc.vocab_size, types=hfc.type_vocab_size)
    out, logits, state = heads_on_one_encoder(
        mlm,
        {
            "clf": transformers.GteForSequenceClassification,
            "tok": transformers.GteForTokenClassification,
        },
        "gte.",
        ("gte.pooler.", "classifier."),
        torch_long(input_ids=ids, attention_mask=mask, token_type_ids=types),
    )
    if hfc.tie_word_embeddings:  # what save_pretrained writes: the tied decoder is dropped
        state["mlm"].pop("lm_head.decoder.weight")
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
    cfg = gte_hf.config_from_hf(ref["config"].to_dict())
    flat, heads = gte_hf.from_hf_tensors(cfg, ref["state"][which], f"hf-{which}")
    return cfg, flat, heads


def close(name, got, want, tol=TOL, report=None):
    assert_close(name, got, want, tol, report)


def _encoder_matches(cfg, out, mask, hidden, report):
    """The encoder's hidden states against transformers' at the real tokens."""
    real = mask.astype(bool)
    assert len(out.hidden_states) == len(hidden) == cfg.num_layers + 1
    for i, (got, want) in enumerate(zip(out.hidden_states, hidden)):
        close(f"hidden_states[{i}]", np.asarray(got)[real], want[real], report=report)


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
    assert cfg.type_vocab_size == ref["config"].type_vocab_size
    positions = np.array([[0, 5, 20, 13], [1, 8, 13, 3]], np.int32)
    out, full, at = encoder_and_mlm(cfg, unflatten_params(flat), ids, types, mask, positions)
    _encoder_matches(cfg, out, mask, ref["hidden"], diffs)
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


def test_released_width_matches_transformers():
    """gte-base-en-v1.5's widths, vocabulary and NTK RoPE (two of its twelve layers) on a padded
    batch: hidden states within 1e-5, MLM logits (up to 50 in size: 768-term sums in float32)
    within 1e-5 of their largest magnitude."""
    cfg = gte.get_preset("gte-base-en-v1.5", num_layers=2)
    torch.manual_seed(0)
    hf = transformers.GteForMaskedLM(
        transformers.GteConfig(**gte_hf.config_to_hf(cfg), attn_implementation="eager")
    ).eval()
    randomize(hf, seed=3)
    ids, mask, types = _batch(cfg.vocab_size, lengths=(19, 11), seed=2, types=1)
    with torch.no_grad():
        t_ids, t_mask = torch.from_numpy(ids).long(), torch.from_numpy(mask).long()
        out = hf(t_ids, attention_mask=t_mask, output_hidden_states=True)
    state = torch_state(hf)
    state.pop("lm_head.decoder.weight")
    flat, heads = gte_hf.from_hf_tensors(cfg, state, "hf")
    diffs: dict[str, float] = {}
    encoder_out, got, _ = encoder_and_mlm(cfg, unflatten_params(flat), ids, types, mask)
    _encoder_matches(cfg, encoder_out, mask, [h.numpy() for h in out.hidden_states], diffs)
    real = mask.astype(bool)
    want = out.logits.numpy()[real]
    scale = float(np.abs(want).max())
    close(
        "mlm_logits", np.asarray(got["mlm_logits"])[real], want, TOL * max(1.0, scale), report=diffs
    )
    print({k: f"{v:.1e}" for k, v in diffs.items()}, f"largest logit {scale:.1f}")


def test_ntk_rope_is_the_original_codes():
    """ntk_rope's frequencies equal the original code's NTKScalingRotaryEmbedding (the base
    times the factor, the frequencies divided by factor ** (2 / dim)) at the released settings."""
    for base, factor in ((500_000, 2.0), (160_000, 2.0), (20_000, 8.0)):
        dim = 64
        scaled = base * factor
        inv = 1.0 / (scaled ** (torch.arange(0, dim, 2).float() / dim))
        want = (inv / factor ** (2 / dim)).numpy()
        cfg = gte.GteConfig(**gte.ntk_rope(base, factor, dim))
        got, scale = cfg.rope()
        assert scale == 1.0
        np.testing.assert_allclose(got, want, rtol=2e-7)


@pytest.mark.parametrize("variant", ["base-en", "untied"])
def test_export_round_trip_loads_in_transformers(variant, tmp_path):
    ref = _reference(variant)
    inputs = torch_long(
        input_ids=ref["ids"], attention_mask=ref["mask"], token_type_ids=ref["types"]
    )
    converted = functools.partial(_converted, variant)
    exports_load_in_transformers(gte_hf, converted, ref, inputs, "gte.", tmp_path)


def _original_dir(path, model, ntk):
    """``model`` saved as Alibaba's original code writes it: config.json of model_type "new" with
    ``rope_theta`` + ``rope_scaling: {"type": "ntk"}`` (``ntk`` = (base, factor)) and its own
    names (save_pretrained's, under ``new.``: fused qkv_proj and up_gate_proj, attn_ln, ...)."""
    model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    saved = load_file(str(path / "model.safetensors"))
    assert any("qkv_proj" in k for k in saved) and any("up_gate_proj" in k for k in saved)
    renamed = {("new." + k[4:] if k.startswith("gte.") else k): v for k, v in saved.items()}
    save_file(renamed, str(path / "model.safetensors"), metadata={"format": "pt"})
    del config["rope_parameters"]
    config.update(
        model_type="new",
        architectures=[type(model).__name__.replace("Gte", "New")],
        rope_theta=ntk[0],
        rope_scaling={"type": "ntk", "factor": ntk[1]},
        position_embedding_type="rope",
        layer_norm_type="layer_norm",
        pack_qkv=True,
        unpad_inputs=False,
        logn_attention_scale=False,
    )
    (path / "config.json").write_text(json.dumps(config))


def test_original_checkpoints_load(tmp_path):
    """A directory of the original code (model_type "new", NTK RoPE, its names) loads to
    transformers' outputs of the same weights; unsupported original settings are one line."""
    ref = _reference("base-en")
    model = transformers.GteForMaskedLM(ref["config"]).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in ref["state"]["mlm"].items()}, False)
    _original_dir(tmp_path / "new", model, (500.0, 2.0))
    bert = bertjax.load_pretrained(str(tmp_path / "new"))
    assert bert.config == gte_hf.config_from_hf(ref["config"].to_dict())
    ids, mask, types = ref["ids"], ref["mask"], ref["types"]
    real = mask.astype(bool)
    got = np.asarray(bert(ids, segment_ids=types, input_mask=mask).mlm_logits)
    close("original mlm_logits", got[real], ref["logits"]["mlm"][real])
    original = json.loads((tmp_path / "new" / "config.json").read_text())
    for key, value, match in (
        ("rope_scaling", {"type": "ntk", "factor": 2.0, "mixed_b": 0.9}, "mixed NTK"),
        ("rope_scaling", {"type": "linear", "factor": 2.0}, "not one the original"),
        ("logn_attention_scale", True, "log-n attention"),
        ("layer_norm_type", "rms_norm", "RMSNorm"),
        ("position_embedding_type", "absolute", "absolute positions"),
    ):
        with pytest.raises(ValueError, match=match):
            gte_hf.config_from_hf({**original, key: value})


# The released checkpoints' config.json (model_type "new"), as the fine-tunes that name them in
# _name_or_path copy them.
RELEASED = {
    "gte-base-en-v1.5": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_attention_heads=12,
        num_hidden_layers=12,
        pad_token_id=0,
        rope_scaling={"factor": 2.0, "type": "ntk"},
        rope_theta=500000,
        type_vocab_size=0,
        vocab_size=30528,
    ),
    "gte-large-en-v1.5": dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_attention_heads=16,
        num_hidden_layers=24,
        pad_token_id=0,
        rope_scaling={"factor": 2.0, "type": "ntk"},
        rope_theta=160000,
        type_vocab_size=2,
        vocab_size=30528,
    ),
    "gte-multilingual-base": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_attention_heads=12,
        num_hidden_layers=12,
        pad_token_id=1,
        rope_scaling={"factor": 8.0, "type": "ntk"},
        rope_theta=20000,
        type_vocab_size=1,
        vocab_size=250048,
    ),
    "gte-multilingual-mlm-base": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_attention_heads=12,
        num_hidden_layers=12,
        pad_token_id=1,
        rope_scaling=None,
        rope_theta=160000,
        type_vocab_size=1,
        vocab_size=250048,
    ),
}
COMMON = dict(
    model_type="new",
    attention_probs_dropout_prob=0.0,
    hidden_act="gelu",
    hidden_dropout_prob=0.1,
    initializer_range=0.02,
    layer_norm_eps=1e-12,
    layer_norm_type="layer_norm",
    logn_attention_clip1=False,
    logn_attention_scale=False,
    max_position_embeddings=8192,
    pack_qkv=True,
    position_embedding_type="rope",
    torch_dtype="float32",
    unpad_inputs=False,
    use_memory_efficient_attention=False,
)
PARAMS = {  # the model cards' sizes, in millions
    "gte-base-en-v1.5": 137,
    "gte-large-en-v1.5": 434,
    "gte-multilingual-base": 305,
    "gte-multilingual-mlm-base": 305,
}


def test_presets_are_the_released_configs_and_counts():
    for name, values in RELEASED.items():
        cfg = gte.get_preset(name)
        assert gte_hf.config_from_hf({**COMMON, **values}) == cfg, name
        hf = transformers.GteConfig(**gte_hf.config_to_hf(cfg))
        assert gte_hf.config_from_hf(hf.to_dict()) == cfg, name
        with torch.device("meta"):
            encoder = transformers.GteModel(hf)
        count = sum(p.numel() for p in encoder.parameters())
        assert cfg.num_params(include_heads=False) == count, name
        assert round(count / 1e6) == PARAMS[name], (name, count)
    # transformers' defaults are GteConfig's
    assert gte_hf.config_from_hf(transformers.GteConfig().to_dict()) == gte.GteConfig()
    # the heads' parameter counts, tied and untied, and the sequence classifier's pooler
    small = gte.get_preset("gte-tiny", vocab_size=301)
    for tied, types in ((True, 0), (False, 2)):
        c = small.replace(tie_word_embeddings=tied, type_vocab_size=types)
        with torch.device("meta"):
            mlm = transformers.GteForMaskedLM(transformers.GteConfig(**gte_hf.config_to_hf(c)))
            clf = transformers.GteForSequenceClassification(
                transformers.GteConfig(**gte_hf.config_to_hf(c, ("pooler", "classifier")))
            )
        assert c.num_params() == sum(p.numel() for p in mlm.parameters())
        encoder = sum(p.numel() for n, p in clf.named_parameters() if n.startswith("gte."))
        assert c.num_params(include_heads=False, include_pooler=True) == encoder
    with pytest.raises(ValueError, match="no Hugging Face GTE class holds exactly"):
        gte_hf.hf_architecture(("qa",))
    with pytest.raises(ValueError, match="type_vocab_size=-1 must be >= 0"):
        gte.get_preset("gte-tiny", type_vocab_size=-1)
    with pytest.raises(ValueError, match="model_type='bert' is not 'gte'"):
        gte_hf.config_from_hf({"model_type": "bert"})


# ---------------------------------------------------------------------------------------------
# Through the user-facing paths
# ---------------------------------------------------------------------------------------------
def test_load_pretrained_and_continued_pretraining(tmp_path):
    """load_pretrained gives transformers' logits; hf -> bertjax -> hf is exact; pretraining from
    the directory starts from its weights (encoder and untied decoder, its layers scanned) and
    trains."""
    vocab = write_vocab(tmp_path / "vocab.txt")
    size = len(vocab.read_text().split())
    torch.manual_seed(0)
    model = transformers.GteForMaskedLM(_hf_config("untied", size)).eval()
    randomize(model, seed=4)
    model.save_pretrained(tmp_path / "hf")  # the original names, as transformers writes them
    ids, mask, types = _batch(size, seed=1)
    with torch.no_grad():
        t_ids, t_mask, t_types = (torch.from_numpy(a).long() for a in (ids, mask, types))
        want = model(t_ids, attention_mask=t_mask, token_type_ids=t_types).logits
    bert = bertjax.load_pretrained(str(tmp_path / "hf"))
    assert bert.config.architecture == "gte" and "mlm" in bert.heads
    real = mask.astype(bool)
    close(
        "load_pretrained",
        np.asarray(bert(ids, segment_ids=types, input_mask=mask).mlm_logits)[real],
        want.numpy()[real],
        1e-4,
    )
    cfg = pretrains_from_hf_dir(tmp_path, "gte", scan_layers=True)
    assert cfg.architecture == "gte" and not cfg.tie_word_embeddings
