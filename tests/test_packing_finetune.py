"""Fine-tuning with packed rows (data.packing): the same loss, predictions and metrics as unpacked."""

import json
import logging
import pathlib
import re

import flax.linen as nn
import jax
import numpy as np
import pytest

from bertjax import train
from bertjax.tasks.registry import get_task
from configs import glue as glue_config
from configs import ner as ner_config
from configs import squad as squad_config
from configs import swag as swag_config

WORDS = (
    "the a movie film was is good bad great awful fun dull plot actors it not very and john smith "
    "works at acme corp in london paris went"
).split()
ENTITIES = {"john": "B-PER", "smith": "I-PER", "acme": "B-ORG", "corp": "I-ORG", "london": "B-LOC"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A vocab, SST-2 and STS-B folders and CoNLL files with examples of varied length."""
    root = tmp_path_factory.mktemp("packing_ft")
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."]
    (root / "vocab.txt").write_text("\n".join(specials + WORDS) + "\n")
    rng = np.random.default_rng(0)

    def text(lo=2, hi=12):
        return " ".join(rng.choice(WORDS, rng.integers(lo, hi)))

    for name, n in (("train", 30), ("dev", 13), ("test", 9)):
        sst2, stsb = root / "glue" / "SST-2", root / "glue" / "STS-B"
        sst2.mkdir(parents=True, exist_ok=True)
        stsb.mkdir(parents=True, exist_ok=True)
        if name == "test":
            rows = "index\tsentence\n" + "".join(f"{i}\t{text()}\n" for i in range(n))
            pairs = "index\tsentence1\tsentence2\n"
            pairs += "".join(f"{i}\t{text()}\t{text(1, 6)}\n" for i in range(n))
        else:
            rows = "sentence\tlabel\n" + "".join(f"{text()}\t{i % 2}\n" for i in range(n))
            pairs = "sentence1\tsentence2\tscore\n"
            pairs += "".join(f"{text()}\t{text(1, 6)}\t{rng.uniform(0, 5):.2f}\n" for _ in range(n))
        (sst2 / f"{name}.tsv").write_text(rows)
        (stsb / f"{name}.tsv").write_text(pairs)
    (root / "ner").mkdir()
    for name, n in (("train.txt", 24), ("valid.txt", 11)):
        lines = ["-DOCSTART- -X- -X- O", ""]
        for _ in range(n):
            words = rng.choice(WORDS, rng.integers(1, 14))
            lines += [f"{w} NN O {ENTITIES.get(w, 'O')}" for w in words] + [""]
        (root / "ner" / name).write_text("\n".join(lines))
    return root


def _config(c, files, data_dir, packing, **overrides):
    c.data.vocab, c.data.do_lower_case = str(files / "vocab.txt"), True
    c.data_dir = str(files / data_dir)
    c.model.preset, c.model.num_layers, c.model.hidden_size = "tiny", 1, 32
    c.model.num_heads, c.model.intermediate_size, c.model.max_position_embeddings = 2, 64, 64
    c.model.hidden_dropout = c.model.attention_dropout = 0.0
    c.data.max_seq_length, c.data.eval_batch_size = 32, 4
    c.data.packing, c.data.max_examples_per_row = packing, 4
    c.train.steps, c.train.global_batch_size, c.train.log_every = 2, 4, 1
    c.train.async_checkpoints = False
    c.optimizer.learning_rate = 1e-3
    c.mesh.num_devices = 1
    c.tensorboard = False
    for key, value in overrides.items():
        setattr(c, key, value)
    return c


def _tasks(files, tmp_path, make, data_dir, **overrides):
    """(unpacked, packed) tasks, loaded, plus one model and its params shared by both."""
    tasks = []
    for packing in (False, True):
        config = _config(make(), files, data_dir, packing, **overrides)
        task = get_task(config.task, config, str(tmp_path))
        task.after_prepare()
        tasks.append(task)
    plain, packed = tasks
    model = plain.build_model(plain.model_config())
    batch = plain.init_batch(plain.phases()[0], 1)
    init = jax.jit(lambda rng: plain.fresh_params(model, rng, batch))  # one compile, not eager
    params = nn.meta.unbox(init(jax.random.key(1)))
    return plain, packed, model, params


def _train_loss(task, model, params):
    """(loss, metrics) over every training example (rows when packed) as one batch, jitted as the
    trainer's step is (one compile, not one per eager op and shape)."""
    feats = task.train_features
    batch = {**feats, "mask": np.ones(len(feats["input_ids"]), np.float32)}

    def loss(params, batch):
        norms = task.normalizers(batch)
        return task.loss(model, params, batch, jax.random.key(0), norms, deterministic=True)

    return jax.jit(loss)(params, batch)


def _runner(task, model, params):
    return jax.jit(lambda batch: task.eval_outputs(model, params, batch))


def _check_equal(plain, packed, model, params, examples):
    rows = len(packed.train_features["input_ids"])
    assert len(plain.train_features["input_ids"]) == examples and rows < examples / 2
    assert packed.train_features["example_weights"].sum() == examples
    loss, metrics = _train_loss(plain, model, params)
    packed_loss, packed_metrics = _train_loss(packed, model, params)
    np.testing.assert_allclose(float(packed_loss), float(loss), atol=1e-5)
    for key, value in metrics.items():
        np.testing.assert_allclose(float(packed_metrics[key]), float(value), atol=1e-5)
    runs = _runner(plain, model, params), _runner(packed, model, params)
    for name, features in [(e.name, e.features) for e in plain.eval_sets]:
        a, b = plain.predict(runs[0], features), packed.predict(runs[1], features)
        assert a.keys() == b.keys()
        for key in a:  # every example once, in the original order (tokens: the real ones)
            assert a[key].shape == b[key].shape, (name, key)
            real = features["input_mask"] > 0 if key in plain.token_outputs else slice(None)
            np.testing.assert_allclose(b[key][real], a[key][real], atol=1e-5)
    got, want = packed.evaluate(runs[1], None), plain.evaluate(runs[0], None)
    assert got.keys() == want.keys() and got
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=1e-5, err_msg=key)
    return runs


