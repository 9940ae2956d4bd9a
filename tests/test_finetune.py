"""Fine-tuning tasks through the one trainer: GLUE, SQuAD, NER, SWAG, init checkpoints, seeds.

Every run uses a 1-layer H32 model, tiny files in the official formats and 2-3 steps.
"""

import json
import logging
import os
import pathlib
import shutil

import jax
import numpy as np
import pytest
from helpers import small_config

from bertjax import multiseed as finetune
from bertjax import train
from bertjax.commands import score as evaluate
from bertjax.tasks.registry import get_task
from configs import glue as glue_config
from configs import ner as ner_config
from configs import squad as squad_config
from configs import swag as swag_config

# conftest.py: `files` (tiny files in the official formats) and a module-scoped XLA cache, which
# the runs below share (most of their programs are the same).


def _results(workdir):
    return json.loads(pathlib.Path(workdir, "eval_results.json").read_text())


def test_glue_classification_trains_and_writes_submission(
    files, tmp_path, capsys, monkeypatch, caplog
):
    c = small_config(
        glue_config.get_config(), files, "glue", **{"train.steps": 0, "train.epochs": 1.0}
    )
    monkeypatch.setenv("BERTJAX_PROGRESS_SECONDS", "0")  # a progress line for every batch
    result = train.train_and_evaluate(c, str(tmp_path))
    assert "bertjax: evaluating dev: 3/3 rows (100%)" in capsys.readouterr().err  # 8 packed
    final = _results(tmp_path)
    assert result["step"] == 3  # 24 examples / batch 8 * 1 epoch
    assert final["task"] == "glue/sst2" and final["best_metric"] == "accuracy"
    assert set(final["dev"]) == {"accuracy"} and 0.0 <= final["dev"]["accuracy"] <= 1.0
    assert final["params"] == "best" and final["train_steps"] == 3
    lines = pathlib.Path(final["predictions"]["sst2:test"]).read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 8
    assert {line.split("\t")[1] for line in lines[1:]} <= {"0", "1"}
    assert c.optimizer.warmup_steps == 0  # 10% of 3 steps
    evals = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if r["split"] == "eval"] == [3]  # once per epoch
    assert all(r["tflops_per_device"] > 0 for r in evals if r["split"] == "train")
    dev_file = final["dev_predictions"]["dev"]  # the dev set's predictions, scored as written
    assert dev_file == str(tmp_path / "dev_predictions" / "sst2-dev.tsv")
    scored = evaluate.evaluate_glue_files("SST-2", str(files / "glue" / "SST-2"), dev_file)
    assert scored["accuracy"] == pytest.approx(final["dev"]["accuracy"])
    # Rerun as it finished: said, returned, nothing evaluated or written again.
    written = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    with caplog.at_level(logging.INFO, logger="bertjax"):
        again = train.train_and_evaluate(c, str(tmp_path))
    assert again == {"final": final, "step": 3}
    assert "the run finished at step 3" in caplog.text and "nothing to do" in caplog.text
    assert "evaluating" not in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == written


def test_the_final_evaluation_is_not_computed_again_by_finalize(
    files, tmp_path, monkeypatch, caplog
):
    """The best params are the last: finalize scores the dev set from the outputs of the run's
    last evaluation (no batch goes through the model twice) and reports what it logged."""
    seen = []
    real = train._runner

    def counting(setup, params):
        run = real(setup, params)

        def counted(batch):
            seen.append(train._batch_key(batch))
            return run(batch)

        return counted

    monkeypatch.setattr(train, "_runner", counting)
    c = small_config(
        glue_config.get_config(), files, "glue", **{"train.steps": 0, "train.epochs": 1.0}
    )
    with caplog.at_level(logging.INFO, logger="bertjax"):
        train.train_and_evaluate(c, str(tmp_path))
    assert seen and len(seen) == len(set(seen)), "a batch went through the model twice"
    assert "final evaluation: the outputs of step 3's evaluation (the same params)" in caplog.text
    final = _results(tmp_path)
    evals = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert final["dev"]["accuracy"] == [r for r in evals if r["split"] == "eval"][-1]["accuracy"]


