"""Quantized checkpoints served as they are shipped: baton on each format's checkpoint of a tiny
NemotronH (dense, MoE), Granite-4.0-H (MoE), Kimi Linear and Bailing (MLA's kv_b_proj stored
quantized too: dequantized at load, as SGLang does) against transformers on the dequantized float32
weights (logprobs within 1e-4 with float32 activations, greedy tokens identical), and against
transformers' own fine-grained FP8 loader on the quantized checkpoint itself."""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.quantization.modules import QuantizedLinear, QuantizedWeight
from tests.reference import hf_greedy
from tests.test_engine import check_against_reference

CASES = [
    ("nemotron_dense", "modelopt_fp8"),
    ("nemotron_dense", "modelopt_nvfp4"),
    ("nemotron_moe", "modelopt_mixed"),
    ("nemotron_moe", "modelopt_nvfp4"),
    ("nemotron_moe", "fp8_block"),
    ("granite_moe", "modelopt_fp8"),
    ("granite_moe", "modelopt_nvfp4"),
    ("granite_moe", "fp8_block"),
    ("kimi_moe", "fp8_block"),
    ("kimi_moe", "modelopt_fp8"),
    ("bailing", "fp8_block"),
]
PROMPTS = [[5, 9, 17, 30, 41], list(range(40, 57)), [7] * 3 + list(range(100, 130))]
NEW_TOKENS = 10


def greedy(llm: LLM):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    return llm.generate(PROMPTS, [params] * len(PROMPTS))


def transformers_references(model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize(("model", "fmt"), CASES)
def test_quantized_checkpoint_matches_transformers_on_dequantized_weights(
    quantized_models, model, fmt
):
    quantized, dequantized = quantized_models(model, fmt)
    llm = LLM(quantized, dtype="float32", page_size=4, max_num_batched_tokens=32)
    modules = list(llm.engine.model.modules())
    assert any(isinstance(m, QuantizedLinear) for m in modules)
    if model.endswith("moe"):
        assert any(isinstance(m, QuantizedWeight) and m.quantized is not None for m in modules)
    check_against_reference(greedy(llm), PROMPTS, transformers_references(dequantized))


def test_fine_grained_fp8_matches_transformers_own_fp8_loader(quantized_models):
    """transformers dequantizes a fine-grained FP8 checkpoint itself on the CPU. It takes each
    block's size from the scale grid's shape, which misreads partial edge blocks, so this
    checkpoint's blocks (4 x 16) divide every weight."""
    quantized, _ = quantized_models("nemotron_moe", "fp8_block_divisible")
    llm = LLM(quantized, dtype="float32", page_size=4, max_num_batched_tokens=32)
    check_against_reference(greedy(llm), PROMPTS, transformers_references(quantized))