@pytest.mark.parametrize("task", ["glue/sst2", "glue/stsb"])
def test_glue_packed_loss_predictions_and_metrics_equal_unpacked(files, tmp_path, task):
    plain, packed, model, params = _tasks(
        files, tmp_path, glue_config.get_config, "glue", task=task
    )
    runs = _check_equal(plain, packed, model, params, examples=30)
    assert packed.train_features["label"].shape == packed.train_features["cls_positions"].shape
    for a, b in zip(plain.test_sets, packed.test_sets):  # the submission predictions too
        np.testing.assert_allclose(
            packed.predict(runs[1], b.features)["prediction"],
            plain.predict(runs[0], a.features)["prediction"],
            atol=1e-5,
        )


def test_ner_packed_loss_and_entity_scores_equal_unpacked(files, tmp_path):
    plain, packed, model, params = _tasks(files, tmp_path, ner_config.get_config, "ner")
    _check_equal(plain, packed, model, params, examples=24)
    assert (packed.train_features["label_ids"][packed.train_features["pack_ids"] == 0] == -1).all()


def test_glue_trains_with_packing(files, tmp_path):
    c = _config(glue_config.get_config(), files, "glue", True)
    result = train.train_and_evaluate(c, str(tmp_path))
    final = json.loads(pathlib.Path(tmp_path, "eval_results.json").read_text())
    assert result["step"] == 2 and 0.0 <= final["dev"]["accuracy"] <= 1.0
    lines = pathlib.Path(final["predictions"]["sst2:test"]).read_text().splitlines()
    assert len(lines) == 10  # header + every test example once


@pytest.mark.parametrize(
    "make, reason",
    [
        (squad_config.get_config, "its doc_stride windows already fill max_seq_length"),
        (swag_config.get_config, "an example is a fixed group of 4 choice rows"),
    ],
)
def test_squad_and_swag_refuse_packing_in_one_line(files, tmp_path, make, reason):
    c = _config(make(), files, "glue", True)
    with pytest.raises(
        ValueError, match=r"^config key data.packing=True: task \S+ cannot be packed"
    ):
        get_task(c.task, c, str(tmp_path)).after_prepare()
    with pytest.raises(ValueError, match=reason):
        get_task(c.task, c, str(tmp_path)).after_prepare()


