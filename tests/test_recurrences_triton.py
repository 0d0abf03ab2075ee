"""The Triton recurrences of KDA, lightning attention and the RG-LRU (kernels/triton/kda.py,
lightning.py, rglru.py), run by the interpreter (TRITON_INTERPRET=1, set in conftest) on CPU
tensors with BATON_KERNELS=triton, against the torch paths (themselves checked against float64 oracles in
test_kimi_kernels.py, test_lightning.py, test_rglru.py): varlen batches resumed mid-chunk, every
chunk-end state including the chunks past a sequence's end, the pool slots left behind, decode
steps with padding rows; each test proves the Triton launcher ran."""

from __future__ import annotations

import pytest
import torch

import baton.kernels.triton.kda as triton_kda
import baton.kernels.triton.lightning as triton_lightning
import baton.kernels.triton.rglru as triton_rglru
from baton.kernels.kda import chunk_kda_torch, kda_decode, kda_decode_torch, kda_prefill
from baton.kernels.lightning import lightning_decode, lightning_prefill_pool
from baton.kernels.rglru import rglru_inputs, rglru_scan_pool, rglru_update
from baton.kernels.ssd import build_chunk_layout
from tests.test_kimi_kernels import kda_inputs
from tests.test_rglru import WIDTH, random_weights

DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3)}
LENS, STARTS, CHUNK = [9, 3, 17], [0, 5, 2], 4  # resumed mid-chunk, shorter than a chunk


@pytest.fixture
def backend(monkeypatch):
    """backend(name, fn, *args): fn run under BATON_KERNELS=name; `calls` records the Triton
    launchers that ran."""
    calls: list[str] = []
    for module in (triton_kda, triton_lightning, triton_rglru):
        for name in [n for n in dir(module) if n.endswith("_triton")]:
            launcher = getattr(module, name)

            def spy(*args, _launcher=launcher, _name=name, **kwargs):
                calls.append(_name)
                return _launcher(*args, **kwargs)

            monkeypatch.setattr(module, name, spy)

    def run(name: str, fn, *args):
        monkeypatch.setenv("BATON_KERNELS", name)
        return fn(*args)

    run.calls = calls
    return run


def kda_prefill_torch(q, k, v, g, beta, pool, slots, layout):
    """kda_prefill's torch path (on the CPU, kda_prefill itself would run the C scan)."""
    out = chunk_kda_torch(q, k, v, g, beta, pool[slots], layout)
    pool[slots] = out.final_states
    return out.o, out.chunk_states


def both(backend, fn, pool: torch.Tensor, args, reference=None):
    """fn(*args(pool copy)) under Triton and `reference` (default: fn) under torch: (torch
    result, torch pool, triton result, triton pool)."""
    torch_pool, triton_pool = pool.clone(), pool.clone()
    want = backend("torch", reference or fn, *args(torch_pool))
    got = backend("triton", fn, *args(triton_pool))
    return want, torch_pool, got, triton_pool


@pytest.mark.parametrize("dtype", DTYPES)
def test_kda_prefill_and_decode_match_torch(backend, dtype):
    H, dk, dv = 2, 8, 40  # dv 40: a full and a partial column block
    q, k, v, g, beta, init = kda_inputs(LENS, H=H, dk=dk, dv=dv, seed=4)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    layout = build_chunk_layout(LENS, STARTS, CHUNK, "cpu")
    pool = torch.randn(len(LENS) + 2, H, dk, dv)
    slots = torch.tensor([3, 1, 4])
    pool[slots] = init
    (o_want, ch_want), pool_want, (o_got, ch_got), pool_got = both(
        backend,
        kda_prefill,
        pool,
        lambda p: (q, k, v, g, beta, p, slots, layout),
        kda_prefill_torch,
    )
    torch.testing.assert_close(o_got.float(), o_want.float(), **TOL[dtype])
    torch.testing.assert_close(ch_got, ch_want, **TOL[torch.float32])
    torch.testing.assert_close(pool_got, pool_want, **TOL[torch.float32])
    rows = torch.tensor([1, 0, 3])  # row 1 is padding on the dummy slot
    step = [t[: len(rows)] for t in (q, k, v, g, beta)]
    want, pool_want, got, pool_got = both(
        backend, kda_decode, pool_got, lambda p: (*step, p, rows), kda_decode_torch
    )
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    assert (got[1] == 0).all()
    torch.testing.assert_close(pool_got, pool_want, **TOL[torch.float32])
    assert backend.calls == ["kda_prefill_triton", "kda_decode_triton"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_lightning_prefill_and_decode_match_torch(backend, dtype):
    gen = torch.Generator().manual_seed(5)
    H, D = 3, 8
    decay = torch.rand(H, generator=gen) * 0.5
    q, k, v = (torch.randn(sum(LENS), H, D, generator=gen).to(dtype) for _ in range(3))
    layout = build_chunk_layout(LENS, STARTS, CHUNK, "cpu")
    pool = torch.randn(5, H, D, D, generator=gen)
    slots = torch.tensor([4, 1, 2])
    want, pool_want, got, pool_got = both(
        backend, lightning_prefill_pool, pool, lambda p: (q, k, v, decay, p, slots, layout)
    )
    torch.testing.assert_close(got.out.float(), want.out.float(), **TOL[dtype])
    torch.testing.assert_close(got.chunk_states, want.chunk_states, **TOL[torch.float32])
    torch.testing.assert_close(got.final_states, want.final_states, **TOL[torch.float32])
    torch.testing.assert_close(pool_got, pool_want, **TOL[torch.float32])
    rows = torch.tensor([2, 4])
    want, pool_want, got, pool_got = both(
        backend, lightning_decode, pool_got, lambda p: (q[:2], k[:2], v[:2], decay, p, rows)
    )
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    torch.testing.assert_close(pool_got, pool_want, **TOL[torch.float32])
    assert backend.calls == ["lightning_prefill_pool_triton", "lightning_decode_triton"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rglru_scan_and_update_match_torch(backend, dtype):
    gen = torch.Generator().manual_seed(6)
    w = random_weights(gen)
    x = torch.randn(sum(LENS), WIDTH, generator=gen)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(STARTS, LENS)])
    a, u = (t.to(dtype) for t in rglru_inputs(x, positions, w))
    layout = build_chunk_layout(LENS, STARTS, CHUNK, "cpu")
    pool = torch.randn(5, WIDTH, generator=gen)
    slots = torch.tensor([4, 1, 2])
    want, pool_want, got, pool_got = both(
        backend, rglru_scan_pool, pool, lambda p: (a, u, p, slots, layout)
    )
    torch.testing.assert_close(got.y.float(), want.y.float(), **TOL[dtype])
    torch.testing.assert_close(got.chunk_states, want.chunk_states, **TOL[torch.float32])
    torch.testing.assert_close(pool_got, pool_want, **TOL[torch.float32])
    rows = torch.tensor([2, 0])
    want, pool_want, got, pool_got = both(
        backend, rglru_update, pool_got, lambda p: (a[:2], u[:2], p, rows)
    )
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    torch.testing.assert_close(pool_got, pool_want, **TOL[torch.float32])
    assert backend.calls == ["rglru_scan_pool_triton", "rglru_update_triton"]
