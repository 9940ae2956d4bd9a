"""Late interaction (ColBERT) against PyLate: ``load_pretrained(DIR).embed_queries/embed_documents``
equal PyLate's ``ColBERT.encode(..., is_query=True/False)``, ``convert --to=pylate`` writes a
directory that loads back with the same vectors, MaxSim search scores as PyLate's
``colbert_scores``, and the Contrastive / Distillation losses and their gradients with respect to
the token embeddings equal PyLate's.

References: tests/data/pylate/ holds two tiny ColBERT directories that PyLate 1.6.0 saved itself
(BERT and ModernBERT encoders) and ``reference.npz``, PyLate's own outputs on them and on random
token embeddings (tests/pylate_reference.py writes both; PyLate pins sentence-transformers 5.3, so
it does not run in the project's environment). sentence-transformers 6's ``MultiVectorEncoder``,
which loads PyLate directories, is a second, live reference where it is installed.
"""

import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
from pylate_reference import TEXTS

import bertjax
from bertjax.convert import detect_format, load_checkpoint
from bertjax.convert import main as convert_main
from bertjax.retrieval import contrastive_losses, search

DATA = pathlib.Path(__file__).resolve().parent / "data" / "pylate"
KINDS = ("bert", "modernbert")
TOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    with np.load(DATA / "reference.npz") as f:
        return dict(f)


@pytest.fixture(scope="module")
def models():
    return {kind: bertjax.load_pretrained(str(DATA / kind)) for kind in KINDS}


def _max_diff(got, want):
    assert [g.shape for g in got] == [w.shape for w in want]
    return max(float(np.abs(g - w).max()) for g, w in zip(got, want))


def _pylate(reference, kind, name):
    return [reference[f"{kind}/{name}/{i}"] for i in range(len(TEXTS))]


@pytest.mark.parametrize("kind", KINDS)
def test_token_vectors_equal_pylate_encode(models, reference, kind):
    model = models[kind]
    assert detect_format(str(DATA / kind)) == "pylate" and model.late_interaction
    s = model.embedding
    assert (s.query_prefix, s.document_prefix, s.query_length, s.document_length) == (
        "[Q] ",
        "[D] ",
        12,
        20,
    )
    queries = model.embed_queries(TEXTS, batch_size=4)
    assert all(q.shape == (12, 16) for q in queries)  # padded with [MASK] to query_length
    assert _max_diff(queries, _pylate(reference, kind, "query")) < TOL
    documents = model.embed_documents(TEXTS, batch_size=4)
    assert _max_diff(documents, _pylate(reference, kind, "document")) < TOL
    # punctuation and [UNK] (PyLate's skiplist looks '#' up as [UNK]) are not document vectors
    assert [len(d) for d in documents] == [7, 5, 13, 4, 20, 19, 18]
    with pytest.raises(ValueError, match="embed_queries / embed_documents"):
        model.embed(TEXTS)


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_of_one_and_the_order_do_not_change_the_vectors(models, reference, kind):
    got = models[kind].embed_documents(TEXTS[::-1], batch_size=1)[::-1]
    assert _max_diff(got, _pylate(reference, kind, "document")) < TOL


def _multi_vector_encoder():
    st = pytest.importorskip("sentence_transformers")
    if not hasattr(st, "MultiVectorEncoder"):
        pytest.skip("sentence-transformers < 6 has no MultiVectorEncoder")
    return st.MultiVectorEncoder


@pytest.mark.parametrize("kind", KINDS)
def test_export_round_trips_and_sentence_transformers_loads_it(models, reference, tmp_path, kind):
    out = tmp_path / "exported"
    convert_main(["--to=pylate", str(DATA / kind), str(out)])
    written = json.loads((out / "config_sentence_transformers.json").read_text())
    assert written["model_type"] == "ColBERT" and written["query_length"] == 12
    assert json.loads((out / "modules.json").read_text())[1]["type"] == "pylate.models.Dense.Dense"
    again = bertjax.load_pretrained(str(out))
    assert _max_diff(again.embed_queries(TEXTS), _pylate(reference, kind, "query")) < TOL
    assert _max_diff(again.embed_documents(TEXTS), _pylate(reference, kind, "document")) < TOL
    encoder = _multi_vector_encoder()(str(out), device="cpu")
    texts = TEXTS[:-1]  # sentence-transformers drops [UNK] from the skiplist; PyLate keeps it
    want = [np.asarray(v) for v in encoder.encode_query(texts)]
    assert _max_diff(again.embed_queries(texts), want) < TOL
    want = [np.asarray(v) for v in encoder.encode_document(texts)]
    assert _max_diff(again.embed_documents(texts), want) < TOL


def test_settings_default_as_pylate_and_bad_settings_name_the_file(tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(DATA / "bert", folder)
    path = folder / "config_sentence_transformers.json"
    config = json.loads(path.read_text())
    for key in ("query_length", "document_length", "skiplist_words", "do_query_expansion"):
        del config[key]
    path.write_text(json.dumps(config))
    s = load_checkpoint(str(folder)).embedding
    assert (s.query_length, s.document_length, s.do_query_expansion) == (32, 180, True)
    assert "".join(s.skiplist_words) == "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
    model = bertjax.load_pretrained(str(folder))  # document_length 180: cut to the table (64)
    assert [len(d) for d in model.embed_documents(["w " * 100])] == [64]
    config["query_length"] = "long"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config_sentence_transformers.json: query_length="):
        load_checkpoint(str(folder))
    config["query_length"] = 2
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"query_length=2 must be at least 3"):
        load_checkpoint(str(folder))


