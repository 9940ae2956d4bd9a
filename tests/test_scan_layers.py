"""Layer scanning (``scan_layers=True``: nn.scan over identical layers, params on a leading
``layers`` axis) for every architecture whose contract declares it (``scanned_layers``): on the
unrolled model's weights, stacked where the contract says (``pretrained.merge_encoder``), the
scanned model gives the same hidden states, MLM and classifier logits and training gradients; it
refuses ``output_hidden_states`` and applies dropout reproducibly from its key; a scanned run's
checkpoint exports to transformers (same logits) and transformers' weights load back into it."""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import traverse_util

from bertjax import models
from bertjax.checkpointing import Checkpointer
from bertjax.convert import load_checkpoint, save_checkpoint
from bertjax.convert.checkpoint import flatten_params, unstack_layers
from bertjax.models.heads import PreTrainingModel, SequenceClassifier
from bertjax.pretrained import merge_encoder

SCANNING = sorted(name for name, arch in models.ARCHITECTURES.items() if arch.can_scan)
SHAPE = dict(num_layers=3, hidden_size=32, num_heads=4, intermediate_size=48)
VOCAB = 97
LENGTHS = (11, 7)  # a padded batch
TOL = 1e-6


TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "mask_token_id")


def _fields(arch) -> dict:
    """The small shape, and the family's token ids inside the small vocabulary."""
    ids = {key: i for i, key in enumerate(TOKEN_IDS) if key in arch.config_fields()}
    return {**SHAPE, **ids}


def _config(arch, **changes):
    return arch.get_preset(arch.preset_names()[0], vocab_size=VOCAB, **_fields(arch), **changes)


def _batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    seq = max(LENGTHS)
    mask = (np.arange(seq)[None, :] < np.array(LENGTHS)[:, None]).astype(np.int32)
    ids = np.where(mask > 0, rng.integers(5, VOCAB, (len(LENGTHS), seq)), 0).astype(np.int32)
    return ids, np.zeros_like(ids), mask


def _random_params(module, seed: int, *inputs):
    """``module``'s params at O(1) activations (an init's 0.02 leaves the layers near the
    identity): norm scales 1 + 0.2 N, biases 0.1 N, embedding tables and decoders 0.5 N, kernels
    N / sqrt(hidden)."""
    shapes = jax.eval_shape(lambda: module.init(jax.random.key(0), *inputs))
    flat = traverse_util.flatten_dict(nn.meta.unbox(shapes["params"]))
    rng = np.random.default_rng(seed)
    out = {}
    for path, x in sorted(flat.items()):
        noise = rng.standard_normal(x.shape).astype(np.float32)
        if path[-1] == "scale":
            out[path] = 1.0 + 0.2 * noise
        elif "bias" in path[-1]:
            out[path] = 0.1 * noise
        elif path[-1] in ("embedding", "decoder"):
            out[path] = 0.5 * noise
        else:
            out[path] = noise / np.sqrt(SHAPE["hidden_size"])
    return traverse_util.unflatten_dict({k: v.astype(np.float32) for k, v in out.items()})


def _stacked(arch, scanned_module, params, *inputs):
    """``params`` of an unrolled model with the encoder's layers stacked as ``scanned_module``'s."""
    shapes = jax.eval_shape(lambda: scanned_module.init(jax.random.key(0), *inputs))
    fresh = nn.meta.unbox(shapes["params"])[arch.encoder_name]
    name = arch.encoder_name
    return {**params, name: merge_encoder(fresh, params[name], "unrolled", arch)}


def _unrolled_flat(tree) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in unstack_layers(flatten_params(tree)).items()}


def _scale(x) -> float:
    """The largest magnitude of ``x``, at least 1."""
    return max(1.0, float(np.max(np.abs(np.asarray(x, np.float64)))))


def _max_diff(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))))


