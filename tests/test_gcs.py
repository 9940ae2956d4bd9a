"""gs:// end to end against a local GCS emulator (tests/gcs_emulator.py): bertjax.fs, the atomic
writes, the workdir lock and metrics, Orbax checkpoints, pretraining and its resume."""

import gzip
import json
import pathlib

import numpy as np
import pytest
from helpers import tensorboard_scalars
from train_fixtures import set_keys, tiny_config

from bertjax import atomic, fs, gcs, train
from bertjax.data import corpus, records


def test_fs_round_trip_in_bucket(gcs_bucket, tmp_path):
    """Every bertjax.fs call on gs:// reaches the emulator through gcsfs."""
    folder = f"{gcs_bucket}/a/b"
    fs.makedirs(folder)
    with fs.open_file(f"{folder}/x.txt", "w") as f:
        f.write("héllo\nworld\n")
    atomic.write_json(f"{folder}/y.json", {"k": 1})
    assert fs.exists(f"{folder}/x.txt") and fs.isdir(folder) and not fs.exists(f"{folder}/z")
    with fs.open_file(f"{folder}/x.txt", "r") as f:
        assert f.read().splitlines() == ["héllo", "world"]
    assert fs.read_bytes(f"{folder}/y.json").startswith(b"{")
    assert fs.glob(f"{folder}/*.json") == [f"{folder}/y.json"]
    assert fs.size(f"{folder}/x.txt") == len("héllo\nworld\n".encode())
    assert fs.isfile(f"{folder}/x.txt") and not fs.isfile(folder) and not fs.isfile(f"{folder}/z")
    assert fs.list_files(f"{gcs_bucket}/a") == ["b/x.txt", "b/y.json"]
    fs.download(f"{folder}/y.json", str(tmp_path / "y.json"))
    fs.upload(str(tmp_path / "y.json"), f"{folder}/c/y.json")
    assert fs.read_bytes(f"{folder}/c/y.json") == (tmp_path / "y.json").read_bytes()
    fs.remove(f"{folder}/c/y.json")
    fs.rename(f"{folder}/x.txt", f"{folder}/x2.txt")
    assert sorted(fs.glob(f"{folder}/*")) == [f"{folder}/x2.txt", f"{folder}/y.json"]
    with pytest.raises(fs.not_found_errors(folder)):
        fs.read_bytes(f"{folder}/x.txt")
    fs.remove(f"{folder}/x2.txt")
    fs.rmtree(f"{gcs_bucket}/a")
    assert fs.glob(f"{gcs_bucket}/a/**") == []


def test_binary_objects_come_back_byte_for_byte(gcs_bucket):
    """What gcsfs uploads in one multipart request (small objects) and in chunks comes back as
    written, whatever it ends with: a checkpoint's data file that ended in a carriage return once
    came back a byte short from the emulator, and its checkpoint could not be read."""
    rng = np.random.default_rng(0)
    body = rng.integers(0, 256, 3000, dtype=np.uint8).tobytes()
    endings = [b"\r", b"\n", b"\r\n", b"\n\r", b"\n--==0==--", b""]
    for i, ending in enumerate(endings):
        fs.write_bytes(f"{gcs_bucket}/bin/{i}", ending + body + ending)
    large = rng.integers(0, 256, 20 << 20, dtype=np.uint8).tobytes() + b"\r"
    fs.write_bytes(f"{gcs_bucket}/bin/large", large)
    for i, ending in enumerate(endings):
        assert fs.read_bytes(f"{gcs_bucket}/bin/{i}") == ending + body + ending, ending
    assert fs.read_bytes(f"{gcs_bucket}/bin/large") == large


