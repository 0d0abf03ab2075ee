"""The Triton recurrences of KDA, lightning attention and the RG-LRU (kernels/triton/kda.py,
lightning.py, rglru.py) compiled on a CUDA device against their torch paths at published widths (Kimi Linear: 32 heads of
128, MiniMax-Text-01: 64 heads of 128, RecurrentGemma-2B: an LRU width of 2560), and the whole
engine on CUDA (compiled kernels, CUDA-graph decode) for Kimi Linear, Bailing, MiniMax and
RecurrentGemma against transformers on the CPU.

    TRITON_INTERPRET=0 .venv/bin/python -m pytest -m gpu tests/gpu/test_recurrences_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from baton.kernels.kda import chunk_kda_torch, kda_decode_torch, kda_gate
from baton.kernels.lightning import lightning_prefill
from baton.kernels.rglru import rglru_scan
from baton.kernels.ssd import build_chunk_layout
from baton.kernels.triton.kda import _kda_scan_kernel, kda_decode_triton, kda_prefill_triton
from baton.kernels.triton.lightning import lightning_decode_triton, lightning_prefill_pool_triton
from baton.kernels.triton.rglru import rglru_scan_pool_triton, rglru_update_triton
from tests.reference import hf_greedy
from tests.test_engine import check_against_reference


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_kda_scan_kernel, InterpretedFunction)


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(_interpreted(), reason="run with TRITON_INTERPRET=0"),
]

LENS, STARTS, CHUNK = [300, 1, 77], [0, 64, 130], 64


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def rand(*shape, scale=1.0):
    return torch.randn(*shape, device="cuda") * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_matches_torch_on_the_gpu(dtype):
    H, d, T, S = 32, 128, sum(LENS), len(LENS)
    q, k, v = (rand(T, H, d).to(dtype) for _ in range(3))
    g = kda_gate(rand(T, H * d), rand(H).abs().log(), rand(H * d, scale=0.5), d)
    beta = torch.sigmoid(rand(T, H))
    layout = build_chunk_layout(LENS, STARTS, CHUNK, "cuda")
    init = rand(S, H, d, d, scale=0.3)
    ref = chunk_kda_torch(q, k, v, g, beta, init, layout)
    pool = torch.zeros(S + 1, H, d, d, device="cuda")
    slots = torch.arange(1, S + 1, device="cuda")
    pool[slots] = init
    o, chunks = kda_prefill_triton(q, k, v, g, beta, pool, slots, layout)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert rel(o, ref.o) < tol and rel(chunks, ref.chunk_states) < 1e-4
    assert rel(pool[slots], ref.final_states) < 1e-4
    ref_pool, rows = pool.clone(), torch.tensor([2, 0, 1], device="cuda")
    step = [t[:3] for t in (q, k, v, g, beta)]
    want = kda_decode_torch(*step, ref_pool, rows)
    got = kda_decode_triton(*step, pool, rows)
    assert rel(got, want) < tol and rel(pool, ref_pool) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lightning_matches_torch_on_the_gpu(dtype):
    H, d, T, S = 64, 128, sum(LENS), len(LENS)
    q, k, v = (rand(T, H, d, scale=0.3).to(dtype) for _ in range(3))
    decay = torch.rand(H, device="cuda") * 0.5
    layout = build_chunk_layout(LENS, STARTS, CHUNK, "cuda")
    init = rand(S, H, d, d, scale=0.3)
    ref = lightning_prefill(q, k, v, decay, init, layout)
    pool = torch.zeros(S + 1, H, d, d, device="cuda")
    slots = torch.arange(1, S + 1, device="cuda")
    pool[slots] = init
    o, chunks = lightning_prefill_pool_triton(q, k, v, decay, pool, slots, layout)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert rel(o, ref.out) < tol and rel(chunks, ref.chunk_states) < 1e-4
    assert rel(pool[slots], ref.final_states) < 1e-4
    rows = torch.tensor([2, 1], device="cuda")
    state = pool[rows].clone()
    got = lightning_decode_triton(q[:2], k[:2], v[:2], decay, pool, rows)
    state = torch.exp(-decay)[None, :, None, None] * state + (
        k[:2].float()[..., :, None] * v[:2].float()[..., None, :]
    )
    want = (q[:2].float()[..., None, :] @ state).squeeze(-2)
    assert rel(got, want) < tol and rel(pool[rows], state) < 1e-5


def test_rglru_matches_torch_on_the_gpu():
    width, T, S = 2560, sum(LENS), len(LENS)
    a, u = torch.rand(T, width, device="cuda"), rand(T, width)
    layout = build_chunk_layout(LENS, STARTS, CHUNK, "cuda")
    init = rand(S, width)
    ref = rglru_scan(a, u, init, layout)
    pool = torch.zeros(S + 1, width, device="cuda")
    slots = torch.arange(1, S + 1, device="cuda")
    pool[slots] = init
    y, chunks = rglru_scan_pool_triton(a, u, pool, slots, layout)
    assert rel(y, ref.y) < 1e-5 and rel(chunks, ref.chunk_states) < 1e-5
    rows = torch.tensor([3, 1], device="cuda")
    want = a[:2] * pool[rows] + u[:2]
    got = rglru_update_triton(a[:2], u[:2], pool, rows)
    assert rel(got, want) < 1e-5 and rel(pool[rows], want) < 1e-6


@pytest.mark.parametrize(
    "fixture,name",
    [
        ("kimi_models", "kimi_moe"),
        ("kimi_models", "bailing_safe_gate"),
        ("kimi_models", "minimax_one_in_four"),
        ("window_models", "rgemma_local"),
    ],
)
def test_cuda_engine_with_graphs_matches_transformers(request, fixture, name):
    model_dir, hf = request.getfixturevalue(fixture)(name)
    g = torch.Generator().manual_seed(17)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist()
               for n in (5, 40, 90)]  # fmt: skip
    refs = [hf_greedy(hf, p, 12) for p in prompts]
    llm = LLM(model_dir, device="cuda", page_size=4, chunked_prefill_size=32)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params)
    check_against_reference(outs, prompts, refs)
