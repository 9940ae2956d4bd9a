"""The loss contract under micro-batching (``Task.micro_batching``): an in-batch-negative (InfoNCE)
loss's cached two-pass step equals the whole-batch gradient, plain accumulation does not, and the
trainer routes each kind (additive, cached, whole_batch) and rejects what it cannot run."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax import microbatch, sharding, train
from bertjax.tasks.base import Task
from configs import base

ROWS, FEATURES, DIM, K = 8, 6, 4, 4


class Encoder(nn.Module):
    rate: float

    @nn.compact
    def __call__(self, x, deterministic: bool):
        x = nn.tanh(nn.Dense(16)(x))
        x = nn.Dropout(self.rate)(x, deterministic=deterministic)
        return nn.Dense(DIM)(x)


def embed_rows(model, params, batch, rng):
    """Query and document embeddings of a batch's rows (one dropout key, split per tower)."""
    q_rng, d_rng = jax.random.split(rng)
    q = model.apply({"params": params}, batch["query"], False, rngs={"dropout": q_rng})
    d = model.apply({"params": params}, batch["document"], False, rngs={"dropout": d_rng})
    return {"query": q, "document": d}


def info_nce(embeddings):
    """Mean cross-entropy of each query against every document of the batch (its own is row r)."""
    logits = embeddings["query"] @ embeddings["document"].T / 0.5  # [rows, rows]
    labels = jnp.arange(logits.shape[0])
    loss = -jnp.mean(jax.nn.log_softmax(logits)[labels, labels])
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    rate: float = 0.0
    attention_impl: str = "xla"
    attention_dropout: float = 0.0


class Contrastive(Task):
    """Query/document pairs; every other document of the batch is a negative."""

    name = "test/contrastive"
    micro_batching = "cached"

    def model_config(self):
        return EncoderConfig(rate=self.config.model.hidden_dropout)

    def build_model(self, model_config):
        return Encoder(model_config.rate)

    def init_batch(self, phase, batch_size):
        return {
            "query": np.zeros((batch_size, FEATURES), np.float32),
            "document": np.zeros((batch_size, FEATURES), np.float32),
        }

    def model_inputs(self, batch):
        return {"x": batch["query"]}

    def embed(self, model, params, batch, rng):
        return embed_rows(model, params, batch, rng)

    def batch_loss(self, embeddings, batch):
        return info_nce(embeddings)


class AdditiveContrastive(Contrastive):
    """The same loss declared additive: each micro-batch's InfoNCE over its own rows only."""

    micro_batching = "additive"

    def normalizers(self, batch):
        return {"examples": jnp.asarray(batch["query"].shape[0], jnp.float32)}

    def loss(self, model, params, batch, rng, normalizers, deterministic):
        loss, metrics = info_nce(embed_rows(model, params, batch, rng))
        share = batch["query"].shape[0] / normalizers["examples"]
        return loss * share, {k: v * share for k, v in metrics.items()}


class WholeBatch(AdditiveContrastive):
    micro_batching = "whole_batch"


def _config(dropout=0.0):
    c = base.get_config()
    c.model.hidden_dropout = dropout
    c.train.steps, c.train.global_batch_size, c.train.seed = 10, ROWS, 0
    c.mesh.data, c.mesh.num_devices = 2, 2  # the micro-batches are split over the data axis
    c.optimizer.warmup_steps = 0
    return c


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    return {
        "query": query,
        "document": query + 0.3 * rng.normal(size=query.shape).astype(np.float32),
    }


def _step(task_cls, accum, tmp_path, dropout=0.0):
    """One jitted trainer step of ``task_cls`` with ``accum`` micro-batches: (metrics, params)."""
    config = _config(dropout)
    setup = train.build(config, str(tmp_path), task_cls(config, str(tmp_path)))
    state = setup.init_state(jax.random.key_data(jax.random.key(0)))
    batch = sharding.global_batch(_batch(), setup.mesh, setup.rules)
    with jax.set_mesh(setup.mesh), nn.logical_axis_rules(setup.rules):
        state, metrics = train.jit_train_step(setup, accum)(state, batch)
    return jax.device_get(metrics), jax.device_get(state.params)


