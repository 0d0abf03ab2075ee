"""Reusable scratch buffers for the torch path's large per-step temporaries.

On the CPU a fresh multi-megabyte tensor costs more than the arithmetic done on it: glibc serves
it with mmap and every page faults on first touch (50 MB of SSM state: ~50 ms to allocate, ~4 ms
to multiply in place). Kernels that gather pool slots into a temporary take it from here instead.
A buffer is valid only until the next call that asks for the same name: callers use it within
one kernel call and never return it.
"""

from __future__ import annotations

import torch

# Keyed by inference mode too: a buffer made under torch.inference_mode() is an inference tensor
# and cannot be written outside it (and the engine runs in it while unit tests may not).
_buffers: dict[tuple[str, torch.dtype, torch.device, bool], torch.Tensor] = {}


def scratch(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """An uninitialised tensor of `shape`, backed by a buffer reused across calls."""
    numel = 1
    for size in shape:
        numel *= size
    key = (name, dtype, torch.device(device), torch.is_inference_mode_enabled())
    buffer = _buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        # Grow geometrically: gathers that grow by a token per step (decode K/V) would otherwise
        # reallocate, and page-fault, on every step.
        grown = 2 * buffer.numel() if buffer is not None else 0
        buffer = torch.empty(max(numel, grown, 1), dtype=dtype, device=device)
        _buffers[key] = buffer
    return buffer[:numel].view(shape)