def test_mnli_evaluates_matched_and_mismatched_and_ax_predicts_diagnostic(files, tmp_path):
    c = small_config(glue_config.get_config(), files, "glue", task="glue/ax")
    train.train_and_evaluate(c, str(tmp_path))
    final = _results(tmp_path)
    assert final["task"] == "glue/ax" and final["best_metric"] == "dev_matched/accuracy"
    assert set(final["dev"]) == {"dev_matched/accuracy", "dev_mismatched/accuracy"}
    ax = pathlib.Path(final["predictions"]["ax:test"])
    assert ax.name == "AX.tsv" and len(ax.read_text().splitlines()) == 5
    preds = {line.split("\t")[1] for line in ax.read_text().splitlines()[1:]}
    assert preds <= {"contradiction", "entailment", "neutral"}
    assert "mnli:test_matched" not in final["predictions"]  # no test files here: skipped
    assert sorted(final["dev_predictions"]) == ["dev_matched", "dev_mismatched"]
    assert len(pathlib.Path(final["dev_predictions"]["dev_mismatched"]).read_text().split()) > 5


def test_squad_v2_trains_and_writes_official_predictions(files, tmp_path):
    c = small_config(
        squad_config.get_config(),
        files,
        "squad",
        task="squad/v2.0",
        **{"data.max_query_length": 10, "data.doc_stride": 8},
    )
    train.train_and_evaluate(c, str(tmp_path))
    final = _results(tmp_path)
    assert final["best_metric"] == "f1"
    assert {"exact", "f1", "HasAns_f1", "NoAns_f1", "best_f1", "best_f1_thresh"} <= set(
        final["dev"]
    )
    preds = json.loads(pathlib.Path(final["predictions"]["predictions"]).read_text())
    odds = json.loads(pathlib.Path(final["predictions"]["null_odds"]).read_text())
    assert set(odds) == set(preds) == {"q1", "q2", "q3", "q4", "q5"}
    search = json.loads(pathlib.Path(final["predictions"]["best_threshold"]).read_text())
    assert search["best_f1"] == final["dev"]["best_f1"]


def _oracle(rows):
    """A stand-in for the trainer's eval runner that returns the given per-example outputs in order
    (what a perfect model would output), so the host-side scoring is checked end to end."""
    state = {"pos": 0}

    def run(batch):
        n = len(batch["mask"])
        take = {k: v[state["pos"] : state["pos"] + n] for k, v in rows.items()}
        real = int(batch["mask"].sum())
        state["pos"] += real
        pad = {k: np.concatenate([v, np.repeat(v[:1], n - len(v), 0)]) for k, v in take.items()}
        return {**pad, "mask": batch["mask"]}

    return run


@pytest.mark.parametrize("version", ["1.1", "2.0"])
def test_squad_scoring_of_a_perfect_model_is_1(files, tmp_path, version, caplog):
    c = small_config(
        squad_config.get_config(),
        files,
        "squad",
        task=f"squad/v{version}",
        **{"data.max_query_length": 10, "data.doc_stride": 8, "data.max_seq_length": 24},
    )
    task = get_task(c.task, c, str(tmp_path))
    with caplog.at_level(logging.INFO, logger="bertjax"):
        task.after_prepare()
    examples, feats, _ = task.eval_sets[0].meta
    assert len(feats) > 5  # the short window splits each context into several features
    train_feats = len(task.train_features["input_ids"])  # train = dev questions here
    assert len(examples) == (4 if version == "1.1" else 5) < train_feats
    assert (  # the log names both counts, each by its name
        f"task squad/v{version}: {len(examples)} training examples in {train_feats} features, "
        f"{len(examples)} dev examples in {len(feats)} features"
    ) in caplog.text
    assert f": {train_feats} training features," in caplog.text  # the trainer's line too
    one_hot = lambda pos: np.eye(24, dtype=np.float32)[pos] * 10.0  # [features, seq]
    # Features whose window misses the answer point at [CLS] (as in training); v1.1 ignores them.
    run = _oracle(
        {"start_logits": one_hot(feats.start_positions), "end_logits": one_hot(feats.end_positions)}
    )
    final = task.finalize(run, None, str(tmp_path))
    preds = json.loads(pathlib.Path(final["predictions"]["predictions"]).read_text())
    assert preds["q1"] == "john smith" and preds["q4"] == "acme corp"
    if version == "1.1":
        assert final["dev"] == {"exact_match": 1.0, "f1": 1.0}  # fractions, as GLUE's
        assert "null_odds" not in final["predictions"]
    else:
        assert preds["q5"] == "" and final["dev"]["exact"] == 1.0
        assert final["dev"]["NoAns_total"] == 1 and final["dev"]["best_f1"] == 1.0


