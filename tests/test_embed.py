"""`bertjax embed`: a corpus -> embedding shards, against ``SentenceTransformer.encode``.

References: tiny random BERT and ModernBERT sentence-transformers directories that
sentence-transformers writes itself (as in test_sentence_transformers.py); the vectors equal
``SentenceTransformer(DIR).encode(texts)`` within 1e-5 in fp32, ids in input order. A run killed
after its first shard resumes without recomputing it and writes the same bytes as a run that was
never interrupted; two JAX processes (launch/local.sh) and four simulated devices give the same
vectors.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import ctrl_c_in_shard, st_dir, tiny_hf, xla_flags

from bertjax import cli
from bertjax.commands import embed as embed_tool
from bertjax.retrieval import corpus_input, embed_corpus
from bertjax.retrieval.beir import document_text
from bertjax.retrieval.bi_encoder import embedding
from bertjax.retrieval.embedding_store import load_embeddings

pytest.importorskip("torch")
st = pytest.importorskip("sentence_transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5
DOCS = [  # (id, title, text): lengths from 1 to past max_seq_length (24 tokens)
    ("d1", "Fox", "The quick brown fox."),
    ("7", None, "lazy dog"),
    ("d3", "", "Hello, world!"),
    ("d4", "Long", " ".join(["the quick brown fox jumps over the lazy dog"] * 4)),
    ("d5", None, "x"),
    ("d6", "Twice", "jumps over everything, twice!"),
    ("d7", None, "query passage query passage the dog"),
]


@pytest.fixture(scope="module")
def st_dirs(tmp_path_factory):
    """sentence-transformers directories: BERT with mean pooling and Normalize, ModernBERT with
    CLS pooling and a prompt."""
    root = tmp_path_factory.mktemp("embed_models")
    bert = st_dir(root / "st_bert", tiny_hf(root / "bert", "bert"), "mean", normalize=True)
    modern = st_dir(
        root / "st_modernbert",
        tiny_hf(root / "modernbert", "modernbert"),
        "cls",
        prompts={"query": "query: "},
    )
    return {"bert": bert, "modernbert": modern}


def _write_jsonl(path, docs=DOCS):
    rows = [{"_id": d, "text": t, **({"title": ti} if ti is not None else {})} for d, ti, t in docs]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _texts(docs=DOCS):
    return [document_text(title, text) for _, title, text in docs]


def _reference(directory, texts, **kwargs):
    model = st.SentenceTransformer(str(directory), device="cpu")
    return model.encode(texts, convert_to_numpy=True, **kwargs)


def _run(*args):
    """`bertjax embed ARGS` in this process through the command table."""
    cli.main(["bertjax", "embed", *map(str, args)])


@pytest.mark.parametrize("kind", ["bert", "modernbert"])
def test_vectors_equal_sentence_transformers(st_dirs, tmp_path, kind):
    corpus = _write_jsonl(tmp_path / "corpus.jsonl")
    out = tmp_path / "out"
    prompt = ["--prompt_name=query"] if kind == "modernbert" else []
    _run(
        f"--checkpoint={st_dirs[kind]}",
        f"--input={corpus}",
        f"--output={out}",
        "--shard_size=3",
        "--batch_size=2",
        *prompt,
    )
    ids, matrix = load_embeddings(out)
    assert ids == [d for d, _, _ in DOCS]
    extra = {"prompt_name": "query"} if prompt else {}
    want = _reference(st_dirs[kind], _texts(), **extra)
    assert matrix.dtype == np.float32 and matrix.shape == want.shape
    assert np.abs(matrix - want).max() < TOL
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["count"] for s in manifest["shards"]] == [3, 3, 1] and manifest["count"] == 7
    assert manifest["dim"] == 32 and manifest["settings"]["max_length"] == 24


def test_an_empty_document_is_embedded_as_sentence_transformers_embeds_it(st_dirs, tmp_path):
    """A BEIR corpus record with an empty text (Cranfield has one) is a document: its vector is
    sentence-transformers' for the empty text, as `evaluate retrieval` and training embed it."""
    corpus = tmp_path / "corpus.jsonl"
    rows = [
        {"_id": "a", "title": "", "text": "lazy dog"},
        {"_id": "b", "title": "", "text": ""},
        {"_id": "c", "text": "  "},
    ]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _run(f"--checkpoint={st_dirs['bert']}", f"--input={corpus}", f"--output={tmp_path / 'out'}")
    ids, matrix = load_embeddings(tmp_path / "out")
    assert ids == ["a", "b", "c"]
    want = _reference(st_dirs["bert"], ["lazy dog", "", ""])
    assert np.abs(matrix - want).max() < TOL


