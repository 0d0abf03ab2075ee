"""Qwen3.5 checkpoints quantized as they are shipped (tests/quant_models.py: tiny dense and MoE
models laid out as the published vision checkpoints, weights under `model.language_model.`, the
MoE's experts one tensor per expert and projection): baton on each format's checkpoint against
transformers on the dequantized float32 weights (greedy tokens transformers' by teacher forcing,
their logprobs and every prompt logprob within 1e-4), with what the releases keep in bf16 kept
so; transformers' own fine-grained FP8 loader on the quantized checkpoint as a second reference;
and a quantized checkpoint at TP=2."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

from baton import LLM, SamplingParams
from baton.engine.quantization.modules import QuantizedLinear, QuantizedWeight
from baton.engine.quantization.schemes import WeightError
from baton.kernels.linear import PackedLinear
from tests.quant_models import QWEN
from tests.test_gdn_models import assert_matches_transformers, prompts_for
from tests.test_quant_checkpoints import copy_of, edit_tensors, load

CASES = [
    ("qwen3_5_dense", "modelopt_fp8"),
    ("qwen3_5_dense", "modelopt_mixed"),
    ("qwen3_5_dense", "fp8_block"),
    ("qwen3_5_moe", "modelopt_fp8"),
    ("qwen3_5_moe", "modelopt_nvfp4"),
    ("qwen3_5_moe", "fp8_block"),
    ("qwen3_next", "fp8_block"),
]
ENGINE = dict(dtype="float32", page_size=4, max_num_batched_tokens=32)
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
PROMPTS = prompts_for(288)  # 5, 23 and 70 tokens: under, across and over a GDN chunk


def transformers_model(model: str, model_dir) -> nn.Module:
    import transformers

    model_class = getattr(transformers, QWEN[model][1])
    return model_class.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def assert_generates_as(llm: LLM, hf: nn.Module) -> None:
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, PARAMS), strict=True):
        assert len(out.token_ids) == PARAMS.max_tokens
        assert_matches_transformers(hf, prompt, out)


@pytest.mark.parametrize(("model", "fmt"), CASES)
def test_quantized_checkpoint_matches_transformers_on_dequantized_weights(
    quantized_models, model, fmt
):
    quantized, dequantized = quantized_models(model, fmt)
    llm = LLM(quantized, **ENGINE)
    assert any(isinstance(m, QuantizedLinear) for m in llm.engine.model.modules())
    assert_generates_as(llm, transformers_model(model, dequantized))


def test_the_fp8_release_layout_is_written(quantized_models):
    """The quantizer writes what Qwen/Qwen3.5-35B-A3B-FP8 holds: per-expert FP8 tensors with
    BF16 weight_scale_inv per 128x128 block, modules_to_not_convert naming each module kept."""
    quantized, _ = quantized_models("qwen3_5_moe", "fp8_block")
    config = json.loads((quantized / "config.json").read_text())["quantization_config"]
    layer = "model.language_model.layers.0"
    assert config["weight_block_size"] == [128, 128]
    for kept in ("lm_head", "model.language_model.embed_tokens", f"{layer}.mlp.gate",
                 f"{layer}.mlp.shared_expert_gate", f"{layer}.linear_attn.in_proj_a"):  # fmt: skip
        assert kept in config["modules_to_not_convert"]
    with safe_open(str(quantized / "model.safetensors"), "pt") as f:
        expert = f"{layer}.mlp.experts.7.gate_proj"
        assert f.get_slice(f"{expert}.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice(f"{expert}.weight_scale_inv").get_dtype() == "BF16"
        qkv_scales = f.get_slice(f"{layer}.linear_attn.in_proj_qkv.weight_scale_inv")
        assert qkv_scales.get_shape() == [2, 2]  # of 160 x 144: partial blocks on both axes
        assert f.get_slice(f"{layer}.linear_attn.in_proj_a.weight").get_dtype() == "BF16"


def test_what_the_release_keeps_in_bf16_stays_unquantized(quantized_models):
    """Qwen3.5 FP8 quantizes in_proj_qkv and in_proj_z but not in_proj_b / in_proj_a: the GDN's
    projections pack as two matmuls, [qkv | z] FP8 and [b | a] plain; the experts' gate_proj and
    up_proj parts are one FP8 stack; router, shared expert gate and head stay plain."""
    quantized, _ = quantized_models("qwen3_5_moe", "fp8_block")
    model = LLM(quantized, **ENGINE).engine.model
    gdn, attention = model.model.layers[0].linear_attn, model.model.layers[1].self_attn
    assert [type(p) for p in gdn.in_proj] == [QuantizedLinear, PackedLinear]
    assert gdn.in_proj[0].format == "fp8"
    assert isinstance(attention.qkv_proj, QuantizedLinear)
    moe = model.model.layers[2].mlp
    assert isinstance(moe.experts.up_proj, QuantizedWeight)
    assert moe.experts.up_proj.quantized.shape == (8, 64, 144)  # [gate | up] of each expert
    assert not hasattr(moe.experts, "gate_proj")
    assert isinstance(moe.shared_expert.gate_up, QuantizedLinear)
    assert isinstance(moe.shared_expert_gate, PackedLinear)
    assert isinstance(model.lm_head, PackedLinear)


def test_expert_parts_stored_unlike_each_other_are_refused(quantized_models, tmp_path):
    """One expert's up_proj in bf16 among FP8 parts: a load error naming both tensors."""
    model_dir = copy_of(quantized_models("qwen3_5_moe", "fp8_block")[0], tmp_path / "m")
    up = "model.language_model.layers.2.mlp.experts.3.up_proj"

    def unquantize(tensors):
        del tensors[f"{up}.weight_scale_inv"]
        tensors[f"{up}.weight"] = tensors[f"{up}.weight"].to(torch.bfloat16)

    edit_tensors(model_dir, unquantize)
    with pytest.raises(
        WeightError,
        match=r"layers\.2\.mlp\.experts\.0\.gate_proj\.weight is quantized but "
        r"model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight is not",
    ):
        load(model_dir)


@pytest.mark.parametrize("model", ["qwen3_5_dense", "qwen3_5_moe"])
def test_fine_grained_fp8_matches_transformers_own_fp8_loader(quantized_models, model):
    """transformers dequantizes the FP8 checkpoint itself (16 x 16 blocks: its loader takes a
    block's size from the scale grid, which misreads partial edge blocks)."""
    quantized, _ = quantized_models(model, "fp8_block_divisible")
    assert_generates_as(LLM(quantized, **ENGINE), transformers_model(model, quantized))


@pytest.mark.parametrize(
    ("model", "fmt"), [("qwen3_5_dense", "modelopt_mixed"), ("qwen3_5_moe", "modelopt_nvfp4")]
)
def test_tensor_parallel_ranks_load_their_slices_of_a_quantized_checkpoint(
    quantized_models, model, fmt
):
    """At TP=2 each rank reads its rows / inputs of every quantized weight and its scales:
    nvidia's dense mix (NVFP4 MLPs in groups of 16 whole, FP8 GDN and attention projections with
    per-tensor scales on both ranks), and NVFP4 experts whose gate_proj and up_proj parts are each
    sliced on their own rows."""
    quantized, dequantized = quantized_models(model, fmt)
    llm = LLM(quantized, tensor_parallel_size=2, **ENGINE)
    try:
        assert_generates_as(llm, transformers_model(model, dequantized))
    finally:
        llm.close()
