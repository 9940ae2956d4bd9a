"""Worker processes that end with their parent, and temporary folders that do not outlive a dead run.

``die_with_parent`` (a pool initializer's job) asks Linux to SIGKILL the worker when its parent
dies (``prctl(PR_SET_PDEATHSIG)``); ``exit_if_orphaned`` is the portable fallback a worker polls.
``make_tmp_dir`` names a temporary folder after its host and pid, so that the next run can tell a
dead run's folder (``remove_stale_tmp_dirs``) from one still in use.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_parent: list[int] = []  # the pid the worker was started by


def die_with_parent(parent_pid: int) -> None:
    """Makes this process end when ``parent_pid`` (its parent) dies: SIGKILL from the kernel on
    Linux, else at the next ``exit_if_orphaned``. Exits at once if the parent is already gone."""
    _parent[:] = [parent_pid]
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: polling only
            pass
    exit_if_orphaned()


def exit_if_orphaned() -> None:
    """Ends this worker (exit status 1, no cleanup) when the parent it was started by has died."""
    if _parent and os.getppid() != _parent[0]:
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale_tmp_dirs(folder: str, prefix: str) -> list[str]:
    """Removes ``{folder}/{prefix}*`` folders left by dead runs (logged, one line each): those of
    this host whose pid is gone, and unnamed ones (older runs). Returns the removed paths."""
    pattern = re.compile(rf"^{re.escape(prefix)}(?P<host>.+)-(?P<pid>\d+)-[^-]+$")
    host, removed = socket.gethostname(), []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        path = os.path.join(folder, name)
        if not name.startswith(prefix) or not os.path.isdir(path):
            continue
        m = pattern.match(name)
        if m and (m["host"] != host or _alive(int(m["pid"]))):
            log.warning("%s: in use by pid %s on %s; left alone", path, m["pid"], m["host"])
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed %s, the temporary folder of an interrupted run", path)
        removed.append(path)
    return removed


def make_tmp_dir(prefix: str, folder: str | None) -> str:
    """A new temporary folder ``{prefix}{host}-{pid}-XXXX`` in ``folder`` (None: the system's),
    after removing the stale ones there (``remove_stale_tmp_dirs``)."""
    if folder is not None:
        remove_stale_tmp_dirs(folder, prefix)
    return tempfile.mkdtemp(prefix=f"{prefix}{socket.gethostname()}-{os.getpid()}-", dir=folder)
