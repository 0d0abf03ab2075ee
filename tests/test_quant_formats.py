"""The formats and the CPU kernels: the test quantizer (tests/quantize.py) checked against
independent code (compressed-tensors' NVFP4 packing and unpacking, transformers' fine-grained FP8
dequantization; nvidia-modelopt's quantizers in the slow test), baton's per-row form against the
formats' definitions, and the weight-only C kernels (linear and routed experts) against
x @ dequantized(W).T."""

from __future__ import annotations

import pytest
import torch

from baton.engine.quantization.config import LayerScheme
from baton.engine.quantization.schemes import quantized_tensor
from baton.kernels.cpu import moe as cpu_moe
from baton.kernels.cpu import quant as cpu_quant
from baton.kernels.layouts import Routing
from baton.kernels.moe import fused_moe_torch, pack_experts
from baton.kernels.quant import QuantizedTensor, concat_rows, dequantize
from tests.quantize import E2M1_VALUES, dequantized, fp8_block, fp8_tensor, nvfp4

needs_kernel = pytest.mark.skipif(
    not cpu_quant.supported(), reason="no AVX-512 or AVX2 + FMA C kernel here"
)
HAS_AMX = cpu_quant.supported() and cpu_quant.amx_from_rows(cpu_quant.AMX_MIN_ROWS)
FP4_DOT_DEFAULT = cpu_quant.fp4_dot()
HAS_FP4_DOT = cpu_quant.fp4_dot(True)  # this build has the VDPBF16PS kernels (AVX512-BF16)
cpu_quant.fp4_dot(FP4_DOT_DEFAULT)
# a bf16 model's paths: the float32 register kernels, NVFP4's VDPBF16PS register kernels (FP8
# keeps the float32 ones there) and AMX tiles (weights decoded into bf16 tiles), each forced at
# every row count where this machine has it
PATHS = [
    "registers",
    pytest.param("dot", marks=pytest.mark.skipif(not HAS_FP4_DOT, reason="no AVX512-BF16 here")),
    pytest.param("amx", marks=pytest.mark.skipif(not HAS_AMX, reason="no AMX here")),
]


@pytest.fixture
def quant_path(request):
    """Run bf16 rows on one path (the param) for the test, the defaults after."""
    cpu_quant.amx_from_rows(1 if request.param == "amx" else 0)
    cpu_quant.fp4_dot(request.param == "dot")
    yield request.param
    cpu_quant.amx_from_rows(cpu_quant.AMX_MIN_ROWS)
    cpu_quant.fp4_dot(FP4_DOT_DEFAULT)


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


def sum_error_bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """How far float32 sums of x @ w.T (+ bias), taken in any order, may be from the float64
    ones: (K + 4) rounding errors (the K products and sums, the scale, the column scale, the
    bias) of 2^-24 each, relative to sum_k |x w| + |bias|; plus the smallest denormal per term
    (products below float32's normal range round absolutely)."""
    k = x.shape[-1]
    magnitude = x.double().abs() @ w.double().abs().T
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    return (k + 4) * (2.0**-24 * magnitude + 2.0**-149)


# The kernels' edges: FP8 K = 160 is not a multiple of FP8_BLOCK's 48-input groups, NVFP4 K = 48
# is a multiple of 16 but not of 32; 5, 29 and 37 columns end in a partial 16-column block (in
# its first or second 8 lanes); 1, 2, 3, 5, 8, 9 and 17 rows leave every row-block remainder of
# both ISAs' register blocks (AVX-512: 8, 4, 2, 1; AVX2: 6, 3, 2, 1).
IN_FEATURES = {"FP8": 160, "FP8_BLOCK": 160, "NVFP4": 48}


@needs_kernel
@pytest.mark.parametrize("algo", list(SCHEMES))
@pytest.mark.parametrize("cols", [5, 29, 37])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17])
def test_cpu_linear_matches_dequantized_weights(algo, cols, rows):
    k = IN_FEATURES[algo]
    q = random_codes(algo, cols, k)
    w = dequantize(q).double()
    g = torch.Generator().manual_seed(rows)
    bias, x = torch.randn(cols, generator=g), torch.randn(rows, k, generator=g)
    y = cpu_quant.linear(x, cpu_quant.pack(q), bias)
    assert y.dtype == torch.float32
    ref = x.double() @ w.T + bias.double()
    assert ((y.double() - ref).abs() <= sum_error_bound(x, w, bias)).all()


