"""Row corpora (JSONL plain/.gz/.zst, Parquet) and compressed text: readers, errors, prepare, vocab."""

import gzip
import hashlib
import json
import os

import pytest

from bertjax.data import corpus, formats, prepare, vocab
from bertjax.text import load_tokenizer

WORDS = "the a of and to in it was he she said that his her on at with for as had".split()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ","] + WORDS
    tokens += list("bcdfgjkmnpqruvxyz") + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    path.write_text("\n".join(tokens) + "\n")
    return load_tokenizer(str(path), do_lower_case=True)


def _documents(num=14):
    """Documents of one-sentence lines ("Word word ... word."), deterministic."""
    docs = []
    for d in range(num):
        sentences = []
        for s in range(2 + d % 5):
            words = [WORDS[(d * 7 + s * 3 + w) % len(WORDS)] for w in range(4 + (d + s) % 9)]
            sentences.append(" ".join(words).capitalize() + ".")
        docs.append(sentences)
    return docs


def _write_jsonl(path, docs, opener=open, key="text"):
    with opener(path, "wt", encoding="utf-8") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"id": i, key: "\n".join(doc)}) + "\n")
            if i == 3:
                f.write("\n")  # blank lines are skipped


def _write_zst(path, text):
    zstandard = pytest.importorskip("zstandard")
    with open(path, "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(text.encode("utf-8")))


def _write_parquet(path, docs, row_group_size=4):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(docs))), "body": ["\n".join(d) for d in docs]})
    pq.write_table(table, path, row_group_size=row_group_size)


def test_row_formats_read_every_row_as_a_document(tmp_path):
    docs = _documents()
    _write_jsonl(tmp_path / "a.jsonl", docs)
    _write_jsonl(tmp_path / "a.jsonl.gz", docs, opener=gzip.open)
    _write_zst(tmp_path / "a.jsonl.zst", (tmp_path / "a.jsonl").read_text())
    _write_parquet(tmp_path / "a.parquet", docs)
    for name, fmt, column in [
        ("a.jsonl", "jsonl", "text"),
        ("a.jsonl.gz", "jsonl", "text"),
        ("a.jsonl.zst", "jsonl", "text"),
        ("a.parquet", "parquet", "body"),
    ]:
        got = list(corpus.iter_documents(str(tmp_path / name), fmt, text_column=column))
        assert got == docs, name
    seen = []
    source = corpus.Source("file", str(tmp_path / "a.jsonl.gz"))
    list(corpus.iter_source_documents(source, "jsonl", seen.append))
    assert sum(seen) == os.path.getsize(tmp_path / "a.jsonl.gz")  # stored bytes, for progress


def test_row_text_is_split_into_paragraphs_and_sentences(tmp_path):
    rows = [{"text": "First one. Second one.\nNew paragraph here"}, {"text": ""}, {"text": None}]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    docs = list(corpus.iter_documents(str(tmp_path / "r.jsonl"), "jsonl"))
    assert docs == [["First one.", "Second one.", "New paragraph here"]]


def test_compressed_text_formats(tmp_path):
    text = "Line one.\nLine two.\n\nOther doc.\n"
    with gzip.open(tmp_path / "c.txt.gz", "wt") as f:
        f.write(text)
    _write_zst(tmp_path / "c.txt.zst", text)
    for name in ("c.txt.gz", "c.txt.zst"):
        docs = list(corpus.iter_documents(str(tmp_path / name), "bert"))
        assert docs == [["Line one.", "Line two."], ["Other doc."]]


def test_bad_rows_are_one_line_errors_naming_file_and_line(tmp_path):
    cases = {
        '{"text": "ok"}\n{"text": "bad\n': "bad.jsonl:2: invalid JSON",
        '{"text": "ok"}\n[1, 2]\n': "bad.jsonl:2: expected a JSON object, got list",
        '{"text": "ok"}\n\n{"body": "x", "id": 3}\n': (
            "bad.jsonl:3: no key 'text' (text_column); the row has keys 'body', 'id'"
        ),
        '{"text": 5}\n': "bad.jsonl:1: 'text' is a int, not a string",
    }
    for content, message in cases.items():
        (tmp_path / "bad.jsonl").write_text(content)
        with pytest.raises(ValueError) as err:
            list(corpus.iter_documents(str(tmp_path / "bad.jsonl"), "jsonl"))
        assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_parquet_errors(tmp_path):
    _write_parquet(tmp_path / "p.parquet", _documents(3))
    with pytest.raises(ValueError, match=r"p.parquet: no column 'text' .*'id', 'body'"):
        list(corpus.iter_documents(str(tmp_path / "p.parquet"), "parquet"))
    with pytest.raises(ValueError, match=r"p.parquet: column 'id' holds int64, not strings"):
        list(corpus.iter_documents(str(tmp_path / "p.parquet"), "parquet", text_column="id"))
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"x.parquet: not a Parquet file"):
        list(corpus.iter_documents(str(tmp_path / "x.parquet"), "parquet"))


