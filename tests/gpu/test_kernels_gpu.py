"""Triton kernels vs their torch paths on a CUDA device at Nemotron-Nano-9B-v2 shapes.

Run them compiled, not interpreted:

    TRITON_INTERPRET=0 .venv/bin/python -m pytest -m gpu tests/gpu

(tests/conftest.py sets TRITON_INTERPRET=1 unless told otherwise so that the CPU suite can run
the kernels; in that mode these tests skip, since the interpreter would prove nothing about the
GPU build.) Errors are relative Frobenius norms: TF32 tl.dot and bfloat16 rounding give ~1e-3,
a wrong index or mask gives O(1).
"""

from __future__ import annotations

import math

import pytest
import torch

from baton.kernels.attention import build_attention_layout, paged_attention_torch
from baton.kernels.conv1d import (
    build_window_layout,
    causal_conv1d_update_torch,
    causal_conv1d_varlen_torch,
)
from baton.kernels.norm import gated_rms_norm_torch, rms_norm_torch
from baton.kernels.ssd import build_chunk_layout, ssd_scan_torch
from baton.kernels.ssu import selective_state_update_multi, selective_state_update_torch
from baton.kernels.triton.attention import paged_attention_triton
from baton.kernels.triton.conv1d import causal_conv1d_update_triton, causal_conv1d_varlen_triton
from baton.kernels.triton.norm import gated_rms_norm_triton, rms_norm_triton
from baton.kernels.triton.ssd import _chunk_scan_kernel, ssd_scan_triton
from baton.kernels.triton.ssu import (
    selective_state_update_multi_triton,
    selective_state_update_triton,
)
from baton.kernels.triton.state_copy import copy_states_triton


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_chunk_scan_kernel, InterpretedFunction)


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        _interpreted(), reason="Triton interpreter is on: run with TRITON_INTERPRET=0"
    ),
]

# Nemotron-Nano-9B-v2
H, P, G, N, CHUNK = 128, 80, 8, 128, 128
CONV_DIM, K = 12288, 4
Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 40, 8, 128, 16
HIDDEN, INTERMEDIATE = 4480, 128 * 80
DEVICE = "cuda"


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.double() - expected.double()).norm()
    return (diff / expected.double().norm().clamp_min(1e-30)).item()


def mamba_params(gen: torch.Generator):
    """A, D, dt_bias as Mamba2 initialises them (dt in [1e-3, 0.1], A in [-16, -1])."""
    A = -torch.exp(torch.rand(H, generator=gen) * math.log(16))
    dt0 = torch.exp(
        torch.rand(H, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)
    )
    dt_bias = dt0 + torch.log(-torch.expm1(-dt0))
    D = torch.randn(H, generator=gen)
    return A.to(DEVICE), D.to(DEVICE), dt_bias.to(DEVICE)


def activations(T: int, dtype: torch.dtype, gen: torch.Generator):
    x = torch.randn(T, H, P, generator=gen).to(DEVICE, dtype)
    dt = (torch.randn(T, H, generator=gen) * 0.5).to(DEVICE, dtype)
    B = torch.randn(T, G, N, generator=gen).to(DEVICE, dtype)
    C = torch.randn(T, G, N, generator=gen).to(DEVICE, dtype)
    return x, dt, B, C


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ssd_scan_matches_torch_path(dtype):
    gen = torch.Generator().manual_seed(0)
    seq_lens, start_pos = [1000, 37, 3000, 1], [0, 250, 4113, 77]
    x, dt, B, C = activations(sum(seq_lens), dtype, gen)
    A, D, dt_bias = mamba_params(gen)
    init = torch.randn(len(seq_lens), H, P, N, generator=gen).to(DEVICE) * 0.1
    layout = build_chunk_layout(seq_lens, start_pos, CHUNK, DEVICE)
    out = ssd_scan_triton(x, dt, A, B, C, D, dt_bias, init, layout)
    ref = ssd_scan_torch(x, dt, A, B, C, D, dt_bias, init, layout)
    assert rel_err(out.y, ref.y) < 1e-2
    assert rel_err(out.final_states, ref.final_states) < 1e-2
    assert rel_err(out.chunk_states, ref.chunk_states) < 1e-2
    limited = ssd_scan_triton(x, dt, A, B, C, D, dt_bias, init, layout, dt_limit=(0.0, 0.01))
    ref = ssd_scan_torch(x, dt, A, B, C, D, dt_bias, init, layout, dt_limit=(0.0, 0.01))
    assert rel_err(limited.y, ref.y) < 1e-2


