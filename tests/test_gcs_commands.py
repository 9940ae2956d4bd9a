"""The commands of a pod job with their inputs and outputs in a bucket (the local GCS emulator,
tests/gcs_emulator.py), each against the same command on local files: `embed` writing resumable
shards into a bucket (interrupted, then resumed: the bytes of a local run), `evaluate retrieval`
reading a BEIR folder in a bucket, `prepare` reading a corpus in a bucket and writing its records
there, `plot` of a run in a bucket, `convert` to and from a bucket in the sentence-transformers,
PyLate and TF formats (tests/test_gcs.py has HF and bertjax), read back by `load_pretrained`,
`extract-features` and `vocab` with their inputs and outputs in a bucket, and tokenizers read from
it."""

import json
import pathlib

import numpy as np
import pytest
from helpers import ctrl_c_in_shard, st_dir, tiny_hf

from bertjax import cli, fs
from bertjax.commands import embed as embed_tool
from bertjax.commands import score
from bertjax.convert import load_checkpoint
from bertjax.convert import main as convert_main
from bertjax.data import prepare
from bertjax.pretrained import load_pretrained
from bertjax.retrieval import embed_corpus
from bertjax.text import load_tokenizer

pytest.importorskip("sentence_transformers")

PYLATE = pathlib.Path(__file__).resolve().parent / "data" / "pylate" / "bert"
TEXTS = ["the quick brown fox", "lazy dog", "Hello, world!", "x", "query passage the dog"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny BERT (transformers) and its sentence-transformers folder (mean pooling, Normalize)."""
    root = tmp_path_factory.mktemp("gcs-models")
    hf = tiny_hf(root / "hf", "bert")
    return {"hf": hf, "st": st_dir(root / "st", hf, "mean", normalize=True)}


def _upload_tree(folder: pathlib.Path, target: str) -> str:
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        fs.write_bytes(f"{target}/{path.relative_to(folder)}", path.read_bytes())
    return target


def test_sentence_transformers_pylate_and_tf_to_and_from_a_bucket(models, gcs_bucket, tmp_path):
    """`convert --to=FORMAT gs://...` then `load_pretrained`/`load_checkpoint` of it: the vectors
    and tensors of the local source, bitwise."""
    st = f"{gcs_bucket}/st"
    convert_main([str(models["st"]), "--to=sentence-transformers", st])
    assert fs.exists(f"{st}/modules.json") and fs.exists(f"{st}/model.safetensors")
    local = load_pretrained(str(models["st"]))
    np.testing.assert_array_equal(load_pretrained(st).embed(TEXTS), local.embed(TEXTS))

    colbert = f"{gcs_bucket}/colbert"
    convert_main(["--to=pylate", str(PYLATE), colbert])
    local = load_pretrained(str(PYLATE))
    remote = load_pretrained(colbert)
    assert remote.late_interaction
    for got, want in zip(remote.embed_queries(TEXTS), local.embed_queries(TEXTS)):
        np.testing.assert_array_equal(got, want)

    convert_main([str(models["hf"]), "--to=tf", f"{gcs_bucket}/tf"])
    want = load_checkpoint(str(models["hf"])).tensors
    for source in (f"{gcs_bucket}/tf", f"{gcs_bucket}/tf/bert_model.ckpt"):  # folder, prefix
        got = load_checkpoint(source).tensors
        assert got.keys() == want.keys(), source
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], f"{source}: {key}")


def _corpus(path: pathlib.Path) -> pathlib.Path:
    rows = [{"_id": f"d{i}", "title": f"t{i}", "text": t} for i, t in enumerate(TEXTS * 2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _without_paths(record: dict) -> dict:
    """run.json / manifest.json without what names the model's and input's paths."""
    return {**record, "model": record["model"]["sha256"], "input": record["input"]["sha256"]}


def test_embed_into_a_bucket_resumes_to_the_bytes_of_a_local_run(
    models, gcs_bucket, tmp_path, capsys, monkeypatch
):
    """The model, the input and the shards in the bucket: Ctrl-C in the second shard, then the
    same command: the finished shard is kept, and every file is the local run's."""
    corpus = _corpus(tmp_path / "corpus.jsonl")
    local = tmp_path / "local"
    cli.main(["bertjax", "embed", f"--checkpoint={models['st']}", f"--input={corpus}",
              f"--output={local}", "--shard_size=4"])  # fmt: skip
    fs.write_bytes(f"{gcs_bucket}/corpus.jsonl", corpus.read_bytes())
    _upload_tree(models["st"], f"{gcs_bucket}/st")
    out = f"{gcs_bucket}/embeddings"
    args = [f"--checkpoint={gcs_bucket}/st", f"--input={gcs_bucket}/corpus.jsonl",
            f"--output={out}", "--shard_size=4"]  # fmt: skip
    embed = ctrl_c_in_shard(monkeypatch, 2)
    with pytest.raises(SystemExit) as exited:
        embed_tool.main(args)
    assert exited.value.code == 130
    assert "1 of 3 shards are written" in capsys.readouterr().err
    assert not fs.exists(f"{out}/manifest.json")
    monkeypatch.setattr(embed_corpus._Encoder, "embed", embed)
    embed_tool.main(args)
    assert "shard 1/3: found finished, skipped" in capsys.readouterr().err
    names = sorted(p.name for p in local.iterdir())
    assert fs.list_files(out) == names and len(names) == 8
    for name in names:
        got, want = fs.read_bytes(f"{out}/{name}"), (local / name).read_bytes()
        if name.endswith(".json") and not name.endswith(".ids.json"):  # run.json, manifest.json
            got, want = _without_paths(json.loads(got)), _without_paths(json.loads(want))
        assert got == want, name


def test_embed_reads_a_parquet_corpus_in_a_bucket_as_the_local_files(gcs_bucket, tmp_path):
    """`embed --input=gs://.../*.parquet` (``read_corpus``, what `embed` reads its texts with):
    the ids, texts and fingerprint of the local files, with their own ids and numbered ones."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bertjax.retrieval.corpus_input import Fields, read_corpus

    for part in range(2):
        rows = {"_id": [f"d{part}{i}" for i in range(5)], "title": [f"t{i}" for i in range(5)]}
        rows["text"] = [TEXTS[(part + i) % len(TEXTS)] for i in range(5)]
        local = tmp_path / f"part-{part}.parquet"
        pq.write_table(pa.table(rows), local, row_group_size=2)
        fs.write_bytes(f"{gcs_bucket}/corpus/part-{part}.parquet", local.read_bytes())
    for fields in (Fields(), Fields(id="", title="")):
        local = read_corpus(str(tmp_path / "*.parquet"), fields)
        remote = read_corpus(f"{gcs_bucket}/corpus/*.parquet", fields)
        assert remote.files == [f"{gcs_bucket}/corpus/part-{p}.parquet" for p in range(2)]
        assert (remote.ids, remote.texts) == (local.ids, local.texts) and len(local.ids) == 10
        assert remote.fingerprint == local.fingerprint


def test_evaluate_retrieval_reads_a_beir_folder_in_a_bucket(
    models, beir_dir, gcs_bucket, tmp_path, capsys
):
    """The same metrics and the same run file as from the local folder."""
    printed = {}
    for where, data, run in (
        ("local", str(beir_dir), str(tmp_path / "run.trec")),
        ("bucket", _upload_tree(beir_dir, f"{gcs_bucket}/beir"), f"{gcs_bucket}/run.trec"),
    ):
        args = ["retrieval", f"--checkpoint={models['st']}", f"--data={data}"]
        assert score.main([*args, f"--output_run={run}"]) == 0
        printed[where] = json.loads(capsys.readouterr().out)
    assert printed["bucket"] == printed["local"] and "ndcg@10" in printed["local"]
    assert fs.read_bytes(f"{gcs_bucket}/run.trec") == (tmp_path / "run.trec").read_bytes()


WORDS = "the a of and to in it was he she said that his her on at with for as had".split()


def test_prepare_reads_and_writes_a_bucket_as_local_files(gcs_bucket, tmp_path):
    """A corpus in the bucket prepared into the bucket: the records and metadata of the local
    run, byte for byte (the pretraining run in tests/test_gcs.py reads records in a bucket)."""
    vocab = tmp_path / "vocab.txt"
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *WORDS]
    vocab.write_text("\n".join(tokens + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]) + "\n")
    tok = load_tokenizer(str(vocab), do_lower_case=True)
    (tmp_path / "corpus").mkdir()
    for f in range(2):
        docs = [
            "\n".join(
                " ".join(WORDS[(f + d + s + w) % 20] for w in range(4 + s)) + "." for s in range(3)
            )
            for d in range(6)
        ]
        text = "\n\n".join(docs) + "\n"
        (tmp_path / "corpus" / f"part-{f}.txt").write_text(text)
        fs.write_bytes(f"{gcs_bucket}/corpus/part-{f}.txt", text.encode())
    kw = dict(max_seq_length=24, max_predictions_per_seq=3, dupe_factor=1, num_shards=2)
    kw.update(eval_fraction=0.2, num_workers=1, show_progress=False)
    local = prepare.prepare(str(tmp_path / "corpus" / "*"), str(tmp_path / "out"), tok, **kw)
    remote = prepare.prepare(f"{gcs_bucket}/corpus/*", f"{gcs_bucket}/out", tok, **kw)
    timing = ("seconds", "docs_per_second", "mb_per_second", "input", "sources")
    assert {k: v for k, v in remote.items() if k not in timing} == {
        k: v for k, v in local.items() if k not in timing
    }
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert fs.list_files(f"{gcs_bucket}/out") == names and len(names) == 4, names
    for name in names:
        if name.endswith(".tfrecord"):
            assert (
                fs.read_bytes(f"{gcs_bucket}/out/{name}") == (tmp_path / "out" / name).read_bytes()
            )


def test_plot_of_a_run_in_a_bucket(gcs_bucket):
    records = [{"step": s, "split": "train", "loss": 3.0 / s} for s in (1, 2, 3)]
    fs.write_bytes(
        f"{gcs_bucket}/run/metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records).encode()
    )
    from bertjax.commands import plot

    assert plot.plot(f"{gcs_bucket}/run") == f"{gcs_bucket}/run/curves.png"
    assert fs.read_bytes(f"{gcs_bucket}/run/curves.png").startswith(b"\x89PNG")


def test_extract_features_reads_and_writes_a_bucket_as_local_files(models, gcs_bucket, tmp_path):
    """The checkpoint, the input lines and the .jsonl / .npz outputs in the bucket: the bytes of
    the local run."""
    from bertjax.commands import extract_features

    lines = "the quick brown fox\nlazy dog ||| Hello, world!\nx\n"
    (tmp_path / "lines.txt").write_text(lines)
    fs.write_bytes(f"{gcs_bucket}/lines.txt", lines.encode())
    _upload_tree(models["hf"], f"{gcs_bucket}/hf")
    for suffix in ("jsonl", "npz"):
        local, remote = tmp_path / f"feats.{suffix}", f"{gcs_bucket}/feats.{suffix}"
        common = ["--layers=-1,0", "--max_seq_length=16"]
        extract_features.main([f"--checkpoint={models['hf']}", f"--input={tmp_path}/lines.txt",
                               f"--output={local}", *common])  # fmt: skip
        extract_features.main([f"--checkpoint={gcs_bucket}/hf", f"--input={gcs_bucket}/lines.txt",
                               f"--output={remote}", *common])  # fmt: skip
        assert fs.read_bytes(remote) == local.read_bytes(), suffix


def test_vocab_from_a_bucket_into_the_bucket_and_its_tokenizers_read_there(gcs_bucket, tmp_path):
    """`bertjax vocab` of a gzipped JSONL and a Parquet corpus in the bucket, WordPiece and
    SentencePiece, written into the bucket: the local files' bytes; each loads from the bucket
    and tokenizes as the local one."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    from bertjax.data import vocab as vocab_tool

    texts = [" ".join(WORDS[(i + w) % 20] for w in range(3 + i % 5)) for i in range(60)]
    jsonl = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts).encode(), mtime=0)
    (tmp_path / "corpus.jsonl.gz").write_bytes(jsonl)
    fs.write_bytes(f"{gcs_bucket}/corpus.jsonl.gz", jsonl)
    pq.write_table(pa.table({"text": texts}), tmp_path / "corpus.parquet")
    fs.write_bytes(f"{gcs_bucket}/corpus.parquet", (tmp_path / "corpus.parquet").read_bytes())
    for fmt, name, kind, size, out in (
        ("jsonl", "corpus.jsonl.gz", "wordpiece", 80, "vocab.txt"),
        ("parquet", "corpus.parquet", "sentencepiece", 32, "sp"),
    ):
        common = [f"--format={fmt}", f"--kind={kind}", f"--vocab_size={size}"]
        vocab_tool.main([f"--input={tmp_path}/{name}", f"--output={tmp_path}/{out}", *common])
        vocab_tool.main([f"--input={gcs_bucket}/{name}", f"--output={gcs_bucket}/{out}", *common])
        files = [out] if kind == "wordpiece" else [f"{out}.model", f"{out}.vocab"]
        for f in files:
            assert fs.read_bytes(f"{gcs_bucket}/{f}") == (tmp_path / f).read_bytes(), f
        local = load_tokenizer(str(tmp_path / files[0]))
        remote = load_tokenizer(f"{gcs_bucket}/{files[0]}")
        assert [remote.tokenize(t) for t in texts[:8]] == [local.tokenize(t) for t in texts[:8]]


