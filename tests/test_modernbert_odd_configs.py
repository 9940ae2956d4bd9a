"""ModernBERT checkpoints with odd transformers configs, each a case where bertjax once refused
the checkpoint or differed from transformers: written by transformers itself, loaded by
``bertjax.load_pretrained``, converted by the ``bertjax convert`` command (to bertjax and back to
transformers), outputs equal to transformers' PyTorch classes (their default SDPA attention)
within 1e-4 in fp32 at every position of a padded batch longer than the sliding window, padding
included, and the export loaded by transformers with no missing or unexpected tensor."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_random import randomize

import bertjax
from bertjax.convert import load_checkpoint, modernbert_hf, unflatten_params
from bertjax.convert import main as convert_main
from bertjax.layers import rope
from bertjax.models.heads import MultipleChoice

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
SEQ = 16  # rows of 16, 3 and 11 tokens: every window (local_attention 4) is shorter
BASE = dict(
    vocab_size=37,
    hidden_size=16,
    num_hidden_layers=3,
    num_attention_heads=2,
    intermediate_size=19,
    max_position_embeddings=SEQ,
    global_attn_every_n_layers=2,
    local_attention=4,
    pad_token_id=0,
    cls_token_id=1,
    sep_token_id=2,
    bos_token_id=1,
    eos_token_id=2,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
ROPES = {  # transformers' rope_parameters of the full / sliding layers
    "yarn+linear": (
        {**YARN, "rope_theta": 1000.0, "beta_fast": 8.0, "beta_slow": 2.0},
        {"rope_type": "linear", "factor": 2.5, "rope_theta": 50.0},
    ),
    "llama3+dynamic": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 4,
            "rope_theta": 500.0,
        },
        {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 20.0},
    ),
    "longrope+proportional": (  # long factors: the inputs are longer than 8 positions
        {
            "rope_type": "longrope",
            "short_factor": [1.0, 1.5, 2.0, 2.5],
            "long_factor": [3.0, 1.0, 4.0, 5.0],
            "original_max_position_embeddings": 8,
            "rope_theta": 300.0,
        },
        {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 40.0},
    ),
}


def _rope(name):
    full, sliding = ROPES[name]
    return dict(rope_parameters={"full_attention": full, "sliding_attention": sliding})


def _offset_embeddings(model) -> None:
    """Token embeddings 37 + k/32 (|k| <= 8): a large common offset over a small spread, every
    LayerNorm sum exact in fp32 (Flax's fast E[x^2] - E[x]^2 loses most digits of the variance)."""
    weight = model.get_input_embeddings().weight
    k = torch.randint(-8, 9, weight.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        weight.copy_(37.0 + k / 32.0)


CASES = {  # name -> (transformers class, config changes, change to the random weights)
    # tie_word_embeddings=False: the MLM decoder is a tensor of its own (was refused, for every
    # class, even those without a decoder).
    "untied_decoder": ("ModernBertForMaskedLM", dict(tie_word_embeddings=False), None),
    "untied_regression": (
        "ModernBertForSequenceClassification",
        dict(tie_word_embeddings=False, num_labels=1, problem_type="regression"),
        None,
    ),
    # layer_types other than "global every n layers from layer 0" (were refused).
    "layer_types": (
        "ModernBertModel",
        dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2),
        None,
    ),
    "all_sliding": ("ModernBertForMaskedLM", dict(layer_types=["sliding_attention"] * 3), None),
    # RoPE scaling types (were refused).
    **{f"rope_{k}": ("ModernBertModel", _rope(k), None) for k in ROPES},
    # activations of transformers' ACT2FN beyond gelu / tanh-gelu / relu / silu (were refused).
    "activations": (
        "ModernBertForSequenceClassification",
        dict(hidden_activation="quick_gelu", classifier_activation="mish", num_labels=3),
        None,
    ),
    "activations_mlm": (
        "ModernBertForMaskedLM",
        dict(hidden_activation="gelu_fast", classifier_activation="relu2"),
        None,
    ),
    # No pad token: the export wrote bertjax's default 50283, which transformers refused.
    "no_pad_token": ("ModernBertForMaskedLM", dict(pad_token_id=None), None),
    # A large common offset in the embeddings: Flax's E[x^2] - E[x]^2 variance lost every digit
    # of the LayerNorm statistics (PyTorch takes E[(x - E[x])^2]).
    "large_mean": ("ModernBertModel", dict(norm_eps=1e-6), _offset_embeddings),
    # Everything odd at once, the default window / layer counts.
    "broad": (
        "ModernBertForSequenceClassification",
        dict(
            vocab_size=29,
            hidden_size=24,
            num_attention_heads=3,
            intermediate_size=7,
            num_hidden_layers=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"]
            + ["sliding_attention", "full_attention"],
            local_attention=5,
            num_labels=4,
            classifier_pooling="mean",
            norm_bias=True,
            attention_bias=True,
            mlp_bias=True,
            classifier_bias=True,
            tie_word_embeddings=False,
            hidden_activation="gelu_new",
            classifier_activation="silu",
            pad_token_id=None,
            cls_token_id=3,
            sep_token_id=4,
            **_rope("yarn+linear"),
        ),
        None,
    ),
}


def _hf_model(cls: str, extra: dict, change=None, seed: int = 0):
    """A random transformers model with O(1) activations (HF's 0.02 init is near the identity)."""
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(transformers.ModernBertConfig(**{**BASE, **extra}))
    randomize(model, seed)
    if change is not None:
        change(model)
    return model.eval()


def _batch(vocab: int, lengths=(SEQ, 3, 11), left: bool = False):
    rng = np.random.default_rng(0)
    ids = rng.integers(5, vocab, (len(lengths), SEQ))
    mask = (np.arange(SEQ)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    ids[:, 0] = 1
    if left:
        ids, mask = ids[:, ::-1].copy(), mask[:, ::-1].copy()
    return np.where(mask > 0, ids, 0), mask


def _hf_outputs(model, ids, mask) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
    return (out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits).numpy()


def _bertjax_outputs(pretrained, cls: str, ids, mask) -> np.ndarray:
    out = pretrained(ids, input_mask=mask)
    if cls == "ModernBertModel":
        return np.asarray(out.sequence_output)
    return np.asarray(out.mlm_logits if cls == "ModernBertForMaskedLM" else out.logits)


def _convert(*args) -> None:
    convert_main([str(a) for a in args])  # what `bertjax convert ARGS` runs


def _max_diff(got, want) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)))


