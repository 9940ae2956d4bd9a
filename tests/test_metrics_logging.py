"""metrics.jsonl on local and remote (object-store-like) workdirs, and its truncation on resume."""

import json

import pytest
import tensorflow as tf

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
