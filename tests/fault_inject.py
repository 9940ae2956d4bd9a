"""`python tests/fault_inject.py COMMAND ...`: the `bertjax` command with a fault injected into
Orbax's checkpoint writes or a hold in training, for the tests that kill or signal a run.

BERTJAX_FAULT_DISK_FULL_STEP=N: writing checkpoint step N fails with ENOSPC (a full disk).
BERTJAX_FAULT_SLOW_SAVE_STEP=N: writing checkpoint step N stalls for 600 s (to be killed mid-save).
BERTJAX_FAULT_SLOW_WRITE=NAME: the first atomic write of a file named NAME (eval_results.json, a dev
predictions file, ...) stalls for 600 s with half its text in the temporary file.
BERTJAX_FAULT_HOLD_STEP=N: after step N is logged (before its checkpoint), training waits until a stop
is requested (SIGTERM, Ctrl-C) or for 600 s: a signal sent once an earlier step is logged lands
before the run can end, however busy the machine.
"""

import errno
import os
import sys
import time

from bertjax import console

# As the `bertjax` command does, before anything imports JAX (whose CUDA plugin, in the test
# extra, prints its no-driver lines at import on a CPU-only machine).
console.quiet_native_logs()

from etils import epath  # noqa: E402

from bertjax import atomic, cli, preemption  # noqa: E402

_write_text = epath.Path.write_text


def _faulty_write_text(self, *args, **kwargs):
    for key, fault in (("DISK_FULL", "full"), ("SLOW_SAVE", "slow")):
        step = os.environ.get(f"BERTJAX_FAULT_{key}_STEP")
        if step and f"/{step}.orbax-checkpoint-tmp" in str(self):
            if fault == "full":
                raise OSError(errno.ENOSPC, "No space left on device", str(self))
            time.sleep(600)
    return _write_text(self, *args, **kwargs)


_atomic_write_text = atomic.write_text


def _slow_atomic_write_text(path, text):
    if os.path.basename(os.fspath(path)) == os.environ.get("BERTJAX_FAULT_SLOW_WRITE"):
        with atomic.atomic_open(path) as f:
            f.write(text[: len(text) // 2])
            f.flush()
            time.sleep(600)
    return _atomic_write_text(path, text)


_should_stop = preemption.StopFlag.should_stop


def _held_should_stop(self, step):
    if str(step) == os.environ.get("BERTJAX_FAULT_HOLD_STEP"):
        deadline = time.monotonic() + 600
        while not self.requested and time.monotonic() < deadline:
            time.sleep(0.05)
    return _should_stop(self, step)


epath.Path.write_text = _faulty_write_text
atomic.write_text = _slow_atomic_write_text
preemption.StopFlag.should_stop = _held_should_stop

if __name__ == "__main__":
    sys.argv[0] = "bertjax"
    cli.main()