def test_ner_scoring_maps_pieces_back_to_words(files, tmp_path):
    # The oracle answers per unpacked feature row.
    c = small_config(ner_config.get_config(), files, "ner", **{"data.eval_packing": False})
    task = get_task(c.task, c, str(tmp_path))
    task.after_prepare()
    gold, word_ids = task.eval_sets[0].meta
    tag_ids = np.zeros_like(word_ids)
    for i, tags in enumerate(gold):
        for pos in np.flatnonzero(word_ids[i] >= 0):
            tag_ids[i, pos] = task.labels.index(tags[word_ids[i, pos]])
    metrics = task.evaluate(_oracle({"tag_ids": tag_ids}), None)
    assert metrics == {"precision": 1.0, "recall": 1.0, "f1": 1.0, "accuracy": 1.0}
    # "john" tagged O: the gold "john smith" is missed and a wrong chunk "smith" (I-PER opens a
    # chunk, conlleval) is found: 2 of 3 entities right each way.
    tag_ids[:, 1] = task.labels.index("O")
    metrics = task.evaluate(_oracle({"tag_ids": tag_ids}), None)
    assert metrics["recall"] == pytest.approx(2 / 3) == metrics["precision"]


def test_ner_reports_entity_f1_on_dev_and_test(files, tmp_path):
    c = small_config(ner_config.get_config(), files, "ner")
    train.train_and_evaluate(c, str(tmp_path))
    final = _results(tmp_path)
    assert final["best_metric"] == "f1"
    assert set(final["dev"]) == {"precision", "recall", "f1", "accuracy"}
    assert {"f1", "per_type"} <= set(final["test"]) and final["labels"][0] == "O"


def test_swag_trains_and_predicts_test(files, tmp_path):
    c = small_config(swag_config.get_config(), files, "swag")
    train.train_and_evaluate(c, str(tmp_path))
    final = _results(tmp_path)
    assert set(final["dev"]) == {"accuracy"}
    lines = pathlib.Path(final["predictions"]["test"]).read_text().splitlines()
    assert lines[0] == "guid,label" and len(lines) == 13


def _tiny_hf_checkpoint(files, path, config=None):
    """A random BertModel written as a Hugging Face directory (config.json + model.safetensors);
    ``config`` defaults to one layer of 32 over the files' vocabulary."""
    import flax.linen as nn

    from bertjax.convert import Checkpoint, flatten_params, save_checkpoint
    from bertjax.models.bert import BertConfig, BertModel

    if config is None:
        config = BertConfig(
            vocab_size=len((files / "vocab.txt").read_text().split()),
            hidden_size=32,
            num_layers=1,
            num_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
        )

    ids = np.zeros((1, 8), np.int32)
    params = nn.meta.unbox(BertModel(config).init(jax.random.key(42), ids)["params"])
    tensors = {k: np.asarray(v) for k, v in flatten_params({"bert": params}).items()}
    save_checkpoint(
        Checkpoint(config, tensors, str(files / "vocab.txt"), True, "test"), str(path), "hf"
    )
    return tensors