@pytest.mark.parametrize("task, data_dir", [("glue/sst2", "glue"), ("ner/conll2003", "ner")])
def test_batch_packing_trains_the_unpacked_run(files, tmp_path, task, data_dir, caplog):
    """data.batch_packing (the fine-tuning default): every step trains on the unpacked run's
    examples, in fewer rows, so the logged losses and the final dev metrics equal the unpacked
    run's (dropout off); the start-up line says the global batch and the rows it is packed in."""
    make = glue_config.get_config if data_dir == "glue" else ner_config.get_config
    runs, rows = {}, {}
    for batch_packing in (False, True):
        c = _config(make(), files, data_dir, False, task=task)
        c.data.batch_packing, c.data.eval_packing = batch_packing, False
        c.train.steps, c.train.global_batch_size = 4, 8
        workdir = tmp_path / f"batch_packing_{batch_packing}"
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="bertjax"):
            result = train.train_and_evaluate(c, str(workdir))
        banner = next(r.getMessage() for r in caplog.records if "compiling" in r.getMessage())
        packed_rows = re.search(r"batch 8 examples in (\d+) packed rows x seq", banner)
        assert (packed_rows is not None and int(packed_rows[1]) < 8) == batch_packing, banner
        assert batch_packing or "batch 8 x seq" in banner, banner
        logged = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
        rows[batch_packing] = [r for r in logged if r.get("split") == "train"]
        runs[batch_packing] = result, [r["loss"] for r in rows[batch_packing]]
    (plain, plain_losses), (packed, packed_losses) = runs[False], runs[True]
    assert len(plain_losses) == 4
    # FLOPs counted from the rows run: per step, fewer for the packed batches.
    flops = {k: [r["tflops_per_device"] / r["steps_per_sec"] for r in rows[k]] for k in rows}
    assert max(flops[True]) < min(flops[False])
    np.testing.assert_allclose(packed_losses, plain_losses, rtol=2e-5)
    for key, value in plain["eval"].items():
        np.testing.assert_allclose(packed["eval"][key], value, rtol=1e-4, atol=1e-5, err_msg=key)


def test_batch_packed_rows_hold_each_global_batch_and_split_among_hosts(files, tmp_path):
    from bertjax.data.array_data import ArrayData
    from bertjax.data.batch_packing import BatchPacked, row_buckets

    c = _config(glue_config.get_config(), files, "glue", False)
    task = get_task(c.task, c, str(tmp_path))
    task.after_prepare()
    features = task.train_features
    assert row_buckets(32, 1) == [4, 8, 16, 32] and row_buckets(32, 8) == [8, 16, 32]
    hosts = [
        BatchPacked(
            ArrayData(features, 8, seed=3),
            max_examples_per_row=4,
            buckets=row_buckets(8, 2),
            process_index=i,
            process_count=2,
        )
        for i in range(2)
    ]
    plain = ArrayData(features, 8, seed=3)
    for _ in range(5):  # crosses an epoch (30 examples)
        parts = [next(h) for h in hosts]
        rows = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        want = next(plain)
        assert len(rows["input_ids"]) in (2, 4, 8) and len(parts[0]["input_ids"]) * 2 == len(
            rows["input_ids"]
        )
        weights = rows["example_weights"] * rows["mask"][:, None]
        assert weights.sum() == 8  # the batch's 8 examples, each once
        got = sorted(rows["label"][weights > 0].tolist())
        assert got == sorted(want["label"].tolist())
        tokens = (rows["input_mask"] * rows["mask"][:, None]).sum()
        assert tokens == want["input_mask"].sum()  # every real token of the batch, once
    # Resuming on one host at the saved position packs the next global batch the two hosts
    # would have packed.
    again = BatchPacked(
        ArrayData(features, 8, seed=3), max_examples_per_row=4, buckets=row_buckets(8, 2)
    )
    again.restore(hosts[0].state())
    parts, single = [next(h) for h in hosts], next(again)
    for key, value in single.items():
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), value)