def _shard_digest(out):
    digest = hashlib.sha256()
    for name in sorted(os.listdir(out)):
        if name.endswith(".tfrecord"):
            digest.update(name.encode() + (out / name).read_bytes())
    return digest.hexdigest()


def test_prepare_reads_row_formats_like_the_bert_format(tmp_path, tok):
    """The same documents as bert-format files, JSONL(.gz) and Parquet give the same shards."""
    docs = _documents(30)
    (tmp_path / "bert").mkdir()
    (tmp_path / "rows").mkdir()
    for part in range(2):
        mine = docs[part::2]
        text = "\n\n".join("\n".join(d) for d in mine) + "\n"
        (tmp_path / "bert" / f"p{part}.txt").write_text(text)
        _write_jsonl(tmp_path / "rows" / f"p{part}.jsonl.gz", mine, opener=gzip.open)
        _write_parquet(tmp_path / "rows" / f"p{part}.parquet", mine)
    kw = dict(max_seq_length=32, max_predictions_per_seq=5, dupe_factor=2, num_shards=2)
    kw.update(show_progress=False, num_workers=1)
    runs = [
        ("bert", "bert/*.txt", "text"),
        ("jsonl", "rows/*.jsonl.gz", "text"),
        ("parquet", "rows/*.parquet", "body"),
    ]
    digests = {}
    for fmt, pattern, column in runs:
        out = tmp_path / f"out-{fmt}"
        meta = prepare.prepare(
            str(tmp_path / pattern), str(out), tok, corpus_format=fmt, text_column=column, **kw
        )
        assert meta["corpus_format"] == fmt and meta["text_column"] == column
        assert meta["documents"]["train"] == 30
        digests[fmt] = _shard_digest(out)
    assert len(set(digests.values())) == 1, digests


def test_prepare_cli_and_vocab_read_parquet(tmp_path, tok):
    _write_parquet(tmp_path / "c.parquet", _documents(20))
    out = tmp_path / "out"
    argv = [
        f"--input={tmp_path}/c.parquet",
        f"--output_dir={out}",
        f"--vocab={tok.vocab_file}",
        "--format=parquet",
        "--text_column=body",
        "--max_seq_length=32",
        "--num_shards=1",
        "--dupe_factor=1",
        "--no_progress",
        "--num_workers=1",
    ]
    assert prepare.main(argv) == 0
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["documents"]["train"] == 20 and meta["examples"]["train"] > 0
    with pytest.raises(ValueError, match=r"no column 'text' \(--text_column\)"):
        bad = [a for a in argv if not a.startswith(("--text_column", "--output_dir"))]
        prepare.main([*bad, f"--output_dir={tmp_path}/out2"])
    lines = list(vocab.corpus_lines(str(tmp_path / "c.parquet"), "parquet", text_column="body"))
    assert lines == [s for d in _documents(20) for s in d]
    vocab_argv = [f"--input={tmp_path}/c.parquet", f"--output={tmp_path}/v.txt", "--format=parquet"]
    with pytest.raises(ValueError, match=r"no column 'text' \(--text_column\)"):
        vocab.main([*vocab_argv, "--vocab_size=50"])


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_missing_text_column_names_the_callers_setting(tmp_path, tok, fmt):
    """The library readers name the option the caller set: a pretraining run's data.text_column,
    not the `bertjax prepare` flag (in worker processes too)."""
    if fmt == "parquet":
        _write_parquet(tmp_path / "c.parquet", _documents(6))
    else:
        _write_jsonl(tmp_path / "c.jsonl", _documents(6), key="body")
    corpus_file = str(tmp_path / f"c.{fmt}")
    kw = dict(corpus_format=fmt, text_column="text", text_column_setting="data.text_column")
    for num_workers in (1, 2):
        with pytest.raises(ValueError) as err:
            prepare.prepare(
                f"{corpus_file},{corpus_file}",
                str(tmp_path / f"out{num_workers}"),
                tok,
                max_seq_length=32,
                num_shards=1,
                show_progress=False,
                num_workers=num_workers,
                **kw,
            )
        message = str(err.value)
        assert "'text' (data.text_column); the " in message and "--text_column" not in message
        assert corpus_file in message and "\n" not in message
    with pytest.raises(ValueError, match=r"'text' \(data.text_column\); the "):
        vocab.train_vocab(corpus_file, str(tmp_path / "v.txt"), 50, **kw)
    meta = prepare.prepare(  # the label is no setting of the prepared data
        corpus_file,
        str(tmp_path / "ok"),
        tok,
        max_seq_length=32,
        num_shards=1,
        show_progress=False,
        num_workers=1,
        corpus_format=fmt,
        text_column="body",
    )
    assert "text_column_setting" not in meta
    again = prepare.prepare(
        corpus_file,
        str(tmp_path / "ok"),
        tok,
        max_seq_length=32,
        num_shards=1,
        show_progress=False,
        num_workers=1,
        corpus_format=fmt,
        text_column="body",
        text_column_setting="data.text_column",
    )
    assert again == meta  # the same settings: skipped, not "written for other settings"


