"""The retrieval runs' round-trip matrix (issue 33, item 1): each kind of retrieval run through
every consumer that applies, in one place.

Three tiny real runs of the trainer (2 steps, H32, evaluated after each step, so ``best/`` may keep
step 1), trained once for the module on one BEIR folder of tiny_hf's words:

* ``bi_encoder``: the ``retrieval`` task from a sentence-transformers model (mean pooling and a
  Dense layer), configured to cls pooling and Normalize;
* ``colbert``: the ``colbert`` task from a transformers BERT (an 8-dim projection, a skiplist);
* ``reranker``: the ``reranker`` task from a ModernBERT ``CrossEncoder``, trained on mined
  negatives and reranking a first-stage run at each evaluation.

==============================  ===================  ===================  ===================
consumer                        bi_encoder           colbert              reranker
==============================  ===================  ===================  ===================
load_pretrained(RUN), RUN/best  text vectors         query and document   pair scores
(the trainer's model, the                            token vectors
params of that step)
evaluate retrieval RUN,         --checkpoint         --checkpoint (and    --rerank --run
RUN/best (the run's own                              the run's pylate/)   (and after the
evaluation of that step)                                                  bi-encoder)
embed RUN, RUN/best             load_pretrained's    the one-line         -
                                vectors              refusal of .embed
convert, read by the peer       sentence-            pylate: the          hf: transformers'
library as installed            transformers:        encoder in           classifier and
                                SentenceTransformer  transformers with    CrossEncoder
                                                     the projection file
==============================  ===================  ===================  ===================

Each peer must load the export with an empty loading report (no missing, unused or reshaped
tensor). PyLate itself is not installed here (it pins an older sentence-transformers; see
tests/pylate_reference.py): its directory's encoder is read by transformers and its projection
applied in torch, which is what PyLate's ``ColBERT.encode`` computes.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import pathlib
import re
from contextlib import redirect_stdout
from typing import Any

import numpy as np
import pytest
from helpers import (
    PAIR_MAX_LEN,
    PAIRS,
    cross_encoder_dir,
    st_dir,
    tiny_hf,
    two_steps,
    write_ranked_beir,
)
from train_fixtures import read_metrics

import bertjax
from bertjax import checkpointing, convert, train
from bertjax.commands import embed as embed_command
from bertjax.commands import score
from bertjax.retrieval import ranking_metrics
from bertjax.retrieval.beir import document_text
from bertjax.retrieval.embedding_store import load_embeddings
from bertjax.retrieval.reranker import rerank
from configs import colbert as colbert_config
from configs import reranker as reranker_config
from configs import retrieval as retrieval_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")

pytestmark = pytest.mark.slow

KINDS = ("bi_encoder", "colbert", "reranker")
FOLDERS = ("RUN", "RUN/best")
SAME = 1e-5  # bertjax against bertjax (the trainer's model, load_pretrained, embed)
PEER = 1e-5  # bertjax against the peer library (PyTorch, fp32)
MEASURES = set(ranking_metrics.MEASURES)


@dataclasses.dataclass
class Run:
    kind: str
    config: Any
    workdir: pathlib.Path
    beir: pathlib.Path

    def folder(self, which: str) -> pathlib.Path:
        return self.workdir / "best" if which == "RUN/best" else self.workdir

    def params(self, which: str):
        """(params, step) of the checkpoint ``which`` loads: the last step, or the kept one."""
        folder = self.workdir / ("best" if which == "RUN/best" else "checkpoints")
        params, _, step = checkpointing.restore_params(str(folder))
        return params, step

    def step(self, which: str) -> int:
        """The step of the params ``which`` holds: the last, or the evaluation with the highest
        nDCG@10 (the first of equals), as the run logged them."""
        if which == "RUN":
            return self.config.train.steps
        evals = read_metrics(self.workdir, "eval")
        best = max(r["ndcg@10"] for r in evals)
        return next(r["step"] for r in evals if r["ndcg@10"] == best)

    @functools.cached_property
    def trainer(self):
        """(task, setup) as train_and_evaluate builds them from the run's config (once a run)."""
        again = str(self.workdir.parent / f"{self.kind}-again")  # the task reads; writes nothing
        task = train.prepared_task(self.config, again)
        return task, train.build(self.config, again, task)

    def recorded(self, step: int) -> dict[str, float]:
        """The measures the run logged for its evaluation at ``step``."""
        (record,) = [r for r in read_metrics(self.workdir, "eval") if r["step"] == step]
        return {k: record[k] for k in MEASURES}