@pytest.mark.parametrize("case", list(CASES))
def test_odd_checkpoint_loads_converts_and_exports_exactly(case, tmp_path):
    cls, extra, change = CASES[case]
    model = _hf_model(cls, extra, change)
    shards = dict(max_shard_size="4KB") if case == "broad" else {}
    if case == "broad":  # saved in bfloat16 and sharded; compared in fp32
        model = model.to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf", **shards)
    reference = getattr(transformers, cls).from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ids, mask = _batch(reference.config.vocab_size)
    want = _hf_outputs(reference.eval(), ids, mask)

    got = _bertjax_outputs(bertjax.load_pretrained(str(tmp_path / "hf")), cls, ids, mask)
    if got.ndim == 3:  # per token: the tokens first, then every position, padding included
        diff = _max_diff(got[mask > 0], want[mask > 0])
        assert diff <= TOL, f"{case}: max abs difference {diff:.2e} at the tokens"
    diff = _max_diff(got, want)
    assert diff <= TOL, f"{case}: max abs difference {diff:.2e}"

    # hf -> bertjax -> hf and hf -> hf with the command: transformers loads the same model.
    _convert("--to=bertjax", tmp_path / "hf", tmp_path / "bertjax")
    _convert("--to=hf", tmp_path / "bertjax", tmp_path / "back")
    _convert("--to=hf", tmp_path / "hf", tmp_path / "direct")
    state = reference.state_dict()
    for out in ("back", "direct"):
        loaded, info = getattr(transformers, cls).from_pretrained(
            tmp_path / out, dtype=torch.float32, output_loading_info=True
        )
        assert not any(info.values()), info
        assert loaded.config.layer_types == reference.config.layer_types
        assert loaded.config.rope_parameters == reference.config.rope_parameters
        assert loaded.config.tie_word_embeddings == reference.config.tie_word_embeddings
        for name, value in loaded.state_dict().items():
            torch.testing.assert_close(value, state[name], rtol=0, atol=0, msg=name)
        np.testing.assert_allclose(_hf_outputs(loaded.eval(), ids, mask), want, rtol=0, atol=1e-6)