@needs_kernel
@pytest.mark.parametrize("algo", list(SCHEMES))
@pytest.mark.parametrize("rows", [1, 2, 3, 9])
@pytest.mark.parametrize("quant_path", PATHS, indirect=True)
def test_cpu_linear_bf16_rows_with_relu_and_bias(algo, rows, quant_path):
    k = IN_FEATURES[algo]
    q = random_codes(algo, 37, k)
    w = dequantize(q).double()
    g = torch.Generator().manual_seed(rows)
    bias, x = torch.randn(37, generator=g), torch.randn(rows, k, generator=g).bfloat16()
    y = cpu_quant.linear(x, cpu_quant.pack(q), bias, relu=True)
    assert y.dtype == torch.bfloat16
    ref = torch.relu(x.double() @ w.T + bias.double())
    assert (ref == 0).any() and (ref > 0).any()  # relu cut some outputs and kept others
    # the float32 result rounded once more, to bfloat16 (half an ulp: up to 2^-8 relative)
    bound = sum_error_bound(x.float(), w, bias) + 2.0**-8 * ref.abs()
    assert ((y.double() - ref).abs() <= bound).all()


@needs_kernel
@pytest.mark.parametrize("algo", ["FP8", "NVFP4"])
@pytest.mark.parametrize("quant_path", PATHS, indirect=True)
def test_cpu_linear_reads_strided_bf16_rows(algo, quant_path):
    """bf16 rows 80 apart (a slice of a wider activation), widened and narrowed in C."""
    q = random_codes(algo, 29, 48)
    w = dequantize(q).double()
    x = torch.randn(3, 80, generator=torch.Generator().manual_seed(9)).bfloat16()[:, 16:64]
    y = cpu_quant.linear(x, cpu_quant.pack(q))
    assert y.dtype == torch.bfloat16
    ref = x.double() @ w.T
    bound = sum_error_bound(x.float(), w, None) + 2.0**-8 * ref.abs()
    assert ((y.double() - ref).abs() <= bound).all()


