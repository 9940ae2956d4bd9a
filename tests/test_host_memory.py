"""bertjax.host_memory: with the policy on, a large block freed and allocated again is reused
(no page faults); without it, glibc hands it back to the kernel and every reuse faults it in."""

import subprocess
import sys

import pytest

_ALLOCATE = """
import ctypes, resource, sys
from bertjax import host_memory
if sys.argv[1] == "retain":
    assert host_memory.retain_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
size = 256 << 20  # one XLA temporaries block: far above glibc's largest mmap threshold
block = libc.malloc(size); libc.memset(block, 1, size); libc.free(block)  # the first step
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):  # the next steps
    block = libc.malloc(size); libc.memset(block, 1, size); libc.free(block)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt (Linux)")
def test_retained_memory_is_reused_without_page_faults():
    def faults(mode):
        done = subprocess.run(
            [sys.executable, "-c", _ALLOCATE, mode], capture_output=True, text=True, check=True
        )
        return int(done.stdout.strip())

    pages = 3 * (256 << 20) // 4096
    assert faults("default") > pages // 2  # every reuse faults the block in again
    assert faults("retain") < pages // 100  # reused as it is