@pytest.mark.parametrize("scan", [False, True])
def test_init_checkpoint_replaces_the_encoder(files, tmp_path, scan):
    from bertjax.models.bert import BertConfig
    from bertjax.pretrained import load_pretrained

    n_vocab = len((files / "vocab.txt").read_text().split())
    cfg = BertConfig(
        vocab_size=n_vocab,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    _tiny_hf_checkpoint(files, tmp_path / "ckpt", cfg)
    c = small_config(
        glue_config.get_config(),
        files,
        "glue",
        init_checkpoint=str(tmp_path / "ckpt"),
        **{"model.scan_layers": scan},
    )
    task = get_task(c.task, c, str(tmp_path))
    task.after_prepare()
    setup = train.build(c, str(tmp_path), task)
    assert setup.model.config.num_layers == 2  # from the checkpoint, not config.model
    state = setup.init_state(jax.random.key_data(jax.random.key(0)))
    fresh = setup.abstract_state.params  # shapes only
    assert set(state.params) == {"bert", "classifier"} and set(fresh) == set(state.params)
    batch = task.eval_sets[0].features
    inputs = dict(
        input_ids=batch["input_ids"],
        segment_ids=batch["segment_ids"],
        input_mask=batch["input_mask"],
    )
    from bertjax.models.bert import BertModel

    encoder = jax.jit(BertModel(setup.model.config).apply)
    ours = encoder({"params": state.params["bert"]}, **inputs)
    ref = load_pretrained(str(tmp_path / "ckpt"))(**inputs)  # the checkpoint's own encoder
    np.testing.assert_allclose(ours.sequence_output, ref.sequence_output, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours.pooled_output, ref.pooled_output, rtol=1e-5, atol=1e-5)
    # Without the checkpoint the same seed gives a different (random) encoder; the head is fresh.
    task.source = None  # no init checkpoint: start_params keeps the fresh params
    rand = setup.init_state(jax.random.key_data(jax.random.key(0)))
    other = encoder({"params": rand.params["bert"]}, **inputs)
    assert not np.allclose(other.sequence_output, ref.sequence_output, atol=1e-3)
    np.testing.assert_array_equal(
        rand.params["classifier"]["kernel"], state.params["classifier"]["kernel"]
    )


def test_vocabulary_must_match_the_init_checkpoint(files, tmp_path):
    _tiny_hf_checkpoint(files, tmp_path / "ckpt")
    other = tmp_path / "vocab2.txt"
    other.write_text((files / "vocab.txt").read_text() + "extra\n")
    c = small_config(
        glue_config.get_config(),
        files,
        "glue",
        init_checkpoint=str(tmp_path / "ckpt"),
        **{"data.vocab": str(other)},
    )
    with pytest.raises(ValueError, match=r"^\S*vocab2\.txt: vocabulary has \d+ tokens"):
        get_task(c.task, c, str(tmp_path)).after_prepare()


def test_ner_casing_follows_an_uncased_checkpoint_and_an_override_warns(files, tmp_path, caplog):
    """configs/ner.py from an uncased checkpoint: capitalised words are lower-cased, not [UNK]; a
    do_lower_case set against the checkpoint's tokenizer applies, with a warning naming the key."""
    _tiny_hf_checkpoint(files, tmp_path / "ckpt")  # its tokenizer_config: do_lower_case
    cased = tmp_path / "ner"
    cased.mkdir()
    for name in ("train.txt", "valid.txt", "test.txt"):
        lines = (files / "ner" / name).read_text().splitlines()
        capitalised = [x if x.startswith("-DOCSTART-") else x[:1].upper() + x[1:] for x in lines]
        (cased / name).write_text("\n".join(capitalised))
    assert "John NN B-NP B-PER" in (cased / "train.txt").read_text()

    def loaded(**overrides):
        c = ner_config.get_config()
        c.init_checkpoint, c.data_dir, c.data.max_seq_length = (
            str(tmp_path / "ckpt"),
            str(cased),
            32,
        )
        for key, value in overrides.items():
            c.data[key] = value
        task = get_task(c.task, c, str(tmp_path / "run"))
        task.after_prepare()
        return task, task.train_features["input_ids"]

    task, ids = loaded()
    assert task.tokenizer.do_lower_case and task.tokenizer.unk_id not in ids
    with caplog.at_level(logging.WARNING, logger="bertjax"):
        task, ids = loaded(do_lower_case=False)
    warned = [r.getMessage() for r in caplog.records if "do_lower_case" in r.getMessage()]
    assert warned and warned[0].startswith("config key data.do_lower_case=False overrides the")
    assert not task.tokenizer.do_lower_case and task.tokenizer.unk_id in ids  # as asked


def test_resume_continues_exactly(files, tmp_path):
    c = small_config(
        glue_config.get_config(),
        files,
        "glue",
        **{"train.checkpoint_every": 1, "train.keep_checkpoints": 5},
    )
    full = tmp_path / "full"
    train.train_and_evaluate(c, str(full))
    # Interrupted after step 2: drop the later checkpoint and the outputs of the end of the run.
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "3")
    shutil.rmtree(cut / "best")
    os.remove(cut / "eval_results.json")
    c2 = small_config(
        glue_config.get_config(),
        files,
        "glue",
        **{"train.checkpoint_every": 1, "train.keep_checkpoints": 5},
    )
    train.train_and_evaluate(c2, str(cut))

    def losses(d):
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in rows if r["split"] == "train"]

    assert [s for s, _ in losses(cut)] == [1, 2, 3]
    np.testing.assert_allclose([v for _, v in losses(cut)], [v for _, v in losses(full)], rtol=1e-6)
    assert _results(cut)["dev"] == _results(full)["dev"]


