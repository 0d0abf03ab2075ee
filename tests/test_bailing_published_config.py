"""inclusionAI's Ling-3.0-tiny config.json (model_type `bailing_hybrid`, as published:
tests/fixtures/published_configs/ling_3_0_tiny, its SOURCES.md says where from), read as
transformers 5.25 reads it and, shrunk in sizes only, built by transformers from that file and
run by baton from that same file: greedy tokens and logprobs must be transformers' (fp32).

The release names its architecture `BailingMoeV3ForCausalLM`, which is not transformers' class:
transformers loads it by model_type, and so does baton. The file omits
`num_nextn_predict_layers` (transformers' default: one MTP layer), spells the experts the
released way (`num_experts`, `num_shared_experts`) and carries keys transformers' fixed
architecture does not read; those are refused by name when they say something else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton.engine.config import ModelConfig
from baton.engine.config_error import ConfigError
from tests.published_runs import assert_runs_as_transformers, prompt_ids

FIXTURE = Path(__file__).parent / "fixtures" / "published_configs" / "ling_3_0_tiny"
VOCAB, LAYERS = 512, 8
# widths, heads, experts, layers and the vocabulary (two groups of 4 layers: KDA, KDA, KDA, MLA)
SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=16, num_hidden_layers=LAYERS, num_attention_heads=4,
    num_key_value_heads=4, head_dim=16, kv_lora_rank=16, q_lora_rank=8, qk_nope_head_dim=8,
    qk_rope_head_dim=4, qk_head_dim=12, v_head_dim=8, num_experts=16,
)  # fmt: skip


def published() -> dict:
    return json.loads((FIXTURE / "config.json").read_text())


def shrink(raw: dict) -> dict:
    """Sizes replaced; the special ids the file lacks take transformers' defaults, kept at the
    same distance from the vocabulary's end."""
    import transformers

    defaults = transformers.BailingHybridConfig()
    out = json.loads(json.dumps(raw)) | SIZES
    for key in ("eos_token_id", "pad_token_id"):
        out[key] = VOCAB - (defaults.vocab_size - getattr(defaults, key))
    return out


def test_published_config_reads_as_transformers_reads_it():
    """The architecture by model_type, MLA at the last layer of each group of 4, a dense first
    layer, the released MoE spellings, KDA's heads and dims as the attention's, one MTP layer."""
    import transformers

    raw = published()
    hf = transformers.BailingHybridConfig(**raw)
    config = ModelConfig.from_dict(raw)
    assert config.architecture == "BailingHybridForCausalLM"
    ling = config.family
    assert list(ling.layer_types) == hf.layer_types
    assert [("sparse" if s else "dense") for s in ling.sparse_layers] == hf.mlp_layer_types
    assert (ling.moe.num_experts, ling.moe.top_k, ling.moe.shared_intermediate_size) == (
        hf.num_local_experts, hf.num_experts_per_tok, hf.moe_intermediate_size * hf.n_shared_experts
    )  # fmt: skip
    assert (ling.kda.num_heads, ling.kda.head_dim, ling.kda.conv_kernel) == (
        hf.linear_num_heads, hf.linear_head_dim, hf.linear_conv_kernel_dim
    )  # fmt: skip
    assert ling.kda.gate_lower_bound == hf.kda_lower_bound
    assert (ling.mla.q_lora_rank, ling.mla.kv_lora_rank, ling.mla.qk_rope_head_dim) == (
        hf.q_lora_rank, hf.kv_lora_rank, hf.qk_rope_head_dim
    )  # fmt: skip
    assert config.num_nextn_predict_layers == hf.num_mtp_layers == 1
    assert config.max_position_embeddings == hf.max_position_embeddings


@pytest.mark.parametrize(
    "key,value",
    [
        ("gated_attention_proj_granularity_type", "element_wise"),
        ("no_kda_lora", False),
        ("rope_interleave", False),
        ("moe_router_enable_expert_bias", False),
        ("moe_shared_expert_intermediate_size", 1024),
    ],
)
def test_keys_transformers_would_silently_misrun_are_refused_by_name(key, value):
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_dict(published() | {key: value})


def test_an_architecture_name_nobody_serves_is_still_refused():
    with pytest.raises(ConfigError, match="unsupported architecture 'BailingMoeV3ForCausalLM'"):
        ModelConfig.from_dict(published() | {"model_type": "bailing_moe_v3"})


def test_published_config_runs_as_transformers_runs_it(tmp_path):
    raw = shrink(published())
    assert_runs_as_transformers(
        tmp_path,
        raw,
        "BailingHybridForCausalLM",
        model_seed=11,
        prompts=prompt_ids(5, (7, 45), VOCAB - 8),
        max_tokens=6,
        page_size=4,
        chunked_prefill_size=16,
    )
