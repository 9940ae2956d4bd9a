"""Faults a new user meets (issue 15): empty splits, corrupted checkpoints, a shared workdir,
another vocabulary, bad config keys; each must give one clear line or the right behaviour."""

import errno
import gc
import json
import logging
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from train_fixtures import read_metrics, tiny_config, write_prepared

from bertjax import checkpointing, multiseed, train, workdir_lock
from bertjax.data import prepare

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


def test_best_checkpoint_and_best_seed_never_pick_nan(tmp_path):
    nan = float("nan")
    best = checkpointing.BestCheckpoint(("spearman", "max"), str(tmp_path))
    assert best.better(0.1) and not best.better(nan)
    best.value = 0.5
    assert not best.better(nan) and best.better(0.6) and not best.better(0.4)
    best.value = nan  # e.g. kept by an older version
    assert best.better(0.1)
    low = checkpointing.BestCheckpoint(("loss", "min"), str(tmp_path))
    low.value = 2.0
    assert not low.better(nan) and low.better(1.0)
    per_seed = {
        s: {"dev": {"spearman": v, "pearson": 0.5}} for s, v in ((1, nan), (2, 0.3), (3, nan))
    }
    for order in (per_seed, dict(reversed(list(per_seed.items())))):
        summary = multiseed.summarize(order, "spearman")
        assert summary["best_seed"] == 2 and summary["best"]["spearman"] == 0.3
        assert np.isnan(summary["median"]["spearman"]) and summary["median"]["pearson"] == 0.5
        assert summary["nan_seeds"] == [1, 3]


def test_a_best_checkpoint_kept_in_percent_is_read_as_a_fraction(tmp_path):
    """SQuAD/NER metrics were percentages before they became fractions: a run resumed across the
    change compares its new fractions with the kept value read as a fraction (else 0.8 would
    never beat a kept 75.0)."""
    params = {"w": np.zeros(2, np.float32)}
    old = checkpointing.Checkpointer(str(tmp_path / "best"), keep=1, async_save=False)
    old.save(3, {"params": params}, {"metric": "f1", "value": 75.0, "step": 3}, "{}", True)
    old.close()
    best = checkpointing.BestCheckpoint(("f1", "max"), str(tmp_path))
    assert best.value == 0.75 and best.better(0.8) and not best.better(0.7)
    best.update(4, {"f1": 0.8}, params, "{}")
    assert checkpointing.BestCheckpoint(("f1", "max"), str(tmp_path)).value == 0.8  # kept as is


