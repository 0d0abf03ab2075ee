"""The gated delta rule's Triton kernels vs its torch path on a CUDA device at Qwen3-Next's
per-layer shapes (16 key heads, 32 value heads, head dims 128, chunk 64).

    TRITON_INTERPRET=0 .venv/bin/python -m pytest -m gpu tests/gpu/test_gated_delta_gpu.py

Errors are relative Frobenius norms: TF32 tl.dot and bfloat16 rounding give ~1e-3, a wrong index
or mask gives O(1).
"""

from __future__ import annotations

import pytest
import torch

from baton.kernels.gated_delta import (
    chunk_gated_delta_rule_torch,
    gated_delta_decode_torch,
    gdn_gating,
)
from baton.kernels.ssd import build_chunk_layout
from baton.kernels.triton.gated_delta import (
    _decode_kernel,
    chunk_gated_delta_rule_triton,
    gated_delta_decode_triton,
)


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_decode_kernel, InterpretedFunction)


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        _interpreted(), reason="Triton interpreter is on: run with TRITON_INTERPRET=0"
    ),
]

HK, HV, DK, DV, CHUNK = 16, 32, 128, 128, 64
DEVICE = "cuda"


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.double() - expected.double()).norm()
    return (diff / expected.double().norm().clamp_min(1e-30)).item()


def inputs(T: int, dtype: torch.dtype, gen: torch.Generator):
    q = torch.randn(T, HK, DK, generator=gen).to(DEVICE, dtype)
    k = torch.randn(T, HK, DK, generator=gen).to(DEVICE, dtype)
    v = torch.randn(T, HV, DV, generator=gen).to(DEVICE, dtype)
    a, b = torch.randn(T, HV, generator=gen), torch.randn(T, HV, generator=gen)
    A_log = torch.empty(HV).uniform_(0.0, 2.7, generator=gen)  # A in [1, 16], as initialised
    g, beta = gdn_gating(a.to(DEVICE, dtype), b.to(DEVICE, dtype), A_log.to(DEVICE),
                         torch.zeros(HV, device=DEVICE), 1.0)  # fmt: skip
    return q, k, v, g, beta


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_rule_matches_torch_path(dtype):
    gen = torch.Generator().manual_seed(0)
    seq_lens, start_pos = [1000, 37, 3000, 1], [0, 250, 4113, 77]
    q, k, v, g, beta = inputs(sum(seq_lens), dtype, gen)
    init = (torch.randn(len(seq_lens), HV, DK, DV, generator=gen) * 0.1).to(DEVICE)
    layout = build_chunk_layout(seq_lens, start_pos, CHUNK, DEVICE)
    out = chunk_gated_delta_rule_triton(q, k, v, g, beta, init, layout)
    ref = chunk_gated_delta_rule_torch(q, k, v, g, beta, init, layout)
    assert rel_err(out.o, ref.o) < 1e-2
    assert rel_err(out.final_states, ref.final_states) < 1e-2
    assert rel_err(out.chunk_states, ref.chunk_states) < 1e-2


@pytest.mark.parametrize("batch", [1, 13, 256])
def test_decode_matches_torch_path_and_skips_padding(batch):
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta = inputs(batch, torch.bfloat16, gen)
    pool = torch.randn(batch + 3, HV, DK, DV, generator=gen).to(DEVICE)
    slots = torch.randperm(batch + 2, generator=gen)[:batch].to(DEVICE) + 1
    slots[batch // 2] = 0  # one padded row on the dummy slot
    ref_pool = pool.clone()
    o = gated_delta_decode_triton(q, k, v, g, beta, pool, slots)
    o_ref = gated_delta_decode_torch(q, k, v, g, beta, ref_pool, slots)
    assert rel_err(o, o_ref) < 1e-2
    assert torch.equal(o[batch // 2], torch.zeros_like(o[batch // 2]))
    assert rel_err(pool, ref_pool) < 1e-4
    assert torch.equal(pool[0], ref_pool[0])
