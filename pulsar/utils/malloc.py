"""glibc's allocator tuned for the length of a build: freed memory is kept for the next allocation.

A build copies and serializes its models several times (a transformer's 90 MB of weights about a
dozen times) and calibration allocates each sample's activations afresh. With glibc's defaults,
memory freed at the top of the heap goes back to the kernel at once (``M_TRIM_THRESHOLD`` 128 KiB)
and blocks above the dynamic mmap threshold are mapped and unmapped on every use, so each new copy
page-faults its memory in again: MiniLM's build took 600 k page faults, 1.6-1.8 s of kernel time in
a 3.2 s build. Inside :func:`tuned_allocator` freed memory stays in the heap (trim threshold 1 GiB),
the heap grows in 256 MiB steps (address space: a page counts once it is touched) and blocks up to
32 MiB (glibc's largest mmap threshold) come from the heap: 380 k page faults, 1.2 s of kernel
time. On leaving, the settings are those glibc's own dynamic thresholds reach in a process that has
freed a large block (:data:`AFTER`), and the free memory is handed back (``malloc_trim``), so a
process that embeds pulsar does not keep the build's peak. Other C
libraries, and a process whose user set any ``MALLOC_*`` variable or ``GLIBC_TUNABLES``, are left
alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # mallopt's parameter numbers (malloc.h)
BUILD = {M_TRIM_THRESHOLD: 1 << 30, M_TOP_PAD: 256 << 20, M_MMAP_THRESHOLD: 32 << 20}
# on leaving: where glibc's own dynamic rule takes a process once it has freed a block of 32 MiB (mmap
# threshold raised to that block's size, at most 32 MiB; trim threshold twice that; top pad its default).
# Not the start-up 128 KiB: a fixed mmap threshold that low maps and unmaps every block over 128 KiB,
# which made the simulator run after a build in the same process 1.5-1.8x slower (MobileNetV2).
AFTER = {M_TRIM_THRESHOLD: 64 << 20, M_TOP_PAD: 128 << 10, M_MMAP_THRESHOLD: 32 << 20}
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX",
                  "GLIBC_TUNABLES")
_lock = threading.Lock()
_depth = 0  # nested builds (a sweep's trials in threads) tune once and restore once


def _glibc() -> Any | None:
    """The process's C library when it is glibc and the user has not tuned it, else None."""
    if not sys.platform.startswith("linux") or any(os.environ.get(k) for k in _USER_SETTINGS):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not all(hasattr(libc, f) for f in ("gnu_get_libc_version", "mallopt", "malloc_trim")):
        return None  # musl and others: their allocators take no such settings
    return libc


@contextlib.contextmanager
def tuned_allocator() -> Iterator[bool]:
    """Within the block, glibc keeps freed memory for reuse (see the module docstring); yields
    whether the settings took effect."""
    global _depth
    libc = _glibc()
    if libc is None:
        yield False
        return
    with _lock:
        _depth += 1
        if _depth == 1:
            for param, value in BUILD.items():
                libc.mallopt(param, value)
    try:
        yield True
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for param, value in AFTER.items():
                    libc.mallopt(param, value)
                libc.malloc_trim(0)


__all__ = ["AFTER", "BUILD", "tuned_allocator"]
