"""metrics.jsonl on local and remote (object-store-like) workdirs, its truncation on resume, and a
restart from scratch that rewrites it (first and last step logged)."""

import json

import pytest
import tensorflow as tf
from helpers import tensorboard_scalars
from train_fixtures import read_metrics, tiny_config

from bertjax import train
from bertjax.metrics_logging import MetricsWriter


@pytest.mark.parametrize("remote", [False, True])
def test_records_append_and_truncate_on_resume(tmp_path, remote):
    workdir = f"ram://metrics_{id(tmp_path)}" if remote else str(tmp_path)
    writer = MetricsWriter(workdir, tensorboard=False)
    for step in range(1, 5):
        writer.write(step, {"loss": 1.0 / step}, total_steps=4, eta=float(4 - step))
    writer.write(4, {"mlm_accuracy": 0.5}, split="eval")
    writer.truncate_after(2)  # a resume from the step-2 checkpoint
    writer.write(3, {"loss": 0.25})
    lines = tf.io.gfile.GFile(f"{workdir}/metrics.jsonl").read().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["step"], r["split"]) for r in records] == [(1, "train"), (2, "train"), (3, "train")]
    assert records[-1]["loss"] == 0.25


def test_restart_from_scratch_rewrites_metrics_and_logs_first_and_last_step(tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    old = [{"step": s, "split": "train", "loss": 9.0} for s in range(1, 6)]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    c = tiny_config(tmp_path, steps=3, **{"train.log_every": 100, "train.checkpoint_every": 100})
    train.train_and_evaluate(c, str(workdir))  # no checkpoint: a restart from scratch
    rows = read_metrics(workdir)
    assert [r["step"] for r in rows] == [1, 3]  # step 1 and the last, though log_every is 100
    assert all(r["loss"] != 9.0 for r in rows)


def test_tensorboard_reads_the_scalars_that_tf_summary_writes(tmp_path):
    """The event file (written without TensorFlow) holds, for TensorBoard's loader, the scalars
    tf.summary.scalar writes for the same records (a bucket's: tests/test_gcs.py)."""
    records = [(1, {"loss": 2.5, "lr": 1e-4}, "train"), (2, {"loss": 1.25}, "train")]
    records += [(2, {"mlm_accuracy": 0.375}, "eval"), (70_000, {"loss": 0.5}, "train")]
    writer = MetricsWriter(str(tmp_path / "run"), tensorboard=True)
    for step, metrics, split in records:
        writer.write(step, metrics, split=split)
    writer.close()
    ours = tmp_path / "run" / "tensorboard"
    reference = tf.summary.create_file_writer(str(tmp_path / "tf"))
    for step, metrics, split in records:
        with reference.as_default(step=step):
            for key, value in metrics.items():
                tf.summary.scalar(f"{split}/{key}", value)
    reference.close()
    assert len(list(ours.iterdir())) == 1
    want = tensorboard_scalars(tmp_path / "tf")
    assert tensorboard_scalars(ours) == want
    assert want["train/loss"] == [(1, 2.5), (2, 1.25), (70_000, 0.5)]


def test_event_bytes_are_tensorboards_serialization():
    from tensorboard.compat.proto import event_pb2, summary_pb2

    from bertjax.tensorboard_events import FILE_VERSION, event_bytes

    assert event_bytes(1.5, file_version=FILE_VERSION) == event_pb2.Event(
        wall_time=1.5, file_version=FILE_VERSION
    ).SerializeToString(deterministic=True)
    for step, scalars in ((0, {"a": 0.0}), (300, {"train/loss": 2.5, "é/x": -1e-30})):
        values = [summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
        want = event_pb2.Event(
            wall_time=1795e6, step=step, summary=summary_pb2.Summary(value=values)
        )
        assert event_bytes(1795e6, step, scalars) == want.SerializeToString(deterministic=True)
