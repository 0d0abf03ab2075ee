"""The fused MoE Triton kernel compiled on a CUDA device vs the torch path, at
Nemotron-3-Nano-30B-A3B expert shapes, and captured in a CUDA graph (no host sync inside).

    TRITON_INTERPRET=0 .venv/bin/python -m pytest -m gpu tests/gpu/test_moe_gpu.py

Errors are relative Frobenius norms (bf16/fp16 rounding and TF32 give ~1e-3; a wrong block,
mask or expert index gives O(1)).
"""

from __future__ import annotations

import pytest
import torch

from baton.kernels.layouts import Routing
from baton.kernels.moe import fused_moe_torch, route_sigmoid_grouped
from baton.kernels.triton.moe import _moe_up_kernel, fused_moe_triton


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_moe_up_kernel, InterpretedFunction)


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        _interpreted(), reason="Triton interpreter is on: run with TRITON_INTERPRET=0"
    ),
]

# Nemotron-3-Nano-30B-A3B: hidden 2688, 128 experts of width 1856, top-6. A quarter of the
# experts keeps the test's memory small; the block shapes do not depend on E.
HIDDEN, INTER, EXPERTS, TOP_K = 2688, 1856, 32, 6
DEVICE = "cuda"


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.double() - expected.double()).norm()
    return (diff / expected.double().norm().clamp_min(1e-30)).item()


def case(T: int, dtype, activation: str, gen: torch.Generator):
    rows = 2 * INTER if activation == "swiglu" else INTER
    x = torch.randn(T, HIDDEN, generator=gen).to(DEVICE, dtype)
    w_up = (torch.randn(EXPERTS, rows, HIDDEN, generator=gen) / HIDDEN**0.5).to(DEVICE, dtype)
    w_down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5).to(DEVICE, dtype)
    gate = torch.randn(EXPERTS, HIDDEN, generator=gen).to(DEVICE)
    bias = torch.zeros(EXPERTS, device=DEVICE)
    routing = route_sigmoid_grouped(
        x, gate, bias, top_k=TOP_K, n_group=1, topk_group=1, norm_topk_prob=True, scaling=2.5
    )
    return x, w_up, w_down, routing


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
@pytest.mark.parametrize("T", [1, 7, 64, 300, 2048])
def test_fused_moe_matches_torch_path(T, activation, dtype):
    gen = torch.Generator().manual_seed(T)
    x, w_up, w_down, routing = case(T, dtype, activation, gen)
    out = fused_moe_triton(x, w_up, w_down, routing, activation)
    ref = fused_moe_torch(x.float(), w_up.float(), w_down.float(), routing, activation)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, ref) < 2e-2


def test_all_tokens_on_one_expert_and_idle_experts():
    gen = torch.Generator().manual_seed(1)
    x, w_up, w_down, _ = case(96, torch.bfloat16, "relu2", gen)
    ids = torch.full((96, 1), 5, device=DEVICE)
    routing = Routing(torch.rand(96, 1, device=DEVICE), ids)
    out = fused_moe_triton(x, w_up, w_down, routing, "relu2")
    ref = fused_moe_torch(x.float(), w_up.float(), w_down.float(), routing, "relu2")
    assert rel_err(out, ref) < 2e-2


def test_fused_moe_replays_in_a_cuda_graph_with_new_routing():
    """Capture once with one routing, replay with another written into the same buffers: the
    per-expert counts are computed on the device, so the replay follows the new routing."""
    gen = torch.Generator().manual_seed(2)
    x, w_up, w_down, routing = case(32, torch.bfloat16, "relu2", gen)
    static = Routing(routing.weights.clone(), routing.ids.clone())
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fused_moe_triton(x, w_up, w_down, static, "relu2")  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(x, w_up, w_down, static, "relu2")
    new_ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(32)])
    static.ids.copy_(new_ids.to(DEVICE))
    static.weights.copy_(torch.rand(32, TOP_K, generator=gen).to(DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    ref = fused_moe_torch(x.float(), w_up.float(), w_down.float(), static, "relu2")
    assert rel_err(out, ref) < 2e-2
