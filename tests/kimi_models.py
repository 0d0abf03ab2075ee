"""Tiny random linear-attention hybrids: Kimi Linear and Bailing hybrid (KDA + MLA + DeepSeek-style
MoE) and MiniMax (lightning attention + softmax attention + Mixtral-style MoE), built by
transformers 5.25
(fp32, fixed seeds, parameters spread like tests/tiny.py) and saved with save_pretrained, whose
files carry the released layout (per-expert w1/w3/w2 under block_sparse_moe, q/k/v_conv1d, the
KDA gate projections beside the others).

Variants: dense first layer + MoE (the release's first_k_dense_replace=1) with grouped routing;
two dense first layers with a low-rank query (q_lora_rank), attention bias and conv 3; MoE in
every layer (first_k_dense_replace=0). Layers come from `linear_attn_config`'s 1-indexed lists,
MLA first, last and between KDA layers. Bailing hybrid (BAILING_CONFIGS): full-rank KDA gates,
bounded decay or softplus, rotary MLA with a head gate, MLA every `layer_group_size`-th layer.
MiniMax (MINIMAX_CONFIGS): softmax attention in one layer of four with the release's residual
factors (alpha != 1), and transformers' alternating default with windowed softmax layers (every
paged kind windowed: pages released) and hidden / heads as head_dim.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny import save_tokenizer, spread_parameters

COMMON = dict(
    vocab_size=288,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=16,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    num_experts=8,
    num_experts_per_token=2,
    rms_norm_eps=1e-5,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

KIMI_CONFIGS: dict[str, dict] = {
    # the release's shape: dense layer 0, MoE after it, 3 KDA : 1 MLA; two expert groups
    "kimi_moe": dict(
        COMMON,
        num_hidden_layers=4,
        num_expert_group=2,
        topk_group=1,
        linear_attn_config=dict(
            head_dim=16,
            num_heads=2,
            short_conv_kernel_size=4,
            kda_layers=[1, 2, 4],
            full_attn_layers=[3],
        ),
    ),  # fmt: skip
    # two dense first layers, MLA first and last, q_lora_rank, attention bias, conv 3, raw top-k
    "kimi_dense_first": dict(
        COMMON,
        num_hidden_layers=4,
        first_k_dense_replace=2,
        q_lora_rank=12,
        attention_bias=True,
        moe_renormalize=False,
        num_shared_experts=2,
        linear_attn_config=dict(
            head_dim=8,
            num_heads=4,
            short_conv_kernel_size=3,
            kda_layers=[2, 3],
            full_attn_layers=[1, 4],
        ),
    ),  # fmt: skip
    # MoE in every layer
    "kimi_moe_only": dict(
        COMMON,
        num_hidden_layers=3,
        first_k_dense_replace=0,
        linear_attn_config=dict(
            head_dim=16,
            num_heads=2,
            short_conv_kernel_size=4,
            kda_layers=[1, 3],
            full_attn_layers=[2],
        ),
    ),  # fmt: skip
}


BAILING_COMMON = dict(
    COMMON,
    head_dim=8,  # KDA heads are the attention's: 4 x 8
    rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    num_expert_group=2,
    topk_group=1,
)
BAILING_CONFIGS: dict[str, dict] = {
    # MLA every 2nd layer, one dense layer, the bounded (safe) KDA gate
    "bailing_safe_gate": dict(
        BAILING_COMMON,
        num_hidden_layers=4,
        layer_group_size=2,
        first_k_dense_replace=1,
    ),  # fmt: skip
    # MLA every 3rd, the softplus gate, a low-rank query, conv 3, MoE in every layer
    "bailing_softplus": dict(
        BAILING_COMMON,
        num_hidden_layers=3,
        layer_group_size=3,
        first_k_dense_replace=0,
        kda_safe_gate=False,
        q_lora_rank=12,
        short_conv_kernel_size=3,
    ),  # fmt: skip
}


MINIMAX_COMMON = dict(
    vocab_size=296,
    hidden_size=64,
    intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    rms_norm_eps=1e-5,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MINIMAX_CONFIGS: dict[str, dict] = {
    # the release's 7 : 1 in small: softmax attention in the last of four layers; its residual
    # factors (alpha 3.56, beta 1 on every part) and some of our own
    "minimax_one_in_four": dict(
        MINIMAX_COMMON,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        head_dim=16,
        full_attn_alpha_factor=3.5565588200778455,
        linear_attn_alpha_factor=1.5,
        linear_attn_beta_factor=0.75,
        mlp_alpha_factor=2.0,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    ),  # fmt: skip
    # transformers' default layer types (full, linear, full), windowed softmax layers
    "minimax_alternating_window": dict(
        MINIMAX_COMMON,
        num_hidden_layers=3,
        num_key_value_heads=1,
        sliding_window=12,
        tie_word_embeddings=True,
    ),  # fmt: skip
}


def build_kimi_model(name: str, seed: int):
    """The transformers model of KIMI_CONFIGS[name], BAILING_CONFIGS[name] or
    MINIMAX_CONFIGS[name], fp32, eval mode, spread."""
    import transformers

    if name in MINIMAX_CONFIGS:
        config = transformers.MiniMaxConfig(**MINIMAX_CONFIGS[name])
        model_class = transformers.MiniMaxForCausalLM
    elif name in BAILING_CONFIGS:
        config = transformers.BailingHybridConfig(**BAILING_CONFIGS[name])
        model_class = transformers.BailingHybridForCausalLM
    else:
        config = transformers.KimiLinearConfig(**KIMI_CONFIGS[name])
        model_class = transformers.KimiLinearForCausalLM
    torch.manual_seed(seed)
    model = model_class(config).eval()
    spread_parameters(model)
    return model


def save_kimi_model(path: Path, name: str, seed: int):
    model = build_kimi_model(name, seed)
    model.save_pretrained(str(path))
    save_tokenizer(path, vocab_size=model.config.vocab_size)
    return model


@pytest.fixture(scope="session")
def kimi_models(tmp_path_factory):
    """name -> (model_dir, transformers model), built once per session, seeded by the name's
    place in its config list (the same weights alone and in the whole suite)."""
    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(f"kimi-{name}")
            seed = 500 + list(KIMI_CONFIGS | BAILING_CONFIGS | MINIMAX_CONFIGS).index(name)
            built[name] = (path, save_kimi_model(path, name, seed=seed))
        return built[name]

    return get
