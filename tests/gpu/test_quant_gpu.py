"""Quantized linears and experts on a GPU: the row quantizer's e4m3 codes (which the Triton
interpreter cannot check), w8a8 and weight-only against torch, and a quantized checkpoint served
on CUDA against the CPU engine on the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from baton.kernels.quant import dequantize, quant_linear, quantize_rows_fp8, w8a8_linear_torch
from tests.test_quant_formats import random_codes

pytestmark = pytest.mark.gpu
cuda = torch.device("cuda")


def on_gpu(q):
    return q._replace(
        data=q.data.to(cuda),
        scale=q.scale.to(cuda),
        global_scale=None if q.global_scale is None else q.global_scale.to(cuda),
    )


def test_row_quantizer_codes_equal_torch_on_gpu():
    from baton.kernels.triton.quant import quantize_rows_fp8_triton

    x = (torch.randn(33, 300) * 40).to(cuda)
    codes, scale = quantize_rows_fp8_triton(x)
    ref_codes, ref_scale = quantize_rows_fp8(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))


@pytest.mark.parametrize("algo", ["FP8", "FP8_BLOCK", "NVFP4"])
@pytest.mark.parametrize("activations", ["dynamic", "none"])
def test_quantized_linear_on_gpu(monkeypatch, algo, activations):
    monkeypatch.setenv("BATON_FP8_ACTIVATIONS", activations)
    q = random_codes(algo, 96, 256)
    if algo == "FP8_BLOCK":
        q = q._replace(group=64, scale=torch.rand(96, 4) * 0.01)
    x = torch.randn(17, 256)
    out = quant_linear(x.to(cuda).bfloat16(), on_gpu(q)).float().cpu()
    if algo != "NVFP4" and activations == "dynamic":
        ref = w8a8_linear_torch(x.bfloat16(), q).float()
    else:
        ref = x.bfloat16().float() @ dequantize(q).bfloat16().float().T
    assert torch.allclose(out, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


def test_quantized_checkpoint_on_cuda_matches_the_cpu_engine(quantized_models, monkeypatch):
    """Weight-only on both (w8a8 would quantize the GPU's activations: other numerics)."""
    monkeypatch.setenv("BATON_FP8_ACTIVATIONS", "none")
    quantized, _ = quantized_models("nemotron_moe", "modelopt_mixed")
    prompts = [[5, 9, 17, 30, 41], list(range(40, 57))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    cpu = LLM(quantized, dtype="float32").generate(prompts, params)
    gpu = LLM(quantized, dtype="float32", device="cuda").generate(prompts, params)
    for a, b in zip(cpu, gpu):
        assert a.token_ids == b.token_ids