def test_open_stream_remote_paths_go_through_gfile(tmp_path):
    pytest.importorskip("tensorflow")
    _write_jsonl(tmp_path / "g.jsonl.gz", _documents(3), opener=gzip.open)
    texts = list(formats.jsonl_texts(f"file://{tmp_path}/g.jsonl.gz"))
    assert texts == ["\n".join(d) for d in _documents(3)]
    _write_parquet(tmp_path / "g.parquet", _documents(9), row_group_size=2)
    seen = []
    texts = list(formats.parquet_texts(f"file://{tmp_path}/g.parquet", "body", seen.append))
    assert texts == ["\n".join(d) for d in _documents(9)]
    assert sum(seen) == os.path.getsize(tmp_path / "g.parquet")


_KILLED_RUN = """
import os, sys
from bertjax.data import prepare, units
from bertjax.text import load_tokenizer
real = units.process_unit
def dying(task):
    if task[0] == 2:
        os._exit(9)  # killed while working on unit 2: units 0 and 1 are complete
    return real(task)
units.process_unit = dying
prepare.prepare(sys.argv[1].split(","), sys.argv[2], load_tokenizer(sys.argv[3], True),
                num_workers=1, show_progress=False, **eval(sys.argv[4]))
"""


def test_a_killed_run_resumes_with_only_the_unfinished_units(tmp_path, tok, monkeypatch):
    import subprocess
    import sys

    from bertjax.data import units

    docs = _documents(40)
    paths = []
    for part in range(4):
        paths.append(str(tmp_path / f"p{part}.txt"))
        (tmp_path / f"p{part}.txt").write_text("\n\n".join("\n".join(d) for d in docs[part::4]))
    kw = dict(max_seq_length=32, max_predictions_per_seq=5, dupe_factor=2, num_shards=3)
    ref = prepare.prepare(paths, str(tmp_path / "ref"), tok, show_progress=False, **kw)
    out = tmp_path / "out"
    args = [",".join(paths), str(out), tok.vocab_file, repr(kw)]
    proc = subprocess.run([sys.executable, "-c", _KILLED_RUN, *args], capture_output=True)
    assert proc.returncode == 9, proc.stderr.decode()[-2000:]
    (work,) = out.glob(".prepare-tmp-*")
    assert sorted(p.name for p in work.glob("unit-*.json")) == [
        "unit-000000.json",
        "unit-000001.json",
    ]
    assert not (out / "metadata.json").exists()
    ran = []
    real = units.process_unit
    monkeypatch.setattr(units, "process_unit", lambda task: ran.append(task[0]) or real(task))
    meta = prepare.prepare(paths, str(out), tok, num_workers=1, show_progress=False, **kw)
    assert ran == [2, 3]
    assert meta["examples"] == ref["examples"] and meta["shards"] == ref["shards"]
    assert _shard_digest(out) == _shard_digest(tmp_path / "ref")
    assert sorted(p.name for p in out.iterdir()) == sorted(["metadata.json", *ref["shards"]])


_KILLED_IN_MERGE = """
import os, sys
import bertjax.fs as fs
from bertjax.data import prepare
from bertjax.text import load_tokenizer
real, renamed = fs.rename, []
def dying(source, target):
    real(source, target)
    renamed.append(target)
    if len(renamed) == 2:
        os._exit(9)  # killed while merging: 2 of the 3 shards are in place, no metadata.json
fs.rename = dying
prepare.prepare(sys.argv[1].split(","), sys.argv[2], load_tokenizer(sys.argv[3], True),
                num_workers=1, show_progress=False, **eval(sys.argv[4]))
"""


def test_a_run_killed_while_merging_publishes_nothing_and_resumes(tmp_path, tok):
    import subprocess
    import sys

    docs = _documents(30)
    paths = []
    for part in range(3):
        paths.append(str(tmp_path / f"p{part}.txt"))
        (tmp_path / f"p{part}.txt").write_text("\n\n".join("\n".join(d) for d in docs[part::3]))
    kw = dict(max_seq_length=32, max_predictions_per_seq=5, dupe_factor=1, num_shards=3)
    ref = prepare.prepare(paths, str(tmp_path / "ref"), tok, show_progress=False, **kw)
    out = tmp_path / "out"
    args = [",".join(paths), str(out), tok.vocab_file, repr(kw)]
    proc = subprocess.run([sys.executable, "-c", _KILLED_IN_MERGE, *args], capture_output=True)
    assert proc.returncode == 9, proc.stderr.decode()[-2000:]
    assert not (out / "metadata.json").exists() and len(list(out.glob("train-*"))) == 2
    meta = prepare.prepare(paths, str(out), tok, num_workers=1, show_progress=False, **kw)
    assert meta["shards"] == ref["shards"]
    assert _shard_digest(out) == _shard_digest(tmp_path / "ref")
    assert sorted(p.name for p in out.iterdir()) == sorted(["metadata.json", *ref["shards"]])
