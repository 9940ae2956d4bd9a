"""The console of a CPU machine: TensorFlow/CUDA/TPU start-up noise is dropped from stderr, errors,
tracebacks and progress lines pass through unchanged."""

import os
import subprocess
import sys

import pytest

from bertjax import console

NOISE = """\
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1795462706.772035   32330 port.cc:153] oneDNN custom operations are on.
I0000 00:00:1795462706.774152   32330 cudart_stub.cc:31] Could not find cuda drivers on your machine
E0000 00:00:1795462708.910790   32330 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA
W0000 00:00:1795462708.910790   32330 some.cc:1] a native warning
"""

KEPT = """\
E0000 00:00:1795462708.910790   32330 tfrecord.cc:52] DataLossError: corrupted record at 12
Traceback (most recent call last):
ValueError: a real error
"""


def test_console_filter_drops_start_up_noise_and_keeps_errors():
    assert all(console.is_noise(line, 2) for line in NOISE.splitlines())
    assert not any(console.is_noise(line, 2) for line in KEPT.splitlines())
    assert not console.is_noise(NOISE.splitlines()[-1], 0)  # TF_CPP_MIN_LOG_LEVEL=0: shown


def test_console_filter_process_passes_everything_else(tmp_path):
    if console.has_accelerator():
        pytest.skip("the filter is only installed on machines without accelerators")
    code = (
        "import os, sys; from bertjax import console; console.quiet_native_logs(); "
        f"os.write(2, {(NOISE + KEPT).encode()!r}); os.write(2, b'\\rprogress 50%'); "
        "sys.exit('bertjax: error: the last words')"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("BERTJAX_RAW_STDERR", "JAX_PLATFORMS")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env)
    assert out.returncode == 1
    assert out.stderr.decode() == KEPT + "\rprogress 50%bertjax: error: the last words\n"
