"""kernels/conv1d.py's `activation`: "none" (LFM2's short conv: no SiLU, and there no bias) on the
torch path and the C kernels (varlen prefill with checkpoint windows, decode step), against the
oracle; "silu" stays what it was."""

from __future__ import annotations

import pytest
import torch

from baton.kernels.conv1d import (
    build_window_layout,
    causal_conv1d_update,
    causal_conv1d_update_torch,
    causal_conv1d_varlen,
    causal_conv1d_varlen_torch,
)
from baton.kernels.cpu import ops as cpu_ops
from baton.kernels.cpu import prefill as cpu_prefill
from tests.oracles import conv_oracle

LENS, DIM, K = [4, 1, 7], 10, 3


def case(dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(LENS), DIM, generator=g).to(dtype)
    weight = torch.randn(DIM, K, generator=g)
    bias = torch.randn(DIM, generator=g)
    pool = torch.randn(5, DIM, K - 1, generator=g).to(dtype)
    slots = torch.tensor([4, 1, 2])
    return x, weight, bias, pool, slots


VARLEN = {"torch": causal_conv1d_varlen_torch, "dispatch": causal_conv1d_varlen}


@pytest.mark.parametrize("path", list(VARLEN))
@pytest.mark.parametrize("activation", ["none", "silu"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_varlen_conv_matches_oracle(path, activation, with_bias):
    if path == "dispatch":  # on the CPU: the C kernel
        if cpu_prefill.library() is None:
            pytest.skip("no C compiler")
    x, weight, bias, pool, slots = case(torch.float32)
    bias = bias if with_bias else None
    init = pool[slots].clone()
    windows_at = torch.tensor([2, 4, 9])  # after tokens of each sequence
    y, windows = VARLEN[path](
        x, weight, bias, pool, slots, build_window_layout(LENS, K, "cpu"), windows_at, activation
    )
    ref, finals, per_token = conv_oracle(x, weight, bias, init, LENS, activation=activation)
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[slots].double(), finals)
    for window, (s, j) in zip(windows, [(0, 2), (1, 0), (2, 4)]):
        torch.testing.assert_close(window.double(), per_token[s][j])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["none", "silu"])
def test_decode_step_c_matches_torch(dtype, activation):
    if cpu_ops.library() is None:
        pytest.skip("no C compiler")
    x, weight, _, pool, slots = case(dtype)
    step = x[:3]
    ref_pool = pool.clone()
    ref = causal_conv1d_update_torch(step, weight, None, ref_pool, slots, activation)
    out = causal_conv1d_update(step, weight, None, pool, slots, activation)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    assert torch.equal(pool, ref_pool)  # the windows are copies, exact in any dtype
    if activation == "none":  # really no SiLU: a negative output survives
        assert (out < 0).any()