def test_parquet_in_and_out_fp16_and_text_files(st_dirs, tmp_path, capsys, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table(
        {
            "doc": [d for d, _, _ in DOCS],
            "body": [t for _, _, t in DOCS],
            "title": [ti for _, ti, _ in DOCS],
        }
    )
    pq.write_table(table, tmp_path / "corpus.parquet")
    model = st_dirs["bert"]
    _run(
        f"--checkpoint={model}",
        f"--input={tmp_path / 'corpus.parquet'}",
        "--text_field=body",
        "--id_field=doc",
        f"--output={tmp_path / 'pq'}",
        "--format=parquet",
        "--dtype=float16",
    )
    ids, matrix = load_embeddings(tmp_path / "pq")
    assert ids == [d for d, _, _ in DOCS] and matrix.dtype == np.float16
    stored = pq.read_table(tmp_path / "pq" / "embeddings-00000-of-00001.parquet")
    assert stored.column_names == ["id", "embedding"]
    want = _reference(model, _texts())
    half_ulp = np.spacing(np.abs(want).astype(np.float16)).astype(np.float32) / 2
    assert (np.abs(matrix.astype(np.float32) - want) <= half_ulp + TOL).all()  # fp32, rounded
    # plain text: one text per line, id = line number, counted on over a glob's files
    (tmp_path / "a.txt").write_text("The quick brown fox.\nlazy dog\n")
    (tmp_path / "b.txt").write_text("x\n")
    capsys.readouterr()
    monkeypatch.setenv("BERTJAX_PROGRESS_SECONDS", "0")  # a progress line for every batch
    _run(f"--checkpoint={model}", f"--input={tmp_path / '*.txt'}", f"--output={tmp_path / 'tx'}")
    err = capsys.readouterr().err.strip().splitlines()
    ids, matrix = load_embeddings(tmp_path / "tx")
    assert ids == ["1", "2", "3"]
    want = _reference(model, ["The quick brown fox.", "lazy dog", "x"])
    assert np.abs(matrix - want).max() < TOL
    assert err[-1].startswith("bertjax embed: 3 texts, 32 dims, float32 npy in 1 shard(s)")
    assert "texts/s" in err[-1] and any("shard 1/1: 3 texts" in line for line in err)
    assert any(line.startswith("bertjax: embedding: 3/3 texts (100%)") for line in err), err


@pytest.mark.parametrize(
    "lines, expected",
    [
        (['{"_id": "a", "text": "ok"}', '{"_id": "b", "body": "no text"}'], ":2: no 'text' key"),
        (
            ['{"_id": "a", "text": "ok"}', '{"_id": "a", "text": "again"}'],
            ":2: id 'a' again (first at ",
        ),
        (['{"_id": "a", "text": "ok"}', '{"_id": "b", "text": "ok"'], ":2: invalid JSON"),
        (['{"text": "no id"}'], ":1: no '_id' key (--id_field)"),
        (['{"_id": "a", "text": 3}'], ":1: 'text' is int, not a string"),
    ],
)
def test_bad_input_is_one_line_naming_file_and_line(st_dirs, tmp_path, capsys, lines, expected):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit) as exited:
        embed_tool.main(
            [f"--checkpoint={st_dirs['bert']}", f"--input={corpus}", f"--output={tmp_path / 'out'}"]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"bertjax embed: error: {corpus}{expected}"), err
    assert not (tmp_path / "out").exists()


