"""The workdir lock: a second run in the same WORKDIR is refused in one line naming the holder,
stale locks (a dead pid, a reused pid, an old heartbeat elsewhere) are taken over, and the
object-store way (no exclusive create) works too."""

import errno
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
