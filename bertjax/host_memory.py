"""Host memory policy for JAX on the CPU (opt-in): freed blocks stay in the process.

XLA's CPU runtime allocates each execution's temporaries as one block (631 MB for the MiniLM-L6
fine-tuning step at batch 32 x 64, several GB for BERT-base pretraining). glibc's malloc hands
blocks that large to the kernel on ``free`` (mmap/munmap, also from its per-thread arenas whatever
``M_MMAP_MAX`` says), so every step faults the whole block in again, page by page, zero-filled:
160k minor page faults and about 0.3 of the 1.8 CPU-seconds of that step, measured
(docs/performance.md, "Fine-tuning speed"). With one arena, no mmap and no trimming, a block freed
by one step is reused by the next: no faults, no kernel zeroing (MiniLM step: 2.11 -> 1.81 CPU-s).

The price is memory: with everything in one never-trimmed heap, compilation's memory and the
steps' blocks fragment it, and the peak RSS grows: 2.55 -> 3.7 GB for that fine-tuning run, 4.1 ->
6.7-9.3 GB for a BERT-base pretraining bench (batch 8), whose step gains nothing (7.6 CPU-s
either way: the faults are small next to its compute). So it is opt-in: the ``bertjax`` command
applies it when JAX runs on the CPU and ``BERTJAX_RETAIN_HOST_MEMORY=1`` is set. A program that
imports bertjax can call ``retain_freed_memory()`` first thing (before JAX starts its threads).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
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


def apply_from_environment(default: str = "0") -> bool:
    """``retain_freed_memory()`` when ``BERTJAX_RETAIN_HOST_MEMORY=1`` (unset: ``default``);
    returns whether applied."""
    if os.environ.get("BERTJAX_RETAIN_HOST_MEMORY", default) != "1":
        return False
    return retain_freed_memory()
