"""Bi-encoder training (the `retrieval` task): JSON lines train a tiny encoder through the one
trainer; the cached two-pass step over micro-batches gives the whole batch's update; a row's own
positive, repeated in another row, is never its negative. A run on a BEIR folder, its measures,
its best nDCG@10 and its folder through every consumer: test_retrieval_round_trips.py."""

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_run
from train_fixtures import set_keys

from bertjax import train
from bertjax.retrieval import contrastive_losses
from configs import retrieval as retrieval_config


def _config(beir_dir, **overrides):
    c = tiny_run(retrieval_config.get_config(), beir_dir)
    c.data.max_seq_length = 16
    c.data.max_query_length = 8
    return set_keys(c, overrides)


def _one_step_params(beir_dir, tmp_path, accum, batch=8, **mesh):
    c = _config(
        beir_dir,
        **{
            "train.steps": 1,
            "train.grad_accum_steps": accum,
            "train.global_batch_size": batch,
            "retrieval.eval": False,
            **{f"mesh.{k}": v for k, v in mesh.items()},
        },
    )
    task = train.prepared_task(c, str(tmp_path))
    setup = train.build(c, str(tmp_path), task)
    state = setup.init_state(jax.random.key_data(jax.random.key(0)))
    step = train.jit_train_step(setup, accum)
    batch = next(iter(task.train_data(setup.phases[0], 0, 1)))
    new_state, metrics = step(state, {k: jnp.asarray(v) for k, v in batch.items()})
    return jax.device_get(new_state.params), float(metrics["loss"])


@pytest.fixture(scope="module")
def one_device_step(beir_dir, tmp_path_factory):
    """(params, loss) after one whole-batch step of 8 on one device: the reference of the cached
    step and of the sharded steps below (built and run once)."""
    return _one_step_params(beir_dir, tmp_path_factory.mktemp("one_device"), 1)


@pytest.mark.slow
def test_the_cached_step_over_micro_batches_is_the_whole_batch_step(
    beir_dir, tmp_path, one_device_step
):
    """grad_accum_steps=4 (the two-pass cached step) updates the params as one batch of 8 does:
    every query still sees all 8 positives as negatives."""
    whole, loss1 = one_device_step
    cached, loss4 = _one_step_params(beir_dir, tmp_path / "b", 4)
    assert loss4 == pytest.approx(loss1, rel=1e-5)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(cached)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_every_devices_documents_are_negatives_for_every_query(beir_dir, tmp_path, one_device_step):
    """The batch split over 4 data-parallel devices (and 2 x 2 data x fsdp) updates the params as
    on one device: the loss scores each query against the documents of the whole global batch."""
    one, loss1 = one_device_step
    for name, mesh in (("b", {"num_devices": 4}), ("c", {"num_devices": 4, "fsdp": 2})):
        four, loss4 = _one_step_params(beir_dir, tmp_path / name, 1, **mesh)
        assert loss4 == pytest.approx(loss1, rel=1e-5)
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(four)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_json_lines_with_hard_negatives(beir_dir, tmp_path):
    rows = [
        {"query": "w1 w2", "positive": "w1 w2 w3", "negatives": ["w9 w8", "w7"]},
        {"query": "w4 w5", "positive": "w4 w5 w6", "negatives": ["w1 w2 w3"]},
        {"query": "w10", "positive": "w10 w11"},
        {"query": "w12", "positive": "w12 w13", "negatives": []},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = _config(beir_dir, **{"data.train_file": str(path), "data.num_negatives": 2})
    task = train.prepared_task(c, str(tmp_path / "run"))
    f = task.train_features
    assert f["doc_ids"].shape[:2] == (4, 3)
    np.testing.assert_array_equal(f["doc_valid"], [[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 0, 0]])
    result = train.train_and_evaluate(c, str(tmp_path / "run"))
    assert np.isfinite(result["train"]["loss"])
    path.write_text('{"query": "a"}\n')
    with pytest.raises(ValueError, match=r"train.jsonl:1: no .positive. field"):
        train.prepared_task(c, str(tmp_path / "bad"))


def test_a_repeated_positive_is_not_a_negative_of_its_own_query():
    rng = np.random.default_rng(0)
    q, d = rng.normal(size=(4, 8)), rng.normal(size=(4, 1, 8))
    d[2, 0] = d[0, 0]  # rows 0 and 2 share a positive
    key = np.array([7, 1, 7, 3])
    # jitted: one compile each, not one per op
    loss = jax.jit(contrastive_losses.multiple_negatives_ranking_loss)
    got, _ = loss(q, d, positive_key=key)
    scores = np.asarray(jax.jit(contrastive_losses.similarity)(q, d[:, 0])) * 20.0
    scores[0, 2] = scores[2, 0] = -np.inf
    logsumexp = jax.jit(jax.nn.logsumexp, static_argnames="axis")
    want = np.mean(logsumexp(scores, axis=1) - np.diag(scores))
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    plain, _ = loss(q, d)
    assert float(plain) > float(got)  # the shared positive counted against rows 0 and 2


def test_tokens_per_step_counts_queries_and_every_document(beir_dir, tmp_path):
    """tok/s of a retrieval step counts every text it encodes: the queries, the positives and the
    hard negatives (8 rows: 8 queries of 8 tokens, 8 x 3 documents of 16), not the queries alone."""
    c = _config(beir_dir, **{"data.num_negatives": 2})
    task = train.prepared_task(c, str(tmp_path))
    phase = types.SimpleNamespace(global_batch_size=8)
    assert task.tokens_per_step(phase) == 8 * 8 + 8 * 3 * 16
