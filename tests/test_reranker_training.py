"""The reranker task through the one trainer, against PyTorch and sentence-transformers.

* Training steps: from the same ``CrossEncoder(...).save()`` directory (BERT and ModernBERT), the
  trainer's per-step losses and final weights equal transformers' ``*ForSequenceClassification``
  trained by ``BCEWithLogitsLoss`` and ``torch.optim.AdamW`` on the same batches (bertjax's
  learning rate each step, weight decay on the same tensors, the gradient clipped to norm 1,
  dropout off); the dev binary cross-entropy the task reports equals torch's on the final model.
* Export: the trained checkpoint converted with ``bertjax convert --to=hf`` loads in
  ``CrossEncoder`` with the scores bertjax gives.
* ``bertjax evaluate retrieval --rerank`` refuses what it cannot do in one line. A run trained on a
  BEIR folder (mined negatives, a first-stage run reranked every epoch) through ``evaluate --rerank``
  and the exports: test_retrieval_round_trips.py.
"""

import json
import pathlib

import jax
import numpy as np
import pytest
from helpers import (
    PAIR_MAX_LEN,
    PAIRS,
    WORDS,
    cross_encoder_dir,
    param_groups,
    torch_run,
    write_ranked_beir,
)
from train_fixtures import read_metrics, set_keys

import bertjax
from bertjax import optim, train
from bertjax.commands import score
from bertjax.convert import main as convert_main
from configs import reranker as reranker_config

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
from sentence_transformers import CrossEncoder  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 4
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5


def _pairs(seed: int, n: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        query = " ".join(rng.choice(WORDS, 3))
        passage = " ".join(rng.choice(WORDS, int(rng.integers(3, 14))))
        rows.append({"query": query, "passage": passage, "label": [0.0, 1.0, 0.3][i % 3]})
    return rows


def _write_jsonl(path: pathlib.Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _config(**overrides):
    c = reranker_config.get_config()
    c.data.max_seq_length = PAIR_MAX_LEN
    c.data.batch_packing = False
    c.data.eval_packing = False
    c.data.eval_batch_size = 8
    c.model.hidden_dropout = 0.0
    c.model.attention_dropout = 0.0
    c.train.global_batch_size = 4
    c.train.steps = STEPS
    c.train.log_every = 1
    c.train.checkpoint_every = 100
    c.train.async_checkpoints = False
    c.optimizer.learning_rate = 1e-3
    c.optimizer.warmup_proportion = 0.0
    c.optimizer.warmup_steps = 1
    c.tensorboard = False
    c.mesh.num_devices = 1
    return set_keys(c, overrides)


def _bce(model, batch, modern):
    inputs = dict(
        input_ids=torch.tensor(np.asarray(batch["input_ids"])).long(),
        attention_mask=torch.tensor(np.asarray(batch["input_mask"])).long(),
    )
    if not modern:
        inputs["token_type_ids"] = torch.tensor(np.asarray(batch["segment_ids"])).long()
    logits = model(**inputs).logits[:, 0]
    labels = torch.tensor(np.asarray(batch["label"])).float()
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)


def _run_config(root: pathlib.Path, source, **overrides):
    return _config(
        **{
            "init_checkpoint": str(source),
            "data.train_file": _write_jsonl(root / "train.jsonl", _pairs(0, 12)),
            "data.dev_file": _write_jsonl(root / "dev.jsonl", _pairs(1, 10)),
            "train.eval_every": STEPS,  # one evaluation, of the final weights
            **overrides,
        }
    )


@pytest.fixture(scope="module")
def runs(hf_dirs, tmp_path_factory):
    """``runs(kind)``: (CrossEncoder folder, config, workdir) of the unpacked run from that kind's
    CrossEncoder, trained on first use; the packing test compares its packed run with BERT's."""
    cache = {}

    def get(kind):
        if kind not in cache:
            root = tmp_path_factory.mktemp(f"reranker_{kind}")
            source = cross_encoder_dir(root / "ce", hf_dirs[kind])
            c = _run_config(root, source)
            train.train_and_evaluate(c, str(root / "run"))
            cache[kind] = source, c, root / "run"
        return cache[kind]

    return get


@pytest.mark.parametrize("kind", ["bert", "modernbert", "eurobert", "nomicbert", "gte"])
def test_reranker_steps_equal_torch_and_export_to_cross_encoder(runs, tmp_path, kind):
    source, c, run = runs(kind)
    dev = _pairs(1, 10)
    workdir = str(run)
    ours = [r["loss"] for r in read_metrics(workdir)]
    task = train.prepared_task(c, workdir)
    setup = train.build(c, workdir, task)
    data = task.train_data(setup.phases[0], 0, 1)
    batches = [next(data) for _ in range(STEPS)]
    lrs = [float(setup.schedule(step)) for step in range(STEPS)]
    mask = jax.tree.leaves(optim.weight_decay_mask(setup.abstract_state.params))
    sizes = [int(np.prod(x.shape)) for x in jax.tree.leaves(setup.abstract_state.params)]
    tensors = (
        sorted(n for n, m in zip(sizes, mask) if m),
        sorted(n for n, m in zip(sizes, mask) if not m),
    )

    model = transformers.AutoModelForSequenceClassification.from_pretrained(source).eval()
    groups = param_groups(model, c.optimizer.weight_decay, tensors)
    opt = torch.optim.AdamW(groups, lr=lrs[0], betas=(0.9, 0.999), eps=1e-6, foreach=False)
    modern = kind in ("modernbert", "eurobert")  # no segment embeddings
    theirs, _ = torch_run(model, lambda m, b: _bce(m, b, modern), opt, batches, lrs, 1.0)
    rel = np.abs(np.subtract(ours, theirs)) / np.abs(theirs)
    print(f"{kind}: losses bertjax {ours} torch {theirs}, max relative difference {rel.max():.2e}")
    assert rel.max() < LOSS_RTOL and ours[-1] != ours[0]

    # the final weights, through bertjax convert --to=hf
    convert_main([workdir, "--to=hf", str(tmp_path / "export")])
    exported = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "export")
    want = model.state_dict()
    got = exported.state_dict()
    assert set(got) == set(want)
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    moved = max(
        float((want[k] - v).abs().max())
        for k, v in transformers.AutoModelForSequenceClassification.from_pretrained(source)
        .state_dict()
        .items()
    )
    print(f"{kind}: max |param difference| {diff:.2e} (the steps moved them by {moved:.2e})")
    assert diff < PARAM_ATOL and moved > 1e-3

    # CrossEncoder loads the export with bertjax's scores
    reference = CrossEncoder(str(tmp_path / "export"), device="cpu")
    ce_scores = reference.predict(PAIRS)
    bj = bertjax.load_pretrained(workdir).predict(PAIRS, max_length=reference.max_seq_length)
    print(f"{kind}: max |predict - CrossEncoder.predict| {np.abs(bj - ce_scores).max():.2e}")
    assert np.abs(bj - ce_scores).max() < 1e-5

    # the dev binary cross-entropy equals torch's on the trained model
    dev_pairs = [(r["query"], r["passage"]) for r in dev]
    logits = torch.tensor(reference.predict(dev_pairs, activation_fn=torch.nn.Identity()))
    labels = torch.tensor([r["label"] for r in dev])
    bce = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.float()))
    reported = json.loads((run / "eval_results.json").read_text())["dev"]
    accuracy = float(np.mean((logits.numpy() > 0) == (labels.numpy() >= 0.5)))
    assert reported["bce"] == pytest.approx(bce, rel=1e-5)
    assert reported["accuracy"] == pytest.approx(accuracy)


