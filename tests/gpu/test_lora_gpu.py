"""The batched LoRA Triton kernels (kernels/triton/lora.py) compiled on a CUDA device against a
float64 oracle at a published width (Nemotron-Nano-9B-v2: hidden 4480, Mamba in_proj 22656) with
8 slots of rank 16, a decode batch mixing slots and rows without an adapter (a row per program)
and a prefill's runs of one slot (the grouped tl.dot kernels), a fused projection's three parts
expanded into their column ranges; then LoRALinear on CUDA runs them.

    TRITON_INTERPRET=0 .venv/bin/python -m pytest -m gpu tests/gpu/test_lora_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from baton.kernels.triton.lora import _lora_shrink_kernel, lora_expand_triton, lora_shrink_triton


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_lora_shrink_kernel, InterpretedFunction)


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(_interpreted(), reason="run with TRITON_INTERPRET=0"),
]

SLOTS, RANK, HIDDEN, WIDE = 8, 16, 4480, 22656
ROW_SLOTS = [3, -1, 0, 7, 3, 3, -1, 5, 1, 0, 2, 6, -1, 4, 4, 7]  # a decode batch: a row each
PREFILL = [2] * 100 + [-1] * 37 + [5] * 60 + [0] * 3  # the grouped (tl.dot) kernels


def oracle(x, a_rows, b_rows, lora_slots, y, slots, rank):
    want = y.double().clone()
    n = b_rows[0].shape[1]
    for t, s in enumerate(lora_slots.tolist()):
        if s < 0:
            continue
        for p, b in enumerate(b_rows):
            a = a_rows[(p * slots + s) * rank : (p * slots + s + 1) * rank].double()
            low = x[t].double() @ a.T
            want[t, p * n : (p + 1) * n] += low @ b[s * rank : (s + 1) * rank].double()
    return want


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("row_slots", [ROW_SLOTS, PREFILL], ids=["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("parts", "n"), [(1, WIDE), (3, 1024)])
def test_shrink_expand_match_the_oracle_on_the_gpu(row_slots, dtype, parts, n):
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)

    x = rand(len(row_slots), HIDDEN)
    a_rows = rand(parts * SLOTS * RANK, HIDDEN, scale=0.02)
    b_rows = [rand(SLOTS * RANK, n, scale=0.02) for _ in range(parts)]
    y = rand(len(row_slots), parts * n)
    lora_slots = torch.tensor(row_slots, device="cuda")
    want = oracle(x, a_rows, b_rows, lora_slots, y, SLOTS, RANK)
    got = y.clone()
    low = lora_shrink_triton(x, a_rows, lora_slots, RANK, parts)
    for p, b in enumerate(b_rows):
        lora_expand_triton(low[:, p * RANK :], b, lora_slots, RANK, got[:, p * n : (p + 1) * n])
    torch.cuda.synchronize()
    none = lora_slots < 0
    assert torch.equal(got[none], y[none])
    assert rel(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_lora_linear_on_cuda_runs_the_triton_kernels(monkeypatch):
    import baton.kernels.triton.lora as triton_lora
    from baton.engine.lora.layer import LoRALinear, slot_rows

    calls = []
    for name in ("lora_shrink_triton", "lora_expand_triton"):
        launcher = getattr(triton_lora, name)
        monkeypatch.setattr(
            triton_lora, name, lambda *a, _l=launcher, _n=name: calls.append(_n) or _l(*a)
        )
    base = nn.Linear(64, 96, bias=False, device="cuda")
    layer = LoRALinear(base, 2, 4, "proj")
    layer.a_rows.normal_()
    layer.b_rows.normal_()
    lora_slots = torch.tensor([1, -1, 0], device="cuda")
    x = torch.randn(3, 64, device="cuda")
    slot_of_column = torch.arange(2, device="cuda").repeat_interleave(4)
    with torch.no_grad(), slot_rows(lora_slots, slot_of_column, True):
        got = layer(x)
    want = oracle(x, layer.a_rows, [layer.b_rows], lora_slots, base(x).detach(), 2, 4)
    assert calls == ["lora_shrink_triton", "lora_expand_triton"]
    assert rel(got, want) < 1e-5
