"""gs:// end to end against a local GCS emulator (tests/gcs_emulator.py): bertjax.fs, the atomic
writes, the workdir lock and metrics, Orbax checkpoints, pretraining and its resume."""

import json

import pytest
from train_fixtures import set_keys, tiny_config

from bertjax import atomic, fs, train


def test_fs_round_trip_in_bucket(gcs_bucket):
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
    fs.rename(f"{folder}/x.txt", f"{folder}/x2.txt")
    assert sorted(fs.glob(f"{folder}/*")) == [f"{folder}/x2.txt", f"{folder}/y.json"]
    with pytest.raises(fs.not_found_errors(folder)):
        fs.read_bytes(f"{folder}/x.txt")
    fs.remove(f"{folder}/x2.txt")
    fs.rmtree(f"{gcs_bucket}/a")
    assert fs.glob(f"{gcs_bucket}/a/**") == []


def _bucket_metrics(workdir, split="train"):
    with fs.open_file(f"{workdir}/metrics.jsonl", "r") as f:
        return [r for r in map(json.loads, f.read().splitlines()) if r["split"] == split]


@pytest.mark.slow
def test_pretrain_in_a_bucket_then_resume_gives_the_uninterrupted_losses(
    gcs_bucket, tmp_path, xla_cache_in_process
):
    """Checkpoints, metrics.jsonl, TensorBoard events and the lock in the bucket; a run stopped at
    step 2 and run again gives the losses of an uninterrupted run, bitwise."""
    config = tiny_config(tmp_path, steps=4, tensorboard=True)
    reference = train.train_and_evaluate(config, f"{gcs_bucket}/ref")
    losses = [r["loss"] for r in _bucket_metrics(f"{gcs_bucket}/ref")]
    assert len(losses) == 4
    run = f"{gcs_bucket}/run"
    train.train_and_evaluate(
        set_keys(tiny_config(tmp_path, steps=4), {"train.stop_at_step": 2}), run
    )
    assert [r["step"] for r in _bucket_metrics(run)] == [1, 2]
    result = train.train_and_evaluate(tiny_config(tmp_path, steps=4, tensorboard=True), run)
    assert [r["loss"] for r in _bucket_metrics(run)] == losses
    assert result["train"]["loss"] == reference["train"]["loss"]
    steps = sorted(p.rsplit("/", 1)[1] for p in fs.glob(f"{run}/checkpoints/*"))
    assert [s for s in steps if s.isdigit()] == ["2", "4"], steps
    assert fs.glob(f"{run}/tensorboard/events.out.tfevents.*")
    assert not fs.exists(f"{run}/run.lock")


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
