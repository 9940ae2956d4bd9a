"""A run's checkpoint is the model it trained (issue 23): every kind of run round-trips.

Each run kind is a tiny real run of the trainer (``train.train_and_evaluate``, 2 steps, hidden 32,
1-2 layers): BERT and ModernBERT pretraining from scratch, continued pretraining from the BERT run,
the four fine-tuning kinds (GLUE, NER, SQuAD, SWAG), GLUE on a frozen encoder (``frozen_glue``, from
a transformers checkpoint) and the end of phase 0 of a two-phase ModernBERT recipe whose phase 1
raises the global RoPE base. For each run:

* ``load_pretrained(workdir)`` computes what the trainer's model (``train.build`` on the run's
  config, the phase's model, the params restored from the checkpoint) computes;
* ``bertjax convert --to=hf`` (``bertjax.convert.main``, in process) writes a directory that
  transformers' ``AutoModelFor...`` of the run's kind loads and that gives the same sequence output
  and head logits (MLM, NSP, classification, token, QA start/end, multiple choice) within 1e-4;
* ``load_pretrained(workdir/best)`` and its transformers export are the model of the step it
  keeps, and ``bertjax evaluate`` scores that step's predictions (GLUE: load_pretrained's; SQuAD:
  the run's predictions.json) to the metrics the run logged for it;
* a GLUE fine-tuning task with ``init_checkpoint=<workdir>`` starts from the checkpoint's encoder
  params, bit for bit, and with the checkpoint's model (the phase-0 checkpoint: phase 0's RoPE base).

The runs are shared by the tests through one module-scoped cache (each trains once, on first use).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pathlib
from typing import Any

import jax
import numpy as np
import pytest
from helpers import hf_inputs, opt_state_paths, random_bert_hf_dir, small_config
from train_fixtures import read_metrics, tiny_config, write_prepared

import bertjax
import bertjax.models as models
from bertjax import checkpointing, convert, train
from bertjax.commands import score
from bertjax.convert.checkpoint import flatten_params, unstack_layers
from bertjax.models.heads import encoder as build_encoder
from configs import glue as glue_config
from configs import ner as ner_config
from configs import squad as squad_config
from configs import swag as swag_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# conftest.py: `files` (tiny files in the official formats) and a module-scoped XLA cache, as in
# test_finetune; small_config (helpers.py) is their shared tiny run config.
pytestmark = pytest.mark.slow

TOL = 1e-4  # bertjax (JAX, fp32) against transformers (PyTorch, fp32)
SAME = 1e-5  # load_pretrained against the trainer's own model (both JAX, fp32)
SEQ, CHOICES = 16, 4  # the probe batch: [2, SEQ] ([2, CHOICES, SEQ] for multiple choice)
PHASE0_THETA, PHASE1_THETA = 10_000.0, 160_000.0

SMALL_BERT = {
    "model.hidden_size": 32,
    "model.num_heads": 2,
    "model.intermediate_size": 64,
    "model.num_layers": 1,
    "mesh.num_devices": 1,
    "train.checkpoint_every": 2,
}
SMALL_MODERNBERT = {
    "model.architecture": "modernbert",
    "model.preset": "modernbert-tiny",
    "model.max_position_embeddings": None,
    "model.hidden_size": 32,
    "model.num_heads": 2,
    "model.intermediate_size": 48,
    "model.num_layers": 2,  # layer 0 global attention, layer 1 a sliding window
    "model.local_attention": 8,  # shorter than the probe: the window matters
    "data.nsp": False,
    "mesh.num_devices": 1,
    "train.checkpoint_every": 2,
}
FINE_TUNING = {  # run kind -> (task, config module, data folder, overrides, transformers class)
    "glue": ("glue/sst2", glue_config, "glue", {}, "AutoModelForSequenceClassification"),
    "ner": ("ner/conll2003", ner_config, "ner", {}, "AutoModelForTokenClassification"),
    "squad": (
        "squad/v1.1",
        squad_config,
        "squad",
        {"data.max_query_length": 10, "data.doc_stride": 8},
        "AutoModelForQuestionAnswering",
    ),
    "swag": ("swag", swag_config, "swag", {}, "AutoModelForMultipleChoice"),
    # GLUE with the encoder frozen (the feature-based approach's run with features=last), from a
    # transformers checkpoint: the head alone trains
    "frozen_glue": (
        "glue/sst2",
        glue_config,
        "glue",
        {"train.freeze_encoder": True},
        "AutoModelForSequenceClassification",
    ),
}
CLASSIFIERS = ("glue", "frozen_glue", "swag")  # load_pretrained runs their heads
RUNS = [
    "bert_pretraining",
    "modernbert_pretraining",
    "continued_pretraining",
    *FINE_TUNING,
    "modernbert_phase0",
]


@dataclasses.dataclass
class Run:
    name: str
    config: Any
    workdir: str
    hf_class: str  # the transformers Auto class of the run's kind
    vocab_size: int
    phase: int = 0  # the phase whose model the checkpoint holds


def _vocab_size(path) -> int:
    return len(pathlib.Path(path).read_text().split())


def _train(name: str, root: pathlib.Path, files: pathlib.Path, bert_run) -> Run:
    """The run ``name`` trained for 2 steps into ``root / name``."""
    workdir = str(root / name)
    phase = 0
    if name in FINE_TUNING:
        task, module, data_dir, extra, hf_class = FINE_TUNING[name]
        c = small_config(module.get_config(), files, data_dir, task=task, **extra)
        c.train.steps = 2
        if name == "frozen_glue":
            random_bert_hf_dir(files, root / "frozen_init", num_layers=1)
            c.init_checkpoint = str(root / "frozen_init")
        vocab = files / "vocab.txt"
    else:
        tmp = root / ("phased" if name == "modernbert_phase0" else "pretraining")
        tmp.mkdir(exist_ok=True)
        arch = SMALL_BERT if name in ("bert_pretraining", "continued_pretraining") else None
        c = tiny_config(tmp, steps=2, **(arch or SMALL_MODERNBERT))
        vocab = tmp / "vocab.txt"
        hf_class = "AutoModelForPreTraining" if arch else "AutoModelForMaskedLM"
        if name == "continued_pretraining":
            c.init_checkpoint = bert_run().workdir
        if name == "modernbert_phase0":  # configs/modernbert_base.py's two phases, stopped at 2
            write_prepared(tmp / "prepared" / "seq16")
            write_prepared(tmp / "prepared" / "seq32", seq=32, pred=6)
            c.model.global_rope_theta = PHASE1_THETA
            c.data.phases = (
                dict(
                    until_step=2,
                    max_seq_length=16,
                    max_predictions_per_seq=3,
                    model=dict(global_rope_theta=PHASE0_THETA),
                ),
                dict(
                    until_step=4,
                    max_seq_length=32,
                    max_predictions_per_seq=6,
                    model=dict(global_rope_theta=PHASE1_THETA),
                ),
            )
            c.train.steps = 4
            c.train.stop_at_step = 2
    result = train.train_and_evaluate(c, workdir)
    assert result["step"] == 2 and np.isfinite(result["train"]["loss"])
    return Run(name, c, workdir, hf_class, _vocab_size(vocab), phase)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, files):
    """``trained(name)``: the run ``name`` (trained on first use, then shared)."""
    root = tmp_path_factory.mktemp("round_trips")
    cache: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name not in cache:
            cache[name] = _train(name, root, files, lambda: get("bert_pretraining"))
        return cache[name]

    return get


def _probe(run: Run) -> dict[str, np.ndarray]:
    """input_ids, segment_ids, input_mask [2, SEQ]: [CLS] ids [SEP], the second row padded
    after 9 tokens, two segments (zeros for ModernBERT); [2, CHOICES, SEQ] for multiple choice."""
    rows = 2 * CHOICES if run.name == "swag" else 2
    rng = np.random.default_rng(0)
    ids = rng.integers(5, run.vocab_size, (rows, SEQ)).astype(np.int32)
    lengths = np.where(np.arange(rows) % 2, 9, SEQ)
    mask = (np.arange(SEQ)[None] < lengths[:, None]).astype(np.int32)
    ids[:, 0] = 2
    ids[np.arange(rows), lengths - 1] = 3
    ids[mask == 0] = 0
    types = ((np.arange(SEQ)[None] >= lengths[:, None] // 2) & (mask == 1)).astype(np.int32)
    if run.config.model.get("architecture") == "modernbert":
        types = np.zeros_like(types)
    batch = dict(input_ids=ids, segment_ids=types, input_mask=mask)
    if run.name == "swag":
        batch = {k: v.reshape(2, CHOICES, SEQ) for k, v in batch.items()}
    return batch


def _flat(batch):
    """[batch, choices, seq] -> [batch * choices, seq] (load_pretrained scores one choice a row)."""
    return {k: v.reshape(-1, v.shape[-1]) for k, v in batch.items()}


def _real(batch):
    return _flat(batch)["input_mask"].astype(bool)


@dataclasses.dataclass
class TrainerModel:
    """The trainer's model of a run (built as train_and_evaluate builds it, the checkpoint's
    phase), its apply and its encoder's jitted: built and compiled once per run, then given the
    params of each checkpoint folder."""

    model: Any
    apply: Any
    encoders: dict[bool, Any]  # add_pooler -> the encoder's jitted apply


@pytest.fixture(scope="module")
def trainer_model():
    """``trainer_model(run)``: the run's TrainerModel (built on first use, then shared)."""
    cache: dict[str, TrainerModel] = {}

    def get(run: Run) -> TrainerModel:
        if run.workdir not in cache:
            task = train.prepared_task(run.config, run.workdir)
            setup = train.build(run.config, run.workdir, task)
            model = train.phase_setup(setup, setup.phases[run.phase]).model
            cache[run.workdir] = TrainerModel(model, jax.jit(model.apply), {})
        return cache[run.workdir]

    return get