def test_cached_step_equals_the_whole_batch_gradient_and_plain_accumulation_does_not():
    model = Encoder(rate=0.5)  # dropout on: both passes must draw the same mask
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    params = jax.jit(lambda x: model.init(jax.random.key(1), x, True)["params"])(batch["query"])
    rng = jax.random.key(7)
    micro = jax.jit(lambda b: jax.tree.map(lambda x: microbatch.split_rows(x, K), b))(batch)

    def embed(p, mb, r):
        return embed_rows(model, p, mb, r)

    jit_embed = jax.jit(embed)

    def whole_batch(p):  # the whole batch's loss, each micro-batch's rows under its own key
        stacked = jax.vmap(lambda i, mb: embed(p, mb, jax.random.fold_in(rng, i)))(
            jnp.arange(K), micro
        )
        return info_nce(jax.tree.map(microbatch.join_rows, stacked))

    (want_loss, want_metrics), want = jax.jit(jax.value_and_grad(whole_batch, has_aux=True))(params)
    loss, metrics, grads = jax.jit(
        lambda p: microbatch.cached_value_and_grad(embed, info_nce, p, micro, rng, K)
    )(params)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(metrics["accuracy"], want_metrics["accuracy"])
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)
    # Dropout is live (another key gives another embedding), so a second pass under another key
    # would not have matched.
    other = jit_embed(params, batch, jax.random.key(8))["query"]
    assert not np.allclose(jit_embed(params, batch, rng)["query"], other)

    def micro_loss(p, mb, r):  # plain accumulation: each micro-batch's own negatives
        loss, metrics = info_nce(embed(p, mb, r))
        return loss / K, metrics

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
    _, _, summed = jax.jit(lambda p: microbatch.accumulate(grad_fn, p, micro, rng, K))(params)
    gaps = [
        np.abs(a - b).max() / np.abs(b).max()
        for a, b in zip(
            jax.tree.leaves(jax.device_get(summed)), jax.tree.leaves(jax.device_get(want))
        )
    ]
    assert max(gaps) > 0.05, gaps


def test_split_and_join_rows_are_strided_and_inverse():
    x = np.arange(8 * 3).reshape(8, 3)
    split = jax.jit(microbatch.split_rows, static_argnums=1)(x, 4)
    assert split.shape == (4, 2, 3) and np.asarray(split)[1, 1, 0] == x[5, 0]  # rows 1 and 5
    np.testing.assert_array_equal(jax.jit(microbatch.join_rows)(split), x)


def test_the_trainer_runs_a_cached_task_as_its_whole_batch_and_sums_an_additive_one(tmp_path):
    whole, whole_params = _step(Contrastive, 1, tmp_path / "a")
    cached, cached_params = _step(Contrastive, K, tmp_path / "b")
    for key in ("loss", "accuracy", "grad_norm"):
        np.testing.assert_allclose(cached[key], whole[key], rtol=2e-5, err_msg=key)
    for a, b in zip(jax.tree.leaves(cached_params), jax.tree.leaves(whole_params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    additive_whole, _ = _step(AdditiveContrastive, 1, tmp_path / "c")
    additive, _ = _step(AdditiveContrastive, K, tmp_path / "d")
    np.testing.assert_allclose(additive_whole["grad_norm"], whole["grad_norm"], rtol=2e-5)
    assert abs(additive["grad_norm"] - whole["grad_norm"]) > 0.01 * whole["grad_norm"]
    assert additive["loss"] < whole["loss"]  # fewer negatives per query: an easier loss


def test_a_cached_task_with_dropout_trains_under_accumulation(tmp_path):
    metrics, _ = _step(Contrastive, K, tmp_path, dropout=0.3)
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0


def test_a_whole_batch_loss_with_accumulation_is_an_error_naming_the_key_and_task(tmp_path):
    metrics, _ = _step(WholeBatch, 1, tmp_path / "one")
    assert np.isfinite(metrics["loss"])
    with pytest.raises(ValueError, match=r"train.grad_accum_steps=4: task test/contrastive"):
        _step(WholeBatch, K, tmp_path / "four")


def test_an_unknown_micro_batching_is_an_error(tmp_path):
    class Odd(Contrastive):
        micro_batching = "sometimes"

    with pytest.raises(ValueError, match="micro_batching='sometimes' is not one of additive"):
        _step(Odd, 1, tmp_path)
