"""Losses against NumPy references, the optimizer's schedule/decay mask, and mesh/sharding helpers."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

from bertjax import losses, optim, sharding

# The losses as one compiled program per shape, rather than one small program per primitive.
masked_lm_loss = jax.jit(losses.masked_lm_loss)


def _np_xent(logits, labels):
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, labels[..., None], -1)[..., 0]


def test_masked_lm_loss_matches_numpy_and_ignores_padding_predictions():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 4, 11)).astype(np.float32)
    labels = rng.integers(0, 11, (3, 4))
    weights = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], np.float32)
    loss, acc = masked_lm_loss(logits, labels, weights)
    nll = _np_xent(logits, labels)
    np.testing.assert_allclose(loss, (nll * weights).sum() / weights.sum(), rtol=1e-6)
    correct = (logits.argmax(-1) == labels) * weights
    np.testing.assert_allclose(acc, correct.sum() / weights.sum(), rtol=1e-6)
    # Padding predictions do not matter, whatever their labels/logits.
    labels2, logits2 = labels.copy(), logits.copy()
    labels2[weights == 0] = 0
    logits2[weights == 0] = 100.0
    loss2, _ = masked_lm_loss(logits2, labels2, weights)
    np.testing.assert_allclose(loss2, loss, rtol=1e-6)


def test_split_batches_add_up_to_the_global_loss():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(8, 3, 7)).astype(np.float32)
    labels = rng.integers(0, 7, (8, 3)).astype(np.int32)
    weights = rng.integers(0, 2, (8, 3)).astype(np.float32)
    whole, _ = masked_lm_loss(logits, labels, weights)
    norm = weights.sum()
    parts = sum(
        np.asarray(masked_lm_loss(logits[i::4], labels[i::4], weights[i::4], norm)[0])
        for i in range(4)
    )
    np.testing.assert_allclose(parts, whole, rtol=1e-6)


def test_nsp_classification_and_regression_losses():
    logits = np.asarray([[2.0, 0.0], [0.0, 3.0], [1.0, 1.5]], np.float32)
    labels = np.asarray([0, 1, 0], np.int32)
    loss, acc = jax.jit(losses.nsp_loss)(logits, labels)
    np.testing.assert_allclose(loss, _np_xent(logits, labels).mean(), rtol=1e-6)
    np.testing.assert_allclose(acc, 2 / 3, rtol=1e-6)
    w = np.asarray([1.0, 1.0, 0.0], np.float32)
    loss_w, acc_w = jax.jit(losses.classification_loss)(logits, labels, w)
    np.testing.assert_allclose(acc_w, 1.0)
    np.testing.assert_allclose(loss_w, _np_xent(logits[:2], labels[:2]).mean(), rtol=1e-6)
    mse = jax.jit(losses.regression_loss)(
        np.asarray([[1.0], [2.0]], np.float32), np.asarray([0.0, 4.0], np.float32)
    )
    np.testing.assert_allclose(mse, 2.5)


def test_schedule_is_linear_warmup_then_linear_decay():
    sched = optim.learning_rate_schedule(1e-4, warmup_steps=10, total_steps=100)
    np.testing.assert_allclose(
        [float(sched(s)) for s in (0, 5, 10, 55, 100, 120)],
        [0.0, 5e-5, 9e-5, 4.5e-5, 0.0, 0.0],
        atol=1e-12,
    )


def test_weight_decay_skips_layernorm_and_biases():
    params = {
        "dense": {"kernel": np.ones((2, 2)), "bias": np.ones(2)},
        "LayerNorm": {"scale": np.ones(2), "bias": np.ones(2)},
        "attention_norm": {"scale": np.ones(2)},
        "word_embeddings": {"embedding": np.ones((3, 2))},
        "output_bias": np.ones(3),
    }
    mask = optim.weight_decay_mask(params)
    assert mask["dense"]["kernel"] and mask["word_embeddings"]["embedding"]
    assert not mask["dense"]["bias"] and not mask["LayerNorm"]["scale"]
    assert not mask["attention_norm"]["scale"] and not mask["output_bias"]


def _opt_config(**kw):
    c = ml_collections.ConfigDict(
        dict(
            name="adamw",
            learning_rate=0.1,
            warmup_steps=0,
            b1=0.9,
            b2=0.999,
            eps=1e-6,
            weight_decay=0.01,
            grad_clip_norm=1.0,
            end_lr_factor=0.0,
        )
    )
    c.update(kw)
    return ml_collections.ConfigDict({"optimizer": c})


def test_adamw_first_step_matches_hand_computation():
    tx, _ = optim.create_optimizer(_opt_config(), total_steps=10)
    params = {"dense": {"kernel": np.asarray([[1.0, -2.0]], np.float32), "bias": np.float32([0.5])}}
    grads = {"dense": {"kernel": np.asarray([[3.0, 4.0]], np.float32), "bias": np.float32([0.0])}}
    state = jax.jit(tx.init)(params)
    updates, _ = jax.jit(tx.update)(grads, state, params)
    # Clip to global norm 1 (norm 5), Adam's first bias-corrected step is sign(g), decay 0.01*w.
    lr = 0.1
    expected_kernel = -lr * (
        np.sign([[3.0, 4.0]]) * (np.abs([[0.6, 0.8]]) / (np.abs([[0.6, 0.8]]) + 1e-6))
        + 0.01 * np.array([[1.0, -2.0]])
    )
    np.testing.assert_allclose(updates["dense"]["kernel"], expected_kernel, rtol=1e-5)
    np.testing.assert_allclose(updates["dense"]["bias"], [0.0], atol=1e-7)  # no decay on biases


def test_unknown_optimizer_is_a_config_error():
    with pytest.raises(ValueError, match="optimizer.name='sgd'"):
        optim.create_optimizer(_opt_config(name="sgd"), total_steps=10)


def test_lamb_is_available():
    tx, _ = optim.create_optimizer(_opt_config(name="lamb"), total_steps=10)
    params = {"w": {"kernel": np.ones((2, 2), np.float32)}}

    @jax.jit
    def norm_of_update(params):
        updates, _ = tx.update({"w": {"kernel": jnp.ones((2, 2))}}, tx.init(params), params)
        return optax.global_norm(updates)

    assert np.isfinite(np.asarray(norm_of_update(params)))


def test_mesh_shape_fills_minus_one_and_rejects_bad_sizes():
    assert sharding.mesh_shape(-1, 2, 2, 8) == (2, 2, 2)
    assert sharding.mesh_shape(1, -1, 1, 8) == (1, 8, 1)
    with pytest.raises(ValueError, match="data\\*fsdp\\*tensor = 4 but there are 8 devices"):
        sharding.mesh_shape(2, 2, 1, 8)
    with pytest.raises(ValueError, match="at most one"):
        sharding.mesh_shape(-1, -1, 1, 8)
    with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
        sharding.rules_from_config([["heads", "model"]])


def test_specs_drop_axes_that_do_not_divide_a_dimension():
    mesh = sharding.create_mesh(2, 2, 2)
    assert sharding.fit_spec(PartitionSpec("tensor", "fsdp"), (1001, 64), mesh) == PartitionSpec(
        None, "fsdp"
    )
    assert sharding.fit_spec(PartitionSpec(("data", "fsdp")), (6,), mesh) == PartitionSpec("data")


def test_fsdp_shards_parameters_and_optimizer_state():
    import flax.linen as nn

    from bertjax import PreTrainingModel
    from bertjax.models.bert import get_preset

    cfg = get_preset("tiny", vocab_size=1024)
    model = PreTrainingModel(cfg)
    ids = jnp.zeros((2, 8), jnp.int32)
    tx = optax.adamw(1e-3)

    def init():
        params = model.init(jax.random.key(0), ids)["params"]
        return {"params": params, "opt": tx.init(params)}

    abstract = jax.eval_shape(init)
    totals = {}
    for name, shape in (("data", (8, 1, 1)), ("fsdp", (1, 8, 1))):
        mesh = sharding.create_mesh(*shape)
        shardings = sharding.logical_shardings(abstract, mesh, sharding.RULES)
        state = jax.jit(lambda: nn.meta.unbox(init()), out_shardings=shardings)()
        totals[name] = sharding.per_device_bytes(state)
    ratio = totals["fsdp"] / totals["data"]
    assert ratio < 0.2, ratio  # ~1/8, plus a few small replicated vectors


def _apply_update(tx, grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def test_stableadamw_matches_a_numpy_reference_over_steps():
    """Two steps of StableAdamW against the update written out in NumPy: Adam with bias
    correction and decoupled decay on kernels only, each tensor's learning rate (decay included)
    divided by max(1, sqrt(mean(g^2 / v_hat)))."""
    b1, b2, eps, wd, lr = 0.9, 0.98, 1e-6, 0.1, 0.01
    cfg = _opt_config(name="stableadamw", b1=b1, b2=b2, eps=eps, weight_decay=wd, learning_rate=lr)
    cfg.optimizer.grad_clip_norm = 0.0
    cfg.optimizer.schedule = "wsd"
    cfg.optimizer.decay_fraction = 0.0  # constant lr: the reference needs no schedule
    tx, _ = optim.create_optimizer(cfg, total_steps=10)
    params = {"d": {"kernel": jnp.asarray([[1.0, -2.0, 0.5]]), "bias": jnp.asarray([0.3])}}
    grads = [
        {"d": {"kernel": jnp.asarray([[3.0, 4.0, -1.0]]), "bias": jnp.asarray([0.2])}},
        {"d": {"kernel": jnp.asarray([[30.0, -0.1, 2.0]]), "bias": jnp.asarray([-5.0])}},
    ]
    state = jax.jit(tx.init)(params)
    apply_step = jax.jit(lambda g, state, params: _apply_update(tx, g, state, params))
    ref = {k: np.asarray(v, np.float64) for k, v in params["d"].items()}
    m = {k: np.zeros_like(v) for k, v in ref.items()}
    v = {k: np.zeros_like(x) for k, x in ref.items()}
    clipped = False
    for t, g in enumerate(grads, start=1):
        params, state = apply_step(g, state, params)
        for k in ref:
            gk = np.asarray(g["d"][k], np.float64)
            m[k] = b1 * m[k] + (1 - b1) * gk
            v[k] = b2 * v[k] + (1 - b2) * gk**2
            m_hat, v_hat = m[k] / (1 - b1**t), v[k] / (1 - b2**t)
            rms = np.sqrt(np.mean(gk**2 / np.maximum(v_hat, eps**2)))
            clipped |= rms > 1
            step = m_hat / (np.sqrt(v_hat) + eps)
            decay = wd * ref[k] if k == "kernel" else 0.0
            ref[k] = ref[k] - lr / max(1.0, rms) * (step + decay)
        for k in ref:
            np.testing.assert_allclose(params["d"][k], ref[k], rtol=1e-5, atol=1e-7)
    assert clipped  # the second step's jump in the gradient is clipped


def test_wsd_schedule_warms_up_holds_and_decays():
    sched = optim.wsd_schedule(1.0, warmup_steps=10, total_steps=100, decay_fraction=0.2)
    values = np.array([float(sched(s)) for s in (0, 5, 10, 50, 80, 90, 100)])
    np.testing.assert_allclose(values, [0.0, 0.5, 1.0, 1.0, 1.0, 0.5, 0.0], atol=1e-6)
    sqrt = optim.wsd_schedule(1.0, 0, 100, decay_fraction=0.5, end_factor=0.1, shape="1-sqrt")
    np.testing.assert_allclose(float(sqrt(75)), 0.1 + 0.9 * (1 - np.sqrt(0.5)), rtol=1e-6)
    with pytest.raises(ValueError, match="optimizer.decay_shape='cosine'"):
        optim.wsd_schedule(1.0, 0, 10, shape="cosine")
    with pytest.raises(ValueError, match="optimizer.schedule='cosine'"):
        cfg = _opt_config()
        cfg.optimizer.schedule = "cosine"
        optim.create_optimizer(cfg, total_steps=10)
