"""ModernBERT: bertjax.models.modernbert against transformers' ModernBertModel /
ModernBertForMaskedLM / ModernBertForSequenceClassification (odd sizes, a sliding window smaller
than the sequences, padded batches), the conversion table both ways, parameter counts, logical
axis names, the attention kernels' sliding window, packed rows and the pretraining head."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import encoder_and_mlm
from hf_random import randomize

import bertjax.models
from bertjax import sharding
from bertjax.convert import hf as convert_hf
from bertjax.convert import modernbert_hf as mhf
from bertjax.layers.attention import attend
from bertjax.models import modernbert
from bertjax.models.heads import PreTrainingModel, SequenceClassifier

TOL = 1e-4
LENGTHS = (24, 17)  # a padded batch, both rows longer than the window
NUM_LABELS = 3
VARIANTS = {
    # no biases anywhere, [CLS] pooling, decoder bias, default RoPE bases
    "plain": dict(classifier_pooling="cls"),
    # every bias, mean pooling, no decoder bias, tanh-GELU MLP, SiLU head, other RoPE bases
    "biased": dict(
        norm_bias=True,
        attention_bias=True,
        mlp_bias=True,
        classifier_bias=True,
        decoder_bias=False,
        classifier_pooling="mean",
        hidden_activation="gelu_pytorch_tanh",
        classifier_activation="silu",
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        },
    ),
}
MAX_DIFFS: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    """The architecture registry knows ``modernbert`` (the lead adds it to bertjax.models)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(bertjax.models.ARCHITECTURES, "modernbert", modernbert.ARCHITECTURE)
        yield
    if MAX_DIFFS:
        print("\nmax abs differences:", {k: f"{v:.2e}" for k, v in MAX_DIFFS.items()})


def _close(name: str, got, want, tol: float = TOL) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    diff = float(np.max(np.abs(got - want)))
    MAX_DIFFS[name] = max(MAX_DIFFS.get(name, 0.0), diff)
    assert diff <= tol, f"{name}: max abs difference {diff:.3e} > {tol}"


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = jnp.asarray(value)
    return tree