def _common(c, beir: pathlib.Path, init: pathlib.Path):
    c.init_checkpoint = str(init)
    c.data_dir = str(beir)
    c.train.eval_every = 1  # two evaluations: best/ keeps the better one
    return two_steps(c)


def _config(kind: str, root: pathlib.Path, beir: pathlib.Path):
    if kind == "bi_encoder":
        init = st_dir(root / "st", tiny_hf(root / "hf_bert", "bert"), "mean", dense=torch.nn.Tanh())
        c = _common(retrieval_config.get_config(), beir, init)
        c.data.max_seq_length = 16
        c.data.max_query_length = 8
        c.retrieval.pooling = "cls"  # not the init's mean pooling: the run's head is recorded
        c.retrieval.normalize = True
    elif kind == "colbert":
        c = _common(colbert_config.get_config(), beir, tiny_hf(root / "hf_bert", "bert"))
        c.colbert.dim = 8
        c.colbert.query_length = 8
        c.colbert.document_length = 12
        c.colbert.skiplist_words = ("fox", "dog")
    else:
        ce = cross_encoder_dir(root / "ce", tiny_hf(root / "hf_modernbert", "modernbert"))
        c = _common(reranker_config.get_config(), beir, ce)
        c.data.max_seq_length = PAIR_MAX_LEN
        c.data.eval_batch_size = 8
        c.data.negatives_file = str(beir / "negatives.trec")
        c.data.num_negatives = 3
        c.data.eval_run = str(beir / "first_stage.trec")
    return c


@pytest.fixture(scope="module")
def beir(tmp_path_factory) -> pathlib.Path:
    return write_ranked_beir(tmp_path_factory.mktemp("beir"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, beir):
    """``runs(kind)``: the run of that kind (trained on first use, then shared)."""
    root = tmp_path_factory.mktemp("retrieval_runs")
    cache: dict[str, Run] = {}

    def get(kind: str) -> Run:
        if kind not in cache:
            c = _config(kind, root, beir)
            workdir = root / kind
            result = train.train_and_evaluate(c, str(workdir))
            assert result["step"] == 2 and np.isfinite(result["train"]["loss"])
            cache[kind] = Run(kind, c, workdir, beir)
        return cache[kind]

    return get


def _corpus(beir: pathlib.Path) -> tuple[list[str], list[str], list[str]]:
    """(document ids, document texts as BEIR joins title and text, query texts)."""
    docs = [json.loads(line) for line in (beir / "corpus.jsonl").read_text().splitlines()]
    queries = [json.loads(line) for line in (beir / "queries.jsonl").read_text().splitlines()]
    texts = [document_text(d.get("title"), d["text"]) for d in docs]
    return [d["_id"] for d in docs], texts, [q["text"] for q in queries]


def _outputs(run: Run, model=None, which: str = "RUN") -> dict[str, Any]:
    """What the run's kind computes for the corpus's texts (the reranker: for PAIRS): with
    ``model`` (a loaded Pretrained), or with the trainer's own model (the task's evaluation
    path, ``train.build`` on the run's config) on the params of checkpoint ``which``."""
    _, docs, queries = _corpus(run.beir)
    if model is not None:
        if run.kind == "bi_encoder":
            return {"vectors": model.embed(docs + queries)}
        if run.kind == "colbert":
            return {"queries": model.embed_queries(queries), "docs": model.embed_documents(docs)}
        return {"scores": model.rerank_scores(PAIRS, max_length=PAIR_MAX_LEN)}
    task, setup = run.trainer
    params, step = run.params(which)
    own = train._runner(setup, params)  # what the run's evaluations call
    if run.kind == "bi_encoder":
        features = task._encode(docs + queries, run.config.data.max_seq_length)
        out = {"vectors": task.predict(own, features)["embedding"]}
    elif run.kind == "colbert":
        out = {
            "queries": task._token_embed(own, True)(queries),
            "docs": task._token_embed(own, False)(docs),
        }
    else:
        features = rerank.pair_features(task.tokenizer, PAIRS, PAIR_MAX_LEN)
        out = {"scores": task.predict(own, features)["score"]}
    return {**out, "step": step}


def _same(got: dict, want: dict, tol: float, what: str) -> None:
    for key in ("vectors", "queries", "docs", "scores"):
        if key not in want:
            continue
        a, b = got[key], want[key]
        if isinstance(b, list):  # per-token vectors: one [tokens, dim] array per text
            assert [x.shape for x in a] == [x.shape for x in b], f"{what}: {key} shapes"
            a, b = np.concatenate(a), np.concatenate(b)
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape, f"{what}: {key} shapes {a.shape} != {b.shape}"
        diff = float(np.max(np.abs(a - b)))
        assert diff <= tol, f"{what}: {key} max abs difference {diff:.2e}"
        assert float(np.max(np.abs(b))) > 1e-3, f"{what}: vacuous comparison"


def _evaluate(*argv: str) -> dict[str, float]:
    """``bertjax evaluate retrieval ARGV`` in process: its JSON."""
    out = io.StringIO()
    with redirect_stdout(out):
        assert score.main(["retrieval", *argv]) == 0
    return json.loads(out.getvalue())


def _measures_equal(got: dict, want: dict, what: str) -> None:
    assert set(got) == MEASURES == set(want), what
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-6), (what, key)