# ---- evaluate retrieval --rerank: its refusals ----
@pytest.fixture(scope="module")
def beir_dir(tmp_path_factory) -> pathlib.Path:
    """helpers.write_ranked_beir: a BEIR folder with a negatives run and a first-stage run."""
    return write_ranked_beir(tmp_path_factory.mktemp("beir"))


def test_evaluate_rerank_refuses_bad_combinations(hf_dirs, beir_dir, tmp_path, capsys):
    source = cross_encoder_dir(tmp_path / "ce", hf_dirs["bert"])
    run = str(beir_dir / "first_stage.trec")
    cases = [
        (["--rerank", str(source), "--run", run], "takes --data=BEIR_DIR and one first stage"),
        (
            ["--rerank", str(source), "--data", str(beir_dir), "--run", run, "--checkpoint", "x"],
            "one first stage",
        ),
        (
            ["--rerank", str(hf_dirs["bert"]), "--data", str(beir_dir), "--run", run],
            "no sequence-classification head|not a cross-encoder",
        ),
        (
            [
                "--rerank",
                str(source),
                "--data",
                str(beir_dir),
                "--run",
                str(beir_dir / "negatives.trec"),
            ],
            "no query of the run is judged",
        ),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit):
            score.main(["retrieval", *argv])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("bertjax evaluate: error:")
        assert any(m in err for m in message.split("|")), err


def test_packed_batches_give_the_unpacked_losses_and_dev_metrics(runs, tmp_path):
    """data.batch_packing and data.eval_packing (the config's defaults) train and evaluate the
    same examples in fewer rows: the same losses and dev metrics to float rounding. The unpacked
    run is the BERT run the torch comparison above trained (the same config, packing off)."""
    source, _, plain_run = runs("bert")
    packing = {"data.batch_packing": True, "data.eval_packing": True}
    workdir = tmp_path / "run_packed"
    train.train_and_evaluate(_run_config(tmp_path, source, **packing), str(workdir))
    results = []
    for run in (plain_run, workdir):
        dev = json.loads((run / "eval_results.json").read_text())["dev"]
        results.append(([r["loss"] for r in read_metrics(run)], dev))
    (plain, plain_dev), (packed, packed_dev) = results
    assert len(plain) == STEPS
    np.testing.assert_allclose(packed, plain, rtol=1e-5)
    assert packed_dev["bce"] == pytest.approx(plain_dev["bce"], rel=1e-5)
    assert packed_dev["accuracy"] == plain_dev["accuracy"]
