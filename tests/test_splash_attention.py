"""The Pallas splash-attention path, run in the Pallas interpreter on CPU: kernel vs explicit
softmax attention (padding, packed segments, gradients), the model switch, the shard_map wrapper."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax import PreTrainingModel, losses, sharding
from bertjax.layers.splash_attention import (
    INTERPRET_ENV,
    block_size,
    segment_ids_from_mask,
    splash_attention,
)
from bertjax.models.bert import get_preset

SEQ, HEADS, HEAD_DIM = 128, 2, 64  # 128: the kernel's smallest block (TPU lane width)
VOCAB = 97


def _qkv(batch=2, seed=0):
    rng = np.random.default_rng(seed)
    shape = (batch, SEQ, HEADS, HEAD_DIM)  # [batch, seq, heads, head_dim]
    return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(3))


@jax.jit
def _reference(q, k, v, allowed):
    """Explicit fp32 softmax attention; allowed [batch, q, k] bool (one compiled program)."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q / np.sqrt(q.shape[-1]), k)
    logits = jnp.where(allowed[:, None], logits, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def _packed_ids():
    """Row 0: sequences 1 and 2 then padding; row 1: one sequence filling the row."""
    row0 = np.r_[np.full(50, 1), np.full(60, 2), np.zeros(18)]
    return jnp.asarray(np.stack([row0, np.ones(SEQ)]), jnp.int32)  # [batch, seq]


def _splash(q, k, v, ids):
    return splash_attention(q, k, v, ids, interpret=True)


def test_padding_mask_matches_explicit_attention_at_real_tokens():
    q, k, v = _qkv()
    mask = np.ones((2, SEQ), np.int32)
    mask[1, 100:] = 0  # row 1 is padded
    ids = segment_ids_from_mask(jnp.asarray(mask))
    np.testing.assert_array_equal(ids, mask)
    got = jax.jit(_splash)(q, k, v, ids)
    keys_allowed = np.broadcast_to(mask.astype(bool)[:, None, :], (2, SEQ, SEQ))
    ref = np.asarray(_reference(q, k, v, keys_allowed))  # the model's bias: padding keys masked
    assert got.shape == q.shape and got.dtype == q.dtype
    got = np.asarray(got)
    np.testing.assert_allclose(got[0], ref[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got[1, :100], ref[1, :100], atol=1e-5, rtol=1e-5)
    # Padding queries attend to the padding keys only: finite, and never seen by a real token.
    assert bool(np.isfinite(got).all())


def test_packed_segments_give_block_diagonal_attention():
    q, k, v = _qkv(seed=1)
    ids = _packed_ids()
    got = jax.jit(_splash)(q, k, v, ids)
    ref = _reference(q, k, v, np.asarray(ids)[:, :, None] == np.asarray(ids)[:, None, :])
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)  # every position, padding included
    # Pack ids are the segment ids as they are (input_mask unread, as in attention_bias).
    np.testing.assert_array_equal(segment_ids_from_mask(jnp.ones((2, SEQ)), ids), ids)


def test_gradients_match_the_reference_and_are_finite():
    q, k, v = _qkv(seed=2)
    ids = _packed_ids()
    cotangent = jnp.asarray(np.random.default_rng(3).standard_normal(q.shape), jnp.float32)
    allowed = np.asarray(ids)[:, :, None] == np.asarray(ids)[:, None, :]

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v) * cotangent).sum()

    got = jax.jit(jax.grad(loss(lambda q, k, v: _splash(q, k, v, ids)), argnums=(0, 1, 2)))(q, k, v)
    ref = jax.jit(jax.grad(loss(lambda q, k, v: _reference(q, k, v, allowed)), argnums=(0, 1, 2)))(
        q, k, v
    )
    for name, g, r in zip("qkv", got, ref):
        assert bool(np.isfinite(np.asarray(g)).all()), name
        np.testing.assert_allclose(g, r, atol=2e-5, rtol=1e-4, err_msg=f"d{name}")


def test_shapes_and_backend_are_checked():
    q, k, v = _qkv()
    ids = jnp.ones((2, SEQ), jnp.int32)
    assert (block_size(128), block_size(256), block_size(512), block_size(1536)) == (
        128,
        256,
        512,
        512,
    )
    with pytest.raises(ValueError, match="multiple of 128.*got 96"):
        splash_attention(q[:, :96], k[:, :96], v[:, :96], ids[:, :96], interpret=True)
    with pytest.raises(ValueError, match="segment_ids must be"):
        splash_attention(q, k, v, ids[:1], interpret=True)
    with pytest.raises(ValueError, match="\\[batch, seq\\] attention mask"):
        segment_ids_from_mask(jnp.ones((2, SEQ, SEQ)))
    if jax.default_backend() != "tpu":
        with pytest.raises(RuntimeError, match="attention_impl='splash' needs a TPU"):
            splash_attention(q, k, v, ids)


