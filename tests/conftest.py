"""Test setup. TRITON_INTERPRET must be set before any module defining Triton kernels is imported,
so it is set here, at the top of the first file pytest imports."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.families import family_models  # noqa: E402, F401 (session fixture, every family)
from tests.gdn_families import gdn_models  # noqa: E402, F401 (session fixture, GDN families)
from tests.kimi_models import kimi_models  # noqa: E402, F401 (session fixture, Kimi Linear)
from tests.quant_models import quantized_models  # noqa: E402, F401 (quantized checkpoints)
from tests.ssm_families import ssm_models  # noqa: E402, F401 (session fixture, Mamba1 / short conv)
from tests.tiny import save_tiny_model  # noqa: E402
from tests.window_models import window_models  # noqa: E402, F401 (sliding-window families)

# Tiny NemotronH shapes the model tests cover (odd sizes, n_groups > 1, conv 3 and 4,
# attention as the first block, chunk sizes smaller than the prompts, tied embeddings).
TINY_CONFIGS = {
    "base": dict(),
    "odd": dict(
        vocab_size=301,
        hidden_size=40,
        hybrid_override_pattern="*M-M*-M",
        num_attention_heads=5,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=72,
        mamba_num_heads=6,
        mamba_head_dim=12,
        ssm_state_size=5,
        n_groups=3,
        conv_kernel=3,
        chunk_size=8,
    ),
    "mamba_only": dict(hybrid_override_pattern="M-M-"),
    "attention_only": dict(hybrid_override_pattern="*-*-"),
    "single_group_tied": dict(
        hybrid_override_pattern="MM*-",
        n_groups=1,
        conv_kernel=4,
        chunk_size=32,
        tie_word_embeddings=True,
    ),
}

# Tiny MoE NemotronH shapes (tests/test_moe_model.py and the engine/disagg tests that take them).
_MOE = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    moe_shared_expert_intermediate_size=40,
    routed_scaling_factor=2.5,
)
MOE_CONFIGS = {
    # Nemotron-3-Nano-like: mostly Mamba and MoE, one attention layer, sigmoid top-k, scaled.
    "moe_nano": dict(_MOE, hybrid_override_pattern="MEM*EMEME"),
    # Group-limited routing: 16 experts in 4 groups, the best 2 groups, 3 experts per token,
    # weights not renormalised.
    "moe_grouped": dict(
        _MOE,
        hybrid_override_pattern="ME*EM-",
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
    ),
    # Nemotron-3-Super-like latent MoE: the experts run at 32 wide inside a 64-wide model.
    "moe_latent": dict(_MOE, hybrid_override_pattern="M*EME", moe_latent_size=32),
}
TINY_CONFIGS.update(MOE_CONFIGS)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """name -> (model_dir, transformers model), built once per session, seeded by the name's
    place in its config list (the same weights alone and in the whole suite)."""
    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(f"tiny-{name}")
            built[name] = (
                path,
                save_tiny_model(path, seed=list(TINY_CONFIGS).index(name), **TINY_CONFIGS[name]),
            )
        return built[name]

    return get


@pytest.fixture(scope="session")
def base_model(tiny_models):
    return tiny_models("base")