def test_bad_parquet_and_text_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"_id": ["a", "b"], "body": ["x", "y"]}), tmp_path / "c.parquet")
    with pytest.raises(ValueError, match=r"c.parquet: no column 'text' \(--text_field\); the "):
        corpus_input.read_corpus(str(tmp_path / "c.parquet"))
    pq.write_table(pa.table({"_id": ["a", "a"], "text": ["x", "y"]}), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"d.parquet: row 2: id 'a' again \(first at .*row 1\)"):
        corpus_input.read_corpus(str(tmp_path / "d.parquet"))
    (tmp_path / "e.txt").write_text("one\n\nthree\n")
    with pytest.raises(ValueError, match=r"e.txt:2: empty text"):
        corpus_input.read_corpus(str(tmp_path / "e.txt"))
    with pytest.raises(FileNotFoundError, match="no file matches"):
        corpus_input.read_corpus(str(tmp_path / "*.nothing"))
    corpus = corpus_input.read_corpus(str(tmp_path / "c.parquet"), corpus_input.Fields("body"))
    assert corpus.ids == ["a", "b"] and corpus.texts == ["x", "y"]


def test_another_model_input_or_setting_is_refused(st_dirs, tmp_path, capsys):
    corpus = _write_jsonl(tmp_path / "corpus.jsonl")
    base = [f"--input={corpus}", f"--output={tmp_path / 'out'}", "--shard_size=4"]
    _run(f"--checkpoint={st_dirs['bert']}", *base)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    capsys.readouterr()
    other_input = _write_jsonl(tmp_path / "other.jsonl", DOCS[:5])
    cases = [
        ([f"--checkpoint={st_dirs['modernbert']}", *base], "another model"),
        (
            [f"--checkpoint={st_dirs['bert']}", f"--input={other_input}", *base[1:]],
            "another input",
        ),
        ([f"--checkpoint={st_dirs['bert']}", *base, "--dtype=float16"], "dtype='float32', not"),
        ([f"--checkpoint={st_dirs['bert']}", *base[:2], "--shard_size=3"], "shard_size=4, not 3"),
    ]
    for args, expected in cases:
        with pytest.raises(SystemExit):
            embed_tool.main(args)
        err = capsys.readouterr().err.strip().splitlines()  # the plan line, then the error
        assert len(err) == 2 and expected in err[-1] and "run.json" in err[-1], err
        assert err[-1].startswith("bertjax embed: error: "), err
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before


def test_bucketed_lengths():
    assert [embedding.padded_length(n, 512) for n in (1, 16, 17, 100, 129, 192, 193, 600)] == [
        16,
        16,
        32,
        128,
        192,
        192,
        256,
        512,
    ]
    assert embedding.padded_length(200, 160) == 160
    # one batch at 64 is not worth a compile: it takes the 128 before it; three at 32 are
    assert embedding.batch_lengths([100, 90, 60, 30, 30, 30], 512) == [
        128,
        128,
        128,
        32,
        32,
        32,
    ]


def _cli(args, env=None):
    cmd = [sys.executable, "-m", "bertjax.cli", "embed", *map(str, args)]
    environ = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=600)


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_bytes(st_dirs, tmp_path, capsys):
    """The command killed in its own process after its first shard; the rerun and a run never
    interrupted in this one (the same XLA flags and devices: the same bytes, without starting two
    more processes)."""
    corpus = _write_jsonl(tmp_path / "corpus.jsonl")
    common = [
        f"--checkpoint={st_dirs['modernbert']}",
        f"--input={corpus}",
        "--shard_size=3",
        "--batch_size=2",
        "--format=parquet",
    ]
    killed = _cli(
        [*common, f"--output={tmp_path / 'resumed'}"], {embed_tool.FAULT_AFTER_SHARDS: "1"}
    )
    assert killed.returncode == 17, killed.stderr[-2000:]
    first = tmp_path / "resumed" / "embeddings-00000-of-00003.parquet"
    assert first.exists() and not (tmp_path / "resumed" / "manifest.json").exists()
    stamp = first.stat().st_mtime_ns, first.stat().st_ino
    capsys.readouterr()
    _run(*common, f"--output={tmp_path / 'resumed'}")
    resumed = capsys.readouterr().err
    lines = resumed.strip().splitlines()
    assert "shard 1/3: found finished, skipped" in resumed
    assert "embedded 4 texts" in lines[-1] and "1 found finished" in lines[-1], lines[-1]
    assert (first.stat().st_mtime_ns, first.stat().st_ino) == stamp  # not written again
    _run(*common, f"--output={tmp_path / 'whole'}")
    names = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "resumed").iterdir())
    assert len(names) == 5 and not any(".tmp" in n for n in names)
    for name in names:
        assert (tmp_path / "whole" / name).read_bytes() == (
            tmp_path / "resumed" / name
        ).read_bytes()