def test_several_seeds_report_median_and_best_dev_run(files, tmp_path):
    c = small_config(glue_config.get_config(), files, "glue", seeds=(0, 1))
    result = finetune.run(c, str(tmp_path))
    summary = _results(tmp_path)
    assert set(summary["seeds"]) == {"0", "1"} and summary["main_metric"] == "accuracy"
    accs = [summary["seeds"][s]["dev"]["accuracy"] for s in ("0", "1")]
    assert summary["median"]["accuracy"] == pytest.approx(np.median(accs))
    assert summary["best"]["accuracy"] == max(accs) and "best dev run" in summary["selection"]
    assert result["eval"] == summary["best"]
    for seed in (0, 1):
        assert _results(tmp_path / f"seed_{seed}")["dev"]["accuracy"] in accs


def test_bad_inputs_give_one_line_errors(files, tmp_path):
    c = small_config(glue_config.get_config(), files, "glue", task="glue/nope")
    with pytest.raises(ValueError, match=r"^config key task='glue/nope' is not a known task"):
        get_task(c.task, c, str(tmp_path))
    bad = tmp_path / "bad"
    shutil.copytree(files / "glue" / "SST-2", bad / "SST-2")
    text = (bad / "SST-2" / "train.tsv").read_text().splitlines()
    text[3] = text[3].rsplit("\t", 1)[0] + "\t2"
    (bad / "SST-2" / "train.tsv").write_text("\n".join(text) + "\n")
    c = small_config(glue_config.get_config(), files, "")
    c.data_dir = str(bad)
    with pytest.raises(ValueError) as err:
        get_task(c.task, c, str(tmp_path)).after_prepare()
    assert str(err.value) == f"{bad}/SST-2/train.tsv:4: label '2' not in ['0', '1']"
    c = small_config(
        swag_config.get_config(), files, ""
    )  # TFDS has no SWAG: local files are required
    with pytest.raises(ValueError, match="^config key data_dir is empty"):
        get_task(c.task, c, str(tmp_path)).after_prepare()
    bad_ner = tmp_path / "ner"
    shutil.copytree(files / "ner", bad_ner)
    (bad_ner / "valid.txt").write_text("john NN B-NP B-PER\nsmith NN B-NP B-XYZ\n")
    c = small_config(ner_config.get_config(), files, "")
    c.data_dir = str(bad_ner)
    with pytest.raises(ValueError, match=r"valid\.txt: sentence 0 word 1: tag 'B-XYZ' not in"):
        get_task(c.task, c, str(tmp_path)).after_prepare()
    # warmup_steps next to the default warmup_proportion used to be ignored without a word
    c = small_config(glue_config.get_config(), files, "glue", **{"optimizer.warmup_steps": 100})
    with pytest.raises(
        ValueError,
        match=r"^config keys optimizer.warmup_proportion=0.1 and "
        r"optimizer.warmup_steps=100: set one of them",
    ):
        get_task(c.task, c, str(tmp_path)).warmup_steps(1000)