@pytest.mark.parametrize("batch", [1, 13, 256])
def test_selective_state_update_matches_torch_path(batch):
    gen = torch.Generator().manual_seed(1)
    x, dt, B, C = activations(batch, torch.bfloat16, gen)
    A, D, dt_bias = mamba_params(gen)
    pool = torch.randn(batch + 3, H, P, N, generator=gen).to(DEVICE)
    slots = torch.randperm(batch + 2, generator=gen)[:batch].to(DEVICE) + 1
    slots[batch // 2] = 0  # one padded row on the dummy slot
    ref_pool = pool.clone()
    y = selective_state_update_triton(pool, x, dt, A, B, C, D, dt_bias, slots)
    y_ref = selective_state_update_torch(ref_pool, x, dt, A, B, C, D, dt_bias, slots)
    live = slots[slots != 0]
    assert rel_err(y[slots != 0], y_ref[slots != 0]) < 1e-2
    assert rel_err(pool[live], ref_pool[live]) < 1e-4
    untouched = torch.ones(batch + 3, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(pool[untouched], ref_pool[untouched])


def test_selective_state_update_multi_matches_torch_path(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    batch, k = 8, 4
    x, dt, B, C = (
        t.view(batch, k, *t.shape[1:]) for t in activations(batch * k, torch.bfloat16, gen)
    )
    A, D, dt_bias = mamba_params(gen)
    pool = torch.randn(batch * (k + 1) + 1, H, P, N, generator=gen).to(DEVICE)
    slots = (torch.arange(batch * (k + 1), device=DEVICE) + 1).view(batch, k + 1)
    ref_pool = pool.clone()
    y = selective_state_update_multi_triton(pool, x, dt, A, B, C, D, dt_bias, slots)
    monkeypatch.setenv("BATON_KERNELS", "torch")  # its torch path lives in the public function
    y_ref = selective_state_update_multi(ref_pool, x, dt, A, B, C, D, dt_bias, slots)
    assert rel_err(y, y_ref) < 1e-2
    assert rel_err(pool, ref_pool) < 1e-4


def test_causal_conv1d_matches_torch_path():
    gen = torch.Generator().manual_seed(3)
    seq_lens = [1000, 2, 3000, 1]
    T = sum(seq_lens)
    x = torch.randn(T, CONV_DIM + 16, generator=gen).to(DEVICE, torch.bfloat16)[:, 8:-8]
    weight = (torch.randn(CONV_DIM, K, generator=gen) * 0.5).to(DEVICE, torch.bfloat16)
    bias = torch.randn(CONV_DIM, generator=gen).to(DEVICE, torch.bfloat16)
    pool = torch.randn(9, CONV_DIM, K - 1, generator=gen).to(DEVICE, torch.bfloat16)
    slots = torch.tensor([3, 7, 1, 5], device=DEVICE)
    layout = build_window_layout(seq_lens, K, DEVICE)
    window_tokens = torch.tensor([0, 127, 999, 1000, 1001, 1500, T - 1], device=DEVICE)
    ref_pool = pool.clone()
    y, windows = causal_conv1d_varlen_triton(x, weight, bias, pool, slots, layout, window_tokens)
    y_ref, windows_ref = causal_conv1d_varlen_torch(
        x, weight, bias, ref_pool, slots, layout, window_tokens
    )
    assert rel_err(y, y_ref) < 2e-2
    assert torch.equal(windows, windows_ref) and torch.equal(pool, ref_pool)
    step = torch.randn(6, CONV_DIM, generator=gen).to(DEVICE, torch.bfloat16)
    step_slots = torch.tensor([3, 0, 7, 1, 5, 0], device=DEVICE)
    y = causal_conv1d_update_triton(step, weight, bias, pool, step_slots)
    y_ref = causal_conv1d_update_torch(step, weight, bias, ref_pool, step_slots)
    live = step_slots != 0
    assert rel_err(y[live], y_ref[live]) < 2e-2
    assert torch.equal(pool[1:], ref_pool[1:])


@pytest.mark.parametrize(
    "q_lens,prefix",
    [([1], [4000]), ([1] * 7, [16, 1, 2047, 300, 15, 4095, 64]), ([500, 1, 37], [0, 1000, 63])],
)
def test_paged_attention_matches_torch_path(q_lens, prefix):
    gen = torch.Generator().manual_seed(4)
    kv_lens = [p + q for p, q in zip(prefix, q_lens)]
    num_pages = sum(-(-n // PAGE) for n in kv_lens) + 1
    k_cache = torch.randn(num_pages * PAGE, KV_HEADS, HEAD_DIM, generator=gen)
    v_cache = torch.randn(num_pages * PAGE, KV_HEADS, HEAD_DIM, generator=gen)
    k_cache, v_cache = k_cache.to(DEVICE, torch.bfloat16), v_cache.to(DEVICE, torch.bfloat16)
    pages = torch.randperm(num_pages - 1, generator=gen) + 1  # page 0 is the dummy
    rows, used = [], 0
    for n in kv_lens:
        need = -(-n // PAGE)
        slots = (pages[used : used + need, None] * PAGE + torch.arange(PAGE)).flatten()[:n]
        used += need
        rows.append(torch.cat([slots, torch.zeros(max(kv_lens) - n, dtype=torch.int64)]))
    layout = build_attention_layout(q_lens, kv_lens, torch.stack(rows), DEVICE)
    q = torch.randn(sum(q_lens), Q_HEADS, HEAD_DIM, generator=gen).to(DEVICE, torch.bfloat16)
    out = paged_attention_triton(q, k_cache, v_cache, layout, HEAD_DIM**-0.5)
    ref = paged_attention_torch(q, k_cache, v_cache, layout, HEAD_DIM**-0.5)
    assert rel_err(out, ref) < 2e-2


def test_norms_match_torch_path():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(300, HIDDEN, generator=gen).to(DEVICE, torch.bfloat16)
    w = torch.randn(HIDDEN, generator=gen).to(DEVICE, torch.bfloat16)
    assert rel_err(rms_norm_triton(x, w, 1e-5), rms_norm_torch(x, w, 1e-5)) < 1e-2
    yz = torch.randn(300, 2 * INTERMEDIATE, generator=gen).to(DEVICE, torch.bfloat16)
    y, z = yz[:, :INTERMEDIATE], yz[:, INTERMEDIATE:]
    w = torch.randn(INTERMEDIATE, generator=gen).to(DEVICE, torch.bfloat16)
    group = INTERMEDIATE // G
    out = gated_rms_norm_triton(y, z, w, 1e-5, group)
    assert rel_err(out, gated_rms_norm_torch(y, z, w, 1e-5, group)) < 1e-2


def test_copy_states_copies_exactly():
    gen = torch.Generator().manual_seed(6)
    pool = torch.randn(6, H, P, N, generator=gen).to(DEVICE)
    chunk_states = torch.randn(2, 3, H, P, N, generator=gen).to(DEVICE)
    before = pool.clone()
    copy_states_triton(
        pool,
        torch.tensor([4, 2], device=DEVICE),
        chunk_states.flatten(0, 1),
        torch.tensor([5, 1], device=DEVICE),
    )
    assert torch.equal(pool[4], chunk_states[1, 2]) and torch.equal(pool[2], chunk_states[0, 1])
    assert torch.equal(pool[[0, 1, 3, 5]], before[[0, 1, 3, 5]])
