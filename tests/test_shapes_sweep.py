"""Shapes and config keys the family tests do not cover, each against transformers: widths that
are not multiples of 8 or 16, attention heads of 48/80/256 with odd GQA ratios, Mamba heads of
odd width, d_state 6..100, n_groups 1 / several / one per head, conv kernels 2..5, chunk sizes
that divide no prompt, MoE top-1 and top-k = every expert, attention first / last / in runs,
partial rotary factors that a family's transformers code ignores or rounds down to an odd
width, bias keys and norm eps as each family's transformers code reads them, a dt ceiling.
Prompts of 1 token, exactly one SSD chunk, one chunk + 1, several chunks and longer than the
engine's prefill chunk, batched and mixed with decodes. Heads that groups do not share evenly
are refused by name."""

from __future__ import annotations

import pytest
import torch
import transformers

from baton import LLM, SamplingParams
from baton.engine.config import ModelConfig
from baton.engine.config_error import ConfigError
from tests.families import FAMILY_CONFIGS, save_model
from tests.reference import hf_greedy
from tests.test_engine import check_against_reference
from tests.tiny import tiny_config_kwargs

NEMOTRON_H = ("NemotronHConfig", "NemotronHForCausalLM")
BAMBA = ("BambaConfig", "BambaForCausalLM")
GRANITE = ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM")
FALCON_H1 = ("FalconH1Config", "FalconH1ForCausalLM")
ZAMBA2 = ("Zamba2Config", "Zamba2ForCausalLM")