@pytest.mark.shared_data
def test_real_glue_dev_files_build_features(shared_data, uncased_vocab, tmp_path):
    sizes = {"sst2": (872, 1821), "mrpc": (408, 1725), "stsb": (1500, 1379)}
    for name, (dev_size, test_size) in sizes.items():
        c = glue_config.get_config()
        c.task, c.data.vocab, c.data.do_lower_case = f"glue/{name}", str(uncased_vocab), True
        c.data_dir = str(shared_data / "glue")
        c.data.max_train_examples = 16
        task = get_task(c.task, c, str(tmp_path))
        task.after_prepare()
        dev = task.eval_sets[0].features
        assert len(dev["input_ids"]) == dev_size and dev["input_ids"].shape[1] == 128
        assert (dev["input_ids"][:, 0] == task.tokenizer.cls_id).all()
        assert len(task.test_sets[0].features["input_ids"]) == test_size
        assert len(task.train_features["input_ids"]) == 16
        if name == "stsb":
            assert dev["label"].dtype == np.float32 and 0 <= dev["label"].min() <= 5
            assert dev["label"].max() <= 5 and task.main_metric == "spearman"
        else:
            assert set(np.unique(dev["label"])) == {0, 1}
        if name == "mrpc":  # pairs: segment 1 present, 68% positive as in the official dev set
            assert dev["segment_ids"].max() == 1 and round(dev["label"].mean(), 2) == 0.68


MODERNBERT = {
    "model.architecture": "modernbert",
    "model.preset": "modernbert-tiny",
    "model.num_heads": 2,
    "model.intermediate_size": 48,
    "model.local_attention": 8,  # shorter than the sequences: sliding-window layers matter
}


@pytest.mark.parametrize(
    "task,config,data_dir,extra",
    [
        ("glue/sst2", glue_config, "glue", {}),
        ("squad/v1.1", squad_config, "squad", {"data.max_query_length": 10, "data.doc_stride": 8}),
        ("ner/conll2003", ner_config, "ner", {}),
        ("swag", swag_config, "swag", {}),
    ],
)
def test_every_task_fine_tunes_a_modernbert(files, tmp_path, task, config, data_dir, extra):
    c = small_config(config.get_config(), files, data_dir, task=task, **MODERNBERT, **extra)
    result = train.train_and_evaluate(c, str(tmp_path))
    final = _results(tmp_path)
    assert result["step"] == 3 and final["dev"]
    setup = train.build(c, str(tmp_path))
    assert setup.model.config.architecture == "modernbert"
    assert "model" in setup.abstract_state.params  # the ModernBERT encoder's subtree


def test_modernbert_init_checkpoint_from_transformers_fine_tunes(files, tmp_path):
    """A transformers ModernBERT directory is the init checkpoint: its architecture is taken from
    the checkpoint and the encoder's params are the checkpoint's, bit for bit."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    n_vocab = len((files / "vocab.txt").read_text().split())
    hf_config = transformers.ModernBertConfig(
        vocab_size=n_vocab,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=40,
        max_position_embeddings=64,
        global_attn_every_n_layers=2,
        local_attention=8,
        pad_token_id=0,
        cls_token_id=2,
        sep_token_id=3,
        bos_token_id=2,
        eos_token_id=3,
    )
    torch.manual_seed(0)
    transformers.ModernBertForMaskedLM(hf_config).save_pretrained(tmp_path / "ckpt")
    shutil.copy(files / "vocab.txt", tmp_path / "ckpt" / "vocab.txt")
    c = small_config(
        glue_config.get_config(), files, "glue", init_checkpoint=str(tmp_path / "ckpt")
    )
    task = get_task(c.task, c, str(tmp_path / "run"))
    task.after_prepare()
    setup = train.build(c, str(tmp_path / "run"), task)
    assert setup.model.config.architecture == "modernbert"
    assert setup.model.config.num_layers == 3  # from the checkpoint, not config.model
    state = setup.init_state(jax.random.key_data(jax.random.key(0)))
    want = task.source.pretrained.encoder_params
    got = state.params["model"]
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves_with_path(got)
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
    result = train.train_and_evaluate(c, str(tmp_path / "run"))
    assert result["step"] == 3
    # the fine-tuned run's checkpoint is the model it trained: it exports (it did not: "missing
    # tensors"), with the checkpoint's window of 8, not the preset's 128
    from bertjax import convert

    ckpt = convert.load_checkpoint(str(tmp_path / "run"))
    assert (ckpt.config.num_layers, ckpt.config.local_attention) == (3, 8)
    convert.save_checkpoint(ckpt, str(tmp_path / "export"), "hf")
    exported = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "export")
    assert exported.config.local_attention == 8 and exported.config.num_labels == 2