def test_a_plain_checkpoint_cannot_be_written_as_pylate(tmp_path):
    hf = tmp_path / "hf"
    convert_main(["--to=hf", str(DATA / "bert"), str(hf)])
    with pytest.raises(ValueError, match="--to=pylate needs a late-interaction checkpoint"):
        convert_main(["--to=pylate", str(hf), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


# ---- scores and losses ----------------------------------------------------------------------------


def test_maxsim_search_scores_equal_pylate_colbert_scores(reference):
    q, d = reference["scores/q"], reference["scores/d"]
    q_mask, d_mask = reference["scores/q_mask"] > 0, reference["scores/d_mask"] > 0
    colbert_scores = jax.jit(contrastive_losses.colbert_scores)  # one program per shape
    np.testing.assert_allclose(colbert_scores(q, d), reference["scores/plain"], rtol=1e-6)
    masked = colbert_scores(q, d, q_mask, d_mask)
    np.testing.assert_allclose(masked, reference["scores/masked"], rtol=1e-6)
    # exact search: every document alone (PyLate scores a document's own tokens: no padding)
    top, rows = search.maxsim_search(q, np.ones(q.shape[:2], bool), d, np.ones(d.shape[:2]), k=4)
    got = np.take_along_axis(top, np.argsort(rows, axis=1), axis=1)
    np.testing.assert_allclose(got, reference["scores/plain"], rtol=1e-6)
    top, rows = search.maxsim_search(q, q_mask, d, d_mask, k=4)
    got = np.take_along_axis(top, np.argsort(rows, axis=1), axis=1)
    own = np.stack(
        [
            [
                np.asarray(colbert_scores(q[i : i + 1][:, q_mask[i]], d[j : j + 1][:, d_mask[j]]))[
                    0, 0
                ]
                for j in range(len(d))
            ]
            for i in range(len(q))
        ]
    )
    np.testing.assert_allclose(got, own, rtol=1e-6)


def _features(reference, prefix):
    keys = ("embeddings", "input_ids", "attention_mask")
    f = {k: reference[f"{prefix}/{k}"] for k in keys}
    f["mask"] = f["attention_mask"].astype(bool) & ~np.isin(f["input_ids"], [5, 6])  # skiplist
    return f


@pytest.mark.parametrize("temperature", [1.0, 0.05])
def test_contrastive_loss_and_gradients_equal_pylate(reference, temperature):
    query, *docs = [_features(reference, f"contrastive/{j}") for j in range(4)]
    d = np.stack([f["embeddings"] for f in docs], axis=1)  # [b, positive + 2 negatives, t, dim]
    d_mask = np.stack([f["mask"] for f in docs], axis=1)

    def loss(q, d):
        return contrastive_losses.colbert_contrastive(
            q, d, document_mask=d_mask, temperature=temperature
        )[0]

    value, (dq, dd) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(query["embeddings"], d)
    assert float(value) == pytest.approx(
        float(reference[f"contrastive/loss/{temperature}"]), rel=2e-6
    )
    scale = temperature  # the gradients grow as 1 / temperature
    grads = [reference[f"contrastive/grad/{temperature}/{j}"] for j in range(4)]
    np.testing.assert_allclose(dq * scale, grads[0] * scale, atol=TOL)
    for j in range(3):
        np.testing.assert_allclose(dd[:, j] * scale, grads[j + 1] * scale, atol=TOL)


@pytest.mark.parametrize("normalize", [True, False])
def test_distillation_loss_and_gradients_equal_pylate(reference, normalize):
    query = _features(reference, "distillation/query")
    docs = _features(reference, "distillation/documents")
    b = len(query["embeddings"])
    d = docs["embeddings"].reshape(b, -1, *docs["embeddings"].shape[1:])
    d_mask = docs["mask"].reshape(b, -1, docs["mask"].shape[-1])
    teacher = reference["distillation/labels"]

    def loss(q, d):
        return contrastive_losses.colbert_distillation(
            q, d, teacher, document_mask=d_mask, normalize_scores=normalize
        )[0]

    value, (dq, dd) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(query["embeddings"], d)
    assert float(value) == pytest.approx(
        float(reference[f"distillation/loss/{normalize}"]), rel=1e-6
    )
    np.testing.assert_allclose(dq, reference[f"distillation/grad/{normalize}/query"], atol=TOL)
    dd = np.asarray(dd).reshape(docs["embeddings"].shape)
    np.testing.assert_allclose(dd, reference[f"distillation/grad/{normalize}/documents"], atol=TOL)


def test_padded_documents_leave_the_losses_as_without_them():
    """document_valid drops a padded column: the loss equals the one on the real columns only."""
    rng = np.random.default_rng(0)
    q = rng.normal(size=(3, 4, 8)).astype(np.float32)
    d = rng.normal(size=(3, 2, 5, 8)).astype(np.float32)
    teacher = rng.normal(size=(3, 2)).astype(np.float32)
    padded = np.concatenate([d, rng.normal(size=(3, 1, 5, 8)).astype(np.float32)], axis=1)
    valid = np.array([[1, 1, 0]] * 3)
    for fn, args in (
        (contrastive_losses.colbert_contrastive, ()),
        (contrastive_losses.colbert_distillation, (teacher,)),
    ):
        extra = args if not args else (np.concatenate([teacher, np.zeros((3, 1))], 1),)
        jitted = jax.jit(fn)  # one program per shape instead of one per op
        want, _ = jitted(q, d, *args)
        got, _ = jitted(q, padded, *extra, document_valid=valid)
        assert float(got) == pytest.approx(float(want), rel=1e-6)