def test_records_in_a_bucket_are_read_in_blocks_not_per_record(gcs_bucket, tmp_path, monkeypatch):
    """The client's file is read a block at a time: each of its reads is a trip through its event
    loop (2000 records of 400 B took 14 s from the emulator read 12, n and 4 bytes at a time)."""
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, 400, dtype=np.uint8).tobytes() for _ in range(2000)]
    local = tmp_path / "r.tfrecord"
    writer = records.RecordWriter(str(local))
    for payload in payloads:
        writer.write(payload)
    writer.close()
    fs.write_bytes(f"{gcs_bucket}/r.tfrecord", local.read_bytes())
    calls = []
    opened = fs.open_file

    def counting(path, mode="rb"):
        f = opened(path, mode)
        for name in ("read", "readinto"):
            method = getattr(f, name)
            setattr(f, name, lambda *a, m=method, n=name: calls.append(n) or m(*a))
        return f

    monkeypatch.setattr(fs, "open_file", counting)
    assert list(records.read_records(f"{gcs_bucket}/r.tfrecord")) == payloads
    assert 0 < len(calls) <= 8, len(calls)  # 6001 when read per record: 3 each, and the end


def _bucket_metrics(workdir, split="train"):
    with fs.open_file(f"{workdir}/metrics.jsonl", "r") as f:
        return [r for r in map(json.loads, f.read().splitlines()) if r["split"] == split]


def test_a_workdir_in_a_bucket_that_does_not_exist_is_one_line_before_any_work(
    gcs_emulator, tmp_path, monkeypatch
):
    def no_work(*args):
        raise AssertionError("training work started")

    monkeypatch.setattr(train, "_train_and_evaluate", no_work)
    with pytest.raises(OSError) as err:
        train.train_and_evaluate(tiny_config(tmp_path), "gs://no-such-bucket/run")
    assert str(err.value) == (
        "gs://no-such-bucket/run: WORKDIR's bucket gs://no-such-bucket does not exist (or this "
        "account cannot see it): create it or use another WORKDIR"
    )


def test_compiling_with_a_vocabulary_in_a_bucket_asks_the_bucket_nothing(
    gcs_emulator, gcs_bucket, tmp_path
):
    """`bertjax compile --topology` takes its shapes from the config alone (compiling needs no
    credentials): a local data.vocab gives its size; one in a bucket, data.vocab_size, and not
    one request reaches the bucket."""
    from bertjax import compile as aot

    config = tiny_config(tmp_path)
    local = aot.shapes_only_task(config, None).fixed_vocab_size
    assert local == len(pathlib.Path(config.data.vocab).read_text().splitlines())
    fs.write_bytes(f"{gcs_bucket}/vocab.txt", pathlib.Path(config.data.vocab).read_bytes())
    config.data.vocab, config.data.vocab_size = f"{gcs_bucket}/vocab.txt", local + 8
    gcs_emulator.fail(403, None, bucket=gcs_bucket)
    assert aot.shapes_only_task(config, None).fixed_vocab_size == local + 8
    assert gcs_emulator.faults()[0]["seen"] == 0


def test_other_schemes_go_through_tensorflows_file_system(tmp_path):
    """A remote path that is not gs:// (s3://, hdfs://, ...; here TensorFlow's in-memory ram://)
    goes through tf.io.gfile, each bertjax.fs call doing what it does on a bucket."""
    import tensorflow as tf

    root = f"ram://{tmp_path.name}/a"
    fs.makedirs(f"{root}/b")
    with fs.open_file(f"{root}/b/x.txt", "w") as f:
        f.write("héllo\n")
    fs.write_bytes(f"{root}/y.bin", b"\r\n")
    assert fs.isfile(f"{root}/b/x.txt") and not fs.isfile(f"{root}/b") and fs.isdir(f"{root}/b")
    assert fs.list_files(root) == ["b/x.txt", "y.bin"] and fs.size(f"{root}/b/x.txt") == 7
    fs.rename(f"{root}/y.bin", f"{root}/z.bin")
    fs.download(f"{root}/z.bin", str(tmp_path / "z.bin"))
    fs.upload(str(tmp_path / "z.bin"), f"{root}/b/z.bin")
    assert fs.read_bytes(f"{root}/b/z.bin") == b"\r\n" and not fs.exists(f"{root}/y.bin")
    with pytest.raises(fs.not_found_errors(root)):
        fs.read_bytes(f"{root}/y.bin")
    refused = tf.errors.PermissionDeniedError(None, None, "no")
    assert fs.write_refusal(root, refused) == "permission denied" and fs.missing_folders(root) == []
    assert tf.errors.OpError in fs.io_errors(root)
    fs.remove(f"{root}/z.bin")
    assert fs.list_files(root) == ["b/x.txt", "b/z.bin"]
    fs.rmtree(root)
    assert not fs.exists(root) and fs.list_files(root) == []