def _pretraining_losses(cfg, params, batch):
    out = PreTrainingModel(cfg).apply(
        {"params": params},
        batch["input_ids"],
        batch["segment_ids"],
        batch["input_mask"],
        batch["masked_lm_positions"],
    )
    mlm, _ = losses.masked_lm_loss(out["mlm_logits"], batch["masked_lm_ids"], batch["weights"])
    nsp, _ = losses.nsp_loss(out["nsp_logits"], batch["next_sentence_labels"])
    return mlm, nsp


def test_model_switch_computes_the_same_losses(monkeypatch):
    rng = np.random.default_rng(4)
    mask = np.ones((2, SEQ), np.int32)
    mask[1, 70:] = 0
    batch = dict(
        input_ids=rng.integers(5, VOCAB, (2, SEQ)).astype(np.int32) * mask,
        segment_ids=(np.arange(SEQ) >= 40).astype(np.int32)[None].repeat(2, 0) * mask,
        input_mask=mask,
        masked_lm_positions=np.array([[3, 50, 90, 120], [1, 20, 69, 0]], np.int32),
        masked_lm_ids=rng.integers(5, VOCAB, (2, 4)).astype(np.int32),
        weights=np.array([[1, 1, 1, 1], [1, 1, 1, 0]], np.float32),
        next_sentence_labels=np.array([0, 1], np.int32),
    )
    batch = {key: jnp.asarray(value) for key, value in batch.items()}
    cfg = get_preset("tiny", vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0)
    params = jax.jit(PreTrainingModel(cfg).init)(jax.random.key(0), batch["input_ids"])["params"]
    params = nn.meta.unbox(params)
    splash_cfg = cfg.replace(attention_impl="splash")
    if jax.default_backend() != "tpu":
        with pytest.raises(RuntimeError, match="needs a TPU"):  # refused while tracing
            jax.jit(lambda p: _pretraining_losses(splash_cfg, p, batch))(params)
        monkeypatch.setenv(INTERPRET_ENV, "1")
    ref = jax.jit(lambda p: _pretraining_losses(cfg, p, batch))(params)
    got = jax.jit(lambda p: _pretraining_losses(splash_cfg, p, batch))(params)
    for name, g, r in zip(("mlm", "nsp"), got, ref):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5, err_msg=name)


def test_sharded_call_runs_the_kernel_per_device_and_matches():
    q, k, v = _qkv(batch=4, seed=5)
    ids = jnp.concatenate([_packed_ids(), _packed_ids()[::-1]])  # [4, seq]
    single = jax.jit(_splash)(q, k, v, ids)
    mesh = sharding.create_mesh(2, 2, 2)  # batch over data*fsdp = 4, heads over tensor = 2
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
        jaxpr = str(jax.make_jaxpr(_splash)(q, k, v, ids))
        got = jax.jit(_splash)(q, k, v, ids)
    assert "shard_map" in jaxpr and "shard_map" not in str(jax.make_jaxpr(_splash)(q, k, v, ids))
    assert got.sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"), None, "tensor")
    np.testing.assert_allclose(got, single, atol=1e-6, rtol=1e-6)


def _pallas_costs(jaxpr) -> list:
    """The cost_estimate of every pallas_call in a jaxpr, its sub-jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn.params.get("cost_estimate"))
        for value in eqn.params.values():
            for sub in value if isinstance(value, list | tuple) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _pallas_costs(inner)
    return found


@pytest.mark.parametrize("window", [0, 32])
def test_the_kernel_declares_its_cost_forward_and_backward(window):
    """Every pallas_call of the kernel (forward, backward dq, backward dk/dv) carries the
    declared pl.CostEstimate (jax's kernel gives none: XLA counted it as free), per example and
    scaled by the batch under vmap; the share of blocks a LocalMask skips is left out."""
    from bertjax.layers.splash_cost import kernel_costs

    q, k, v = _qkv(batch=2)
    ids = _packed_ids()

    def loss(q, k, v):
        return splash_attention(q, k, v, ids, interpret=True, local_window=window).sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    costs = _pallas_costs(jaxpr)
    assert len(costs) == 3 and all(c is not None for c in costs)
    want = kernel_costs(HEADS, SEQ, HEAD_DIM, "float32", block_size(SEQ), window // 2)
    assert sorted(c.flops for c in costs) == sorted(2 * w.flops for w in want.values())
    forward = 4 * HEADS * SEQ * SEQ * HEAD_DIM  # q k^T and p v, one example
    assert forward <= want["forward"].flops <= 1.05 * forward
    assert want["dq"].flops == want["dkv"].flops == 2 * want["forward"].flops


def test_a_local_mask_declares_only_the_blocks_it_computes():
    from bertjax.layers.splash_cost import kept_share

    assert kept_share(1024, 512, 64) == 1.0  # a +-64 band meets every 512-block pair
    assert kept_share(1024, 128, 64) == 22 / 64  # the diagonal and its neighbours of 8 x 8
    assert kept_share(512, 128, 0) == 1.0
