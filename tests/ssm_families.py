"""Tiny random models of the Mamba1 / short-conv hybrids (Jamba, LFM2, LFM2-MoE) and the pure
state-space models (Mamba, Falcon-Mamba, Mamba2), two configs each, built by transformers
(tests/families.py's helpers: fp32, fixed seeds, parameters spread) and shared per session.
Each pair differs where the families do: MoE on and off, attention placement, odd d_state and
conv widths, tied or not."""

from __future__ import annotations

import pytest

from tests.families import save_model

SSM_CONFIGS: dict[str, tuple[str, str, dict]] = {
    # Jamba: experts (4, top 2) on odd layers, attention at layer 2 of 4, d_state 5.
    "jamba_moe": (
        "JambaConfig",
        "JambaForCausalLM",
        dict(
            vocab_size=320,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_layer_period=4,
            attn_layer_offset=2,
            num_experts=4,
            num_experts_per_tok=2,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=5,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=6,
            max_position_embeddings=4096,
        ),
    ),
    # Jamba without experts (num_experts 1: a dense MLP everywhere), attention first, MQA, conv
    # 3, dt_rank "auto", conv without bias, projections with bias, tied embeddings.
    "jamba_dense": (
        "JambaConfig",
        "JambaForCausalLM",
        dict(
            vocab_size=301,
            hidden_size=40,
            intermediate_size=56,
            num_hidden_layers=3,
            num_attention_heads=5,
            num_key_value_heads=1,
            attn_layer_period=3,
            attn_layer_offset=0,
            num_experts=1,
            mamba_d_state=4,
            mamba_d_conv=3,
            mamba_expand=2,
            mamba_conv_bias=False,
            mamba_proj_bias=True,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
        ),
    ),
    # LFM2: attention at layer 1 of 4, conv_L_cache 3, the FFN width auto-adjusted with a
    # multiplier and rounded up (96 -> 64 -> 80 -> 96 in multiples of 32).
    "lfm2_a": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(
            vocab_size=320,
            hidden_size=32,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["conv", "full_attention", "conv", "conv"],
            conv_L_cache=3,
            block_ffn_dim_multiplier=1.25,
            block_multiple_of=32,
            max_position_embeddings=4096,
        ),
    ),
    # LFM2: attention first and last, conv_L_cache 4 with conv bias, the FFN width as given
    # (block_auto_adjust_ff_dim off), untied embeddings, rope theta of its own.
    "lfm2_b": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(
            vocab_size=301,
            hidden_size=40,
            intermediate_size=75,
            num_hidden_layers=4,
            num_attention_heads=5,
            num_key_value_heads=5,
            layer_types=["full_attention", "conv", "conv", "full_attention"],
            conv_L_cache=4,
            conv_bias=True,
            block_auto_adjust_ff_dim=False,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
            max_position_embeddings=4096,
        ),
    ),
    # LFM2 with no attention layer: its only state is the conv windows (no K/V pool, no pages).
    "lfm2_conv_only": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(
            vocab_size=320,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["conv", "conv"],
            conv_L_cache=3,
            block_auto_adjust_ff_dim=False,
            max_position_embeddings=4096,
        ),
    ),
    # LFM2-MoE: one dense layer, then experts (6, top 2) with the expert bias, renormalised and
    # scaled by 1.5; attention at layer 2.
    "lfm2_moe_a": (
        "Lfm2MoeConfig",
        "Lfm2MoeForCausalLM",
        dict(
            vocab_size=320,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["conv", "conv", "full_attention"],
            num_dense_layers=1,
            num_experts=6,
            num_experts_per_tok=2,
            use_expert_bias=True,
            norm_topk_prob=True,
            routed_scaling_factor=1.5,
            max_position_embeddings=4096,
        ),
    ),
    # LFM2-MoE with its MoE off: every layer dense (num_dense_layers = num_hidden_layers),
    # attention first, conv 4.
    "lfm2_moe_dense": (
        "Lfm2MoeConfig",
        "Lfm2MoeForCausalLM",
        dict(
            vocab_size=301,
            hidden_size=40,
            intermediate_size=56,
            moe_intermediate_size=16,
            num_hidden_layers=3,
            num_attention_heads=5,
            num_key_value_heads=1,
            layer_types=["full_attention", "conv", "conv"],
            conv_L_cache=4,
            num_dense_layers=3,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=4096,
        ),
    ),
    # LFM2-MoE: experts from the first layer, no expert bias, weights not renormalised.
    "lfm2_moe_nobias": (
        "Lfm2MoeConfig",
        "Lfm2MoeForCausalLM",
        dict(
            vocab_size=320,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=12,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            layer_types=["conv", "full_attention"],
            num_dense_layers=0,
            num_experts=4,
            num_experts_per_tok=3,
            use_expert_bias=False,
            norm_topk_prob=False,
            max_position_embeddings=4096,
        ),
    ),
    # Mamba: d_state 5, conv 4, tied embeddings, float32 residual stream.
    "mamba_a": (
        "MambaConfig",
        "MambaForCausalLM",
        dict(vocab_size=320, hidden_size=32, state_size=5, num_hidden_layers=3, conv_kernel=4),
    ),
    # Mamba: conv 3 without bias, projections with bias, explicit time_step_rank, untied.
    "mamba_b": (
        "MambaConfig",
        "MambaForCausalLM",
        dict(
            vocab_size=301,
            hidden_size=24,
            state_size=8,
            num_hidden_layers=2,
            conv_kernel=3,
            use_conv_bias=False,
            use_bias=True,
            time_step_rank=5,
            residual_in_fp32=False,
            tie_word_embeddings=False,
        ),
    ),
    # Falcon-Mamba: weightless dt/B/C norms with their own eps.
    "falcon_mamba_a": (
        "FalconMambaConfig",
        "FalconMambaForCausalLM",
        dict(
            vocab_size=320,
            hidden_size=32,
            state_size=6,
            num_hidden_layers=2,
            conv_kernel=4,
            mixer_rms_eps=1e-3,
        ),
    ),
    "falcon_mamba_b": (
        "FalconMambaConfig",
        "FalconMambaForCausalLM",
        dict(
            vocab_size=301,
            hidden_size=24,
            state_size=3,
            num_hidden_layers=3,
            conv_kernel=3,
            time_step_rank=4,
            tie_word_embeddings=False,
        ),
    ),
    # Mamba2: 4 heads of 16 in 2 groups, d_state 8, chunk 16.
    "mamba2_a": (
        "Mamba2Config",
        "Mamba2ForCausalLM",
        dict(
            vocab_size=320,
            hidden_size=32,
            num_heads=4,
            head_dim=16,
            state_size=8,
            n_groups=2,
            num_hidden_layers=2,
            conv_kernel=4,
            chunk_size=16,
        ),
    ),
    # Mamba2: one group, 5 heads of 8, d_state 5, conv 3, chunk 8, bias, tied.
    "mamba2_b": (
        "Mamba2Config",
        "Mamba2ForCausalLM",
        dict(
            vocab_size=301,
            hidden_size=20,
            num_heads=5,
            head_dim=8,
            state_size=5,
            n_groups=1,
            num_hidden_layers=3,
            conv_kernel=3,
            chunk_size=8,
            use_bias=True,
            tie_word_embeddings=True,
        ),
    ),
}


@pytest.fixture(scope="session")
def ssm_models(tmp_path_factory):
    """name -> (model_dir, transformers model), built once per session. Each model's seed is
    its place in SSM_CONFIGS, not the order tests ask for them: a test that must catch a
    broken path sees the same weights alone and in the whole suite."""
    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(f"ssm-{name}")
            seed = 300 + list(SSM_CONFIGS).index(name)
            built[name] = (path, save_model(path, *SSM_CONFIGS[name], seed=seed))
        return built[name]

    return get
