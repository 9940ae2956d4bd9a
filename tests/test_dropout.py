"""bertjax.layers.dropout: the flax-compatible masks and the statistics of the 16-bit masks."""

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from bertjax import PreTrainingModel
from bertjax.layers.dropout import Dropout, keep_threshold, random_halfwords
from bertjax.models.bert import get_preset

# One compiled program per shape (and key impl) instead of one per primitive, run eagerly.
_halfwords = jax.jit(random_halfwords, static_argnums=1)


class _TwoSites(nn.Module):
    """Two dropout sites in one parent, named automatically like the model's."""

    impl: str
    flax_module: bool = False

    @nn.compact
    def __call__(self, x):
        make = (lambda: nn.Dropout(0.1)) if self.flax_module else (lambda: Dropout(0.1, self.impl))
        return make()(x, deterministic=False), make()(x, deterministic=False)


def test_flax_impl_draws_exactly_flax_linen_dropout_masks():
    x = np.ones((4, 16, 32), np.float32)
    rngs = {"dropout": jax.random.key(7)}
    ours = jax.jit(_TwoSites("flax").apply)({}, x, rngs=rngs)
    ref = jax.jit(_TwoSites("flax", flax_module=True).apply)({}, x, rngs=rngs)
    for a, b in zip(ours, ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(ours[0]), np.asarray(ours[1]))  # sites differ


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_bits16_keep_rate_and_unbiased_expectation(rate):
    x = np.full((64, 128, 512), 3.0, np.float32)  # 4.2M elements
    apply = jax.jit(lambda x, rngs: Dropout(rate).apply({}, x, False, rngs=rngs))
    y = np.asarray(apply(x, {"dropout": jax.random.key(0)}))
    keep_p = keep_threshold(rate) / 2**16
    sigma = np.sqrt(keep_p * (1 - keep_p) / y.size)
    assert abs((y != 0).mean() - keep_p) < 5 * sigma
    # kept values are rescaled by exactly 1/keep_p, so the mean is x up to sampling noise
    np.testing.assert_allclose(np.unique(y[y != 0]), [3.0 / keep_p], rtol=1e-6)
    assert abs(y.mean() - 3.0) < 5 * 3.0 / keep_p * sigma


def test_bits16_masks_are_uncorrelated_within_and_across_blocks():
    # one Threefry block feeds 4 neighbours on the last axis: check lags 1..8 and across rows
    keep = (np.asarray(_halfwords(jax.random.key(3), (2048, 512))) < 2**15).astype(np.float64)
    flat = keep.reshape(-1)
    for lag in range(1, 9):
        corr = np.corrcoef(flat[:-lag], flat[lag:])[0, 1]
        assert abs(corr) < 5 / np.sqrt(flat.size), (lag, corr)
    rows = np.corrcoef(keep[:-1].reshape(-1), keep[1:].reshape(-1))[0, 1]
    assert abs(rows) < 5 / np.sqrt(flat.size)
    # the 16-bit values are uniform: every top-4-bit bucket gets 1/16 of the values
    values = np.asarray(_halfwords(jax.random.key(4), (1024, 256)))
    counts = np.bincount(values.reshape(-1) >> 12, minlength=16) / values.size
    np.testing.assert_allclose(counts, 1 / 16, atol=5 * np.sqrt(1 / 16 / values.size))


@pytest.mark.parametrize(
    "key,shape",
    [
        (jax.random.key(1), (8, 12)),  # Threefry, four per block
        (jax.random.key_data(jax.random.key(1)), (8, 12)),  # raw uint32[2] key data
        (jax.random.key(1, impl="rbg"), (8, 12)),  # other impls: two per jax.random.bits word
        (jax.random.key(1), (8, 6)),  # last axis not a multiple of 4
        (jax.random.key(1), (8, 7)),  # odd: one per word
    ],
)
def test_halfwords_every_path_is_deterministic_and_in_range(key, shape):
    a, b = np.asarray(_halfwords(key, shape)), np.asarray(_halfwords(key, shape))
    np.testing.assert_array_equal(a, b)
    assert a.shape == shape and int(a.max()) < 2**16 and len(np.unique(a)) > 0.9 * a.size


def test_bits16_mask_does_not_depend_on_sharding():
    """Like jax.random.bits, the mask is a function of (key, index): sharded == unsharded."""
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    key = jax.random.key(5)
    whole = jax.jit(lambda k: random_halfwords(k, (8, 16, 64)))(key)
    sharded = jax.jit(
        lambda k: random_halfwords(k, (8, 16, 64)),
        out_shardings=NamedSharding(mesh, PartitionSpec("data", None, "tensor")),
    )(key)
    np.testing.assert_array_equal(np.asarray(whole), np.asarray(sharded))


def test_model_losses_equal_without_dropout_and_differ_with_it():
    """Both impls compute the same model; with dropout on they draw different masks."""
    ids = jax.random.randint(jax.random.key(0), (2, 16), 5, 100)
    outs = {}
    for impl in ("bits16", "flax"):
        cfg = get_preset("tiny", vocab_size=100, max_position_embeddings=16, dropout_impl=impl)
        model = PreTrainingModel(cfg)
        params = model.init(jax.random.key(1), ids)
        outs[impl, True] = model.apply(params, ids)["mlm_logits"]
        rngs = {"dropout": jax.random.key(2)}
        outs[impl, False] = model.apply(params, ids, deterministic=False, rngs=rngs)["mlm_logits"]
    np.testing.assert_array_equal(outs["bits16", True], outs["flax", True])
    assert not np.allclose(outs["bits16", False], outs["flax", False])
    assert np.isfinite(np.asarray(outs["bits16", False])).all()


def test_bad_dropout_impl_is_a_config_error():
    with pytest.raises(ValueError, match="dropout_impl"):
        get_preset("tiny", dropout_impl="fast")
