"""The Mamba1 scan and decode Triton kernels (kernels/triton/selective_scan.py) and the conv
kernels without activation (LFM2's short conv), run by the interpreter (TRITON_INTERPRET=1,
set in conftest) on CPU tensors with BATON_KERNELS=triton, against the torch paths and the
oracles, in float32 and float16, on varlen batches resumed mid-chunk; each test proves the
Triton launcher ran."""

from __future__ import annotations

import pytest
import torch

import baton.kernels.triton.conv1d as triton_conv1d
import baton.kernels.triton.selective_scan as triton_scan
from baton.kernels.conv1d import build_window_layout, causal_conv1d_update, causal_conv1d_varlen
from baton.kernels.selective_scan import (
    selective_scan_pool,
    selective_scan_torch,
    selective_state_update,
    selective_state_update_torch,
)
from baton.kernels.ssd import build_chunk_layout
from tests.oracles import conv_oracle
from tests.test_selective_scan import inputs, scan_args

DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


@pytest.fixture
def launched(monkeypatch) -> list[str]:
    """Force the Triton backend; record every launcher call."""
    monkeypatch.setenv("BATON_KERNELS", "triton")
    calls: list[str] = []
    for module, names in (
        (triton_scan, ["selective_scan_pool_triton", "selective_state_update_triton"]),
        (triton_conv1d, ["causal_conv1d_varlen_triton", "causal_conv1d_update_triton"]),
    ):
        for name in names:
            launcher = getattr(module, name)

            def spy(*args, _launcher=launcher, _name=name, **kwargs):
                calls.append(_name)
                return _launcher(*args, **kwargs)

            monkeypatch.setattr(module, name, spy)
    return calls


def cast(t: dict, dtype: torch.dtype) -> dict:
    """The activations in the serving dtype (A and the states stay float32, as in the model)."""
    return {
        k: v.to(dtype) if v is not None and k in ("x", "dt", "B", "C", "z") else v
        for k, v in t.items()
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate", [True, False], ids=["gated", "ungated"])
def test_varlen_scan_matches_torch_with_chunk_end_states(launched, dtype, gate):
    lens, starts, chunk = [5, 11, 1], [0, 6, 13], 4  # resumed mid-chunk; a one-token prefill
    t = cast(inputs(lens, width=20, d_state=5, gate=gate), dtype)
    pool = torch.randn(5, 20, 5)
    slots = torch.tensor([4, 1, 3])
    pool[slots] = t["init"]
    layout = build_chunk_layout(lens, starts, chunk, "cpu")
    ref = selective_scan_torch(*scan_args(t), t["init"], layout)
    before = pool.clone()
    y, chunks = selective_scan_pool(*scan_args(t), pool, slots, layout, want_chunk_states=True)
    assert launched == ["selective_scan_pool_triton"]
    tol = TOL[dtype]
    torch.testing.assert_close(y.float(), ref.y.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(chunks, ref.chunk_states, atol=tol, rtol=tol)
    torch.testing.assert_close(pool[slots], ref.final_states, atol=tol, rtol=tol)
    for other in (0, 2):
        assert torch.equal(pool[other], before[other])


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_update_matches_torch_and_padding_touches_only_slot_zero(launched, dtype):
    t = cast(inputs([4], width=20, d_state=5), dtype)
    pool = torch.randn(6, 20, 5)
    slots = torch.tensor([3, 0, 5, 0])
    ref_pool = pool.clone()
    ref = selective_state_update_torch(ref_pool, *scan_args(t), slots)
    y = selective_state_update(pool, *scan_args(t), slots)
    assert launched == ["selective_state_update_triton"]
    tol = TOL[dtype]
    live = torch.tensor([0, 2])
    torch.testing.assert_close(y[live].float(), ref[live].float(), atol=tol, rtol=tol)
    torch.testing.assert_close(pool[1:], ref_pool[1:], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_without_activation_matches_oracle(launched, dtype):
    """LFM2's short conv: no SiLU, no bias; varlen prefill with windows, then a decode step."""
    lens, dim, K = [3, 6], 12, 3
    g = torch.Generator().manual_seed(5)
    x = torch.randn(sum(lens), dim, generator=g).to(dtype)
    weight = torch.randn(dim, K, generator=g)
    pool = torch.randn(4, dim, K - 1, generator=g).to(dtype)
    slots = torch.tensor([2, 3])
    init = pool[slots].clone()
    layout = build_window_layout(lens, K, "cpu")
    y, windows = causal_conv1d_varlen(
        x, weight, None, pool, slots, layout, torch.tensor([1, 7]), activation="none"
    )
    ref, finals, per_token = conv_oracle(x, weight, None, init, lens, activation="none")
    tol = TOL[dtype]
    torch.testing.assert_close(y.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(pool[slots].double(), finals, atol=tol, rtol=tol)
    torch.testing.assert_close(windows[0].double(), per_token[0][1], atol=tol, rtol=tol)
    torch.testing.assert_close(windows[1].double(), per_token[1][4], atol=tol, rtol=tol)
    step = torch.randn(2, dim, generator=g).to(dtype)
    window = torch.cat([pool[slots].double(), step.double()[:, :, None]], dim=2)
    out = causal_conv1d_update(step, weight, None, pool, slots, activation="none")
    torch.testing.assert_close(out.double(), (window * weight.double()).sum(-1), atol=tol, rtol=tol)
    assert launched == ["causal_conv1d_varlen_triton", "causal_conv1d_update_triton"]