def test_a_tokenizer_json_in_a_bucket_reads_as_the_local_one(models, gcs_bucket):
    """A Hugging Face tokenizer.json with its sidecar config in a bucket, as `convert --to=bertjax`
    writes it beside a checkpoint there: `load_tokenizer` of the file and of its folder reads it
    in the bucket, and `load_checkpoint` copies it to a local file beside copies of its sidecars
    (``remote.stage_vocab``); each tokenizes as the local file."""
    from bertjax.convert.checkpoint import TOKENIZER_SIDECARS

    hf, bj = models["hf"], f"{gcs_bucket}/bj"
    convert_main([str(hf), "--to=bertjax", bj])
    staged = pathlib.Path(load_checkpoint(bj).vocab_file)
    copied = ["tokenizer.json", *(n for n in TOKENIZER_SIDECARS if (hf / n).exists())]
    assert staged.name == "tokenizer.json" and len(copied) > 1, copied
    for name in copied:
        assert fs.read_bytes(f"{bj}/{name}") == (hf / name).read_bytes(), name
        assert (staged.parent / name).read_bytes() == (hf / name).read_bytes(), name
    want = load_tokenizer(str(hf / "tokenizer.json"))
    for source in (f"{bj}/tokenizer.json", bj, str(staged)):
        tok = load_tokenizer(source)
        assert (tok.vocab_size, tok.special_ids) == (want.vocab_size, want.special_ids), source
        assert [tok.encode(t) for t in TEXTS] == [want.encode(t) for t in TEXTS], source


def test_convert_over_a_folder_in_the_bucket_needs_overwrite_then_replaces_it(models, gcs_bucket):
    """An existing bucket folder is refused in one line and kept; with --overwrite it is removed
    (fs.rmtree of a gs:// folder) and the export takes its place."""
    target = f"{gcs_bucket}/hf"
    fs.write_bytes(f"{target}/stale/old.txt", b"old")
    with pytest.raises(FileExistsError, match=r"/hf: output already exists \(pass --overwrite"):
        convert_main([str(models["hf"]), "--to=hf", target])
    assert fs.read_bytes(f"{target}/stale/old.txt") == b"old"
    convert_main([str(models["hf"]), "--to=hf", target, "--overwrite"])
    assert not fs.exists(f"{target}/stale/old.txt") and fs.exists(f"{target}/config.json")
    want = load_checkpoint(str(models["hf"])).tensors
    got = load_checkpoint(target).tensors
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], key)
