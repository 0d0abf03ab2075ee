"""The Triton quantized kernels in the interpreter (conftest sets TRITON_INTERPRET=1): weight-only
FP8 / NVFP4 linears and routed experts against the dequantized weights, the w8a8 GEMM against its
torch definition on codes quantized by torch, and the dynamic row quantizer's scales. The
interpreter casts float32 to e4m3 wrongly (a rounding that carries into the exponent halves the
value: 31.3 -> 16), so the row quantizer's codes are checked on a GPU (tests/gpu/test_quant_gpu.py);
every kernel also compiles for sm_90 in tests/gpu/compile_check.py."""

from __future__ import annotations

import pytest
import torch

from baton.kernels.layouts import Routing
from baton.kernels.moe import fused_moe_torch
from baton.kernels.quant import dequantize, quantize_rows_fp8, w8a8_linear_torch
from baton.kernels.triton.moe import fused_moe_triton
from baton.kernels.triton.quant import quantize_rows_fp8_triton, w8a8_matmul, weight_only_matmul
from tests.test_quant_formats import SCHEMES, random_codes


@pytest.mark.parametrize("algo", list(SCHEMES))
def test_weight_only_linear_matches_dequantized_weights(algo):
    q = random_codes(algo, 37, 160)
    x, bias = torch.randn(5, 160), torch.randn(37)
    ref = x.double() @ dequantize(q).double().T + bias.double()
    out = weight_only_matmul(x, q, bias)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("group", [160, 64])  # one scale per row; per 64 inputs
def test_w8a8_gemm_matches_its_torch_definition(group):
    q = random_codes("FP8", 37, 160)._replace(group=group)
    q = q._replace(scale=torch.rand(37, -(-160 // group)) * 0.01)
    x = torch.randn(5, 160)
    codes, row_scale = quantize_rows_fp8(x)
    out = w8a8_matmul(codes, row_scale, q, None, torch.float32)
    ref = w8a8_linear_torch(x, q)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    # and w8a8 stays within FP8 rounding of the activations of the weight-only product
    exact = x @ dequantize(q).T
    assert float((ref - exact).abs().max()) < 0.05 * float(exact.abs().max())


def test_row_quantizer_scales_are_amax_over_448():
    x = torch.randn(6, 200)
    x[3] = 0.0  # a zero row gets scale 1
    _, scale = quantize_rows_fp8_triton(x)
    assert torch.equal(scale, quantize_rows_fp8(x)[1])


@pytest.mark.parametrize(("algo", "activation"), [("FP8_BLOCK", "swiglu"), ("NVFP4", "relu2")])
def test_routed_experts_match_the_torch_path(algo, activation):
    E, D, inter = 4, 64, 32
    up = random_codes(algo, 2 * inter if activation == "swiglu" else inter, D, (E,))
    down = random_codes(algo, D, inter, (E,))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(7, D, generator=g) * 0.1
    routing = Routing(torch.rand(7, 2, generator=g), torch.randint(0, E, (7, 2), generator=g))
    ours = fused_moe_triton(x, up, down, routing, activation)
    ref = fused_moe_torch(x.double(), up, down, routing, activation).float()
    assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