# -------------------------------------------------------------------------------------------------
# load_pretrained(RUN) and load_pretrained(RUN/best)
# -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", FOLDERS)
@pytest.mark.parametrize("kind", KINDS)
def test_load_pretrained_is_the_model_the_run_trained(runs, kind, which):
    run = runs(kind)
    want = _outputs(run, which=which)
    assert want["step"] == run.step(which)
    loaded = bertjax.load_pretrained(str(run.folder(which)), quiet=True)
    assert loaded.late_interaction == (kind == "colbert")
    _same(_outputs(run, loaded), want, SAME, f"{kind}: load_pretrained({which})")


def test_a_bi_encoder_run_records_its_head(runs):
    """The bi-encoder's checkpoint keeps the head the run trained (cls pooling and Normalize as
    configured, the init's Dense layer trained), not the init's mean pooling."""
    run = runs("bi_encoder")
    loaded = bertjax.load_pretrained(str(run.workdir), quiet=True)
    task, _ = run.trainer
    assert loaded.embedding.head == task.embedding_head()
    assert loaded.embedding.head.pooling == ("cls",) and loaded.embedding.head.normalize
    assert len(loaded.embedding.head.dense) == 1
    start = bertjax.load_pretrained(run.config.init_checkpoint, quiet=True)
    moved = loaded.embedding.tensors["dense_0/kernel"] - start.embedding.tensors["dense_0/kernel"]
    assert np.abs(moved).max() > 1e-4  # trained
    vectors = loaded.embed(_corpus(run.beir)[1])
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


# -------------------------------------------------------------------------------------------------
# bertjax evaluate retrieval
# -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", FOLDERS)
@pytest.mark.parametrize("kind", KINDS)
def test_evaluate_gives_the_runs_own_evaluation(runs, kind, which, capsys, monkeypatch):
    """``bertjax evaluate retrieval`` of RUN (the last step) and RUN/best (the kept step) gives
    the measures the run logged when it evaluated those params; for RUN/best also its final
    results (eval_results.json, the best params). Reranking shows its progress."""
    run = runs(kind)
    folder = str(run.folder(which))
    data = [f"--data={run.beir}"]
    capsys.readouterr()
    if kind == "reranker":
        monkeypatch.setenv("BERTJAX_PROGRESS_SECONDS", "0")  # a progress line for every batch
        got = _evaluate(f"--rerank={folder}", *data, f"--run={run.config.data.eval_run}")
        assert re.search(r"bertjax: reranking: (\d+)/\1 pairs \(100%\)", capsys.readouterr().err)
    else:
        got = _evaluate(f"--checkpoint={folder}", *data)
    step = run.step(which)
    _measures_equal(got, run.recorded(step), f"{kind}: evaluate {which} (step {step})")
    results = json.loads((run.workdir / "eval_results.json").read_text())
    assert results["params"] == "best" and results["best_metric"] == "ndcg@10"
    assert results["dev"]["recall@100"] == 1.0  # 12 documents: all in the top 100
    assert 0.0 < results["dev"]["ndcg@10"] <= 1.0
    if which == "RUN/best":
        _measures_equal(got, results["dev"], f"{kind}: evaluate {which}, eval_results.json")
    if kind == "colbert":  # the run's own PyLate export too
        exported = _evaluate(f"--checkpoint={results['pylate']}", *data)
        _measures_equal(exported, results["dev"], "colbert: evaluate RUN/pylate")


