"""One run per WORKDIR: ``WORKDIR/run.lock`` names the holder (host, pid) while a run trains.

A second run on the same WORKDIR refuses to start with one line naming the holder; a WORKDIR that
cannot be written (a read-only file system, no permission) is a one-line error naming it. The lock is
created exclusively where the filesystem allows it (a complete file hard-linked into place on
local paths); on
``gs://`` and other remote filesystems, which have no exclusive create, it is written only
if absent and then read back after a short wait: of two runs racing for it, only the one whose
token is there goes on. A daemon thread refreshes the lock's heartbeat every ``heartbeat_s``.

A lock is stale, and is taken over with a warning, when its holder is on this host and its process
is gone (or the pid now belongs to a later process), or when the holder is on another host and its
heartbeat is older than ``stale_after_s`` (a preempted VM). Release removes the lock only if it is
still ours. With several processes only process 0 takes it; the others learn its outcome.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

import jax
import numpy as np
from jax.experimental import multihost_utils

from bertjax import atomic, fs

LOCK_FILE = "run.lock"
log = logging.getLogger("bertjax")
_HELD: set[str] = set()  # the tokens of the locks this process holds now


class WorkdirLockedError(RuntimeError):
    """Another live run holds the WORKDIR (the message names its host and pid)."""


class WorkdirNotWritableError(OSError):
    """The WORKDIR cannot be written (a read-only file system, or no permission): the message names
    the WORKDIR, not the lock file that could not be created."""


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks (Linux /proc), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


class WorkdirLock:
    """``with WorkdirLock(workdir): ...`` holds ``workdir/run.lock`` for the block."""

    def __init__(self, workdir: str, *, heartbeat_s: float = 60.0, stale_after_s: float = 600.0):
        self.workdir = str(workdir).rstrip("/")
        self.path = f"{self.workdir}/{LOCK_FILE}"
        self.remote = "://" in str(workdir)
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        pid = os.getpid()
        self.record = {
            "host": socket.gethostname(),
            "pid": pid,
            "pid_start": _process_start(pid),
            "token": uuid.uuid4().hex,
            "started": time.time(),
            "heartbeat": time.time(),
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.held = False

    # ---- acquire / release ---------------------------------------------------------------------
    def acquire(self) -> None:
        """Takes the lock (process 0); raises WorkdirLockedError, on every process, if it is held."""
        error = None
        if jax.process_index() == 0:
            try:
                self._acquire()
            except (WorkdirLockedError, WorkdirNotWritableError) as err:
                error = err
        if jax.process_count() > 1:
            ok = multihost_utils.broadcast_one_to_all(np.int32(error is None))
            if error is None and not int(ok):
                error = WorkdirLockedError(f"{self.path}: process 0 could not take the lock")
        if error is not None:
            raise error
        if self.held:
            self._thread = threading.Thread(target=self._beat, name="workdir-lock", daemon=True)
            self._thread.start()

    def _acquire(self) -> None:
        fs.makedirs(os.path.dirname(self.path))
        for _ in range(3):
            if self._create():
                self.held = True
                _HELD.add(self.record["token"])
                return
            holder = self._read()
            if holder is None:  # removed meanwhile (the holder exited): try again
                continue
            why = self._stale(holder)
            if why is None:
                raise WorkdirLockedError(
                    f"{self.path}: WORKDIR is in use by pid {holder.get('pid')} on host "
                    f"{holder.get('host')} (since {_when(holder.get('started'))}); wait for it to "
                    "end or use another --workdir (delete the lock only if that run is dead)"
                )
            log.warning(
                "%s: taking over a stale lock of pid %s on host %s (%s)",
                self.path,
                holder.get("pid"),
                holder.get("host"),
                why,
            )
            self._remove_if(holder.get("token"))
        raise WorkdirLockedError(f"{self.path}: could not take the lock (others keep taking it)")

    def _create(self) -> bool:
        """Creates the lock file if absent; whether it is now ours (raises WorkdirNotWritableError
        when the WORKDIR cannot be written)."""
        try:
            return self._create_file()
        except fs.io_errors(self.path) as err:
            why = fs.write_refusal(self.path, err)
            bucket = fs.bucket(self.path)
            if why is None and bucket and isinstance(err, FileNotFoundError):
                if not fs.exists(bucket):
                    raise WorkdirNotWritableError(
                        f"{self.workdir}: WORKDIR's bucket {bucket} does not exist (or this "
                        "account cannot see it): create it or use another WORKDIR"
                    ) from None
            if why is None:
                raise
            raise WorkdirNotWritableError(
                f"{self.workdir}: WORKDIR is read-only ({why}); a run writes its lock, checkpoints "
                "and metrics there: make it writable or use another WORKDIR"
            ) from None

    def _create_file(self) -> bool:
        text = json.dumps(self.record)
        if not self.remote:  # a complete file linked in place: exclusive, never half-written
            tmp = f"{self.path}.{self.record['token']}.tmp"
            with open(tmp, "w") as f:
                f.write(text)
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                return False
            finally:
                os.remove(tmp)
            return True
        if fs.exists(self.path):
            return False
        atomic.write_text(self.path, text)
        time.sleep(2.0)  # a racing writer's object lands meanwhile; the last one stays
        holder = self._read()
        return holder is not None and holder.get("token") == self.record["token"]

    def _read(self) -> dict | None:
        try:
            with fs.open_file(self.path, "r") as f:
                text = f.read()
        except fs.not_found_errors(self.path):
            return None
        try:
            holder = json.loads(text)
        except json.JSONDecodeError:
            holder = None
        if not isinstance(holder, dict):  # a half-written or foreign file: stale
            return {"host": "?", "pid": "?", "token": None, "heartbeat": 0.0}
        return holder

    def _stale(self, holder: dict) -> str | None:
        """Why the holder is gone, or None when it may be alive."""
        if holder.get("token") is None:
            return "unreadable lock file"
        if holder.get("host") == self.record["host"] and isinstance(holder.get("pid"), int):
            pid = holder["pid"]
            if pid == os.getpid() and holder["token"] not in _HELD:
                return "an earlier run of this process could not remove it"
            if not _pid_alive(pid):
                return "its process is gone"
            start = holder.get("pid_start")
            if start and _process_start(pid) not in (None, start):
                return "its pid now belongs to another process"
            return None
        age = time.time() - float(holder.get("heartbeat") or 0.0)
        if age > self.stale_after_s:
            return f"no heartbeat for {age:.0f} s"
        return None

    def _remove_if(self, token: str | None) -> None:
        """Removes the lock file if it still holds ``token`` (a stale lock or our own)."""
        holder = self._read()
        if holder is not None and holder.get("token") == token:
            try:
                fs.remove(self.path)
            except fs.not_found_errors(self.path):
                pass

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            holder = self._read()
            if holder is None or holder.get("token") != self.record["token"]:
                log.warning("%s: the lock was taken by another run", self.path)
                return
            self.record["heartbeat"] = time.time()
            try:
                atomic.write_text(self.path, json.dumps(self.record))
            except fs.io_errors(self.path) as err:
                log.warning("%s: could not refresh the lock: %s", self.path, err)

    def release(self, after_error: bool = False) -> None:
        """Stops the heartbeat and removes the lock if it is still ours. ``after_error``: the run
        failed, and a failure to remove the lock (its bucket down, say) is logged, not raised:
        the run's error is the one to report (a later run takes the lock over as stale)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.held:
            self.held = False
            _HELD.discard(self.record["token"])
            try:
                self._remove_if(self.record["token"])
            except fs.io_errors(self.path) as err:
                if not after_error:
                    raise
                log.warning("%s: could not remove the lock: %s", self.path, err)

    def __enter__(self) -> WorkdirLock:
        self.acquire()
        return self

    def __exit__(self, kind, *exc) -> None:
        self.release(after_error=kind is not None)


def _when(started) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(started)))
    except (TypeError, ValueError):
        return "an unknown time"