@pytest.mark.parametrize("name", SCANNING)
def test_scanned_layers_compute_what_the_unrolled_layers_do(name):
    arch = models.architecture(name)
    cfg = _config(arch, hidden_dropout=0.1, attention_dropout=0.1)
    scan = cfg.replace(scan_layers=True)
    ids, types, mask = _batch()
    positions = np.array([[1, 4, 9], [0, 2, 6]], np.int32)
    labels = np.array([[7, 8, 9], [10, 11, 12]], np.int32)
    inputs = (ids, types, mask, positions)

    def pretraining(c):
        return PreTrainingModel(c, nsp=arch.nsp)

    params = _random_params(pretraining(cfg), 1, *inputs)
    stacked = _stacked(arch, pretraining(scan), params, *inputs)

    def loss(c, p, rng=None):
        out = pretraining(c).apply(
            {"params": p},
            *inputs,
            deterministic=rng is None,
            rngs={} if rng is None else {"dropout": rng},
        )
        nll = optax.softmax_cross_entropy_with_integer_labels(out["mlm_logits"], labels).mean()
        return nll, out

    def step(c):  # one training step's loss, outputs and gradients
        return jax.jit(jax.value_and_grad(lambda p: loss(c, p), has_aux=True))

    (want_loss, want), want_grads = step(cfg)(params)
    (got_loss, got), got_grads = step(scan)(stacked)
    diffs = {"loss": _max_diff(got_loss, want_loss)}
    scales = {"loss": _scale(want_loss)}
    for key in ("sequence_output", "mlm_logits"):
        diffs[key], scales[key] = _max_diff(got[key], want[key]), _scale(want[key])
    want_grads, got_grads = _unrolled_flat(want_grads), _unrolled_flat(got_grads)
    assert sorted(got_grads) == sorted(want_grads)
    assert any("layer_2/" in k for k in got_grads)
    diffs["gradients"] = max(_max_diff(got_grads[k], want_grads[k]) for k in want_grads)
    scales["gradients"] = max(_scale(g) for g in want_grads.values())
    assert min(np.abs(g).max() for k, g in want_grads.items() if "layer_" in k) > 0

    clf = SequenceClassifier(cfg, num_labels=3)
    clf_params = _random_params(clf, 3, ids, types, mask)
    scan_clf = SequenceClassifier(scan, num_labels=3)
    clf_stacked = _stacked(arch, scan_clf, clf_params, ids, types, mask)
    want_clf = jax.jit(clf.apply)({"params": clf_params}, ids, types, mask)
    got_clf = jax.jit(scan_clf.apply)({"params": clf_stacked}, ids, types, mask)
    diffs["classifier_logits"] = _max_diff(got_clf, want_clf)
    scales["classifier_logits"] = _scale(want_clf)
    # float32 rounding: TOL relative to the largest value compared
    assert all(v <= TOL * s for v, s in zip(diffs.values(), scales.values())), (diffs, scales)

    # Training mode: dropout is applied (the scan splits the dropout key per layer) and the
    # outputs are reproducible from the key.
    train = jax.jit(lambda p, rng: loss(scan, p, rng)[1]["sequence_output"])
    first = train(stacked, jax.random.key(5))
    np.testing.assert_array_equal(first, train(stacked, jax.random.key(5)))
    assert _max_diff(first, got["sequence_output"]) > 1e-2
    encoder = arch.encoder(scan, name=arch.encoder_name)
    with pytest.raises(ValueError, match="output_hidden_states needs scan_layers=False"):
        jax.eval_shape(  # refused while tracing: nothing to compile
            lambda: encoder.apply(
                {"params": stacked[arch.encoder_name]}, ids, types, mask, output_hidden_states=True
            )
        )


def _training_checkpoint(workdir, arch, params) -> None:
    """What a pretraining run with ``scan_layers=True`` leaves: WORKDIR/checkpoints/<step>."""
    model = {"architecture": arch.name, "preset": arch.preset_names()[0], **_fields(arch)}
    model.update(scan_layers=True, remat="none", dtype="float32", max_position_embeddings=64)
    experiment = {"task": "pretrain", "model": model, "data": {"vocab": "", "prepared_dir": ""}}
    ckpt = Checkpointer(str(workdir / "checkpoints"), async_save=False)
    ckpt.save(3, {"params": params, "step": np.int32(3)}, {}, json.dumps(experiment), force=True)
    ckpt.close()


@pytest.mark.parametrize("name", SCANNING)
def test_scanned_checkpoint_to_and_from_transformers(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    arch = models.architecture(name)
    scan = _config(arch, scan_layers=True, max_position_embeddings=64)
    ids, types, mask = _batch(seed=1)
    module = PreTrainingModel(scan, nsp=arch.nsp)
    params = _random_params(module, 4, ids, types, mask)
    stacked = f"{arch.encoder_name}/{arch.scanned_layers[0]}/"  # where the contract says
    assert any(k.startswith(stacked) for k in flatten_params(params))
    _training_checkpoint(tmp_path / "run", arch, params)

    # A scanned run -> transformers: the exported model computes the run's logits.
    ckpt = load_checkpoint(str(tmp_path / "run"))
    assert not ckpt.config.scan_layers and ckpt.config.num_layers == SHAPE["num_layers"]
    save_checkpoint(ckpt, str(tmp_path / "hf"), "hf")
    hf = transformers.AutoModelForMaskedLM.from_pretrained(
        str(tmp_path / "hf"), attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        want = hf(
            input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long()
        ).logits.numpy()
    got = jax.jit(module.apply)({"params": params}, ids, types, mask)["mlm_logits"]
    real = mask.astype(bool)
    assert _max_diff(np.asarray(got)[real], want[real]) <= 1e-5

    # transformers -> a scanned model (what init_checkpoint does): the same tensors, restacked.
    back = load_checkpoint(str(tmp_path / "hf")).tensors
    source = traverse_util.unflatten_dict(
        {tuple(k.split("/")[1:]): v for k, v in back.items() if k.startswith(arch.encoder_name)}
    )
    restacked = {
        **params,
        arch.encoder_name: merge_encoder(params[arch.encoder_name], source, "hf", arch),
    }
    want_flat = flatten_params(params)
    got_flat = {k: v for k, v in flatten_params(restacked).items() if k in back or "/layers/" in k}
    assert sorted(got_flat) == sorted(want_flat)
    for key, value in want_flat.items():
        np.testing.assert_array_equal(got_flat[key], value, err_msg=key)
