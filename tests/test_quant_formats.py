"""The formats and the CPU kernels: the test quantizer (tests/quantize.py) checked against
independent code (compressed-tensors' NVFP4 packing and unpacking, transformers' fine-grained FP8
dequantization; nvidia-modelopt's quantizers in the slow test), baton's per-row form against the
formats' definitions, and the weight-only C kernels (linear and routed experts) against
x @ dequantized(W).T."""

from __future__ import annotations

import pytest
import torch

from engine.quantization.config import LayerScheme
from engine.quantization.schemes import quantized_tensor
from kernels import cpu_moe, cpu_quant
from kernels.layouts import Routing
from kernels.moe import fused_moe_torch, pack_experts
from kernels.quant import QuantizedTensor, concat_rows, dequantize
from tests.quantize import E2M1_VALUES, dequantized, fp8_block, fp8_tensor, nvfp4

needs_kernel = pytest.mark.skipif(not cpu_quant.supported(), reason="no AVX-512 C kernel here")
SCHEMES = {
    "FP8": LayerScheme(algo="FP8", block=None, key="quant_algo"),
    "FP8_BLOCK": LayerScheme(algo="FP8_BLOCK", block=(32, 48), key="weight_block_size"),
    "NVFP4": LayerScheme(algo="NVFP4", block=None, key="quant_algo"),
}


def stored(algo: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    if algo == "NVFP4":
        return nvfp4(w)
    if algo == "FP8_BLOCK":
        return fp8_block(w, SCHEMES[algo].block)
    return fp8_tensor(w)


def test_nvfp4_packing_and_ties_match_compressed_tensors():
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4

    torch.manual_seed(0)
    w = torch.randn(32, 64)
    w *= 5.25 / w.abs().amax()  # weight_scale_2 = 5.25 / (6 * 448) = 2^-9 exactly
    # A row whose groups have amax 3 (block scale 3 / (6 * 2^-9) = 256, exact), so that each
    # value x is quantized as 2x, exactly: every rounding boundary, whose ties must go to the
    # even mantissa as ModelOpt's cast rounds them.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -3.5, 6.0]
    w[0] = torch.tensor(ties + [0.0] * 5).repeat(4) / 2
    q = nvfp4(w)
    assert float(q["weight_scale_2"]) == 2**-9
    theirs = quantize_and_pack_fp4(
        w, q["weight_scale"].float(), 1 / q["weight_scale_2"], group_size=16
    )
    assert torch.equal(theirs, q["weight"])
    rounded = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, -4.0, 6.0]
    assert (dequantized(q, None)[0, :11] * 2).tolist() == rounded


def test_nvfp4_nibble_order_matches_compressed_tensors_unpack():
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    packed = torch.arange(256, dtype=torch.uint8).view(16, 16)
    theirs = unpack_fp4_from_uint8(packed, 16, 32, dtype=torch.float32)
    ours = QuantizedTensor(
        "nvfp4", packed, torch.ones(16, 2).to(torch.float8_e4m3fn), torch.ones(16), 16
    )
    assert torch.equal(dequantize(ours), theirs)
    assert float(theirs[0, 2]) == E2M1_VALUES[1]  # byte 1: the even input in the low nibble


@pytest.mark.parametrize("shape", [(96, 128), (3, 64, 96)])
def test_fp8_block_dequantization_matches_transformers(shape):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    torch.manual_seed(1)
    q = fp8_block(torch.randn(shape), (32, 32))
    theirs = Fp8Dequantize(None)._dequantize_one(q["weight"], q["weight_scale_inv"], torch.float32)
    assert torch.equal(theirs, dequantized(q, (32, 32)))