def _upload(folder: pathlib.Path, target: str) -> str:
    for path in sorted(folder.iterdir()):
        fs.write_bytes(f"{target}/{path.name}", path.read_bytes())
    return target


@pytest.mark.slow
def test_a_run_in_a_bucket_resumes_to_the_local_runs_losses(
    gcs_emulator, gcs_bucket, tmp_path, files, monkeypatch
):
    """Prepared records (read through bertjax.fs), vocabulary, checkpoints, metrics.jsonl,
    TensorBoard events and the lock all in the bucket. The bucket goes down for good after
    step 2's checkpoint: the run stops with one line naming the object it could not write; once
    the bucket is back, the same run resumes from step 2 and gives the losses of the uninterrupted
    run on the local copies, bitwise. A corrupted shard there is one line naming it. The emulator
    is killed in the middle of a checkpoint write, a partial step is never resumed from, retired
    steps go commit file first, and a fine-tuning run starts from the run in the bucket."""
    local = tiny_config(tmp_path, steps=4)
    expected = train.train_and_evaluate(local, str(tmp_path / "local"))
    with open(tmp_path / "local" / "metrics.jsonl") as f:
        losses = [r["loss"] for r in map(json.loads, f) if r["split"] == "train"]
    assert len(losses) == 4
    prepared = _upload(pathlib.Path(local.data.prepared_dir), f"{gcs_bucket}/prepared")
    vocab = f"{gcs_bucket}/vocab.txt"
    fs.write_bytes(vocab, pathlib.Path(local.data.vocab).read_bytes())

    def bucket_config(**keys):
        config = set_keys(tiny_config(tmp_path, steps=4, tensorboard=True), keys)
        config.data.prepared_dir, config.data.vocab = prepared, vocab
        return config

    run = f"{gcs_bucket}/run"
    # The emulator dies at step 3's metrics (after step 2's checkpoint) and stays down.
    gcs_emulator.fail(
        "die", method="POST", bucket=gcs_bucket, name=r"^run/metrics\.jsonl$", after=2
    )
    monkeypatch.setenv(gcs.RETRY_SECONDS, "1")
    monkeypatch.setenv(gcs.BACKOFF_SECONDS, "0.05")
    with pytest.raises(gcs.Unavailable) as down:
        train.train_and_evaluate(bucket_config(), run)
    assert str(down.value).startswith(f"{run}/metrics.jsonl: Cloud Storage failed ")
    assert "\n" not in str(down.value)
    gcs_emulator.stop()
    gcs_emulator.start()
    monkeypatch.delenv(gcs.RETRY_SECONDS)  # the kill below is longer than a second
    assert [r["step"] for r in _bucket_metrics(run)] == [1, 2]
    # A save of step 4 cut short by a crash: some of its objects, no commit file.
    step2 = f"{run}/checkpoints/2"
    names = [n for n in fs.list_files(step2) if n != "commit_success.txt"]
    assert "commit_success.txt" in fs.list_files(step2) and len(names) > 3
    for name in names[:-2]:
        fs.write_bytes(f"{run}/checkpoints/4/{name}", fs.read_bytes(f"{step2}/{name}"))
    # The resume keeps one step (step 2 is retired on gs:// once 4 is saved), and the emulator
    # dies at the first upload of step 4 (a fault in the middle of the checkpoint write), to come
    # back a second later with what it held: the clients retry and the run goes on.
    restarted = gcs_emulator.kill_during_upload("run/checkpoints/4/")
    result = train.train_and_evaluate(bucket_config(**{"train.keep_checkpoints": 1}), run)
    restarted.join(timeout=60)
    assert not restarted.is_alive(), "the emulator did not die during the save of step 4"
    assert [r["loss"] for r in _bucket_metrics(run)] == losses  # resumed from 2, not the partial 4
    assert result["train"]["loss"] == expected["train"]["loss"]
    steps = sorted(p.rsplit("/", 1)[1] for p in fs.glob(f"{run}/checkpoints/*"))
    assert [s for s in steps if s.isdigit()] == ["4"], steps
    assert "commit_success.txt" in fs.list_files(f"{run}/checkpoints/4")
    # Step 2 was retired commit file first: never complete-looking with objects missing.
    bucket_name = gcs_bucket.split("://", 1)[1]
    retired = [
        d for d in gcs_emulator.deletions() if d.startswith(f"{bucket_name}/run/checkpoints/2/")
    ]
    assert retired[0].endswith("/2/commit_success.txt") and len(retired) == len(names) + 1, retired
    events = tmp_path / "events"  # one file per start of the run, each uploaded whole
    for path in fs.glob(f"{run}/tensorboard/events.out.tfevents.*"):
        fs.download(path, str(events / path.rsplit("/", 1)[1]))
    last_loss = tensorboard_scalars(events)["train/loss"][-1]
    assert last_loss == (4, pytest.approx(result["train"]["loss"], rel=1e-6))
    assert not fs.exists(f"{run}/run.lock")
    shard = fs.glob(f"{prepared}/train-00001-*")[0]
    fs.write_bytes(shard, fs.read_bytes(shard)[:-3])
    with pytest.raises(ValueError, match=f"^{shard}: record 23 is corrupted or cut short$"):
        list(records.read_records(shard))

    _finetune_from(run, str(tmp_path / "local"), files, tmp_path / "finetune")


