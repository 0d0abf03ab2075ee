"""Tiny random models (NemotronH dense and MoE, Granite-4.0-H MoE) quantized by tests/quantize.py
into each format, built once per session: (quantized dir, dequantized float32 dir)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.families import FAMILY_CONFIGS, save_model
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
SOURCES = {
    "nemotron_dense": lambda path: save_tiny_model(path, seed=41),
    "nemotron_moe": lambda path: save_tiny_model(
        path, seed=42, hybrid_override_pattern="MEM*EM-", **_MOE
    ),
    "granite_moe": lambda path: save_model(
        path, GRANITE[0], GRANITE[1], dict(GRANITE[2], intermediate_size=32), seed=43
    ),
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
OPTIONS = {
    ("nemotron_moe", "modelopt_mixed"): dict(mixed=MIXED),
    # an exclude list that misses one: layer 2's in_proj stays bf16 without being listed
    ("nemotron_moe", "modelopt_nvfp4"): dict(
        exclude=("backbone.layers.0.mixer.out_proj",), unlisted=("backbone.layers.2.mixer.in_proj",)
    ),
    ("nemotron_moe", "fp8_block"): dict(block=(128, 128)),  # in_proj: 164 rows, an edge of 36
    ("nemotron_moe", "fp8_block_divisible"): dict(block=(4, 16)),
    ("granite_moe", "fp8_block"): dict(block=(32, 48)),
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