# name -> (config class, causal LM class, config kwargs, SSD chunk size)
SHAPE_CONFIGS: dict[str, tuple[str, str, dict, int]] = {
    # hidden 100, heads of 48 (6 q on 2 kv), one group per Mamba head (5 x 20), conv 5, d_state
    # 24, two attention layers in a row, odd MLP width and vocabulary.
    "nemotron_h_wide_heads": (
        *NEMOTRON_H,
        tiny_config_kwargs(
            vocab_size=333,
            hidden_size=100,
            hybrid_override_pattern="M**-MM-",
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=48,
            intermediate_size=99,
            mamba_num_heads=5,
            mamba_head_dim=20,
            ssm_state_size=24,
            n_groups=5,
            conv_kernel=5,
            chunk_size=12,
        ),
        12,
    ),
    # attention first and last (3 q heads of 80 on 1 kv), two MLPs in a row, conv 2, chunk 7,
    # d_state 100, one group, tied embeddings.
    "nemotron_h_conv2_dstate100": (
        *NEMOTRON_H,
        tiny_config_kwargs(
            vocab_size=290,
            hidden_size=72,
            hybrid_override_pattern="*M--M*",
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=80,
            intermediate_size=51,
            mamba_num_heads=4,
            mamba_head_dim=18,
            ssm_state_size=100,
            n_groups=1,
            conv_kernel=2,
            chunk_size=7,
            tie_word_embeddings=True,
        ),
        7,
    ),
    # heads of 256, Mamba heads of 33, chunk 5.
    "nemotron_h_head256": (
        *NEMOTRON_H,
        tiny_config_kwargs(
            vocab_size=300,
            hidden_size=48,
            hybrid_override_pattern="MM*M",
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=256,
            intermediate_size=40,
            mamba_num_heads=2,
            mamba_head_dim=33,
            ssm_state_size=6,
            n_groups=2,
            conv_kernel=4,
            chunk_size=5,
        ),
        5,
    ),
    # MoE top-1 of 6 experts in 2 groups (the best one kept), and top-4 of 4 (every expert).
    "nemotron_h_moe_top1": (
        *NEMOTRON_H,
        tiny_config_kwargs(
            vocab_size=310,
            hidden_size=48,
            hybrid_override_pattern="EM*E",
            n_routed_experts=6,
            num_experts_per_tok=1,
            moe_intermediate_size=12,
            moe_shared_expert_intermediate_size=20,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.0,
            chunk_size=8,
        ),
        8,
    ),
    "nemotron_h_moe_every_expert": (
        *NEMOTRON_H,
        tiny_config_kwargs(
            vocab_size=310,
            hidden_size=56,
            hybrid_override_pattern="ME*EM",
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=14,
            n_routed_experts=4,
            num_experts_per_tok=4,
            moe_intermediate_size=20,
            moe_shared_expert_intermediate_size=36,
            routed_scaling_factor=1.5,
            mamba_num_heads=4,
            mamba_head_dim=14,
            chunk_size=9,
        ),
        9,
    ),
    # partial rotary 0.25 of heads of 20: transformers rotates int(5) -> 3 pairs = 6 channels.
    "bamba_odd_rotary": (
        *BAMBA,
        dict(
            vocab_size=290,
            hidden_size=100,
            intermediate_size=37,
            num_hidden_layers=3,
            num_attention_heads=5,
            num_key_value_heads=5,
            attn_layer_indices=[2],
            mamba_n_heads=8,
            mamba_d_head=25,
            mamba_d_state=100,
            mamba_n_groups=4,
            mamba_d_conv=2,
            mamba_chunk_size=7,
            max_position_embeddings=4096,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1000.0,
                "partial_rotary_factor": 0.25,
            },
        ),
        7,
    ),
    # Granite with top-k = every expert, two attention layers in a row; and one whose
    # rope_parameters carry a partial_rotary_factor, which transformers' Granite ignores.
    "granite_every_expert": (
        *GRANITE,
        dict(
            vocab_size=300,
            hidden_size=72,
            intermediate_size=20,
            shared_intermediate_size=44,
            num_hidden_layers=4,
            layer_types=["mamba", "attention", "attention", "mamba"],
            num_attention_heads=6,
            num_key_value_heads=3,
            num_local_experts=4,
            num_experts_per_tok=4,
            position_embedding_type="rope",
            embedding_multiplier=6.0,
            residual_multiplier=0.3,
            attention_multiplier=0.1,
            logits_scaling=3.0,
            mamba_n_heads=3,
            mamba_d_head=48,
            mamba_d_state=16,
            mamba_n_groups=3,
            mamba_d_conv=4,
            mamba_chunk_size=10,
            max_position_embeddings=4096,
        ),
        10,
    ),
    "granite_partial_rotary_ignored": (
        *GRANITE,
        dict(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=20,
            shared_intermediate_size=44,
            num_hidden_layers=3,
            layer_types=["mamba", "attention", "mamba"],
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=0,
            position_embedding_type="rope",
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 100.0,
                "partial_rotary_factor": 0.5,
            },
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_d_state=16,
            mamba_n_groups=2,
            mamba_d_conv=4,
            mamba_chunk_size=10,
            max_position_embeddings=4096,
        ),
        10,
    ),
    # Falcon-H1: one group per head, conv 5, mamba_d_ssm below the heads' default width.
    "falcon_h1_group_per_head": (
        *FALCON_H1,
        dict(
            vocab_size=333,
            hidden_size=96,
            intermediate_size=75,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            mamba_d_ssm=60,
            mamba_n_heads=5,
            mamba_d_head=12,
            mamba_d_state=24,
            mamba_n_groups=5,
            mamba_d_conv=5,
            mamba_chunk_size=12,
            mamba_rms_norm=True,
            mamba_norm_before_gate=False,
            max_position_embeddings=4096,
        ),
        12,
    ),
    # Zamba2 whose rope_parameters carry a partial_rotary_factor (transformers ignores it).
    "zamba2_partial_rotary_ignored": (
        *ZAMBA2,
        dict(
            vocab_size=320,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=3,
            layers_block_type=["mamba", "hybrid", "mamba"],
            num_attention_heads=4,
            num_key_value_heads=4,
            num_mem_blocks=1,
            use_shared_attention_adapter=False,
            adapter_rank=4,
            use_mem_rope=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 100.0,
                "partial_rotary_factor": 0.5,
            },
            n_mamba_heads=4,
            mamba_d_state=8,
            mamba_ngroups=2,
            chunk_size=16,
            time_step_min=1e-6,
            max_position_embeddings=4096,
        ),
        16,
    ),
    # Bias keys as each family's transformers code reads them: NemotronH's attention has no
    # bias whatever attention_bias says, Falcon-H1's Mamba out_proj takes projectors_bias (not
    # mamba_proj_bias), Zamba2's conv1d always has one (use_conv_bias is read by nothing).
    "nemotron_h_bias_keys": (
        *NEMOTRON_H,
        tiny_config_kwargs(
            hybrid_override_pattern="M*-ME*",
            attention_bias=True,
            mlp_bias=True,
            use_bias=True,
            use_conv_bias=False,
        ),
        16,
    ),
    "falcon_h1_bias_keys": (
        *FALCON_H1,
        dict(
            FAMILY_CONFIGS["falcon_prenorm"][2],
            attention_bias=True,
            mlp_bias=True,
            mamba_proj_bias=True,
            projectors_bias=False,
            mamba_conv_bias=False,
        ),
        16,
    ),
    "falcon_h1_projectors_bias": (
        *FALCON_H1,
        dict(FAMILY_CONFIGS["falcon_prenorm"][2], projectors_bias=True),
        16,
    ),
    "zamba2_bias_keys": (
        *ZAMBA2,
        dict(FAMILY_CONFIGS["zamba2_shared"][2], add_bias_linear=True, use_conv_bias=False),
        16,
    ),
    # A large rms_norm_eps (the norms really feel it) and a finite dt ceiling; Zamba2's Mamba
    # norm keeps transformers' 1e-5 whatever rms_norm_eps says.
    "nemotron_h_eps_dt_ceiling": (
        *NEMOTRON_H,
        tiny_config_kwargs(layer_norm_epsilon=0.05, time_step_limit=(0.002, 0.03)),
        16,
    ),
    "zamba2_rms_norm_eps": (
        *ZAMBA2,
        dict(FAMILY_CONFIGS["zamba2_shared"][2], rms_norm_eps=0.05),
        16,
    ),
}
NEW_TOKENS = 6


