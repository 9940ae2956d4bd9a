"""A readable console on a machine without accelerators: TensorFlow's and JAX's start-up chatter
filtered out of stderr, real errors kept.

On a CPU-only Linux box, TensorFlow prints native INFO lines at import (oneDNN, "Could not find cuda
drivers") that ``TF_CPP_MIN_LOG_LEVEL`` does not silence (they are logged before absl is
initialised), an ``E0000 ... failed call to cuInit`` error line when it lists devices, and JAX's
TPU probe (libtpu installed) prints TPU host-bound warnings. ``quiet_native_logs`` makes JAX use the
CPU (it has nothing else) and passes stderr through a small filter process that drops exactly
those lines: native INFO/WARNING lines as ``TF_CPP_MIN_LOG_LEVEL`` asks, absl's "before
InitializeLog" banners and the cuInit error. Every other line, errors included, passes unchanged;
the filter is a separate process, so a crash's last words still reach the terminal.
``BERTJAX_RAW_STDERR=1`` turns it off.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys

# A native (absl/glog) log line: I0000 00:00:1795462706.772035   32330 port.cc:153] ...
_NATIVE = r"[IWEF]\d{4} \d\d:\d\d:[\d.]+\s+\d+ \S+:\d+\] "
BANNERS = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "WARNING: Logging before InitGoogle() is written to STDERR",
)
NO_GPU_ERRORS = ("failed call to cuInit",)  # noise only where there is no GPU
ACCELERATOR_NODES = ("/dev/nvidia[0-9]*", "/dev/accel*", "/dev/vfio/[0-9]*", "/dev/kfd")


def has_accelerator() -> bool:
    """Whether the machine has a GPU or TPU device node (NVIDIA, TPU, AMD)."""
    return any(glob.glob(pattern) for pattern in ACCELERATOR_NODES)


def is_noise(line: str, min_level: int) -> bool:
    """Whether a stderr line is start-up chatter on a CPU-only machine. ``min_level`` is
    ``TF_CPP_MIN_LOG_LEVEL`` (1 drops native INFO lines, 2 WARNING lines too; errors never,
    except the cuInit failure of a machine without a GPU)."""
    text = line.rstrip("\r\n")
    if text in BANNERS or text.startswith("To enable the following instructions: AVX"):
        return True
    if not re.match(_NATIVE, text):
        return False
    level = "IWEF".index(text[0])
    return level < min_level or (level == 2 and any(e in text for e in NO_GPU_ERRORS))


def _filter(level: int) -> None:
    """The filter process: stdin -> stdout without the noise lines (see ``is_noise``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pending = b""
    while chunk := os.read(0, 1 << 16):
        *lines, pending = (pending + chunk).split(b"\n")
        out = [x + b"\n" for x in lines if not is_noise(x.decode("utf-8", "replace"), level)]
        if pending and not pending.startswith((b"I", b"W", b"E", b"F", b"To enable")):
            out.append(pending)  # a progress bar's partial line: shown now
            pending = b""
        os.write(1, b"".join(out))
    os.write(1, pending)


def quiet_native_logs() -> None:
    """On a Linux machine without accelerators (and BERTJAX_RAW_STDERR unset): JAX on the CPU and
    stderr through the noise filter. Call before TensorFlow is imported and JAX initialised."""
    if not sys.platform.startswith("linux") or has_accelerator():
        return
    # JAX on the CPU: with libtpu installed (the aot extra) it would otherwise start the TPU
    # runtime in every process (warnings, and a lock file one process at a time may hold).
    if not os.environ.get("JAX_PLATFORMS"):
        os.environ["JAX_PLATFORMS"] = "cpu"
        if "jax" in sys.modules:  # jax read the environment at import
            sys.modules["jax"].config.update("jax_platforms", "cpu")
    if os.environ.get("BERTJAX_RAW_STDERR"):
        return
    if os.environ.get("BERTJAX_STDERR_FILTER_OF") == str(os.getpid()):
        return  # this process's stderr goes through the filter already
    level = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0")
    read, write = os.pipe()
    try:
        subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-S",
                os.path.abspath(__file__),
                level if level.isdigit() else "0",
            ],
            stdin=read,
            stdout=2,
            start_new_session=True,  # a Ctrl-C or a kill of the job does not cut the filter first
        )
    except OSError:
        os.close(read)
        os.close(write)
        return
    os.close(read)
    sys.stderr.flush()
    os.dup2(write, 2)
    os.environ["BERTJAX_STDERR_FILTER_OF"] = str(os.getpid())
    os.close(write)


if __name__ == "__main__":
    _filter(int(sys.argv[1]))
