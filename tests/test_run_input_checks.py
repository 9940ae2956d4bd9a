"""A pretraining run checks its config and data before it starts: an empty eval split is skipped
with a warning, data prepared with another vocabulary is an error, and bad config keys or batch
sizes are one line naming the key."""

import json
import logging
import pathlib
import subprocess
import sys

import pytest
from train_fixtures import read_metrics, tiny_config, write_prepared

from bertjax import train
from bertjax.data import prepare
from bertjax.tasks.registry import get_task

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_empty_eval_split_skips_evaluation_with_a_warning(tmp_path, caplog):
    write_prepared(tmp_path / "prepared", eval_examples=0)
    config = tiny_config(tmp_path, steps=2, **{"train.eval_every": 1, "train.eval_steps": 2})
    with caplog.at_level(logging.WARNING):
        result = train.train_and_evaluate(config, str(tmp_path / "run"))
    assert result["step"] == 2 and not result["eval"]
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    assert read_metrics(tmp_path / "run", "eval") == []
    assert caplog.text.count("the eval split has no examples") == 1


def test_prepared_data_of_another_vocabulary_is_an_error(tmp_path, caplog):
    config = tiny_config(tmp_path, steps=1)
    vocab = pathlib.Path(config.data.vocab)
    meta_path = pathlib.Path(config.data.prepared_dir) / "metadata.json"
    with caplog.at_level(logging.WARNING):  # older metadata without the hash: accepted, warned
        train.prepared_task(config, str(tmp_path / "run"))
    assert "records no vocabulary hash" in caplog.text
    meta = json.loads(meta_path.read_text())
    meta["vocab_sha256"] = prepare.vocab_sha256(str(vocab))
    meta_path.write_text(json.dumps(meta))
    train.prepared_task(config, str(tmp_path / "run"))  # the same vocabulary: fine
    lines = vocab.read_text().splitlines()
    lines[10], lines[11] = lines[11], lines[10]  # two tokens swapped: same size, other ids
    vocab.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as err:
        train.prepared_task(config, str(tmp_path / "run"))
    message = str(err.value)
    assert "\n" not in message and "prepared with another vocabulary" in message
    assert str(meta_path) in message and str(vocab) in message


def _cli(tmp_path, *extra):
    cmd = [
        sys.executable,
        "-m",
        "bertjax.cli",
        "pretrain",
        f"--config={REPO}/tests/tiny_pretrain_config.py:{tmp_path}",
        f"--workdir={tmp_path / 'run'}",
        *extra,
    ]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("bertjax pretrain: error:")]


def test_config_errors_are_one_line_naming_the_key(tmp_path):
    tiny_config(tmp_path)  # its data written here: the commands below import no TensorFlow
    proc = _cli(tmp_path, "--config.train.stepz=5")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert _errors(proc.stderr) == [
        'bertjax pretrain: error: unknown config key train.stepz (did you mean "steps"?)'
    ]
    proc = _cli(tmp_path, "--config.train.global_batch_size=-8")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert _errors(proc.stderr) == [
        "bertjax pretrain: error: config key train.global_batch_size=-8 must be a positive integer"
    ]
    proc = _cli(tmp_path, "--config.train.stepz=5", "--verbose")
    assert proc.returncode != 0 and "Traceback" in proc.stderr and not _errors(proc.stderr)


def test_batch_not_divisible_by_the_batch_devices_is_one_line(tmp_path):
    config = tiny_config(
        tmp_path,
        steps=1,
        **{"train.global_batch_size": 12, "data.streams": 4, "mesh.num_devices": 0},
    )
    task = train.prepared_task(config, str(tmp_path / "run"))
    with pytest.raises(ValueError) as err:
        train.build(config, str(tmp_path / "run"), task)  # 8 devices share the batch
    assert str(err.value) == (
        "config key train.global_batch_size=12 is not divisible by the 8 devices that shard the "
        "batch (mesh {'data': 8, 'fsdp': 1, 'tensor': 1}); use a multiple of 8"
    )


def test_streams_that_do_not_split_the_batch_are_one_line_before_any_data_work(tmp_path):
    config = tiny_config(tmp_path, steps=1, **{"train.global_batch_size": 12, "data.streams": 8})
    config.data.prepared_dir = str(tmp_path / "never")  # nothing is prepared or read first
    with pytest.raises(ValueError) as err:
        get_task("pretrain", config, str(tmp_path / "run"))
    assert str(err.value) == (
        "config key train.global_batch_size=12 is not divisible by data.streams=8 (set "
        "data.streams to a divisor of it)"
    )
    assert not (tmp_path / "never").exists()


def test_a_run_that_fails_before_writing_leaves_no_folder_it_created(tmp_path):
    missing = {"data.prepared_dir": str(tmp_path / "none"), "data.corpus": str(tmp_path / "no.txt")}
    config = tiny_config(tmp_path, steps=1, **missing)
    workdir = tmp_path / "runs" / "new"  # both folders created by the run
    with pytest.raises(FileNotFoundError, match="no.txt"):
        train.train_and_evaluate(config, str(workdir))
    assert not (tmp_path / "runs").exists()
    empty = tmp_path / "empty"  # there before: kept, as it was
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no.txt"):
        train.train_and_evaluate(config, str(empty))
    assert empty.is_dir() and not list(empty.iterdir())
    (tmp_path / "runs").mkdir()  # the parent there before, holding the user's file: kept
    (tmp_path / "runs" / "notes.txt").write_text("mine")
    with pytest.raises(FileNotFoundError, match="no.txt"):
        train.train_and_evaluate(config, str(workdir))
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["notes.txt"]
