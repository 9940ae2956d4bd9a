"""Host memory policy for JAX on the CPU: freed blocks stay in the process.

XLA's CPU runtime allocates each execution's temporaries as one block (631 MB for the MiniLM-L6
fine-tuning step at batch 32 x 64, several GB for BERT-base pretraining). glibc's malloc hands
blocks that large to the kernel on ``free`` (mmap/munmap, also from its per-thread arenas whatever
``M_MMAP_MAX`` says), so every step faults the whole block in again, page by page, zero-filled:
160k minor page faults and about 0.3 of the 1.8 CPU-seconds of that step, measured
(docs/performance.md, "Fine-tuning speed"). With one arena, no mmap and no trimming, a block freed
by one step is reused by the next: no faults, no kernel zeroing. The process then keeps its peak
heap for its lifetime, which is what a training process reaches anyway.

``retain_freed_memory`` applies that policy through ``mallopt``; it is what the ``bertjax`` command
does when JAX runs on the CPU. A program that imports bertjax can call it first thing (before JAX
starts its threads), or set ``GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:
glibc.malloc.trim_threshold=17179869184`` in the environment.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8


def retain_freed_memory() -> bool:
    """Makes glibc keep freed memory for reuse (one arena, no mmap, no trimming); returns whether
    it applied (False on another C library or platform). Call before JAX starts its threads."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # -1 as the trim threshold disables trimming (mallopt(3)).
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))
    applied = all(mallopt(param, value) == 1 for param, value in settings)
    if not applied:
        log.debug("mallopt refused the host memory settings: freed memory is returned as before")
    return applied
