"""Keep glibc from returning per-step temporaries to the OS (CPU serving), and hand freed memory
back when something large and one-off is gone (`release_freed_memory`).

By default glibc serves allocations over 128 KiB-32 MiB (its threshold adapts) with mmap and
unmaps them on free, so every step's activations, logits and gathered states page-fault again on
first touch; here that costs more than the arithmetic (an 8 MiB tensor: ~4 ms to allocate vs
~1 ms once the heap keeps it). Raising the mmap and trim thresholds keeps freed blocks in the
heap for reuse. Process-wide and idempotent; a no-op off glibc.

The price: what loading frees (each plain weight once its packed copy exists, the matmul
chooser's scratch) would stay in the heap for good, ~290 MB of a 110M fp32 model's engine.
`release_freed_memory` hands it back once, after loading (malloc_trim also returns free pages
inside the heap, not only at its top).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger("baton.engine")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's ceiling on 64-bit
_done = False


def keep_freed_memory_in_heap() -> bool:
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
        ok &= libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
    except (OSError, AttributeError):
        return False
    _done = ok
    if not ok:
        logger.info("mallopt unavailable; CPU temporaries will page-fault on every step")
    return ok


_LIBC: ctypes.CDLL | None = None


def release_freed_memory() -> bool:
    """Hand freed heap pages back to the system (glibc's malloc_trim; nothing elsewhere): after a
    long tokenization or a large refused frame, whose memory would otherwise stay with the process
    (freed blocks are kept for reuse: here by design, elsewhere once glibc's adaptive mmap
    threshold has risen). False off glibc."""
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else None
        except OSError:
            _LIBC = None
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


def available_memory() -> int:
    """Bytes of memory this machine can give without swapping (/proc/meminfo's MemAvailable;
    elsewhere the free physical pages)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
