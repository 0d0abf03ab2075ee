"""The Mamba1 scan / decode Triton kernels and LFM2's short conv compiled on a CUDA device against
their torch paths (at Jamba-like widths), and the whole engine on CUDA (compiled kernels,
CUDA-graph decode) for a pure SSM, LFM2 and Jamba against transformers on the CPU.

    TRITON_INTERPRET=0 .venv/bin/python -m pytest -m gpu tests/gpu/test_mamba1_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from baton.kernels.conv1d import build_window_layout, causal_conv1d_varlen_torch
from baton.kernels.selective_scan import selective_scan_torch, selective_state_update_torch
from baton.kernels.ssd import build_chunk_layout
from baton.kernels.triton.conv1d import causal_conv1d_varlen_triton
from baton.kernels.triton.selective_scan import (
    _scan_kernel,
    selective_scan_pool_triton,
    selective_state_update_triton,
)
from tests.reference import hf_greedy
from tests.test_engine import check_against_reference


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_scan_kernel, InterpretedFunction)


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(_interpreted(), reason="run with TRITON_INTERPRET=0"),
]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scan_and_update_match_torch_on_the_gpu(dtype):
    width, N, lens, starts = 8192, 16, [300, 1, 77], [0, 64, 130]  # Jamba's d_inner, d_state
    T, S = sum(lens), len(lens)
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda")

    x, dt, z = rand(T, width).to(dtype), (rand(T, width) - 2).to(dtype), rand(T, width).to(dtype)
    B, C = rand(T, N).to(dtype), rand(T, N).to(dtype)
    A = -torch.rand(width, N, generator=g, device="cuda") * 4
    D, bias = rand(width), rand(width) * 0.1
    init = rand(S, width, N) * 0.3
    layout = build_chunk_layout(lens, starts, 64, "cuda")
    ref = selective_scan_torch(x, dt, A, B, C, D, bias, z, init, layout)
    pool = torch.zeros(S + 1, width, N, device="cuda")
    slots = torch.arange(1, S + 1, device="cuda")
    pool[slots] = init
    y, chunks = selective_scan_pool_triton(x, dt, A, B, C, D, bias, z, pool, slots, layout, True)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert rel(y, ref.y) < tol and rel(chunks, ref.chunk_states) < 1e-4
    assert rel(pool[slots], ref.final_states) < 1e-4
    ref_pool = pool.clone()
    rows = torch.tensor([2, 0, 1], device="cuda")
    ref_y = selective_state_update_torch(ref_pool, x[:3], dt[:3], A, B[:3], C[:3], D, bias,
                                         z[:3], rows)  # fmt: skip
    got = selective_state_update_triton(pool, x[:3], dt[:3], A, B[:3], C[:3], D, bias, z[:3], rows)
    assert rel(got[[0, 2]], ref_y[[0, 2]]) < tol and rel(pool[1:], ref_pool[1:]) < 1e-5


def test_short_conv_without_activation_matches_torch_on_the_gpu():
    lens, dim, K = [200, 3], 2048, 3
    x = torch.randn(sum(lens), dim, device="cuda")
    w, pool = torch.randn(dim, K, device="cuda"), torch.randn(3, dim, K - 1, device="cuda")
    slots, layout = torch.tensor([1, 2], device="cuda"), build_window_layout(lens, K, "cuda")
    ref_pool = pool.clone()
    ref, _ = causal_conv1d_varlen_torch(x, w, None, ref_pool, slots, layout, None, "none")
    got, _ = causal_conv1d_varlen_triton(x, w, None, pool, slots, layout, None, "none")
    assert rel(got, ref) < 1e-5 and torch.equal(pool, ref_pool)


@pytest.mark.parametrize("name", ["mamba_a", "lfm2_a", "jamba_moe"])
def test_cuda_engine_with_graphs_matches_transformers(ssm_models, name):
    model_dir, hf = ssm_models(name)
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist()
               for n in (5, 40, 90)]  # fmt: skip
    refs = [hf_greedy(hf, p, 12) for p in prompts]
    llm = LLM(model_dir, device="cuda", page_size=4, chunked_prefill_size=32)
    assert llm.engine.graph_runner is not None and llm.engine.graph_runner.use_cuda_graphs
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params)
    assert llm.engine.graph_runner.graphs, "no decode step ran through a CUDA graph"
    check_against_reference(outs, prompts, refs)