def _newest_data_file(checkpoints: pathlib.Path, step: int) -> pathlib.Path:
    files = [p for p in (checkpoints / str(step) / "state").rglob("d/*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("fault", ["truncate", "flip"])
def test_resume_skips_a_corrupted_newest_checkpoint(tmp_path, caplog, monkeypatch, fault):
    config = tiny_config(tmp_path, steps=4)
    reference = train.train_and_evaluate(config, str(tmp_path / "ref"))
    losses = [r["loss"] for r in read_metrics(tmp_path / "ref")]
    checkpoints = tmp_path / "ref" / "checkpoints"
    path = _newest_data_file(checkpoints, 4)
    data = bytearray(path.read_bytes())
    if fault == "truncate":
        data = data[: len(data) // 2]
    else:
        data[100 : len(data) : 997] = bytes(b ^ 0xFF for b in data[100 : len(data) : 997])
    path.write_bytes(bytes(data))
    unraisable = []  # "Exception ignored in ..." that Python would print to stderr
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with caplog.at_level(logging.WARNING):
        result = train.train_and_evaluate(config, str(tmp_path / "ref"))
        gc.collect()
    skipped = [r.getMessage() for r in caplog.records if "does not restore" in r.getMessage()]
    assert len(skipped) == 1 and "step 4" in skipped[0] and "\n" not in skipped[0], skipped
    # The bad step's other reads (abandoned TensorStore coroutines) print nothing more.
    assert not [r for r in caplog.records if r.name == "asyncio"]
    assert not unraisable, [str(u.exc_value)[:200] for u in unraisable]
    assert result["step"] == 4 and result["train"]["loss"] == pytest.approx(
        reference["train"]["loss"], rel=1e-6
    )
    assert [r["loss"] for r in read_metrics(tmp_path / "ref")] == pytest.approx(losses, rel=1e-6)
    kept = [p.name for p in checkpoints.iterdir() if p.name.startswith("4.unrestorable")]
    assert len(kept) == 1 and (checkpoints / kept[0] / "state").is_dir()  # never deleted
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["2", "4"]


def test_closed_loop_noise_is_dropped_by_the_commands_hooks(monkeypatch, request):
    """An abandoned read can hand its result to Orbax's closed loop before bertjax has caught the
    restore's error (CI): the `bertjax` command's hooks (process_hooks.install) drop only errors
    raised by the loop machinery itself, called from native code."""
    import asyncio
    import types

    from bertjax import process_hooks

    shown, printed = [], []
    monkeypatch.setattr(sys, "unraisablehook", shown.append)
    monkeypatch.setattr(sys, "excepthook", lambda *args: printed.append(args[1]))
    request.addfinalizer(process_hooks.install())
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as caught:
        err = caught
    from_native = err.__traceback__.tb_next  # as if TensorStore's C++ callback had called it
    for tb in (from_native, err.__traceback__):
        sys.unraisablehook(
            types.SimpleNamespace(exc_value=err, exc_type=type(err), exc_traceback=tb)
        )
        sys.excepthook(type(err), err, tb)
    # Only the one raised through this test's own frame is shown, by each hook.
    assert [u.exc_traceback for u in shown] == [err.__traceback__] and printed == [err]


def test_no_restorable_checkpoint_is_one_line_naming_the_file(tmp_path):
    config = tiny_config(tmp_path, steps=2)
    train.train_and_evaluate(config, str(tmp_path / "run"))
    metadata = tmp_path / "run" / "checkpoints" / "2" / "state" / "_METADATA"
    metadata.write_text("")
    with pytest.raises(ValueError) as err:
        train.train_and_evaluate(config, str(tmp_path / "run"))
    message = str(err.value)
    assert "\n" not in message and str(metadata) in message and "step 2" in message, message
    assert metadata.exists()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_workdir_lock_refuses_a_second_run_and_is_released(tmp_path):
    first = workdir_lock.WorkdirLock(str(tmp_path))
    with first:
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
        with pytest.raises(workdir_lock.WorkdirLockedError) as err:
            workdir_lock.WorkdirLock(str(tmp_path)).acquire()
        message = str(err.value)
        assert "\n" not in message and f"pid {os.getpid()}" in message
        assert f"host {socket.gethostname()}" in message
    assert not (tmp_path / "run.lock").exists()
    with workdir_lock.WorkdirLock(str(tmp_path)):  # free again
        pass


def test_workdir_lock_takes_over_stale_locks(tmp_path, caplog):
    lock = tmp_path / "run.lock"
    host = socket.gethostname()
    stale = [
        {"host": host, "pid": _dead_pid(), "token": "dead", "heartbeat": time.time()},
        {"host": host, "pid": os.getpid(), "pid_start": "1", "token": "reused", "heartbeat": 0},
        {"host": "elsewhere", "pid": 7, "token": "old", "heartbeat": time.time() - 3600},
    ]
    for holder in stale:
        lock.write_text(json.dumps(holder))
        caplog.clear()
        with caplog.at_level(logging.WARNING), workdir_lock.WorkdirLock(str(tmp_path)):
            assert json.loads(lock.read_text())["pid"] == os.getpid()
        assert "taking over a stale lock" in caplog.text and f"pid {holder['pid']}" in caplog.text
        assert not lock.exists()
    lock.write_text(
        json.dumps({"host": "elsewhere", "pid": 7, "token": "x", "heartbeat": time.time()})
    )
    with pytest.raises(workdir_lock.WorkdirLockedError, match="in use by pid 7 on host elsewhere"):
        workdir_lock.WorkdirLock(str(tmp_path)).acquire()
    assert json.loads(lock.read_text())["token"] == "x"  # a live holder's lock is left alone


def test_workdir_lock_without_exclusive_create(tmp_path, monkeypatch):
    """The gs:// way (tf.io.gfile only: write if absent, then read back)."""
    monkeypatch.setattr(workdir_lock.time, "sleep", lambda s: None)
    first = workdir_lock.WorkdirLock(str(tmp_path))
    first.remote = True
    with first:
        other = workdir_lock.WorkdirLock(str(tmp_path))
        other.remote = True
        with pytest.raises(workdir_lock.WorkdirLockedError, match=f"pid {os.getpid()}"):
            other.acquire()
    assert not (tmp_path / "run.lock").exists()


@pytest.mark.parametrize(
    "code, why",
    [(errno.EROFS, "read-only file system"), (errno.EACCES, "permission denied")],
)
def test_a_read_only_workdir_is_one_line_naming_it(tmp_path, monkeypatch, code, why):
    """What a write under a read-only WORKDIR raises (simulated: root may write a chmod-ed one)."""
    real_open = open

    def refusing_open(path, mode="r", *args, **kwargs):
        if str(path).startswith(str(tmp_path)) and "w" in mode:
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(workdir_lock, "open", refusing_open, raising=False)
    with pytest.raises(workdir_lock.WorkdirNotWritableError) as err:
        workdir_lock.WorkdirLock(f"{tmp_path}/").acquire()
    message = str(err.value)
    assert message.startswith(f"{tmp_path}: WORKDIR is read-only ({why})"), message
    assert "\n" not in message and "run.lock" not in message
    assert isinstance(err.value, OSError)  # the CLI's one-line error path
    monkeypatch.setattr(  # any other failure (a full disk) stays what it is
        workdir_lock, "open", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full"))
    )
    with pytest.raises(OSError) as err:
        workdir_lock.WorkdirLock(str(tmp_path)).acquire()
    assert err.value.errno == errno.ENOSPC


def test_training_refuses_a_locked_workdir_and_releases_after(tmp_path):
    config = tiny_config(tmp_path, steps=1)
    run = tmp_path / "run"
    run.mkdir()
    holder = workdir_lock.WorkdirLock(str(run))
    with holder, pytest.raises(workdir_lock.WorkdirLockedError, match="WORKDIR is in use"):
        train.train_and_evaluate(config, str(run))
    assert not (run / "checkpoints").exists()  # refused before doing anything
    train.train_and_evaluate(config, str(run))
    assert not (run / "run.lock").exists()


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
        sys.executable, "-m", "bertjax.cli", "pretrain",
        f"--config={REPO}/tests/tiny_pretrain_config.py:{tmp_path}",
        f"--workdir={tmp_path / 'run'}", *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("bertjax: error:")]


def test_config_errors_are_one_line_naming_the_key(tmp_path):
    proc = _cli(tmp_path, "--config.train.stepz=5")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert _errors(proc.stderr) == [
        'bertjax: error: unknown config key train.stepz (did you mean "steps"?)'
    ]
    proc = _cli(tmp_path, "--config.train.global_batch_size=-8")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert _errors(proc.stderr) == [
        "bertjax: error: config key train.global_batch_size=-8 must be a positive integer"
    ]
    proc = _cli(tmp_path, "--config.train.stepz=5", "--verbose")
    assert proc.returncode != 0 and "Traceback" in proc.stderr and not _errors(proc.stderr)


def test_batch_not_divisible_by_the_batch_devices_is_one_line(tmp_path):
    config = tiny_config(tmp_path, steps=1, **{"train.global_batch_size": 12, "data.streams": 4})
    task = train.prepared_task(config, str(tmp_path / "run"))
    with pytest.raises(ValueError) as err:
        train.build(config, str(tmp_path / "run"), task)  # 8 devices share the batch
    assert str(err.value) == (
        "config key train.global_batch_size=12 is not divisible by the 8 devices that shard the "
        "batch (mesh {'data': 8, 'fsdp': 1, 'tensor': 1}); use a multiple of 8"
    )


def test_streams_that_do_not_split_the_batch_are_one_line_before_any_data_work(tmp_path):
    config = tiny_config(tmp_path, steps=1, **{"train.global_batch_size": 12})  # streams 8
    config.data.prepared_dir = str(tmp_path / "never")  # nothing is prepared or read first
    with pytest.raises(ValueError) as err:
        train.get_task("pretrain", config, str(tmp_path / "run"))
    assert str(err.value) == (
        "config key train.global_batch_size=12 is not divisible by data.streams=8 (set "
        "data.streams to a divisor of it)"
    )
    assert not (tmp_path / "never").exists()