def _flatten(tree, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for key, value in tree.items():
        if hasattr(value, "items"):
            out.update(_flatten(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = np.asarray(value)
    return out


def _batch(vocab: int, lengths=LENGTHS, seed: int = 0):
    rng = np.random.default_rng(seed)
    seq = max(lengths)
    ids = rng.integers(3, vocab, (len(lengths), seq)).astype(np.int32)
    mask = (np.arange(seq)[None, :] < np.array(lengths)[:, None]).astype(np.int32)
    ids[:, 0] = 1  # [CLS]
    return np.where(mask > 0, ids, 0), mask  # pad id 0


# ---------------------------------------------------------------------------------------------
# transformers references (built once per variant)
# ---------------------------------------------------------------------------------------------
def _hf_config(variant: str, **extra):
    transformers = pytest.importorskip("transformers")
    values = dict(
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
        num_labels=NUM_LABELS,
        attn_implementation="eager",
    )
    values.update(VARIANTS[variant], **extra)
    return transformers.ModernBertConfig(**values)


@functools.cache
def _reference(variant: str):
    """HF ForMaskedLM and ForSequenceClassification sharing one random encoder, their state
    dicts as NumPy, and their outputs on the padded batch."""
    import torch
    import transformers

    torch.manual_seed(0)
    hfc = _hf_config(variant)
    mlm = transformers.ModernBertForMaskedLM(hfc).eval()
    randomize(mlm, seed=1)
    clf = transformers.ModernBertForSequenceClassification(hfc).eval()
    clf.load_state_dict(
        {k: v for k, v in mlm.state_dict().items() if k.startswith("model.")}, strict=False
    )
    randomize(clf, seed=2, only=("head.", "classifier."))
    ids, mask = _batch(hfc.vocab_size)
    t_ids, t_mask = torch.from_numpy(ids).long(), torch.from_numpy(mask).long()
    with torch.no_grad():
        out = mlm(t_ids, attention_mask=t_mask, output_hidden_states=True)
        logits = clf(t_ids, attention_mask=t_mask).logits
    return dict(
        config=hfc,
        mlm=mlm,
        clf=clf,
        ids=ids,
        mask=mask,
        mlm_state={k: v.numpy().copy() for k, v in mlm.state_dict().items()},
        clf_state={k: v.numpy().copy() for k, v in clf.state_dict().items()},
        hidden=[h.numpy() for h in out.hidden_states],
        mlm_logits=out.logits.numpy(),
        clf_logits=logits.numpy(),
    )


def _converted(variant: str, which: str):
    ref = _reference(variant)
    cfg = mhf.config_from_hf(ref["config"].to_dict())
    flat, heads = mhf.from_hf_tensors(cfg, ref[f"{which}_state"], f"hf-{which}")
    return cfg, flat, heads


# ---------------------------------------------------------------------------------------------
# Numerical identity with transformers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_encoder_and_mlm_match_transformers(variant):
    ref = _reference(variant)
    cfg, flat, heads = _converted(variant, "mlm")
    assert heads == ("mlm",)
    assert cfg.local_attention == 8 and cfg.global_attn_every_n_layers == 2
    assert cfg.classifier_pooling == VARIANTS[variant]["classifier_pooling"]
    ids, mask = ref["ids"], ref["mask"]
    real = mask.astype(bool)
    params = _unflatten(flat)

    # The pretraining model: MLM logits everywhere and at chosen (masked) positions.
    positions = np.array([[0, 5, 20, 23], [1, 8, 16, 3]], np.int32)
    out, full, at = encoder_and_mlm(cfg, params, ids, None, mask, positions)  # at: [b, k, vocab]
    assert out.pooled_output is None
    _close(
        f"{variant}/last_hidden_state",
        np.asarray(out.sequence_output)[real],
        ref["hidden"][-1][real],
    )
    assert len(out.hidden_states) == len(ref["hidden"]) == cfg.num_layers + 1
    for got, want in zip(out.hidden_states, ref["hidden"]):
        _close(f"{variant}/hidden_states", np.asarray(got)[real], want[real])

    assert full["pooled_output"] is None
    _close(f"{variant}/mlm_logits", np.asarray(full["mlm_logits"])[real], ref["mlm_logits"][real])
    want = np.take_along_axis(ref["mlm_logits"], positions[:, :, None], axis=1)
    _close(f"{variant}/mlm_logits_masked", at, want)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sequence_classifier_matches_transformers(variant):
    ref = _reference(variant)
    cfg, flat, heads = _converted(variant, "clf")
    assert heads == ("pooler", "classifier")
    model = SequenceClassifier(cfg, num_labels=NUM_LABELS)
    logits = jax.jit(lambda p, i, m: model.apply({"params": p}, i, None, m))(
        _unflatten(flat), ref["ids"], ref["mask"]
    )
    _close(f"{variant}/classifier_logits ({cfg.classifier_pooling})", logits, ref["clf_logits"])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_round_trip_loads_in_transformers(variant, tmp_path):
    import torch
    import transformers

    ref = _reference(variant)
    ids, mask = torch.from_numpy(ref["ids"]).long(), torch.from_numpy(ref["mask"]).long()
    for which in ("mlm", "clf"):
        cfg, flat, heads = _converted(variant, which)
        state = mhf.to_hf_tensors(cfg, flat, heads)
        original = ref[f"{which}_state"]
        assert sorted(state) == sorted(original)
        for name, value in original.items():
            np.testing.assert_array_equal(state[name], value, err_msg=name)
        # config_to_hf + the weights, through a directory, into transformers' from_pretrained.
        mhf.write_hf_dir(str(tmp_path / which), cfg, flat, heads)
        arch = mhf.hf_architecture(heads)
        loaded, info = getattr(transformers, arch).from_pretrained(
            str(tmp_path / which), attn_implementation="eager", output_loading_info=True
        )
        assert not any(info.values()), info
        assert loaded.config.layer_types == ref["config"].layer_types
        assert loaded.config.rope_parameters == ref["config"].rope_parameters
        with torch.no_grad():
            got = loaded.eval()(ids, attention_mask=mask).logits.numpy()
        want = ref["mlm_logits"] if which == "mlm" else ref["clf_logits"]
        np.testing.assert_array_equal(got, want)
        back = convert_hf.load_hf(str(tmp_path / which))  # what load_pretrained and convert read
        assert back.config == cfg and back.heads == heads
        assert all(np.array_equal(back.tensors[k], v) for k, v in flat.items())
    # A bare ModernBertModel state dict (no "model." prefix) reads as the encoder alone.
    bare = {k[len("model.") :]: v for k, v in ref["mlm_state"].items() if k.startswith("model.")}
    enc_flat, enc_heads = mhf.from_hf_tensors(cfg, bare, "bare")
    assert enc_heads == () and sorted(mhf.to_hf_tensors(cfg, enc_flat, ())) == sorted(bare)


def test_config_conversion_round_trip_and_hf_defaults():
    transformers = pytest.importorskip("transformers")
    cfg = modernbert.get_preset(
        "modernbert-tiny",
        vocab_size=1000,
        pad_token_id=0,
        cls_token_id=1,
        sep_token_id=2,
        norm_bias=True,
        attention_bias=True,
        decoder_bias=False,
        classifier_pooling="mean",
        classifier_activation="silu",
        global_rope_theta=1234.0,
        local_rope_theta=77.0,
        global_attn_every_n_layers=4,
        local_attention=64,
        hidden_dropout=0.1,
        attention_dropout=0.05,
        param_dtype="bfloat16",
    )
    hf = mhf.config_to_hf(cfg)
    assert mhf.config_from_hf(hf) == cfg
    loaded = transformers.ModernBertConfig.from_dict(hf)  # what from_pretrained does
    assert mhf.config_from_hf(loaded.to_dict()) == cfg
    assert loaded.layer_types == [
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "sliding_attention",
    ]
    assert loaded.sliding_window == 32
    # transformers' defaults are ModernBERT-base, and so are the preset's.
    assert mhf.config_from_hf(transformers.ModernBertConfig().to_dict()) == modernbert.get_preset(
        "modernbert-base"
    )
    # Legacy config.json keys (global_rope_theta, no layer_types / rope_parameters).
    legacy = {k: v for k, v in hf.items() if k not in ("layer_types", "rope_parameters")}
    assert mhf.config_from_hf(legacy) == cfg
    with pytest.raises(ValueError, match="model_type"):
        mhf.config_from_hf({"model_type": "bert"})
    # Any pattern of layer types (transformers 5), not only "global every n layers".
    lone = mhf.config_from_hf({**hf, "layer_types": ["sliding_attention"] * cfg.num_layers})
    assert lone.layer_pattern == "llll" and not any(map(lone.is_global, range(4)))
    with pytest.raises(ValueError, match="layer_types"):
        mhf.config_from_hf({**hf, "layer_types": ["sliding_attention"] * (cfg.num_layers - 1)})


def test_from_hf_tensors_lists_every_problem():
    ref = _reference("plain")
    cfg = mhf.config_from_hf(ref["config"].to_dict())
    state = dict(ref["mlm_state"])
    del state["model.layers.2.mlp.Wo.weight"]
    state["model.layers.1.attn.Wqkv.bias"] = np.zeros(288, np.float32)
    state["model.final_norm.weight"] = np.ones(95, np.float32)
    with pytest.raises(ValueError) as err:
        mhf.from_hf_tensors(cfg, state, "/ckpt/model.safetensors")
    msg = str(err.value)
    assert msg.startswith("/ckpt/model.safetensors:")
    assert "missing 1 tensor(s): model.layers.2.mlp.Wo.weight [96, 80]" in msg
    assert "unexpected 1 tensor(s): model.layers.1.attn.Wqkv.bias [288]" in msg
    assert "model.final_norm.weight [95] (config implies [96])" in msg
    untied = dict(ref["mlm_state"], **{"decoder.weight": np.zeros((301, 96), np.float32)})
    with pytest.raises(ValueError, match="not tied"):
        mhf.from_hf_tensors(cfg, untied, "untied")
    # Every name of the table is unique and the table has the documented transforms.
    names = mhf.hf_names(cfg, ("mlm",))
    assert len({n for _, n, _ in names}) == len(names)
    assert ("model/layer_0/attn/Wqkv/kernel", "model.layers.0.attn.Wqkv.weight", "linear") in names
    assert (
        "model/layer_3/attn/Wo/kernel",
        "model.layers.3.attn.Wo.weight",
        "linear_heads",
    ) in names
    assert not any(p.startswith("model/layer_0/attn_norm") for p, _, _ in names)


# ---------------------------------------------------------------------------------------------
# The model on its own
# ---------------------------------------------------------------------------------------------
def _small(**overrides) -> modernbert.ModernBertConfig:
    base = dict(vocab_size=301, hidden_size=96, num_layers=5, num_heads=3, intermediate_size=80)
    base.update(global_attn_every_n_layers=2, local_attention=8, max_position_embeddings=64)
    return modernbert.ModernBertConfig(**{**base, **overrides})


def _count(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def _shapes(module, *args):
    return jax.eval_shape(lambda: module.init(jax.random.key(0), *args))["params"]


@pytest.mark.parametrize("biases", [False, True])
def test_num_params_is_the_real_count(biases):
    flags = dict.fromkeys(("norm_bias", "attention_bias", "mlp_bias", "classifier_bias"), biases)
    cfg = _small(**flags, decoder_bias=not biases)
    ids = jnp.ones((1, 4), jnp.int32)
    assert _count(_shapes(PreTrainingModel(cfg, nsp=False), ids)) == cfg.num_params()
    assert _count(
        _shapes(modernbert.ModernBertModel(cfg, add_pooler=False), ids)
    ) == cfg.num_params(False)
    with_pooler = _count(_shapes(modernbert.ModernBertModel(cfg), ids))
    assert with_pooler == cfg.num_params(False, include_pooler=True)
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for name in ("modernbert-base", "modernbert-large"):
        preset = modernbert.get_preset(name)
        with torch.device("meta"):
            hf = transformers.ModernBertForMaskedLM(
                transformers.ModernBertConfig(
                    **{
                        k: v
                        for k, v in mhf.config_to_hf(preset).items()
                        if k not in ("architectures", "model_type")
                    }
                )
            )
        assert sum(p.numel() for p in hf.parameters()) == preset.num_params(), name
    assert modernbert.get_preset("modernbert-base").num_params() == 149_655_232


def test_every_param_has_logical_axis_names():
    cfg = _small(norm_bias=True, attention_bias=True, mlp_bias=True, classifier_bias=True)
    ids = jnp.ones((1, 4), jnp.int32)
    allowed = {"embed", "heads", "kv", "mlp", "vocab", "norm", "embed_out", "classes", None}
    for module in (PreTrainingModel(cfg, nsp=False), SequenceClassifier(cfg, num_labels=3)):
        boxed = jax.eval_shape(lambda m=module: m.init(jax.random.key(0), ids))["params"]
        leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
        assert leaves
        for leaf in leaves:
            assert isinstance(leaf, nn.LogicallyPartitioned), "a parameter without axis names"
            assert len(leaf.names) == leaf.value.ndim and set(leaf.names) <= allowed
        specs = nn.get_partition_spec(boxed)
        assert jax.tree.structure(specs) == jax.tree.structure(nn.meta.unbox(boxed))
    layer = nn.get_partition_spec(boxed)["model"]["layer_1"]
    assert tuple(layer["attn"]["Wqkv"]["kernel"]) == ("embed", None, "heads", "kv")
    assert tuple(layer["attn"]["Wo"]["kernel"]) == ("heads", "kv", "embed")
    assert tuple(layer["mlp"]["Wi"]["kernel"]) == ("embed", None, "mlp")
    with nn.logical_axis_rules(sharding.RULES):
        mesh_axes = nn.logical_to_mesh_axes(("embed", None, "heads", "kv"))
    assert tuple(mesh_axes) == ("fsdp", None, "tensor", None)


def test_config_presets_and_validation():
    names = modernbert.preset_names()
    presets = ["modernbert-tiny", "modernbert-mini", "modernbert-base", "modernbert-large"]
    family = [f"ettin-{s}" for s in ("17m", "32m", "68m", "150m", "400m", "1b")]
    assert names == presets + family + ["mmbert-small", "mmbert-base"]
    with pytest.raises(
        ValueError, match="^ModernBERT preset 'base' is now named 'modernbert-base'"
    ):
        modernbert.get_preset("base")  # bertjax 0.2's short name: BERT-base's name
    base, large = (
        modernbert.get_preset("modernbert-base"),
        modernbert.get_preset("modernbert-large"),
    )
    assert (base.num_layers, base.hidden_size, base.intermediate_size, base.num_heads) == (
        22,
        768,
        1152,
        12,
    )
    assert (large.num_layers, large.hidden_size, large.intermediate_size, large.num_heads) == (
        28,
        1024,
        2624,
        16,
    )
    assert (base.global_attn_every_n_layers, base.local_attention, base.vocab_size) == (
        3,
        128,
        50368,
    )
    assert (
        base.head_dim == 64 and modernbert.ARCHITECTURE.config_class is modernbert.ModernBertConfig
    )
    assert base.to_dict()["architecture"] == "modernbert"
    assert modernbert.ModernBertConfig.from_dict(base.to_dict()) == base
    assert bertjax.models.config_from_dict(large.to_dict()) == large
    tiny = modernbert.get_preset("modernbert-tiny", local_attention=16)
    assert tiny.replace(num_layers=2).num_layers == 2 and tiny.local_attention == 16
    for bad, key in (
        (dict(classifier_pooling="max"), "classifier_pooling"),
        (dict(scan_layers=True), "scan_layers"),
        (dict(local_attention=0), "local_attention"),
        (dict(hidden_size=100, num_heads=3), "hidden_size"),
        (dict(hidden_size=66, num_heads=6), "odd head_dim=11"),
        (dict(classifier_activation="prelu"), "classifier_activation"),
        (dict(layer_pattern="glg"), "layer_pattern"),
        (dict(global_rope_scaling='{"rope_type": "ntk"}'), "global_rope_scaling"),
        (dict(attention_impl="flash"), "attention_impl"),
    ):
        with pytest.raises(ValueError, match=key):
            _small(**bad)
    with pytest.raises(ValueError, match=r"unknown keys \['layers'\]"):
        modernbert.ModernBertConfig.from_dict({"layers": 3})
    with pytest.raises(ValueError, match="unknown model preset"):
        modernbert.get_preset("modernbert-huge")
    shared = set(bertjax.models.config_fields("bert")) - {"type_vocab_size", "layer_norm_eps"}
    assert shared <= set(bertjax.models.config_fields("modernbert"))


def test_forward_flops_counts_the_window():
    cfg = _small()  # 5 layers: global 0, 2, 4; local 1, 3 (window 8 -> 9 keys)
    h, i, v = 96, 80, 301
    seq, masked = 32, 5
    dense = 5 * 2 * (4 * h * h + 3 * h * i)
    attn = 4 * h * (3 * seq + 2 * 9)
    want = seq * (dense + attn) + masked * 2 * (h * h + h * v)
    assert modernbert.forward_flops_per_sequence(cfg, seq, masked) == want
    short = modernbert.forward_flops_per_sequence(cfg, 4, 0)  # window wider than the sequence
    assert short == 4 * (dense + 4 * h * 5 * 4)
    assert bertjax.models.forward_flops_per_sequence(cfg, seq, masked) == want


def _reference_attention(q, k, v, allowed):
    logits = np.einsum("bqhd,bkhd->bhqk", q / np.sqrt(q.shape[-1]), k)
    logits = np.where(allowed[:, None], logits, -np.inf)
    with np.errstate(invalid="ignore"):  # padding queries that see no key: NaN, never compared
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        return np.einsum("bhqk,bkhd->bqhd", probs / probs.sum(-1, keepdims=True), v)


def _window_inputs(seq: int, lengths, heads: int = 2, dim: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    q, k, v = (
        rng.standard_normal((len(lengths), seq, heads, dim)).astype(np.float32) for _ in "qkv"
    )
    mask = (np.arange(seq)[None] < np.array(lengths)[:, None]).astype(np.int32)
    return q, k, v, mask


@pytest.mark.parametrize("impl", ["xla", "dot_product"])
def test_attend_sliding_window(impl):
    from bertjax.layers.core import attention_bias

    window, seq = 6, 20
    q, k, v, mask = _window_inputs(seq, (20, 13))
    pos = np.arange(seq)
    allowed = (np.abs(pos[:, None] - pos[None]) <= window // 2)[None] & (mask[:, None, :] > 0)
    want = _reference_attention(q, k, v, allowed)
    bias = attention_bias(jnp.asarray(mask), jnp.float32)
    got = attend(
        q,
        k,
        v,
        bias,
        impl=impl,
        dropout_rate=0.0,
        dropout_impl="bits16",
        deterministic=True,
        local_window=window,
    )
    real = mask > 0
    np.testing.assert_allclose(np.asarray(got)[real], want[real], atol=1e-5)
    assert bool(jnp.isfinite(got).all())


@pytest.mark.accelerator
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU")
def test_attend_sliding_window_cudnn_equals_the_reference_on_gpu():
    """``attention_impl=cudnn``: the window as band blocks, each query block one small fused
    attention with the band as its bias (cuDNN has no two-sided window), on a padded bf16 batch;
    runs where a GPU is (CI and this project's CPU box skip it)."""
    from bertjax.layers.core import attention_bias

    window, seq = 32, 128
    q, k, v, mask = _window_inputs(seq, (128, 77), heads=2, dim=64, seed=5)
    pos = np.arange(seq)
    allowed = (np.abs(pos[:, None] - pos[None]) <= window // 2)[None] & (mask[:, None, :] > 0)
    want = _reference_attention(q, k, v, allowed)
    bias = attention_bias(jnp.asarray(mask), jnp.float32)
    qkv = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    kwargs = dict(impl="cudnn", dropout_rate=0.0, dropout_impl="bits16", deterministic=True)
    got = jax.jit(lambda q, k, v, b: attend(q, k, v, b, **kwargs, local_window=window))(*qkv, bias)
    real = mask > 0
    np.testing.assert_allclose(np.asarray(got, np.float32)[real], want[real], atol=3e-2)


def test_splash_sliding_window_in_interpreter(monkeypatch):
    """The LocalMask splash kernel (Pallas interpreter) equals the explicit window (3x3 blocks
    of 128, the corner ones skipped), and the model with attention_impl=splash equals xla."""
    pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")
    monkeypatch.setenv("BERTJAX_SPLASH_INTERPRET", "1")
    window, seq = 16, 384
    q, k, v, mask = _window_inputs(seq, (300, 384), heads=2, dim=32, seed=3)
    pos = np.arange(seq)
    allowed = (np.abs(pos[:, None] - pos[None]) <= window // 2)[None] & (mask[:, None, :] > 0)
    want = _reference_attention(q, k, v, allowed)
    kwargs = dict(impl="splash", dropout_rate=0.0, dropout_impl="bits16", deterministic=True)
    run = jax.jit(
        lambda q, k, v, ids: attend(q, k, v, None, **kwargs, segment_ids=ids, local_window=window)
    )
    got = run(q, k, v, jnp.asarray(mask))
    real = mask > 0
    np.testing.assert_allclose(np.asarray(got)[real], want[real], atol=1e-5)
    # Under a mesh: one kernel per device in shard_map (batch over data, heads over tensor).
    mesh = sharding.create_mesh(2, 1, 2, devices=jax.devices()[:4])
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
        assert "shard_map" in str(jax.make_jaxpr(run)(q, k, v, jnp.asarray(mask)))
        sharded = run(q, k, v, jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(got), atol=1e-6)
    # The encoder (a global and a local layer) with splash vs xla on a padded batch of 128.
    cfg = _small(num_layers=2, hidden_size=64, num_heads=2, intermediate_size=48, vocab_size=50)
    cfg = cfg.replace(max_position_embeddings=128)
    ids, mask = _batch(cfg.vocab_size, lengths=(128, 77))
    enc = modernbert.ModernBertModel(cfg, add_pooler=False)
    params = jax.jit(enc.init)(jax.random.key(0), ids, None, mask)["params"]
    outs = [
        jax.jit(modernbert.ModernBertModel(c, add_pooler=False).apply)(
            {"params": params}, ids, None, mask
        )
        for c in (cfg, cfg.replace(attention_impl="splash"))
    ]
    real = mask > 0
    _close(
        "splash vs xla (model)",
        np.asarray(outs[1].sequence_output)[real],
        np.asarray(outs[0].sequence_output)[real],
        tol=1e-5,
    )


def test_dot_product_and_remat_equal_xla_on_the_model():
    ref = _reference("plain")
    cfg, flat, _ = _converted("plain", "mlm")
    params, real = _unflatten(flat)["model"], ref["mask"] > 0
    outputs = {}
    for name, variant_cfg in (
        ("xla", cfg),
        ("dot_product", cfg.replace(attention_impl="dot_product")),
        ("remat", cfg.replace(remat="full")),
        ("bfloat16", cfg.replace(dtype="bfloat16")),
    ):
        enc = modernbert.ModernBertModel(variant_cfg, add_pooler=False)
        run = jax.jit(lambda p, i, m, e=enc: e.apply({"params": p}, i, None, m).sequence_output)
        outputs[name] = np.asarray(run(params, ref["ids"], ref["mask"]))
    _close("dot_product vs xla", outputs["dot_product"][real], outputs["xla"][real], tol=1e-5)
    np.testing.assert_allclose(outputs["remat"], outputs["xla"], atol=1e-6)
    assert outputs["bfloat16"].dtype == jnp.bfloat16
    bf16 = np.abs(outputs["bfloat16"].astype(np.float32) - outputs["xla"])[real]
    print(f"bfloat16 vs float32 encoder: max {bf16.max():.3f}, mean {bf16.mean():.4f}")
    assert bf16.mean() < 0.02 and bf16.max() < 0.25


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_rows_equal_separate_sequences(variant):
    """Two sequences in one row (pack_ids, restarting position_ids) give what each gives alone:
    hidden states, pooled outputs (cls or mean) at pool_positions and classifier logits."""
    cfg, flat, _ = _converted(variant, "clf")
    params = _unflatten(flat)
    rng = np.random.default_rng(5)
    a, b = rng.integers(3, cfg.vocab_size, 13), rng.integers(3, cfg.vocab_size, 9)
    a[0] = b[0] = 1
    row = np.concatenate([a, b, [0, 0]])[None].astype(np.int32)  # [1, 24]
    pack = np.array([[1] * 13 + [2] * 9 + [0, 0]], np.int32)
    positions = np.array([list(range(13)) + list(range(9)) + [0, 0]], np.int32)
    starts = np.array([[0, 13]], np.int32)
    enc = modernbert.ModernBertModel(cfg)
    clf = SequenceClassifier(cfg, num_labels=NUM_LABELS)

    @jax.jit  # one program (op by op, the 5 layers are some 200 small compiles)
    def packed_and_alone(params, alone_ids, alone_mask):
        packed = enc.apply(
            {"params": params["model"]},
            row,
            None,
            None,
            position_ids=positions,
            pack_ids=pack,
            pool_positions=starts,
        )
        packed_logits = clf.apply(
            {"params": params}, row, position_ids=positions, pack_ids=pack, cls_positions=starts
        )  # [1, 2, labels]
        alone = enc.apply({"params": params["model"]}, alone_ids, None, alone_mask)
        alone_logits = clf.apply({"params": params}, alone_ids, None, alone_mask)
        return packed, packed_logits, alone, alone_logits

    # Each sequence alone: a padded batch [a; b + padding] (padding is proven inert above).
    alone_ids = np.zeros((2, 13), np.int32)
    alone_ids[0], alone_ids[1, :9] = a, b
    alone_mask = (alone_ids > 0).astype(np.int32)
    packed, packed_logits, alone, alone_logits = packed_and_alone(params, alone_ids, alone_mask)
    assert packed.pooled_output.shape == (1, 2, cfg.hidden_size)
    for j, (length, start) in enumerate(((13, 0), (9, 13))):
        got = packed.sequence_output[0, start : start + length]
        _close(f"{variant}/packed vs alone", got, alone.sequence_output[j, :length], tol=1e-5)
        _close(f"{variant}/packed pooled", packed.pooled_output[0, j], alone.pooled_output[j], 1e-5)
        _close(f"{variant}/packed logits", packed_logits[0, j], alone_logits[j], tol=1e-5)


def test_training_step_is_finite_with_dropout():
    """Gradients through remat ("dots"), dropout everywhere (bits16), both layer kinds."""
    cfg = _small(hidden_size=32, num_heads=2, intermediate_size=24, num_layers=3, vocab_size=50)
    cfg = cfg.replace(hidden_dropout=0.1, attention_dropout=0.1, remat="dots")
    ids, mask = _batch(cfg.vocab_size)
    model = PreTrainingModel(cfg, nsp=False)
    rng = np.random.default_rng(0)  # random params of the init's shapes (cheaper than init)
    shapes = nn.meta.unbox(_shapes(model, ids))
    params = jax.tree.map(
        lambda x: jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype), shapes
    )
    positions = jnp.asarray([[1, 2], [3, 4]], jnp.int32)

    def loss(p, rng):
        out = model.apply(
            {"params": p}, ids, None, mask, positions, deterministic=False, rngs={"dropout": rng}
        )
        return jax.nn.logsumexp(out["mlm_logits"], -1).mean()

    step = jax.jit(jax.value_and_grad(loss))
    (value, grads), (other, _) = step(params, jax.random.key(1)), step(params, jax.random.key(2))
    assert np.isfinite(float(value)) and float(value) != float(other)  # dropout is on
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    grads = jax.device_get(grads)  # checked on the host: no small program per leaf
    assert all(np.isfinite(g).all() and (g != 0).any() for g in jax.tree.leaves(grads))


@pytest.mark.parametrize(
    "preset",
    ["ettin-17m", "ettin-32m", "ettin-68m", "ettin-150m", "ettin-400m", "ettin-1b", "mmbert-base"],
)
def test_the_family_presets_are_the_checkpoints_shapes(preset):
    """Ettin's and mmBERT's shapes: their config.json (written by config_to_hf) builds
    transformers' ModernBertForMaskedLM with exactly the parameters bertjax counts, and reads
    back as the same config; the names give the released sizes (17M ... 1B, mmBERT-base 307M)."""
    transformers = pytest.importorskip("transformers")
    import torch

    cfg = modernbert.get_preset(preset, pad_token_id=0, cls_token_id=1, sep_token_id=2)
    hf = mhf.config_to_hf(cfg)
    assert mhf.config_from_hf(hf) == cfg
    with torch.device("meta"):
        model = transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(**hf))
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    size = preset.rsplit("-", 1)[1]
    named = {"base": 307e6}.get(size) or float(size[:-1]) * (1e9 if size[-1] == "b" else 1e6)
    assert abs(cfg.num_params() / named - 1) < 0.04, (preset, cfg.num_params())
