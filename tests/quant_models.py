"""Tiny random models (NemotronH dense and MoE, Granite-4.0-H MoE, Qwen3.5 dense and MoE as the
published vision checkpoints) quantized by tests/quantize.py into each format, built once per
session: (quantized dir, dequantized float32 dir)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.families import FAMILY_CONFIGS, save_model
from tests.gdn_families import GDN_CONFIGS, QWEN_COMMON, VISION, save_gdn_model
from tests.kimi_models import save_kimi_model
from tests.quantize import quantize_checkpoint
from tests.tiny import save_tiny_model

# Every in_features a multiple of 16 (NVFP4's group), as ModelOpt requires.
_MOE = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    routed_scaling_factor=2.5,
)
GRANITE = FAMILY_CONFIGS["granite_moe"]
# Qwen3.5 with every dimension over 128 a partial 128-block (hidden 144, GDN conv channels and
# the MLP 160) and every input width a multiple of 16 (NVFP4), also per rank at TP=2.
_QWEN_TEXT = dict(
    QWEN_COMMON,
    hidden_size=144,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [1, 1, 0], "mrope_interleaved": True},
)  # fmt: skip
QWEN = {
    "qwen3_5_dense": (
        "Qwen3_5Config",
        "Qwen3_5ForConditionalGeneration",
        dict(
            vision_config=dict(VISION, out_hidden_size=144),
            text_config=dict(
                _QWEN_TEXT,
                num_hidden_layers=4,
                layer_types=["linear_attention"] * 2 + ["full_attention", "linear_attention"],
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=16,
                linear_value_head_dim=24,
                intermediate_size=160,
            ),
        ),
    ),
    "qwen3_5_moe": (
        "Qwen3_5MoeConfig",
        "Qwen3_5MoeForConditionalGeneration",
        dict(
            vision_config=dict(VISION, out_hidden_size=144),
            text_config=dict(
                _QWEN_TEXT,
                num_hidden_layers=3,
                layer_types=["linear_attention", "full_attention", "linear_attention"],
                linear_num_key_heads=1,
                linear_num_value_heads=2,
                linear_key_head_dim=32,
                linear_value_head_dim=48,
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=64,
            ),
        ),
    ),
    # Qwen3-Next (R = 1, heads of 8): in_proj_qkvz's rows are regrouped as they load
    "qwen3_next": GDN_CONFIGS["qwen3_next_mixed"],
}
SOURCES = {
    "nemotron_dense": lambda path: save_tiny_model(path, seed=41),
    "nemotron_moe": lambda path: save_tiny_model(
        path, seed=42, hybrid_override_pattern="MEM*EM-", **_MOE
    ),
    "granite_moe": lambda path: save_model(
        path, GRANITE[0], GRANITE[1], dict(GRANITE[2], intermediate_size=32), seed=43
    ),
    "qwen3_5_dense": lambda path: save_gdn_model(path, QWEN["qwen3_5_dense"], seed=44),
    "qwen3_5_moe": lambda path: save_gdn_model(path, QWEN["qwen3_5_moe"], seed=45),
    "qwen3_next": lambda path: save_gdn_model(path, QWEN["qwen3_next"], seed=46),
    # Kimi Linear and Bailing: KDA + MLA (kv_b_proj quantized with the rest) + grouped MoE
    "kimi_moe": lambda path: save_kimi_model(path, "kimi_moe", seed=47),
    "bailing": lambda path: save_kimi_model(path, "bailing_safe_gate", seed=48),
}
# Nemotron 3 Super's kind of mix: NVFP4 routed experts, FP8 shared experts and some Mamba
# projections, FP8 q/k (v left bf16: the three are then not fused), NVFP4 o_proj and MLP down.
MIXED = {
    "backbone.layers.1.mixer.experts": "NVFP4",
    "backbone.layers.4.mixer.experts": "NVFP4",
    "backbone.layers.1.mixer.shared_experts": "FP8",
    "backbone.layers.0.mixer.in_proj": "FP8",
    "backbone.layers.5.mixer.out_proj": "FP8",
    "backbone.layers.3.mixer.q_proj": "FP8",
    "backbone.layers.3.mixer.k_proj": "FP8",
    "backbone.layers.3.mixer.o_proj": "NVFP4",
    "backbone.layers.6.mixer.up_proj": "FP8",
    "backbone.layers.6.mixer.down_proj": "NVFP4",
}
# What Qwen's and NVIDIA's releases leave in bf16: the GDN's in_proj_a / in_proj_b, the router
# (`mlp.gate`, never quantized here) and the shared expert's gate, the vision tower, the head.
_QWEN_KEEP = (
    "*.linear_attn.in_proj_a",
    "*.linear_attn.in_proj_b",
    "*.mlp.shared_expert_gate",
    "model.visual*",
)
# Qwen/Qwen3.5-*-FP8: 128x128 blocks, BF16 weight_scale_inv, modules_to_not_convert naming
# every module left unquantized.
_QWEN_FP8_BLOCK = dict(exclude=_QWEN_KEEP, scale_dtype=torch.bfloat16, list_every_unquantized=True)
_QWEN_LAYERS = "model.language_model.layers"
# ModelOpt NVFP4 of a Qwen3.5 MoE (ModelOpt's Qwen3.5 recipes): routed and shared experts NVFP4,
# attention and GDN layers in bf16.
_QWEN_NVFP4 = dict(
    exclude=(*_QWEN_KEEP, f"{_QWEN_LAYERS}.*.linear_attn*", f"{_QWEN_LAYERS}.*.self_attn*", "mtp*")
)
# nvidia/Qwen3.6-27B-NVFP4's mix on the dense model: W4A16_NVFP4 MLPs, FP8 attention and GDN
# projections but in_proj_a / in_proj_b (not listed: bf16), the MTP layer excluded.
_QWEN_MIXED = dict(
    exclude=("mtp*", "mtp.layers.0*"),
    mixed={
        **{f"{_QWEN_LAYERS}.{i}.mlp": "W4A16_NVFP4" for i in range(4)},
        **{f"{_QWEN_LAYERS}.2.self_attn.{p}": "FP8" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
        **{f"{_QWEN_LAYERS}.{i}.linear_attn.{p}": "FP8"
           for i in (0, 1, 3) for p in ("in_proj_qkv", "in_proj_z", "out_proj")},
    },
)  # fmt: skip
OPTIONS = {
    ("nemotron_moe", "modelopt_mixed"): dict(mixed=MIXED),
    # an exclude list that misses one: layer 2's in_proj stays bf16 without being listed
    ("nemotron_moe", "modelopt_nvfp4"): dict(
        exclude=("backbone.layers.0.mixer.out_proj",), unlisted=("backbone.layers.2.mixer.in_proj",)
    ),
    ("nemotron_moe", "fp8_block"): dict(block=(128, 128)),  # in_proj: 164 rows, an edge of 36
    ("nemotron_moe", "fp8_block_divisible"): dict(block=(4, 16)),
    ("granite_moe", "fp8_block"): dict(block=(32, 48)),
    ("qwen3_5_dense", "modelopt_fp8"): dict(exclude=_QWEN_KEEP),
    ("qwen3_5_dense", "modelopt_mixed"): _QWEN_MIXED,
    ("qwen3_5_dense", "fp8_block"): _QWEN_FP8_BLOCK,
    ("qwen3_5_dense", "fp8_block_divisible"): dict(_QWEN_FP8_BLOCK, block=(16, 16)),
    ("qwen3_5_moe", "modelopt_fp8"): dict(exclude=_QWEN_KEEP),
    ("qwen3_5_moe", "modelopt_nvfp4"): _QWEN_NVFP4,
    ("qwen3_5_moe", "fp8_block"): _QWEN_FP8_BLOCK,
    ("qwen3_5_moe", "fp8_block_divisible"): dict(_QWEN_FP8_BLOCK, block=(16, 16)),
    # 8-row blocks: each head's q, k, v, z rows (8) regroup whole; 16-input edges of 8 (down)
    ("qwen3_next", "fp8_block"): dict(
        exclude=("*.linear_attn.in_proj_ba", "*.mlp.shared_expert_gate"),
        block=(8, 16),
        list_every_unquantized=True,
    ),
}


@pytest.fixture(scope="session")
def quantized_models(tmp_path_factory):
    """(model, format) -> (quantized dir, dequantized float32 dir)."""
    sources: dict[str, Path] = {}
    built: dict[tuple[str, str], tuple[Path, Path]] = {}

    def get(model: str, fmt: str) -> tuple[Path, Path]:
        if model not in sources:
            sources[model] = tmp_path_factory.mktemp(f"quant-src-{model}")
            SOURCES[model](sources[model])  # with the tiny tokenizer
        if (model, fmt) not in built:
            root = tmp_path_factory.mktemp(f"quant-{model}-{fmt}")
            quantized, reference = root / "quantized", root / "dequantized"
            options = OPTIONS.get((model, fmt), {})
            quantize_checkpoint(
                sources[model], quantized, reference, fmt.removesuffix("_divisible"), **options
            )
            built[model, fmt] = (quantized, reference)
        return built[model, fmt]

    return get