def test_fp8_partial_edge_blocks_match_transformers_block_dequantization():
    """Edge blocks cut short (200 rows, 72 inputs in 128 x 128 blocks): scale shape is the
    ceiling division, and each edge scale covers what is left."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    torch.manual_seed(2)
    q = fp8_block(torch.randn(200, 200), (128, 128))
    assert q["weight_scale_inv"].shape == (2, 2)
    theirs = _dequantize_fp8_weight(q["weight"], q["weight_scale_inv"], [128, 128], torch.float32)
    assert torch.equal(theirs, dequantized(q, (128, 128)))


@pytest.mark.parametrize("algo", list(SCHEMES))
@pytest.mark.parametrize("lead", [(), (3,)])
def test_per_row_form_has_the_formats_values(algo, lead):
    torch.manual_seed(3)
    w = torch.randn(*lead, 40, 96)
    tensors = stored(algo, w)
    q = quantized_tensor(SCHEMES[algo], tensors, (40, 96))
    assert q.shape == (*lead, 40, 96)
    assert torch.equal(dequantize(q), dequantized(tensors, SCHEMES[algo].block))


def test_fused_parts_keep_each_parts_scale():
    torch.manual_seed(4)
    parts = [torch.randn(n, 64) * s for n, s in ((32, 1.0), (16, 30.0), (16, 0.01))]
    qs = [quantized_tensor(SCHEMES["FP8"], fp8_tensor(p), tuple(p.shape)) for p in parts]
    fused = concat_rows(qs)
    assert torch.equal(dequantize(fused), torch.cat([dequantize(q) for q in qs]))


def random_codes(algo: str, n: int, k: int, lead=()) -> QuantizedTensor:
    """Every code (but e4m3's NaN) and odd scales, subnormal e4m3 codes included."""
    g = torch.Generator().manual_seed(n * k)
    if algo == "NVFP4":
        data = torch.randint(0, 256, (*lead, n, k // 2), generator=g, dtype=torch.uint8)
        scale = torch.randint(0, 0x7F, (*lead, n, k // 16), generator=g, dtype=torch.uint8)
        return QuantizedTensor(
            "nvfp4", data, scale.view(torch.float8_e4m3fn), torch.rand(*lead, n, generator=g), 16
        )
    codes = torch.randint(0, 256, (*lead, n, k), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    group = 48 if algo == "FP8_BLOCK" else k
    scale = torch.rand(*lead, n, -(-k // group), generator=g) * 0.01
    return QuantizedTensor("fp8", codes.view(torch.float8_e4m3fn), scale, None, group)


@needs_kernel
@pytest.mark.parametrize("algo", list(SCHEMES))
@pytest.mark.parametrize("rows", [1, 7, 19])
def test_cpu_linear_matches_dequantized_weights(algo, rows):
    q = random_codes(algo, 37, 160)
    bias = torch.randn(37)
    x = torch.randn(rows, 160)
    ref = x.double() @ dequantize(q).double().T + bias.double()
    y = cpu_quant.linear(x, cpu_quant.pack(q), bias)
    assert y.dtype == torch.float32
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    relu = cpu_quant.linear(x.bfloat16(), cpu_quant.pack(q), bias, relu=True)
    expected = torch.relu(x.bfloat16().double() @ dequantize(q).double().T + bias.double())
    assert relu.dtype == torch.bfloat16
    assert torch.allclose(relu.double(), expected, rtol=1e-2, atol=1e-2 * float(expected.max()))


@needs_kernel
def test_cpu_linear_keeps_e4m3_subnormals_when_denormals_are_flushed():
    q = QuantizedTensor(
        "fp8",
        torch.tensor([[1, 7, 0x81, 0x08, 0]], dtype=torch.uint8).view(torch.float8_e4m3fn),
        torch.ones(1, 1),
        None,
        5,
    )
    previous = torch.set_flush_denormal(True)
    try:
        y = cpu_quant.linear(torch.ones(1, 5), cpu_quant.pack(q))
    finally:
        torch.set_flush_denormal(False)
    assert previous  # the flag took, so the kernel really ran with DAZ/FTZ set
    assert float(y) == pytest.approx(2**-9 * (1 + 7 - 1) + 2**-6, rel=1e-6)


@needs_kernel
@pytest.mark.parametrize("algo", list(SCHEMES))
@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
def test_cpu_routed_experts_match_the_torch_path(algo, activation):
    E, D, inter = 6, 64, 48
    up = random_codes(algo, 2 * inter if activation == "swiglu" else inter, D, (E,))
    down = random_codes(algo, D, inter, (E,))
    packed = pack_experts(up, down, activation)
    assert isinstance(packed, cpu_moe.QuantPanelExperts)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, D, generator=g) * 0.1
    routing = Routing(torch.rand(9, 2, generator=g), torch.randint(0, E, (9, 2), generator=g))
    ours = fused_moe_torch(x, up, down, routing, activation, packed)
    ref = fused_moe_torch(x.double(), up, down, routing, activation).float()
    assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


@pytest.mark.slow  # importing nvidia-modelopt costs several seconds of CPU
def test_quantizers_match_nvidia_modelopt():
    """NVIDIA's own quantizers write the same bytes and scales: NVFP4 (packing, e2m1 rounding,
    e4m3 block scales, weight_scale_2), FP8 per tensor, and FP8 in 128 x 128 blocks with
    partial edges (ModelOpt pads them)."""
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
    torch.manual_seed(6)
    w = torch.randn(48, 64)
    data, scale, scale_2 = qtensor.NVFP4QTensor.quantize(w.clone(), 16)
    ours = nvfp4(w)
    assert torch.equal(data._quantized_data, ours["weight"])
    assert torch.equal(scale.view(torch.uint8), ours["weight_scale"].view(torch.uint8))
    assert torch.equal(scale_2.reshape(()), ours["weight_scale_2"])
    data, scale = qtensor.FP8QTensor.quantize(w.clone())
    ours = fp8_tensor(w)
    assert torch.equal(data._quantized_data.view(torch.uint8), ours["weight"].view(torch.uint8))
    assert torch.equal(scale.reshape(()), ours["weight_scale"])
    w = torch.randn(200, 200)
    data, scale = qtensor.FP8QTensor.quantize(w.clone(), block_sizes={-1: 128, -2: 128})
    ours = fp8_block(w, (128, 128))
    assert torch.equal(scale.reshape(2, 2), ours["weight_scale_inv"])
    codes = data._quantized_data.view(torch.uint8)[:200, :200]
    assert torch.equal(codes, ours["weight"].view(torch.uint8))