@needs_kernel
@pytest.mark.skipif(not HAS_AMX, reason="no AMX here")
@pytest.mark.parametrize(
    "algo, k, group",
    [
        ("NVFP4", 80, 16),  # 40 k pairs: the last tile of 16 pairs cut short
        ("FP8", 161, 161),  # one scale per column (per-tensor), an odd K
        ("FP8", 200, 64),  # 4 groups of 2 tiles, the last one cut short
        ("FP8", 130, 32),  # a group per tile, 5 groups
    ],
)
@pytest.mark.parametrize("cols", [5, 37, 67])
@pytest.mark.parametrize("rows", [8, 17, 150])
def test_cpu_linear_bf16_rows_on_amx_tiles(algo, k, group, cols, rows):
    """AMX's edges: a block pair or a lone block (37 and 67 columns: 3 and 5 blocks), one or two
    row tiles of a row pair, 150 rows across two row panels of 128, groups of whole tiles (FP8's
    group sums scaled as they leave the tiles), K past the last whole tile."""
    q = random_codes("NVFP4" if algo == "NVFP4" else "FP8", cols, k)
    if algo == "FP8":
        scale = torch.rand(cols, -(-k // group), generator=torch.Generator().manual_seed(k)) * 0.01
        q = QuantizedTensor("fp8", q.data, scale, None, group)
    w = dequantize(q).double()
    g = torch.Generator().manual_seed(rows)
    bias, x = torch.randn(cols, generator=g), torch.randn(rows, k, generator=g).bfloat16()
    packed = cpu_quant.pack(q)
    assert cpu_quant.amx_from_rows(rows)  # this call's rows run on AMX
    try:
        y = cpu_quant.linear(x, packed, bias, relu=True)
    finally:
        cpu_quant.amx_from_rows(cpu_quant.AMX_MIN_ROWS)
    ref = torch.relu(x.double() @ w.T + bias.double())
    bound = sum_error_bound(x.float(), w, bias) + 2.0**-8 * ref.abs()
    assert ((y.double() - ref).abs() <= bound).all()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_cpu_linear_fp8_scales_past_the_packed_range_go_to_the_column_scale(rows):
    """FP8 scales near float32's top: the packed scales give 2^shift up to `col`, which the
    epilogue multiplies back (with the bias and relu after it)."""
    q = random_codes("FP8_BLOCK", 29, 160)
    q = QuantizedTensor("fp8", q.data, q.scale * 2.0**20, None, q.group)
    packed = cpu_quant.pack(q)
    assert packed.col is not None and float(packed.col[0]) > 1
    w = dequantize(q).double()
    g = torch.Generator().manual_seed(rows)
    bias, x = torch.randn(29, generator=g) * 1e3, torch.randn(rows, 160, generator=g)
    y = cpu_quant.linear(x, packed, bias, relu=True)
    ref = torch.relu(x.double() @ w.T + bias.double())
    assert ((y.double() - ref).abs() <= sum_error_bound(x, w, bias)).all()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("algo", list(SCHEMES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quant_path", PATHS, indirect=True)
def test_cpu_linear_long_rows_stay_within_the_float32_sum_bound(algo, rows, dtype, quant_path):
    """K = 2048 (43 FP8 groups of 48, the last cut short; 128 NVFP4 groups), 67 columns; bf16
    rows take NVFP4's bf16 dot-product kernel where the CPU has AVX512-BF16 (6 rows: its 4- and
    2-row blocks)."""
    q = random_codes(algo, 67, 2048)
    w = dequantize(q).double()
    x = torch.randn(rows, 2048, generator=torch.Generator().manual_seed(7)).to(dtype)
    y = cpu_quant.linear(x, cpu_quant.pack(q))
    ref = x.double() @ w.T
    bound = sum_error_bound(x.float(), w, None)
    if dtype == torch.bfloat16:  # the float32 result rounded once more
        bound = bound + 2.0**-8 * ref.abs()
    assert ((y.double() - ref).abs() <= bound).all()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("algo", ["FP8_BLOCK", "NVFP4"])
def test_cpu_linear_denormal_range_gives_finite_sums(algo, rows):
    """Subnormal e4m3 codes and scales (float32 denormals once decoded) with inputs near and
    below float32's normal range: no NaN or inf, and the float32 sums' bound holds, with
    DAZ/FTZ set by the caller."""
    q = random_codes(algo, 37, 48)
    if algo == "NVFP4":  # every group scale an e4m3 subnormal (codes 1..7: 2^-9 .. 7 * 2^-9)
        scale = (q.scale.view(torch.uint8) % 7 + 1).view(torch.float8_e4m3fn)
        q = QuantizedTensor("nvfp4", q.data, scale, torch.full_like(q.global_scale, 2.0**-10), 16)
    else:  # every code an e4m3 subnormal, with tiny scales
        codes = (q.data.view(torch.uint8) & 0x87).view(torch.float8_e4m3fn)
        q = QuantizedTensor("fp8", codes, q.scale * 1e-30, None, q.group)
    w = dequantize(q).double()
    x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(8)) * 1e-36
    previous = torch.set_flush_denormal(True)
    try:
        y = cpu_quant.linear(x, cpu_quant.pack(q))
    finally:
        torch.set_flush_denormal(False)
    assert previous
    assert torch.isfinite(y).all()
    assert ((y.double() - x.double() @ w.T).abs() <= sum_error_bound(x, w, None)).all()


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
@pytest.mark.parametrize("tokens", [1, 9, 40])
def test_cpu_routed_experts_match_the_torch_path(algo, activation, tokens):
    """1 token: one row per expert; 40 tokens over 6 experts: blocks of 6 rows and remainders.
    D = 80: a partial 64-column panel in the down projection, and an FP8_BLOCK group cut short."""
    E, D, inter = 6, 80, 48
    up = random_codes(algo, 2 * inter if activation == "swiglu" else inter, D, (E,))
    down = random_codes(algo, D, inter, (E,))
    packed = pack_experts(up, down, activation)
    assert isinstance(packed, cpu_moe.QuantPanelExperts)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, D, generator=g) * 0.1
    routing = Routing(
        torch.rand(tokens, 2, generator=g), torch.randint(0, E, (tokens, 2), generator=g)
    )
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