def _trainer_outputs(
    trainer: TrainerModel, run: Run, folder: str = "checkpoints", at: int = 2
) -> dict[str, np.ndarray]:
    """What the trainer's model (``trainer``: the run's) computes with the params restored from
    the run's checkpoint (``folder`` of the workdir, its step ``at``): its heads' logits, and the
    encoder's sequence output."""
    params, _, step = checkpointing.restore_params(os.path.join(run.workdir, folder))
    assert step == at
    batch = _probe(run)
    model = trainer.model
    out = trainer.apply({"params": params}, **batch)
    if isinstance(out, dict):  # pretraining: sequence_output, mlm_logits, nsp_logits (BERT)
        keys = ("sequence_output", "mlm_logits", "nsp_logits")
        return {k: np.asarray(out[k]) for k in keys if k in out} | {"model_config": model.config}
    # a fine-tuning model returns its logits: the sequence output is its encoder's
    arch = models.architecture(model.config)
    enc_params = params[arch.encoder_name]
    add_pooler = "pooler" in enc_params
    if add_pooler not in trainer.encoders:
        encoder = build_encoder(model.config, add_pooler=add_pooler)
        trainer.encoders[add_pooler] = jax.jit(encoder.apply)
    flat = _flat(batch)
    enc_out = trainer.encoders[add_pooler](
        {"params": enc_params}, flat["input_ids"], flat["segment_ids"], flat["input_mask"]
    )
    result = {"sequence_output": np.asarray(enc_out.sequence_output)}
    if isinstance(out, tuple):  # QA: (start, end) -> [b, seq, 2]
        result["logits"] = np.stack([np.asarray(x) for x in out], -1)
    else:
        result["logits"] = np.asarray(out)
    result["model_config"] = model.config
    return result


