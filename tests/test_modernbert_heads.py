"""transformers' ModernBertForTokenClassification / ...ForQuestionAnswering / ...ForMultipleChoice
(a ``head`` of dense + act + norm before the classifier: per token for the first two, on the pooled
[CLS] or mean for multiple choice) written by transformers itself, read by ``bertjax convert``'s
loader, run by bertjax's TokenClassifier / SpanClassifier / MultipleChoice heads (logits equal
within 1e-4 in fp32 on a padded batch longer than the window) and exported back loadably."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_random import randomize

from bertjax.convert import load_checkpoint, save_checkpoint, unflatten_params
from bertjax.convert.checkpoint import flatten_params
from bertjax.models.heads import MultipleChoice, SpanClassifier, TokenClassifier
from bertjax.pretrained import head_of, pretrained_from_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
LENGTHS = (24, 17)
VARIANTS = {
    "plain": dict(classifier_pooling="cls"),
    "biased": dict(
        norm_bias=True,
        attention_bias=True,
        mlp_bias=True,
        classifier_bias=True,
        classifier_pooling="mean",
        hidden_activation="gelu_pytorch_tanh",
        classifier_activation="silu",
    ),
}
CLASSES = {  # transformers class -> (bertjax head, heads of the checkpoint)
    "ModernBertForTokenClassification": ("token", ("classifier", "token_head")),
    "ModernBertForQuestionAnswering": ("span", ("token_head", "qa")),
    "ModernBertForMultipleChoice": ("choice", ("pooler", "classifier")),
}


def _hf_model(cls: str, variant: str, seed: int):
    """A random small ModernBERT of class ``cls`` (odd sizes, window 8 < the sequences)."""
    config = transformers.ModernBertConfig(
        vocab_size=301,
        hidden_size=96,
        num_attention_heads=3,
        intermediate_size=80,
        num_hidden_layers=5,
        global_attn_every_n_layers=2,
        local_attention=8,
        max_position_embeddings=64,
        pad_token_id=0,
        cls_token_id=1,
        bos_token_id=1,
        sep_token_id=2,
        eos_token_id=2,
        num_labels=2 if cls.endswith("QuestionAnswering") else 5,
        attn_implementation="eager",
        **VARIANTS[variant],
    )
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(config).eval()
    randomize(model, seed)
    return model


def _batch(rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = np.resize(np.array(LENGTHS), rows)
    seq = max(LENGTHS)
    ids = rng.integers(3, 301, (rows, seq)).astype(np.int32)
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int32)
    ids[:, 0] = 1
    return np.where(mask > 0, ids, 0), mask


def _hf_logits(model, cls: str, ids, mask):
    t_ids, t_mask = torch.from_numpy(ids).long(), torch.from_numpy(mask).long()
    with torch.no_grad():
        out = model(t_ids, attention_mask=t_mask)
    if cls.endswith("QuestionAnswering"):
        return np.stack([out.start_logits.numpy(), out.end_logits.numpy()], -1)
    return out.logits.numpy()


def _bertjax_logits(kind: str, config, params, ids, mask, num_labels: int):
    if kind == "token":
        module = TokenClassifier(config, num_labels)
    elif kind == "span":
        module = SpanClassifier(config)
    else:
        module = MultipleChoice(config)
    out = jax.jit(lambda p, i, m: module.apply({"params": p}, i, None, m))(params, ids, mask)
    return np.stack(out, -1) if kind == "span" else np.asarray(out)


def _inputs(cls: str):
    if cls.endswith("MultipleChoice"):
        ids, mask = _batch(6)
        return ids.reshape(2, 3, -1), mask.reshape(2, 3, -1)  # [batch, choices, seq]
    return _batch(2)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("cls", list(CLASSES))
def test_head_checkpoint_converts_exactly_and_exports_back(cls, variant, tmp_path):
    kind, heads = CLASSES[cls]
    model = _hf_model(cls, variant, seed=3)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ids, mask = _inputs(cls)
    want = _hf_logits(model, cls, ids, mask)

    ckpt = load_checkpoint(str(tmp_path / "hf"))
    assert ckpt.heads == tuple(
        h for h in ("pooler", "mlm", "classifier", "token_head", "qa") if h in heads
    )
    assert ckpt.hf_class == cls
    params = unflatten_params({k: jnp.asarray(v) for k, v in ckpt.tensors.items()})
    got = _bertjax_logits(kind, ckpt.config, params, ids, mask, ckpt.num_labels)
    real = mask.astype(bool)
    if kind != "choice":  # per-token logits: padding positions are not compared
        got, want = got[real], want[real]
    assert got.shape == want.shape
    diff = float(np.max(np.abs(got - want)))
    assert diff <= TOL, f"{cls}/{variant}: max abs difference {diff:.2e}"

    # Back to transformers, directly and through bertjax's own format: the same class, no
    # missing or unexpected tensors, the same logits.
    save_checkpoint(ckpt, str(tmp_path / "bertjax"), "bertjax")
    again = load_checkpoint(str(tmp_path / "bertjax"))
    assert again.hf_class == cls and again.heads == ckpt.heads
    for source, out in ((ckpt, "back"), (again, "back2")):
        save_checkpoint(source, str(tmp_path / out), "hf")
        loaded, info = getattr(transformers, cls).from_pretrained(
            str(tmp_path / out), attn_implementation="eager", output_loading_info=True
        )
        assert not any(info.values()), info
        state = loaded.state_dict()
        for name, value in model.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
        got = _hf_logits(loaded.eval(), cls, ids, mask)
        np.testing.assert_allclose(got, _hf_logits(model, cls, ids, mask), rtol=0, atol=1e-6)


def test_load_pretrained_keeps_the_encoder_of_a_token_classifier(tmp_path):
    model = _hf_model("ModernBertForTokenClassification", "plain", seed=4)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    pretrained = pretrained_from_checkpoint(load_checkpoint(str(tmp_path / "hf")))
    assert pretrained.heads == () and set(pretrained.params) == {"model"}
    ids, mask = _batch(2)
    out = pretrained(ids, input_mask=mask)
    with torch.no_grad():
        ref = model.model(
            torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long()
        )
    real = mask.astype(bool)
    got, want = np.asarray(out.sequence_output)[real], ref.last_hidden_state.numpy()[real]
    assert float(np.max(np.abs(got - want))) <= TOL


def test_a_masked_lm_checkpoint_names_only_heads_modernbert_has(tmp_path, caplog):
    """A ModernBERT masked-LM checkpoint lacks the pooler (a task head) but never "nsp" (it has
    none); heads="all" adds the pooler only, by the model's own initialisers."""
    import logging

    _hf_model("ModernBertForMaskedLM", "plain", seed=5).save_pretrained(tmp_path / "hf")
    with caplog.at_level(logging.INFO, logger="bertjax"):
        loaded = pretrained_from_checkpoint(load_checkpoint(str(tmp_path / "hf")))
    assert loaded.missing == ("pooler",)
    assert "['pooler'] absent" in caplog.text and "nsp" not in caplog.text
    full = pretrained_from_checkpoint(load_checkpoint(str(tmp_path / "hf")), heads="all")
    assert full.heads == ("pooler", "mlm") and "seq_relationship" not in full.params
    ids, mask = _batch(2)
    assert np.isfinite(np.asarray(full(ids, input_mask=mask).pooled_output)).all()
    # The fresh pooler is the one a whole init of the model gives (seed 0, the default), though
    # only the heads are computed.
    own = jax.jit(full.module.init)(jax.random.key(0), ids, ids, mask)["params"]
    own = flatten_params(nn.meta.unbox(own))
    got = {k: v for k, v in flatten_params(full.params).items() if head_of(k) == "pooler"}
    assert got and all(np.array_equal(v, own[k]) for k, v in got.items())
