"""The workdir lock: a second run in the same WORKDIR is refused in one line naming the holder,
stale locks (a dead pid, a reused pid, an old heartbeat elsewhere) are taken over, and the
object-store way (no exclusive create) works too."""

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest
from train_fixtures import tiny_config

from bertjax import train, workdir_lock


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
