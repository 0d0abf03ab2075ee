"""Tiny random models of every non-NemotronH family, built by transformers at test time (fp32,
fixed seeds, parameters spread like tests/tiny.py), saved with save_pretrained plus the tiny
byte-level tokenizer, and shared per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny import align_dt_limit, save_tokenizer, spread_parameters

# name -> (transformers config class, causal LM class, config kwargs)
FAMILY_CONFIGS: dict[str, tuple[str, str, dict]] = {
    # Bamba: attention in the middle, GQA 4/2, partial rotary (transformers' 0.5 default),
    # two Mamba groups, chunk 16.
    "bamba_a": (
        "BambaConfig",
        "BambaForCausalLM",
        dict(
            vocab_size=320,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_layer_indices=[1],
            mamba_n_heads=8,
            mamba_d_state=8,
            mamba_n_groups=2,
            mamba_d_conv=4,
            mamba_chunk_size=16,
            max_position_embeddings=4096,
        ),
    ),
    # Bamba, odd shapes: attention first and last, MQA (5 heads of 8 on 1 KV head), full rotary
    # with its own theta, conv 3, chunk 8, one group, tied embeddings.
    "bamba_b": (
        "BambaConfig",
        "BambaForCausalLM",
        dict(
            vocab_size=301,
            hidden_size=40,
            intermediate_size=72,
            num_hidden_layers=4,
            num_attention_heads=5,
            num_key_value_heads=1,
            attn_layer_indices=[0, 3],
            mamba_n_heads=5,
            mamba_d_state=6,
            mamba_n_groups=1,
            mamba_d_conv=3,
            mamba_chunk_size=8,
            max_position_embeddings=4096,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 500.0,
                "partial_rotary_factor": 1.0,
            },
            tie_word_embeddings=True,
        ),
    ),
    # Granite-4.0-H: MoE (8 experts, top 2) beside the shared MLP, rotary, µP multipliers
    # (embeddings x12, residual x0.22, softmax scale 1/64 instead of 1/4, logits / 6).
    "granite_moe": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            vocab_size=320,
            hidden_size=64,
            intermediate_size=24,
            shared_intermediate_size=48,
            num_hidden_layers=4,
            layer_types=["mamba", "attention", "mamba", "mamba"],
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            position_embedding_type="rope",
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=1 / 64,
            logits_scaling=6.0,
            mamba_n_heads=8,
            mamba_d_state=8,
            mamba_n_groups=2,
            mamba_d_conv=4,
            mamba_chunk_size=16,
            max_position_embeddings=4096,
        ),
    ),
    # Granite-4.0-H dense (no experts, the shared MLP alone), NoPE attention first, MQA, odd
    # widths, tied embeddings, logits multiplied (logits_scaling < 1).
    "granite_dense": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            vocab_size=301,
            hidden_size=40,
            intermediate_size=24,
            shared_intermediate_size=56,
            num_hidden_layers=3,
            layer_types=["attention", "mamba", "mamba"],
            num_attention_heads=5,
            num_key_value_heads=1,
            num_local_experts=0,
            position_embedding_type=None,
            embedding_multiplier=1.0,  # with tied embeddings a larger one makes greedy loop
            residual_multiplier=0.7,
            attention_multiplier=0.25,
            logits_scaling=0.5,
            mamba_n_heads=5,
            mamba_d_state=6,
            mamba_n_groups=1,
            mamba_d_conv=3,
            mamba_chunk_size=8,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        ),
    ),
    # Falcon-H1: every multiplier away from 1, the gated norm after the gate
    # (mamba_norm_before_gate=False), mamba_d_ssm narrower than expand x hidden, and a
    # partial_rotary_factor that transformers' Falcon-H1 ignores (it rotates whole heads).
    "falcon_mup": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(
            vocab_size=320,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            mamba_d_ssm=96,
            mamba_n_heads=6,
            mamba_d_state=8,
            mamba_n_groups=2,
            mamba_d_conv=4,
            mamba_chunk_size=16,
            mamba_rms_norm=True,
            mamba_norm_before_gate=False,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
            },
            embedding_multiplier=1.7,
            lm_head_multiplier=0.6,
            key_multiplier=0.8,
            attention_in_multiplier=1.3,
            attention_out_multiplier=0.7,
            ssm_in_multiplier=1.2,
            ssm_out_multiplier=0.9,
            ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3],
            mlp_multipliers=[1.4, 0.6],
            max_position_embeddings=4096,
        ),
    ),
    # Falcon-H1 without the Mamba norm (y * silu(z)), MQA with odd heads, conv 3, chunk 8; and
    # one with the norm before the gate (norm(y) * silu(z)), falcon_prenorm.
    "falcon_nonorm": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(
            vocab_size=301,
            hidden_size=40,
            intermediate_size=72,
            num_hidden_layers=2,
            num_attention_heads=5,
            num_key_value_heads=1,
            mamba_n_heads=4,
            mamba_d_state=6,
            mamba_n_groups=1,
            mamba_d_conv=3,
            mamba_chunk_size=8,
            mamba_rms_norm=False,
            max_position_embeddings=4096,
        ),
    ),
    "falcon_prenorm": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(
            vocab_size=320,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            mamba_n_heads=4,
            mamba_d_state=8,
            mamba_n_groups=2,
            mamba_d_conv=4,
            mamba_chunk_size=16,
            mamba_rms_norm=True,
            mamba_norm_before_gate=True,
            ssm_multipliers=[0.9, 1.1, 1.0, 1.2, 0.8],
            max_position_embeddings=4096,
        ),
    ),
    # Zamba2: two shared blocks over three hybrid layers (block 0 used twice, with its own
    # adapters and KV pages per use), q/k/v adapters, rotary; time_step_min 1e-6 (transformers'
    # decode path does not clamp dt, its prefill clamps at time_step_min: so low, both agree).
    "zamba2_shared": (
        "Zamba2Config",
        "Zamba2ForCausalLM",
        dict(
            vocab_size=320,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=5,
            layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid"],
            num_attention_heads=4,
            num_key_value_heads=4,  # transformers' k/v adapters only fit without GQA
            num_mem_blocks=2,
            use_shared_attention_adapter=True,
            adapter_rank=4,
            use_mem_rope=True,
            n_mamba_heads=4,
            mamba_d_state=8,
            mamba_ngroups=2,
            chunk_size=16,
            time_step_min=1e-6,
            max_position_embeddings=4096,
        ),
    ),
    # Zamba2: one shared block at every hybrid layer, no q/k/v adapters (the MLP's remain), NoPE,
    # untied lm_head, conv 3, chunk 8.
    "zamba2_single": (
        "Zamba2Config",
        "Zamba2ForCausalLM",
        dict(
            vocab_size=301,
            hidden_size=40,
            intermediate_size=56,
            num_hidden_layers=4,
            layers_block_type=["hybrid", "mamba", "hybrid", "mamba"],
            num_attention_heads=5,
            num_key_value_heads=5,
            num_mem_blocks=1,
            use_shared_attention_adapter=False,
            adapter_rank=6,
            use_mem_rope=False,
            n_mamba_heads=5,
            mamba_d_state=6,
            mamba_ngroups=1,
            mamba_d_conv=3,
            chunk_size=8,
            time_step_min=1e-6,
            tie_word_embeddings=False,
            max_position_embeddings=4096,
        ),
    ),
}


def build_model(config_class: str, model_class: str, kwargs: dict, seed: int):
    """A random transformers model of any family (class names as in FAMILY_CONFIGS), fp32,
    eval mode, parameters spread and dt limited like tests/tiny.py."""
    import torch
    import transformers

    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    spread_parameters(model)
    align_dt_limit(model)
    return model


def save_model(path: Path, config_class: str, model_class: str, kwargs: dict, seed: int):
    """build_model, saved with save_pretrained plus the tiny tokenizer; returns the model."""
    model = build_model(config_class, model_class, kwargs, seed)
    model.save_pretrained(str(path))
    save_tokenizer(path, vocab_size=model.config.vocab_size)
    return model


def build_family_model(name: str, seed: int):
    return build_model(*FAMILY_CONFIGS[name], seed)


def save_family_model(path: Path, name: str, seed: int):
    return save_model(path, *FAMILY_CONFIGS[name], seed)


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """name -> (model_dir, transformers model), built once per session, seeded by the name's
    place in its config list (the same weights alone and in the whole suite)."""
    built = {}

    def get(name: str):
        if name not in built:
            path = tmp_path_factory.mktemp(f"family-{name}")
            built[name] = (
                path,
                save_family_model(path, name, seed=100 + list(FAMILY_CONFIGS).index(name)),
            )
        return built[name]

    return get