@pytest.mark.slow
def test_four_devices_and_two_processes_match_sentence_transformers(st_dirs, tmp_path):
    """Simulated devices: a subprocess with 4 CPU devices runs process 1 then process 0 of 2
    (each its every-other shard over all 4 devices, batches split over them)."""
    corpus = _write_jsonl(tmp_path / "corpus.jsonl")
    script = textwrap.dedent(f"""
        import jax, bertjax
        from bertjax.retrieval import corpus_input, embed_corpus
        assert len(jax.local_devices()) == 4
        model = bertjax.load_pretrained({str(st_dirs["bert"])!r}, quiet=True)
        corpus = corpus_input.read_corpus({str(corpus)!r})
        options = embed_corpus.EmbedOptions(shard_size=2, batch_size=3)  # 4 rows, one per device
        for index in (1, 0):
            done = embed_corpus.embed_corpus(model, corpus, {str(tmp_path / "out")!r}, options,
                                             process_index=index, process_count=2)
            print(index, done.shards_embedded, done.manifest)
    """)
    environ = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": ROOT,
        "XLA_FLAGS": xla_flags(4),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environ, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["1 2 False", "0 2 True"], done.stdout
    ids, matrix = load_embeddings(tmp_path / "out")
    assert ids == [d for d, _, _ in DOCS]
    assert np.abs(matrix - _reference(st_dirs["bert"], _texts())).max() < TOL


@pytest.mark.slow
def test_two_processes_through_launch_local(st_dirs, tmp_path):
    """Two real JAX processes (launch/local.sh, bertjax.distributed), two CPU devices each: each
    embeds every other shard, process 0 writes the manifest once both are done."""
    corpus = _write_jsonl(tmp_path / "corpus.jsonl")
    environ = {
        **os.environ,
        "LOG_DIR": str(tmp_path / "logs"),
        "PYTHONPATH": ROOT,
        "BERTJAX_CMD": f"{sys.executable} -m bertjax.cli",
    }
    cmd = [
        os.path.join(ROOT, "launch", "local.sh"),
        "2",
        "--devices_per_process",
        "2",
        "--",
        "embed",
        f"--checkpoint={st_dirs['modernbert']}",
        f"--input={corpus}",
        f"--output={tmp_path / 'out'}",
        "--shard_size=2",
        "--batch_size=2",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=600)
    logs = "".join(p.read_text() for p in sorted((tmp_path / "logs").glob("*.log")))
    assert done.returncode == 0, done.stderr[-2000:] + logs[-2000:]
    assert "shard 2/4: 2 texts" in logs and "shard 1/4: 2 texts" in logs, logs[-2000:]
    ids, matrix = load_embeddings(tmp_path / "out")
    assert ids == [d for d, _, _ in DOCS]
    assert np.abs(matrix - _reference(st_dirs["modernbert"], _texts())).max() < TOL


def test_ctrl_c_is_one_line_keeps_the_written_shards_then_resumes(
    st_dirs, tmp_path, capsys, monkeypatch
):
    corpus = _write_jsonl(tmp_path / "corpus.jsonl")
    out = tmp_path / "out"
    args = [f"--checkpoint={st_dirs['bert']}", f"--input={corpus}", f"--output={out}"]
    _run(*args, "--shard_size=3")
    reference = {p.name: p.read_bytes() for p in out.iterdir()}
    out = tmp_path / "stopped"
    args = [f"--checkpoint={st_dirs['bert']}", f"--input={corpus}", f"--output={out}"]
    embed = ctrl_c_in_shard(monkeypatch, 2)
    capsys.readouterr()
    try:
        embed_tool.main([*args, "--shard_size=3"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C left `bertjax embed` as a traceback")
    except SystemExit as exited:
        assert exited.code == 130
    else:
        pytest.fail("`bertjax embed` finished after Ctrl-C")
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "bertjax embed: interrupted (Ctrl-C): 1 of 3 shards are written; "
        "rerun the same command to resume"
    ), err
    assert "Traceback" not in "\n".join(err) and "shard 1/3" in err[-2]
    monkeypatch.setattr(embed_corpus._Encoder, "embed", embed)
    _run(*args, "--shard_size=3")
    assert "shard 1/3: found finished, skipped" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == reference