def test_padding_that_sees_no_key_matches_sdpa(tmp_path):
    """A padding query farther than the window from every token sees no key in sliding-window
    layers (a row of padding alone, none in any layer). PyTorch's SDPA, transformers' default,
    gives it a zero context; its eager attention an average of every value: they differ there,
    and bertjax follows the default."""
    model = _hf_model("ModernBertForMaskedLM", {})
    model.save_pretrained(tmp_path / "hf")
    ids, mask = _batch(37, lengths=(SEQ, 3, 0))
    pad = mask == 0
    outs = {
        impl: _hf_outputs(
            transformers.ModernBertForMaskedLM.from_pretrained(
                tmp_path / "hf", attn_implementation=impl
            ).eval(),
            ids,
            mask,
        )
        for impl in ("sdpa", "eager")
    }
    assert _max_diff(outs["eager"][pad], outs["sdpa"][pad]) > 0.1  # implementation-defined
    pretrained = bertjax.load_pretrained(str(tmp_path / "hf"))
    got = _bertjax_outputs(pretrained, "ModernBertForMaskedLM", ids, mask)
    assert _max_diff(got, outs["sdpa"]) <= TOL


def test_multiple_choice_pools_the_first_token_of_left_padded_choices(tmp_path):
    """transformers' ModernBertForMultipleChoice pools (cls) at attention_mask.argmax(-1): the
    first token of a left-padded choice (bertjax read position 0, padding)."""
    cls = "ModernBertForMultipleChoice"
    model = _hf_model(cls, dict(num_labels=1))
    model.save_pretrained(tmp_path / "hf")
    ids, mask = _batch(37, lengths=(SEQ, 3, 11, 7), left=True)
    ids, mask = ids.reshape(2, 2, SEQ), mask.reshape(2, 2, SEQ)  # [batch, choices, seq]
    want = _hf_outputs(model, ids, mask)
    ckpt = load_checkpoint(str(tmp_path / "hf"))
    params = unflatten_params({k: jnp.asarray(v) for k, v in ckpt.tensors.items()})
    got = jax.jit(MultipleChoice(ckpt.config).apply)({"params": params}, ids, None, mask)
    assert _max_diff(np.asarray(got), want) <= TOL
    # load_pretrained runs the checkpoint as a one-label scorer per choice, pooled the same way
    out = bertjax.load_pretrained(str(tmp_path / "hf"))(
        ids.reshape(4, SEQ), None, mask.reshape(4, SEQ)
    )
    assert _max_diff(np.asarray(out.logits).reshape(2, 2), want) <= TOL


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_schedules_equal_transformers_tables(name):
    """cos/sin of every RoPE schedule, global and local, at inputs shorter and longer than the
    original context of the schedules (longrope switches its factors there)."""
    config = transformers.ModernBertConfig(**{**BASE, **_rope(name)})
    cfg = modernbert_hf.config_from_hf(config.to_dict())
    for length in (6, SEQ):
        for is_global, kind in ((True, "full_attention"), (False, "sliding_attention")):
            module = transformers.models.modernbert.modeling_modernbert.ModernBertRotaryEmbedding
            positions = torch.arange(length)[None]
            cos, sin = module(config)(torch.zeros(1, dtype=torch.float32), positions, kind)
            got = rope.rope_tables(jnp.arange(length)[None], *cfg.rope(is_global, length))
            np.testing.assert_allclose(np.asarray(got[0]), cos.numpy(), rtol=0, atol=2e-6)
            np.testing.assert_allclose(np.asarray(got[1]), sin.numpy(), rtol=0, atol=2e-6)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(hidden_activation="prelu"), "hidden_activation='prelu'"),
        (dict(classifier_activation="xielu"), "classifier_activation='xielu'"),
        (dict(head_dim=4), "head_dim=4"),
        (
            dict(
                rope_parameters={
                    "full_attention": {"rope_type": "linear", "factor": 2.0},
                    "sliding_attention": {"partial_rotary_factor": 0.5, "rope_type": "linear"},
                }
            ),
            r"rope_parameters\['sliding_attention'\].*partial_rotary_factor=0.5",
        ),
        (
            dict(rope_parameters={"full_attention": {"rope_type": "ntk", "rope_theta": 1.0}}),
            r"rope_parameters\['full_attention'\]: rope_type 'ntk'",
        ),
    ],
)
def test_what_transformers_cannot_run_is_refused_naming_the_key(changes, message):
    """Settings transformers' ModernBERT fails on (or has learned activation parameters for):
    one ValueError naming the config.json key."""
    values = {**transformers.ModernBertConfig(**BASE).to_dict(), **changes}
    with pytest.raises(ValueError, match=message):
        modernbert_hf.config_from_hf(values)
