"""The fused C Mamba decode step (kernels/cpu/ops.c) for every family's gate: "norm_then_gate"
(Falcon-H1's norm(y) * silu(z)) and "none" (y * silu(z)) against the composite torch path,
float32 and bfloat16, like the "gated" mode's test in test_kernels_cpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from baton.kernels.cpu import ops as cpu_ops
from baton.kernels.norm import group_rms_norm
from tests.test_kernels_cpu import (
    causal_conv1d_update_torch,
    needs_cc,
    selective_state_update_torch,
)


def composite(zxbcdt, conv, ssm, slots, w, cb, A, D, dt_bias, norm_w, dims, limit, eps, mode):
    H, P, G, N, group = dims
    I = H * P
    z, xbc, dt = zxbcdt.split([I, I + 2 * G * N, H], dim=-1)
    xbc = causal_conv1d_update_torch(xbc, w, cb, conv, slots)
    x, B, C = xbc.split([I, G * N, G * N], dim=-1)
    b = zxbcdt.shape[0]
    y = selective_state_update_torch(
        ssm,
        x.reshape(b, H, P),
        dt,
        A,
        B.reshape(b, G, N),
        C.reshape(b, G, N),
        D,
        dt_bias,
        slots,
        limit,
    ).reshape(b, I)
    if mode == "norm_then_gate":
        return (group_rms_norm(y, norm_w, eps, group) * F.silu(z.float())).to(z.dtype)
    return (y.float() * F.silu(z.float())).to(z.dtype)


@needs_cc
@pytest.mark.parametrize("mode", ["norm_then_gate", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,P,G,N,K,group_div", [(4, 8, 2, 6, 4, 2), (6, 5, 1, 7, 3, 1)])
def test_fused_decode_gate_modes_match_the_torch_path(mode, dtype, H, P, G, N, K, group_div):
    g = torch.Generator().manual_seed(H + K)
    I, batch, num_slots = H * P, 5, 8
    conv_dim = I + 2 * G * N
    zxbcdt = torch.randn(batch, I + conv_dim + H, generator=g).to(dtype)
    conv = torch.randn(num_slots, conv_dim, K - 1, generator=g).to(dtype)
    ssm = torch.randn(num_slots, H, P, N, generator=g)
    w = torch.randn(conv_dim, K, generator=g).to(dtype)
    cb = torch.randn(conv_dim, generator=g).to(dtype)
    A = -torch.rand(H, generator=g) * 3
    D, dt_bias = torch.randn(H, generator=g), torch.randn(H, generator=g)
    norm_w = 1 + 0.1 * torch.randn(I, generator=g)
    slots = torch.tensor([6, 1, 3, 7, 2])
    limit, eps, group = (0.001, 5.0), 1e-5, I // group_div
    params = cpu_ops.MambaDecodeParams(
        conv_weight=w.float(), conv_bias=cb.float(), dt_bias=dt_bias, A=A, D=D, norm_weight=norm_w
    )
    assert cpu_ops.mamba_decode_supported(zxbcdt, conv, ssm)
    conv_f, ssm_f = conv.clone(), ssm.clone()
    dims = (H, P, G, N, group)
    out = cpu_ops.mamba_decode_cpu(
        zxbcdt, conv_f, ssm_f, slots, params, limit, eps,
        num_heads=H, head_dim=P, n_groups=G, d_state=N, norm_group=group, norm_mode=mode,
    )  # fmt: skip
    conv_t, ssm_t = conv.float(), ssm.clone()
    ref = composite(
        zxbcdt.float(), conv_t, ssm_t, slots, w.float(), cb.float(), A, D, dt_bias, norm_w, dims,
        limit, eps, mode,
    )  # fmt: skip
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    torch.testing.assert_close(out.float(), ref, **tol)
    # The modes differ from each other and from the gated norm (the mode is really read).
    gated = cpu_ops.mamba_decode_cpu(
        zxbcdt, conv.clone(), ssm.clone(), slots, params, limit, eps,
        num_heads=H, head_dim=P, n_groups=G, d_state=N, norm_group=group, norm_mode="gated",
    )  # fmt: skip
    assert (gated.float() - out.float()).abs().max() > 0.05
