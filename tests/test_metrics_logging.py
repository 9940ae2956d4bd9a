"""metrics.jsonl on local and remote (object-store-like) workdirs, its truncation on resume, and a
restart from scratch that rewrites it (first and last step logged)."""

import json

import pytest
import tensorflow as tf
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