def test_a_reranker_run_trains_on_the_qrels_and_mined_negatives(runs):
    run = runs("reranker")
    task, _ = run.trainer
    labels = task.train_features["label"]
    assert len(labels) == 8 * 4 and labels.sum() == 8  # a positive and 3 mined negatives each


def test_evaluate_reranks_after_searching_with_the_bi_encoder_run(runs, tmp_path):
    """``--rerank=RERANKER_RUN/best --checkpoint=BI_ENCODER_RUN``: the bi-encoder run searched,
    then its top documents reranked, gives what reranking the run file it writes gives."""
    bi_encoder, reranker = runs("bi_encoder"), runs("reranker")
    data = [f"--data={bi_encoder.beir}"]
    first = tmp_path / "bi.trec"
    _evaluate(f"--checkpoint={bi_encoder.workdir}", *data, f"--output_run={first}")
    base = [f"--rerank={reranker.workdir / 'best'}", *data, "--top_k=5"]
    reranked = tmp_path / "reranked.trec"
    searched = _evaluate(*base, f"--checkpoint={bi_encoder.workdir}", f"--output_run={reranked}")
    assert searched == pytest.approx(_evaluate(*base, f"--run={first}"), abs=1e-9)
    assert len(reranked.read_text().splitlines()) == 4 * 5  # 4 judged queries, the top 5 each


# -------------------------------------------------------------------------------------------------
# bertjax embed
# -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", FOLDERS)
def test_embed_writes_load_pretrained_vectors(runs, tmp_path, which):
    run = runs("bi_encoder")
    folder = str(run.folder(which))
    corpus = run.beir / "corpus.jsonl"
    embed_command.main([f"--checkpoint={folder}", f"--input={corpus}", f"--output={tmp_path}"])
    ids, matrix = load_embeddings(tmp_path)
    want_ids, docs, _ = _corpus(run.beir)
    assert ids == want_ids
    want = bertjax.load_pretrained(folder, quiet=True).embed(docs)
    _same({"vectors": matrix}, {"vectors": want}, SAME, f"embed {which}")