def prompts_for(vocab: int, chunk: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    lengths = [1, chunk, chunk + 1, 2 * chunk + 3, 41]
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", list(SHAPE_CONFIGS))
def test_engine_matches_transformers(tmp_path, name):
    config_class, model_class, kwargs, chunk = SHAPE_CONFIGS[name]
    hf = save_model(tmp_path, config_class, model_class, kwargs, seed=7)
    prompts = prompts_for(hf.config.vocab_size, chunk)
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    # Prefill chunks of 10 tokens (not a multiple of any SSD chunk here) sharing steps with
    # decodes; pages of 4.
    llm = LLM(tmp_path, page_size=4, max_num_batched_tokens=24, chunked_prefill_size=10)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params)
    check_against_reference(outs, prompts, refs)
    stats = llm.stats()
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


def with_changes(family: str, **changes) -> tuple[str, dict]:
    config_class, _, kwargs = FAMILY_CONFIGS[family]
    return config_class, {**kwargs, **changes}


@pytest.mark.parametrize(
    ("config_class", "kwargs", "named"),
    [
        (NEMOTRON_H[0], tiny_config_kwargs(mamba_num_heads=5), "mamba_num_heads=5 .* n_groups=2"),
        (
            NEMOTRON_H[0],
            tiny_config_kwargs(num_attention_heads=6, num_key_value_heads=4),
            "num_attention_heads=6 .* num_key_value_heads=4",
        ),
        (*with_changes("bamba_a", mamba_n_groups=3), "mamba_n_heads=8 .* mamba_n_groups=3"),
        (*with_changes("granite_moe", num_key_value_heads=3), "num_key_value_heads=3"),
        (*with_changes("falcon_mup", mamba_n_groups=4), "mamba_n_heads=6 .* mamba_n_groups=4"),
        (*with_changes("zamba2_single", mamba_ngroups=2), "n_mamba_heads=5 .* mamba_ngroups=2"),
        (
            *with_changes("zamba2_shared", num_key_value_heads=2),
            "use_shared_attention_adapter=True needs num_key_value_heads=2",
        ),
        (NEMOTRON_H[0], tiny_config_kwargs(mamba_ssm_cache_dtype="fp32"), "mamba_ssm_cache_dtype"),
    ],
)
def test_unservable_configs_are_refused_at_load_naming_the_key(config_class, kwargs, named):
    """transformers builds these models but its forward fails on heads that groups do not share
    evenly (and on Zamba2's q/k/v adapters with GQA); baton refuses them at load (it paired
    heads with the wrong groups and produced tokens), and a state dtype it cannot name (it
    raised an AttributeError)."""
    raw = getattr(transformers, config_class)(**kwargs).to_dict()
    with pytest.raises(ConfigError, match=named):
        ModelConfig.from_dict(raw)