@pytest.fixture(scope="module")
def outputs(trained, trainer_model):
    """``outputs(name)``: (trainer's outputs, load_pretrained's model and outputs), computed once."""
    cache = {}

    def get(name):
        if name not in cache:
            run = trained(name)
            pretrained = bertjax.load_pretrained(run.workdir)
            got = pretrained(**_flat(_probe(run)))
            cache[name] = (run, _trainer_outputs(trainer_model(run), run), pretrained, got)
        return cache[name]

    return get


def _close(got, want, real, tol, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shapes {got.shape} != {want.shape}"
    if real is not None and got.ndim >= 2 and got.shape[:2] == real.shape:
        got, want = got[real], want[real]  # per-token outputs: padding is not compared
    diff = float(np.max(np.abs(got - want)))
    assert diff <= tol, f"{what}: max abs difference {diff:.2e}"
    assert float(np.max(np.abs(want))) > 1e-3, f"{what}: vacuous comparison"


def _function_of(model_config) -> dict:
    """A model config's fields that define its function (not kernels, dtypes or layouts)."""
    values = dict(model_config.to_dict())
    for key in ("attention_impl", "dropout_impl", "remat", "scan_layers", "dtype", "param_dtype"):
        values.pop(key, None)
    return values


@pytest.mark.parametrize("name", RUNS)
def test_load_pretrained_is_the_model_the_run_trained(outputs, name):
    run, want, pretrained, got = outputs(name)
    real = _real(_probe(run))
    assert _function_of(pretrained.config) == _function_of(want["model_config"])
    _close(got.sequence_output, want["sequence_output"], real, SAME, f"{name}: sequence output")
    if "mlm_logits" in want:
        _close(got.mlm_logits, want["mlm_logits"], real, SAME, f"{name}: MLM logits")
    if "nsp_logits" in want:
        _close(got.nsp_logits, want["nsp_logits"], None, SAME, f"{name}: NSP logits")
    if name in CLASSIFIERS:  # the sequence classifier (SWAG: one score per choice)
        logits = np.asarray(got.logits).reshape(want["logits"].shape)
        _close(logits, want["logits"], None, SAME, f"{name}: classifier logits")


@pytest.mark.parametrize("name", list(FINE_TUNING))
def test_the_best_folder_is_the_model_of_its_step(outputs, trainer_model, tmp_path, name):
    """``load_pretrained(RUN/best)`` (the params of the best evaluation, what ``finalize`` and
    the exports use) is the trainer's model with the params of the step it keeps, and so is its
    transformers export (``bertjax convert RUN/best --to=hf``)."""
    run, _, pretrained, _ = outputs(name)
    best = bertjax.load_pretrained(os.path.join(run.workdir, "best"))
    step = _kept_step(run)
    want = _trainer_outputs(trainer_model(run), run, "best", step)
    assert _function_of(best.config) == _function_of(pretrained.config)
    again = best(**_flat(_probe(run)))
    real = _real(_probe(run))
    _close(again.sequence_output, want["sequence_output"], real, SAME, f"{name}: best, sequence")
    if name in CLASSIFIERS:
        logits = np.asarray(again.logits).reshape(want["logits"].shape)
        _close(logits, want["logits"], None, SAME, f"{name}: best, classifier logits")
    convert.main([os.path.join(run.workdir, "best"), "--to=hf", str(tmp_path / "hf")])
    hf, loading = getattr(transformers, run.hf_class).from_pretrained(
        tmp_path / "hf", attn_implementation="eager", output_loading_info=True
    )
    assert not any(loading.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        out = hf.eval()(**_torch_inputs(run, _probe(run)))
    if run.hf_class == "AutoModelForQuestionAnswering":
        logits = np.stack([out.start_logits.numpy(), out.end_logits.numpy()], -1)
    else:
        logits = out.logits.numpy()
    _close(logits, want["logits"], real if logits.ndim > 2 else None, TOL, f"{name}: best, HF")


def _kept_step(run: Run) -> int:
    """The step whose params ``RUN/best`` keeps."""
    kept = checkpointing.Checkpointer(os.path.join(run.workdir, "best"), async_save=False)
    try:
        step = kept.latest_step()
    finally:
        kept.close()
    assert step in (1, 2), step  # evaluated once per epoch of a 2-step run
    return step


def _evaluate(*argv: str) -> dict:
    """``bertjax evaluate ARGV`` in process: the JSON it prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert score.main(list(argv)) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("name", ["glue", "frozen_glue", "squad"])
def test_the_best_folder_evaluates_to_the_metrics_of_its_step(trained, files, tmp_path, name):
    """``bertjax evaluate`` scores the kept step's predictions to what the run logged for that
    step and wrote in eval_results.json. GLUE: ``load_pretrained(RUN/best).predict`` on the dev
    sentences gives the run's own dev predictions, line for line, and ``bertjax evaluate glue`` of
    them its accuracy; SQuAD: ``bertjax evaluate squad`` of the run's predictions.json (the best
    params' answers) its exact match and F1 (the official script's percentages)."""
    run = trained(name)
    results = json.loads(pathlib.Path(run.workdir, "eval_results.json").read_text())
    assert results["params"] == "best"
    (logged,) = [r for r in read_metrics(run.workdir, "eval") if r["step"] == _kept_step(run)]
    if name == "squad":
        got = _evaluate(
            "squad",
            f"--dataset={files / 'squad' / 'dev-v1.1.json'}",
            f"--predictions={results['predictions']['predictions']}",
        )
        got = {key: value / 100 for key, value in got.items()}  # percentages -> fractions
    else:
        labels = files / "glue" / "SST-2"
        rows = [line.split("\t") for line in (labels / "dev.tsv").read_text().splitlines()[1:]]
        best = bertjax.load_pretrained(os.path.join(run.workdir, "best"))
        logits = best.predict([sentence for sentence, _ in rows], activation="Identity")
        lines = ["index\tprediction"] + [f"{i}\t{p}" for i, p in enumerate(logits.argmax(-1))]
        predictions = tmp_path / "SST-2.tsv"
        predictions.write_text("\n".join(lines) + "\n")
        own = pathlib.Path(results["dev_predictions"]["dev"]).read_text()
        assert predictions.read_text() == own
        got = _evaluate(
            "glue", "--task=SST-2", f"--labels={labels}", f"--predictions={predictions}"
        )
    assert set(got) == set(results["dev"]), (got, results["dev"])
    for key, value in got.items():
        assert value == pytest.approx(results["dev"][key], abs=1e-9), key
        assert value == pytest.approx(logged[key], abs=1e-9), key


def test_a_frozen_run_trained_its_head_alone(trained):
    """The frozen GLUE run's encoder is its transformers init bit for bit, its pooler and the
    classifier excepted (the head that reads the pooler trains it), and its optimizer state holds
    those alone."""
    run = trained("frozen_glue")
    init = convert.load_checkpoint(run.config.init_checkpoint).tensors
    setup = train.build(run.config, run.workdir)
    assert opt_state_paths(setup.abstract_state.opt_state) == {
        ("bert", "pooler", "kernel"),
        ("bert", "pooler", "bias"),
        ("classifier", "kernel"),
        ("classifier", "bias"),
    }
    assert setup.partition is not None and len(setup.partition.frozen) == len(init) - 2
    saved, _, _ = checkpointing.restore_params(os.path.join(run.workdir, "checkpoints"))
    got = {k: np.asarray(v) for k, v in unstack_layers(flatten_params(saved)).items()}
    moved = {k for k in init if not np.array_equal(got[k], init[k])}
    assert moved == {"bert/pooler/kernel", "bert/pooler/bias"}


def _torch_inputs(run: Run, batch) -> dict:
    out = hf_inputs(batch)
    if run.config.model.get("architecture") == "modernbert":
        out.pop("token_type_ids")
    return out


@pytest.mark.parametrize("name", RUNS)
def test_hf_export_computes_what_the_run_trained(outputs, tmp_path, name):
    run, want, pretrained, got = outputs(name)
    convert.main([run.workdir, "--to=hf", str(tmp_path / "hf")])
    hf, loading = getattr(transformers, run.hf_class).from_pretrained(
        tmp_path / "hf", attn_implementation="eager", output_loading_info=True
    )
    # transformers' own report: no tensor newly initialised, unused or of another shape.
    assert not any(
        loading.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")
    ), loading
    hf.eval()
    batch = _probe(run)
    real = _real(batch)
    with torch.no_grad():
        out = hf(**_torch_inputs(run, batch))
        seq = hf.base_model(**_torch_inputs(run, _flat(batch))).last_hidden_state.numpy()
    _close(seq, got.sequence_output, real, TOL, f"{name}: HF sequence output")
    if run.hf_class == "AutoModelForPreTraining":
        _close(out.prediction_logits.numpy(), got.mlm_logits, real, TOL, f"{name}: HF MLM")
        _close(out.seq_relationship_logits.numpy(), got.nsp_logits, None, TOL, f"{name}: HF NSP")
    elif run.hf_class == "AutoModelForMaskedLM":
        _close(out.logits.numpy(), got.mlm_logits, real, TOL, f"{name}: HF MLM")
    elif run.hf_class == "AutoModelForQuestionAnswering":
        logits = np.stack([out.start_logits.numpy(), out.end_logits.numpy()], -1)
        _close(logits, want["logits"], real, TOL, f"{name}: HF start/end logits")
    else:  # sequence / token classification, multiple choice
        _close(out.logits.numpy(), want["logits"], real, TOL, f"{name}: HF logits")
    _pipeline_agrees(run, tmp_path / "hf", pretrained)
    if run.name == "modernbert_phase0":  # transformers reads phase 0's base (not phase 1's)
        rope = getattr(hf.config, "rope_parameters", None)
        theta = rope["full_attention"]["rope_theta"] if rope else hf.config.global_rope_theta
        assert theta == PHASE0_THETA


def _softmax(logits: np.ndarray) -> np.ndarray:
    probs = np.exp(logits - logits.max())
    return probs / probs.sum()


def _pipeline_agrees(run: Run, export, pretrained) -> None:
    """transformers' ``pipeline`` on the export, with the tokenizer it saved: ``fill-mask`` gives
    the MLM runs' top tokens with the probabilities of load_pretrained's logits, and
    ``text-classification`` the GLUE run's class probabilities (``pretrained``: the run loaded)."""
    vocab = (pathlib.Path(export) / "vocab.txt").read_text().split()
    words = [w for w in vocab if w.isalnum()]  # whole words: not [CLS], ##s or punctuation
    if run.hf_class in ("AutoModelForPreTraining", "AutoModelForMaskedLM"):
        fill = transformers.pipeline("fill-mask", model=str(export), top_k=3)
        text = f"{words[0]} {fill.tokenizer.mask_token} {words[1]}"
        # bertjax tokenizes as Google's BERT: "[MASK]" in a text is not the token; put it in.
        batch = pretrained.encode_batch([f"{words[0]} {words[2]} {words[1]}"])
        batch["input_ids"][0, 2] = vocab.index("[MASK]")  # [CLS] w [MASK] w [SEP]
        logits = np.asarray(pretrained(**batch).mlm_logits, np.float64)[0, 2]
        probs = _softmax(logits)
        top = fill(text)
        assert [t["token"] for t in top] == np.argsort(-probs)[:3].tolist(), (top, probs)
        np.testing.assert_allclose([t["score"] for t in top], np.sort(probs)[::-1][:3], atol=TOL)
    elif run.name in ("glue", "frozen_glue"):
        classify = transformers.pipeline("text-classification", model=str(export), top_k=None)
        text = f"{words[0]} {words[1]} {words[2]}"
        logits = np.asarray(pretrained.predict([text], activation="Identity"), np.float64)[0]
        probs = _softmax(logits)
        scores = {r["label"]: r["score"] for r in classify([text])[0]}
        labels = [classify.model.config.id2label[i] for i in range(len(probs))]
        np.testing.assert_allclose([scores[k] for k in labels], probs, atol=TOL)


def _encoder_tensors(params, arch) -> dict[str, np.ndarray]:
    """The encoder's tensors by unrolled path (a scanned model's layers unstacked)."""
    flat = unstack_layers(flatten_params(params[arch.encoder_name]))
    return {k: np.asarray(v) for k, v in flat.items()}


@pytest.mark.parametrize("name", [name for name in RUNS if name != "frozen_glue"])
def test_fine_tuning_starts_from_the_runs_checkpoint(trained, files, tmp_path, name):
    run = trained(name)
    c = small_config(glue_config.get_config(), files, "glue", init_checkpoint=run.workdir)
    c.data.vocab = ""  # the checkpoint's vocabulary
    task = train.prepared_task(c, str(tmp_path / "ft"))
    setup = train.build(c, str(tmp_path / "ft"), task)
    state = setup.init_state(jax.random.key_data(jax.random.key(0)))
    arch = models.architecture(setup.model.config)
    assert arch.name == (run.config.model.get("architecture") or "bert")
    dropout = dict(hidden_dropout=0.0, attention_dropout=0.0)  # the fine-tuning config's own
    assert _function_of(setup.model.config.replace(**dropout)) == _function_of(
        convert.load_checkpoint(run.workdir).config.replace(**dropout)
    )
    if name == "modernbert_phase0":  # the checkpoint's model: phase 0's base, not phase 1's
        assert setup.model.config.global_rope_theta == PHASE0_THETA
    saved, _, _ = checkpointing.restore_params(os.path.join(run.workdir, "checkpoints"))
    want = _encoder_tensors(saved, arch)
    got = _encoder_tensors(state.params, arch)
    fresh = sorted(set(got) - set(want))
    assert not set(want) - set(got) and all(p.startswith("pooler/") for p in fresh), fresh
    for path, value in want.items():
        np.testing.assert_array_equal(got[path], value, err_msg=f"{name}: {path}")


def _resaved(run: Run, directory: pathlib.Path, edit) -> str:
    """The run's checkpoint saved again under ``directory/checkpoints`` with its config edited by
    ``edit``: what the same run writes when configured so (the trainer saves its config as is)."""
    params, values, step = checkpointing.restore_params(os.path.join(run.workdir, "checkpoints"))
    values.pop("tokenizer", None)  # written before runs recorded it
    edit(values)
    ckpt = checkpointing.Checkpointer(str(directory / "checkpoints"), keep=1, async_save=False)
    try:
        ckpt.save(step, {"params": params}, {}, json.dumps(values), True)
    finally:
        ckpt.close()
    return str(directory)


def _legacy_vocab_key(values):  # a bertjax 0.2 run's saved config: the top-level `vocab` key
    values["vocab"], values["data"]["vocab"] = values["data"]["vocab"], ""


def _init_checkpoints_vocab(glue_workdir):  # data.vocab empty: the init checkpoint's vocabulary
    def edit(values):
        values["vocab"] = values["data"]["vocab"] = ""
        values["init_checkpoint"] = glue_workdir

    return edit


def _cased(values):  # data.do_lower_case=False (a bertjax 0.2 run also saved do_lower_case: null)
    values["do_lower_case"], values["data"]["do_lower_case"] = None, False


@pytest.mark.parametrize("setting", ["legacy_vocab_key", "init_checkpoints_vocab", "cased"])
def test_a_fine_tuned_runs_checkpoint_keeps_its_tokenizer(trained, tmp_path, setting):
    """A checkpoint written before runs recorded their tokenizer (``tokenizer`` in its config)
    still finds its vocabulary and casing from the keys the run set; one written now records them."""
    run = trained("glue")
    _, values, _ = checkpointing.restore_params(os.path.join(run.workdir, "checkpoints"))
    assert values["tokenizer"]["do_lower_case"] is True  # recorded by the run
    assert (
        bertjax.load_pretrained(run.workdir).tokenizer.vocab_file
        == values["tokenizer"]["vocab_file"]
    )
    edit = {
        "legacy_vocab_key": _legacy_vocab_key,
        "init_checkpoints_vocab": _init_checkpoints_vocab(run.workdir),
        "cased": _cased,
    }[setting]
    loaded = bertjax.load_pretrained(_resaved(run, tmp_path, edit))
    assert loaded.tokenizer is not None, "the run's vocabulary is lost"
    assert loaded.tokenizer.do_lower_case is (setting != "cased"), "the run's casing is lost"