def test_embed_refuses_a_colbert_run_in_one_line(runs, tmp_path, capsys):
    """A ColBERT model has a vector per token: ``bertjax embed`` (one vector per text) says so
    in one line, as load_pretrained(RUN).embed does (it failed with a traceback: AttributeError:
    'LateInteractionSettings' object has no attribute 'max_seq_length')."""
    run = runs("colbert")
    corpus = run.beir / "corpus.jsonl"
    with pytest.raises(ValueError, match="late-interaction"):
        bertjax.load_pretrained(str(run.workdir), quiet=True).embed(["quick fox"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        embed_command.main(
            [f"--checkpoint={run.workdir}", f"--input={corpus}", f"--output={tmp_path}/v"]
        )
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error") == 1, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("bertjax embed: error:") and "late-interaction (ColBERT)" in line, err
    assert not (tmp_path / "v").exists()


# -------------------------------------------------------------------------------------------------
# convert, read by the peer libraries
# -------------------------------------------------------------------------------------------------
def _loading_report_is_empty(cls, folder) -> Any:
    model, info = cls.from_pretrained(
        str(folder), attn_implementation="eager", output_loading_info=True
    )
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (
        info
    )
    return model.eval()


def test_a_bi_encoder_run_converts_to_sentence_transformers(runs, tmp_path):
    run = runs("bi_encoder")
    convert.main([str(run.workdir), "--to=sentence-transformers", str(tmp_path / "st")])
    _loading_report_is_empty(transformers.AutoModel, tmp_path / "st")  # what ST's Transformer loads
    _, docs, queries = _corpus(run.beir)
    exported = st.SentenceTransformer(str(tmp_path / "st"), device="cpu")
    want = bertjax.load_pretrained(str(run.workdir), quiet=True).embed(docs + queries)
    _same({"vectors": exported.encode(docs + queries)}, {"vectors": want}, PEER, "ST export")


def test_a_colbert_run_converts_to_pylate(runs, tmp_path):
    """``convert RUN --to=pylate``: transformers loads the directory's encoder with an empty
    report; its hidden states through the 1_Dense projection file, L2-normalised, are the
    document token vectors bertjax gives (skiplist tokens dropped); and the directory converted
    back to bertjax embeds as the run."""
    from safetensors.numpy import load_file

    run = runs("colbert")
    out = tmp_path / "pylate"
    convert.main([str(run.workdir), "--to=pylate", str(out)])
    modules = json.loads((out / "modules.json").read_text())
    assert [m["type"] for m in modules] == [
        "sentence_transformers.models.Transformer",
        "pylate.models.Dense.Dense",
    ]
    settings = json.loads((out / "config_sentence_transformers.json").read_text())
    assert settings["model_type"] == "ColBERT" and settings["skiplist_words"] == ["fox", "dog"]
    encoder = _loading_report_is_empty(transformers.AutoModel, out)
    projection = load_file(str(out / "1_Dense" / "model.safetensors"))["linear.weight"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    _, docs, _ = _corpus(run.beir)
    model = bertjax.load_pretrained(str(run.workdir), quiet=True)
    want = model.embed_documents(docs)
    assert settings["document_prefix"] == ""  # no [D] token in this vocabulary
    skip = set(tokenizer.convert_tokens_to_ids(list(settings["skiplist_words"])))
    for text, vectors in zip(docs, want):
        ids = tokenizer(text, truncation=True, max_length=settings["document_length"])["input_ids"]
        with torch.no_grad():
            hidden = encoder(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()
        tokens = hidden @ projection.T
        tokens /= np.linalg.norm(tokens, axis=-1, keepdims=True)
        kept = tokens[[i not in skip for i in ids]]
        assert kept.shape == vectors.shape
        np.testing.assert_allclose(kept, vectors, atol=PEER)
    convert.main(["--from=pylate", str(out), "--to=bertjax", str(tmp_path / "back")])
    for folder in (out, tmp_path / "back"):
        again = bertjax.load_pretrained(str(folder), quiet=True)
        _same(_outputs(run, again), _outputs(run, model), SAME, f"pylate export: {folder.name}")


def test_a_reranker_run_converts_to_a_cross_encoder(runs, tmp_path):
    """``convert RUN/best --to=hf``: transformers' classifier loads it with an empty report and
    gives the kept step's logits; ``CrossEncoder`` gives load_pretrained's scores."""
    run = runs("reranker")
    best = str(run.workdir / "best")
    convert.main([best, "--to=hf", str(tmp_path / "hf")])
    hf = _loading_report_is_empty(transformers.AutoModelForSequenceClassification, tmp_path / "hf")
    model = bertjax.load_pretrained(best, quiet=True)
    batch = rerank.pair_features(model.tokenizer, PAIRS, PAIR_MAX_LEN)
    with torch.no_grad():
        logits = hf(
            input_ids=torch.from_numpy(batch["input_ids"]).long(),
            attention_mask=torch.from_numpy(batch["input_mask"]).long(),
        ).logits[:, 0]
    _same({"scores": logits.numpy()}, _outputs(run, model), PEER, "hf export")
    ce = st.CrossEncoder(str(tmp_path / "hf"), device="cpu")
    got = ce.predict(PAIRS, activation_fn=torch.nn.Identity())
    want = model.rerank_scores(PAIRS, max_length=ce.max_seq_length)
    _same({"scores": got}, {"scores": want}, PEER, "CrossEncoder")
