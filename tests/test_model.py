"""The encoder and its pretraining heads: presets, shapes, masking, logical axes, equal code paths."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax import PreTrainingModel
from bertjax.models.bert import ALIASES, PRESETS, BertConfig, BertModel, get_preset

VOCAB = 97


def _inputs(batch=2, seq=12, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, VOCAB, (batch, seq)).astype(np.int32)
    types = (np.arange(seq) >= seq // 2).astype(np.int32)[None].repeat(batch, 0)
    mask = np.ones((batch, seq), np.int32)
    mask[1, seq - 4 :] = 0  # second row is padded
    return jnp.asarray(ids), jnp.asarray(types), jnp.asarray(mask)


def _init(cfg, nsp=True):
    model = PreTrainingModel(cfg, nsp=nsp)
    ids, types, mask = _inputs()
    params = jax.jit(model.init)(jax.random.key(0), ids, types, mask)["params"]
    return model, nn.meta.unbox(params), params


@pytest.fixture(scope="module")
def tiny():
    """The tiny model, its params (unboxed and boxed) and its outputs on ``_inputs()``, built
    once for the tests that share them (each jitted: op by op, a model is ~50 small compiles)."""
    cfg = get_preset("tiny", vocab_size=VOCAB)
    model, params, boxed = _init(cfg)
    return cfg, model, params, boxed, _outputs(cfg, params)


def test_presets_cover_the_miniatures_base_and_large():
    assert len([k for k in PRESETS if k.startswith("L") and "_H" in k]) == 26  # 24 + large, MiniLM
    assert ALIASES["tiny"] == "L2_H128" and ALIASES["medium"] == "L8_H512"
    minilm = get_preset("minilm")  # all-MiniLM-L6-v2's shape: 22.7M parameters, 12 heads of 32
    assert (minilm.num_layers, minilm.hidden_size, minilm.num_heads) == (6, 384, 12)
    assert minilm.num_params(include_heads=False) == 22_713_216
    base, large = get_preset("base"), get_preset("large")
    assert (base.num_layers, base.hidden_size, base.num_heads) == (12, 768, 12)
    assert (large.num_layers, large.hidden_size, large.num_heads) == (24, 1024, 16)
    # Parameter counts of the published BERT-Base/Large encoders (Hugging Face BertModel).
    assert base.num_params(include_heads=False) == 109_482_240
    assert large.num_params(include_heads=False) == 335_141_888
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        get_preset("huge")
    with pytest.raises(ValueError, match="hidden_size"):
        BertConfig(hidden_size=100, num_heads=12)
    with pytest.raises(ValueError, match="unknown keys \\['layers'\\]"):
        BertConfig.from_dict({"layers": 3})


def test_names_of_bertjax_0_2_are_one_line_errors_naming_the_new_ones():
    import bertjax
    from bertjax import pretrained

    with pytest.raises(ImportError, match="^bertjax.BertForPreTraining was renamed bertjax.Pre"):
        from bertjax import BertForPreTraining  # noqa: F401
    with pytest.raises(ImportError, match="^bertjax.BertForPreTraining was renamed"):
        bertjax.BertForPreTraining  # noqa: B018
    with pytest.raises(ImportError, match="PretrainedEncoder was renamed .*heads.InferenceModel"):
        pretrained.PretrainedEncoder  # noqa: B018
    assert "BertForPreTraining" not in dir(bertjax) and "BertForPreTraining" not in bertjax.__all__
    with pytest.raises(AttributeError, match="has no attribute 'Nothing'"):
        pretrained.Nothing  # noqa: B018


def test_param_count_matches_config_and_every_param_has_logical_axes(tiny):
    cfg, _, params, boxed, _ = tiny
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params()
    leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    for leaf in leaves:
        assert isinstance(leaf, nn.LogicallyPartitioned), "a parameter without logical axis names"
        assert len(leaf.names) == leaf.value.ndim
    kernel = params["bert"]["encoder"]["layer_0"]["attention"]["query"]["kernel"]
    assert kernel.shape == (cfg.hidden_size, cfg.num_heads, cfg.head_dim)


def test_padding_does_not_change_unpadded_positions(tiny):
    cfg, _, params, _, out = tiny
    ids, types, mask = _inputs()
    # Row 1 with its padded tail replaced by other tokens gives the same unpadded outputs.
    ids2 = ids.at[1, -4:].set(7)
    out2 = _outputs(cfg, params, ids2)
    np.testing.assert_allclose(
        out["sequence_output"][1, :-4], out2["sequence_output"][1, :-4], atol=1e-6
    )
    np.testing.assert_allclose(out["nsp_logits"][1], out2["nsp_logits"][1], atol=1e-6)


def test_mlm_at_positions_equals_gathered_full_logits(tiny):
    _, model, params, _, out = tiny
    ids, types, mask = _inputs()
    positions = np.asarray([[1, 3, 5], [0, 2, 7]], np.int32)
    full = np.asarray(out["mlm_logits"])  # [b, seq, vocab]
    picked = jax.jit(model.apply)({"params": params}, ids, types, mask, positions)["mlm_logits"]
    assert full.shape == (2, 12, VOCAB) and picked.shape == (2, 3, VOCAB)
    np.testing.assert_allclose(
        picked, np.take_along_axis(full, positions[..., None], axis=1), atol=1e-5
    )


def test_mlm_decoder_is_tied_to_word_embeddings(tiny):
    _, model, params, _, _ = tiny
    assert "kernel" not in params["predictions"]  # no separate decoder matrix
    ids, types, mask = _inputs()

    def logit(p):
        return model.apply({"params": p}, ids, types, mask)["mlm_logits"][0, 0, 5]

    grads = jax.jit(jax.grad(logit))(params)
    emb_grad = np.asarray(grads["bert"]["embeddings"]["word_embeddings"]["embedding"])
    assert float(np.abs(emb_grad[5]).sum()) > 0  # the decoder row of token 5 is the embedding row


def _outputs(cfg, params, ids=None):
    model = PreTrainingModel(cfg)
    inputs, types, mask = _inputs()
    return jax.jit(model.apply)({"params": params}, inputs if ids is None else ids, types, mask)


def _stack_layers(params, num_layers):
    enc = params["bert"]["encoder"]
    layers = [enc[f"layer_{i}"] for i in range(num_layers)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    new = jax.tree.map(lambda x: x, params)
    new["bert"]["encoder"] = {"layers": stacked}
    return new


@pytest.mark.parametrize(
    "change",
    [
        dict(attention_impl="dot_product"),
        dict(remat="full"),
        dict(remat="dots"),
        dict(scan_layers=True),
        dict(scan_layers=True, remat="dots"),
    ],
)
def test_switches_compute_the_same_outputs(change, tiny):
    cfg, _, params, _, ref = tiny
    cfg2 = cfg.replace(**change)
    params2 = _stack_layers(params, cfg.num_layers) if cfg2.scan_layers else params
    got = _outputs(cfg2, params2)
    for key in ("sequence_output", "pooled_output", "mlm_logits", "nsp_logits"):
        np.testing.assert_allclose(got[key], ref[key], atol=2e-5, rtol=1e-5, err_msg=key)


def test_scanned_gradients_match_unrolled(tiny):
    cfg, _, params, _, _ = tiny
    ids, types, mask = _inputs()

    def loss(c, p):
        return PreTrainingModel(c).apply({"params": p}, ids, types, mask)["mlm_logits"].sum()

    g = jax.jit(jax.grad(lambda p: loss(cfg, p)))(params)
    cfg2 = cfg.replace(scan_layers=True, remat="full")
    g2 = jax.jit(jax.grad(lambda p: loss(cfg2, p)))(_stack_layers(params, cfg.num_layers))
    np.testing.assert_allclose(
        g2["bert"]["encoder"]["layers"]["intermediate"]["kernel"][1],
        g["bert"]["encoder"]["layer_1"]["intermediate"]["kernel"],
        atol=1e-4,
        rtol=1e-4,
    )


def test_bfloat16_compute_keeps_fp32_params_and_stays_close(tiny):
    cfg, _, params, _, ref = tiny
    got = _outputs(cfg.replace(dtype="bfloat16"), params)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    assert got["mlm_logits"].dtype == jnp.float32  # logits and losses in fp32
    np.testing.assert_allclose(got["mlm_logits"], ref["mlm_logits"], atol=0.15)
    np.testing.assert_allclose(got["pooled_output"], ref["pooled_output"], atol=0.1)


def test_dropout_is_active_only_when_not_deterministic(tiny):
    cfg = get_preset("tiny", vocab_size=VOCAB, hidden_dropout=0.5)
    model, params = PreTrainingModel(cfg), tiny[2]  # dropout adds no params
    ids, types, mask = _inputs()
    apply = jax.jit(model.apply, static_argnames="deterministic")
    det = apply({"params": params}, ids, types, mask)
    det2 = apply({"params": params}, ids, types, mask)
    drop = apply(
        {"params": params},
        ids,
        types,
        mask,
        deterministic=False,
        rngs={"dropout": jax.random.key(1)},
    )
    np.testing.assert_array_equal(det["mlm_logits"], det2["mlm_logits"])
    assert not np.allclose(det["mlm_logits"], drop["mlm_logits"])


def test_sequence_longer_than_position_table_is_a_clear_error():
    cfg = get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=8)
    ids = jnp.ones((1, 9), jnp.int32)
    with pytest.raises(ValueError, match="sequence length 9 exceeds max_position_embeddings=8"):
        BertModel(cfg).init(jax.random.key(0), ids)


def test_hidden_states_are_embeddings_then_each_layer(tiny):
    cfg, _, params, _, _ = tiny
    ids, types, mask = _inputs()
    model = BertModel(cfg)
    variables = {"params": params["bert"]}  # the pretraining model's encoder
    out = jax.jit(model.apply, static_argnames="output_hidden_states")(
        variables, ids, types, mask, output_hidden_states=True
    )
    assert len(out.hidden_states) == cfg.num_layers + 1
    np.testing.assert_array_equal(out.hidden_states[-1], out.sequence_output)
