"""Keep glibc from returning per-step temporaries to the OS (CPU serving), and hand freed memory
back when something large and one-off is gone (`release_freed_memory`).

By default glibc serves allocations over 128 KiB-32 MiB (its threshold adapts) with mmap and
unmaps them on free, so every step's activations, logits and gathered states page-fault again on
first touch; here that costs more than the arithmetic (an 8 MiB tensor: ~4 ms to allocate vs
~1 ms once the heap keeps it). Raising the mmap and trim thresholds keeps freed blocks in the
heap for reuse. Process-wide and idempotent; a no-op off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

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


def release_freed_memory() -> None:
    """Hand freed heap pages back to the system (glibc's malloc_trim; nothing elsewhere): after a
    long tokenization or a large refused frame, whose memory would otherwise stay with the process
    (freed blocks are kept for reuse: here by design, elsewhere once glibc's adaptive mmap
    threshold has risen)."""
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else None
        except OSError:
            _LIBC = None
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)
