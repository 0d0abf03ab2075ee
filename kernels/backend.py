"""Which implementation a kernel call runs: the Triton kernels or the torch path.

CUDA tensors go to Triton and CPU tensors to torch, unless `BATON_KERNELS=torch|triton` forces
one (with `TRITON_INTERPRET=1`, `triton` runs the Triton kernels on CPU tensors).
"""

from __future__ import annotations

import os
from typing import Literal

import torch

Backend = Literal["torch", "triton"]


KERNELS_ENV = "BATON_KERNELS"


def select_backend(tensor: torch.Tensor) -> Backend:
    forced = os.environ.get(KERNELS_ENV, "").strip().lower()
    if forced in ("torch", "triton"):
        return forced  # type: ignore[return-value]
    if forced:
        raise ValueError(f"BATON_KERNELS must be 'torch' or 'triton', got {forced!r}")
    return "triton" if tensor.is_cuda else "torch"


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s input precision for a model served in `dtype`.

    A float32 model is served for exactness, so its products stay IEEE float32 (TF32 would cut
    them to a 10-bit mantissa and move logprobs by ~1e-3 against transformers). bfloat16 and
    float16 inputs already fit TF32 exactly; only the float32 intermediates (decay weights,
    softmax probabilities) are rounded, below the serving dtype's own precision, so they use the
    tensor cores.
    """
    return "ieee" if dtype == torch.float32 else "tf32"
