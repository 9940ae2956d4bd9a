"""ColBERT training (the `colbert` task): a BEIR folder or JSON lines train a tiny encoder with
PyLate's Contrastive or Distillation loss through the one trainer; the cached two-pass step over
micro-batches gives the whole batch's update; evaluation scores exact MaxSim search; the run's
PyLate export loads back with the vectors the run's model computes."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_run
from train_fixtures import set_keys

import bertjax
from bertjax import convert, train
from bertjax.commands import score
from configs import colbert as colbert_config


def _config(beir_dir, **overrides):
    c = tiny_run(colbert_config.get_config(), beir_dir)
    c.colbert.dim = 8
    c.colbert.query_length = 8
    c.colbert.document_length = 12
    c.colbert.skiplist_words = ("w3", "w7")  # words of the fixture, to exercise the skiplist
    return set_keys(c, overrides)


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["modernbert"])  # BERT: test_retrieval_round_trips.py
def test_a_beir_folder_trains_evaluates_and_exports(beir_dir, tmp_path, architecture):
    overrides = {}
    if architecture == "modernbert":
        overrides = {"model.architecture": "modernbert", "model.preset": "modernbert-tiny"}
    run = tmp_path / "run"
    result = train.train_and_evaluate(_config(beir_dir, **overrides), str(run))
    assert result["step"] == 2 and np.isfinite(result["train"]["loss"])
    final = json.loads((run / "eval_results.json").read_text())
    assert set(final["dev"]) == {"ndcg@10", "recall@10", "recall@100", "mrr@10", "map@100"}
    assert final["dev"]["recall@100"] == 1.0 and 0.0 < final["dev"]["ndcg@10"] <= 1.0
    # the export: load_pretrained gives a late-interaction model; evaluate retrieval uses MaxSim
    model = bertjax.load_pretrained(final["pylate"])
    assert model.late_interaction and model.embedding.query_prefix == ""  # no [Q] in vocab.txt
    queries = model.embed_queries(["w1 w2", "w3"])
    docs = model.embed_documents(["w1 w2 w3 w4", "w7"])
    assert [q.shape for q in queries] == [(8, 8), (8, 8)]  # [CLS] w w [SEP] + 4 [MASK]s
    assert [d.shape for d in docs] == [(5, 8), (2, 8)]  # w3 and w7 skipped
    np.testing.assert_allclose(np.linalg.norm(queries[0], axis=-1), 1.0, rtol=1e-5)
    # The run's folder is the same model for every consumer: load_pretrained of the run and of
    # its best step, evaluate --checkpoint=RUN, convert RUN --to=pylate (issue 33, item 1).
    for folder in (run, run / "best"):
        again_model = bertjax.load_pretrained(str(folder))
        assert again_model.late_interaction and again_model.embedding.head == model.embedding.head
        for ours, theirs in zip(again_model.embed_queries(["w1 w2", "w3"]), queries):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    convert.main(["--from=bertjax", str(run), "--to=pylate", str(tmp_path / "pylate")])
    convert.main(["--from=pylate", str(tmp_path / "pylate"), "--to=bertjax", str(tmp_path / "bj")])
    for folder in ("pylate", "bj"):  # and back: a bertjax checkpoint records the ColBERT head
        exported = bertjax.load_pretrained(str(tmp_path / folder))
        for ours, theirs in zip(exported.embed_documents(["w1 w2 w3 w4", "w7"]), docs):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    for checkpoint in (final["pylate"], str(run), str(run / "best")):
        args = score._parser().parse_args(
            ["retrieval", f"--checkpoint={checkpoint}", f"--data={beir_dir}"]
        )
        again = score.evaluate_retrieval(args)
        for key, value in final["dev"].items():
            assert again[key] == pytest.approx(value, abs=1e-6), (checkpoint, key)


def _one_step_params(beir_dir, tmp_path, accum, **overrides):
    c = _config(
        beir_dir,
        **{
            "train.steps": 1,
            "train.grad_accum_steps": accum,
            "train.global_batch_size": 8,
            "retrieval.eval": False,
            **overrides,
        },
    )
    task = train.prepared_task(c, str(tmp_path))
    setup = train.build(c, str(tmp_path), task)
    state = setup.init_state(jax.random.key_data(jax.random.key(0)))
    step = train.jit_train_step(setup, accum)
    batch = next(iter(task.train_data(setup.phases[0], 0, 1)))
    new_state, metrics = step(state, {k: jnp.asarray(v) for k, v in batch.items()})
    return jax.device_get(new_state.params), float(metrics["loss"])


def _assert_same_step(beir_dir, tmp_path, **overrides):
    whole, loss1 = _one_step_params(beir_dir, tmp_path / "a", 1, **overrides)
    cached, loss4 = _one_step_params(beir_dir, tmp_path / "b", 4, **overrides)
    assert loss4 == pytest.approx(loss1, rel=1e-5)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(cached)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_the_cached_step_over_micro_batches_is_the_whole_batch_step(beir_dir, tmp_path):
    """grad_accum_steps=4 (the two-pass cached step) updates the params as one batch of 8 does:
    every query's softmax still runs over all 8 rows' documents."""
    _assert_same_step(beir_dir, tmp_path)


def _scored_rows(path):
    rows = [
        {
            "query": "w1 w2",
            "positive": "w1 w2 w3",
            "negatives": ["w9 w8", "w7"],
            "scores": [9.0, 2.0, 1.0],
        },
        {"query": "w4 w5", "positive": "w4 w5 w6", "negatives": ["w1 w2 w3"], "scores": [5, 4]},
        {
            "query": "w10",
            "positive": "w10 w11",
            "negatives": ["w12", "w13 w14"],
            "scores": [3.0, 0.5, -1.0],
        },
        {"query": "w12", "positive": "w12 w13", "negatives": ["w1"], "scores": [1.0, 0.0]},
    ] * 2
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_distillation_reads_teacher_scores_and_keeps_the_whole_batch_step(beir_dir, tmp_path):
    path = _scored_rows(tmp_path / "train.jsonl")
    keys = {"data.train_file": str(path), "data.num_negatives": 2, "colbert.loss": "distillation"}
    task = train.prepared_task(_config(beir_dir, **keys), str(tmp_path / "run"))
    f = task.train_features
    np.testing.assert_array_equal(f["teacher_scores"][:2], [[9, 2, 1], [5, 4, 0]])
    np.testing.assert_array_equal(f["doc_valid"][:4], [[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 0]])
    _assert_same_step(beir_dir, tmp_path / "steps", **keys)
    path.write_text('{"query": "w1", "positive": "w2", "negatives": ["w3"], "scores": [1.0]}\n')
    with pytest.raises(ValueError, match=r"train.jsonl:1: \"scores\" has 1 values for 2"):
        train.prepared_task(_config(beir_dir, **keys), str(tmp_path / "bad"))


def test_bad_colbert_settings_are_one_line_errors(beir_dir, tmp_path):
    with pytest.raises(ValueError, match=r"colbert.loss='mse': choose one of"):
        train.prepared_task(_config(beir_dir, **{"colbert.loss": "mse"}), str(tmp_path / "a"))
    with pytest.raises(ValueError, match=r"max_position_embeddings=32"):
        train.prepared_task(
            _config(beir_dir, **{"colbert.document_length": 40}), str(tmp_path / "b")
        )
    with pytest.raises(ValueError, match=r"teacher scores from data.train_file"):
        train.prepared_task(
            _config(beir_dir, **{"colbert.loss": "distillation"}), str(tmp_path / "c")
        )
    with pytest.raises(ValueError, match=r"query_prefix='\[Q\] ' is not a token"):
        train.prepared_task(_config(beir_dir, **{"colbert.query_prefix": "[Q] "}), str(tmp_path))


@pytest.mark.slow
def test_training_starts_from_a_pylate_model(beir_dir, tmp_path):
    """init_checkpoint=a PyLate directory: its tokenizer ("[Q] ", "[D] " found by "auto"), its
    encoder and its projection are where training starts."""
    source = pathlib.Path(__file__).resolve().parent / "data" / "pylate" / "bert"
    c = colbert_config.get_config()
    c.data_dir = str(beir_dir)
    c.init_checkpoint = str(source)
    c = set_keys(
        c,
        {
            "colbert.dim": 16,
            "colbert.query_length": 12,
            "colbert.document_length": 20,
            "train.global_batch_size": 4,
            "train.steps": 1,
            "retrieval.eval": False,
            "mesh.num_devices": 1,
            "tensorboard": False,
        },
    )
    task = train.prepared_task(c, str(tmp_path))
    s = task.settings()
    assert (s.query_prefix, s.document_prefix) == ("[Q] ", "[D] ")
    setup = train.build(c, str(tmp_path), task)
    params = jax.device_get(setup.init_state(jax.random.key_data(jax.random.key(0))).params)
    want = bertjax.load_pretrained(str(source)).embedding.tensors["dense_0/kernel"]
    np.testing.assert_array_equal(params["dense_0"]["kernel"], want)