def _finetune_from(run, local_run, files, workdir):
    """A GLUE fine-tuning run whose init_checkpoint is the run in the bucket (its vocabulary, in
    the bucket too, is the one it recorded) starts from that run's params: those of the local
    run, bitwise."""
    import jax
    from flax import traverse_util
    from helpers import small_config

    from bertjax.pretrained import load_pretrained
    from bertjax.tasks.registry import get_task
    from configs import glue as glue_config

    expected = load_pretrained(local_run)  # the local run's newest step: 4, as in the bucket
    model = load_pretrained(run)
    # The vocabulary in the bucket, read from a local copy of it.
    assert model.tokenizer.vocab_file != expected.tokenizer.vocab_file
    assert model.tokenizer.vocab == expected.tokenizer.vocab
    c = small_config(glue_config.get_config(), files, "glue", init_checkpoint=run)
    c.data.vocab = ""  # the init checkpoint's
    task = get_task(c.task, c, str(workdir))
    task.after_prepare()
    setup = train.build(c, str(workdir), task)
    state = setup.init_state(jax.random.key_data(jax.random.key(0)))
    got = traverse_util.flatten_dict(jax.device_get(state.params["bert"]), sep="/")
    want = traverse_util.flatten_dict(expected.params["bert"], sep="/")
    assert got.keys() <= want.keys() and "embeddings/word_embeddings/embedding" in got
    for key, value in got.items():
        np.testing.assert_array_equal(value, want[key], key)


def test_a_corpus_glob_in_a_bucket_reads_as_the_local_files(gcs_bucket, tmp_path):
    """Corpus files found by a gs:// glob (.gz included) through bertjax.fs, as prepare reads them."""
    text = "First sentence here. Second one.\n\nAnother document.\n"
    fs.write_bytes(f"{gcs_bucket}/corpus/a.txt", text.encode())
    fs.write_bytes(f"{gcs_bucket}/corpus/b.txt.gz", gzip.compress(text.encode()))
    (tmp_path / "a.txt").write_text(text)
    sources = corpus.list_sources(f"{gcs_bucket}/corpus/*")
    assert [s.path for s in sources] == [f"{gcs_bucket}/corpus/{n}" for n in ("a.txt", "b.txt.gz")]
    expected = list(corpus.iter_documents(str(tmp_path / "a.txt"), "text"))
    for name in ("a.txt", "b.txt.gz"):
        assert list(corpus.iter_documents(f"{gcs_bucket}/corpus/{name}", "text")) == expected


def _upload_tree(folder: pathlib.Path, target: str) -> str:
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        fs.write_bytes(f"{target}/{path.relative_to(folder)}", path.read_bytes())
    return target


def test_convert_and_load_pretrained_from_and_to_a_bucket(
    gcs_bucket, tmp_path, uncased_vocab, monkeypatch
):
    """A Hugging Face directory in a bucket converts (format detected there) to a bertjax
    checkpoint in the bucket, which ``load_pretrained("gs://...")`` runs as the local original,
    bitwise, and which converts back to Hugging Face in the bucket with the same tensors. An
    existing DST is refused, a missing SRC is one line naming it, and an upload cut short leaves a
    DST that is not taken for a checkpoint (the files that make it one go last)."""
    from helpers import make_hf_model

    from bertjax import convert
    from bertjax.convert import remote
    from bertjax.convert.hf import read_safetensors
    from bertjax.pretrained import load_pretrained

    local = tmp_path / "hf"
    make_hf_model(local, uncased_vocab)
    hf = _upload_tree(local, f"{gcs_bucket}/models/hf")
    convert.main([hf, "--to=bertjax", f"{gcs_bucket}/models/bj"])
    assert fs.exists(f"{gcs_bucket}/models/bj/0/commit_success.txt")
    assert fs.read_bytes(f"{gcs_bucket}/models/bj/vocab.txt") == (local / "vocab.txt").read_bytes()
    ids = np.array([[2, 50, 60, 70, 3, 0], [2, 80, 3, 90, 3, 0]], np.int32)
    expected = load_pretrained(str(local))(ids)
    model = load_pretrained(f"{gcs_bucket}/models/bj")
    assert model.directory == f"{gcs_bucket}/models/bj"
    got = model(ids)
    for name in ("sequence_output", "pooled_output", "mlm_logits", "nsp_logits"):
        np.testing.assert_array_equal(getattr(got, name), getattr(expected, name), name)
    convert.main([f"{gcs_bucket}/models/bj", "--to=hf", f"{gcs_bucket}/models/hf2"])
    back = tmp_path / "back.safetensors"
    fs.download(f"{gcs_bucket}/models/hf2/model.safetensors", str(back))
    original = read_safetensors(str(local / "model.safetensors"))
    written = read_safetensors(str(back))
    assert written.keys() == original.keys()
    for key in original:
        np.testing.assert_array_equal(written[key], original[key], key)
    from_hf2 = load_pretrained(f"{gcs_bucket}/models/hf2")(ids)  # read from a local copy
    np.testing.assert_array_equal(from_hf2.mlm_logits, expected.mlm_logits)

    with pytest.raises(FileExistsError, match=f"^{gcs_bucket}/models/hf2: output already exists"):
        convert.main([hf, "--to=hf", f"{gcs_bucket}/models/hf2"])
    with pytest.raises(FileNotFoundError, match=f"^{gcs_bucket}/nothing: checkpoint not found$"):
        convert.load_checkpoint(f"{gcs_bucket}/nothing")

    uploaded = []

    def cut_short(source, target):  # the connection drops before the last files
        if len(uploaded) == 3:
            raise OSError("connection reset")
        uploaded.append(target)
        fs.write_bytes(target, pathlib.Path(source).read_bytes())

    monkeypatch.setattr(remote.fs, "upload", cut_short)
    for fmt in ("hf", "bertjax"):
        uploaded.clear()
        with pytest.raises(OSError, match="connection reset"):
            convert.main([str(local), f"--to={fmt}", f"{gcs_bucket}/cut/{fmt}"])
        assert len(uploaded) == 3 and not any(remote._marker_rank(p) for p in uploaded)
        with pytest.raises((ValueError, FileNotFoundError)):
            convert.load_checkpoint(f"{gcs_bucket}/cut/{fmt}", fmt)
