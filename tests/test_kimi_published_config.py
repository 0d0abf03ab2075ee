"""Kimi Linear's config.json as published (tests/fixtures/published_configs/
kimi_linear_48b_a3b_instruct, its SOURCES.md says where from), shrunk in sizes only, built by
transformers from that file and run by baton from that same file: greedy tokens and logprobs must
be transformers' (fp32). A key baton misreads (the released spellings `num_experts_per_token`,
`moe_renormalize`, `model_max_length`..., the 1-indexed layer lists) shows up as a refusal or as
different logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton.engine.config import ModelConfig
from baton.engine.config_error import ConfigError
from tests.published_runs import assert_runs_as_transformers, prompt_ids

FIXTURE = Path(__file__).parent / "fixtures" / "published_configs" / "kimi_linear_48b_a3b_instruct"
VOCAB, LAYERS = 512, 5
# widths, heads, experts, layers and the vocabulary; KDA heads = MLA heads and 3 KDA : 1 MLA, as
# published
SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
    num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_experts=16,
)  # fmt: skip


def published() -> dict:
    return json.loads((FIXTURE / "config.json").read_text())


def shrink(raw: dict) -> dict:
    """Sizes replaced; the layer lists keep their layers among the first LAYERS; the special
    ids keep their distance from the vocabulary's end (pad is its last id, as published)."""
    out = json.loads(json.dumps(raw))
    end = raw["vocab_size"]
    out.update(SIZES)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        out[key] = VOCAB - (end - raw[key])
    linear = out["linear_attn_config"]
    linear.update(head_dim=16, num_heads=4)
    for key in ("full_attn_layers", "kda_layers"):
        linear[key] = [layer for layer in linear[key] if layer <= LAYERS]
    return out


def test_published_config_reads_as_transformers_reads_it():
    """Layer kinds from the 1-indexed lists (MLA at layers 4, 8, ..., 27), dense layer 0, the
    released MoE spellings."""
    import transformers

    raw = published()
    hf = transformers.KimiLinearConfig(**raw)
    kimi = ModelConfig.from_dict(raw).family
    assert list(kimi.layer_types) == hf.layer_types
    assert [("sparse" if s else "dense") for s in kimi.sparse_layers] == hf.mlp_layer_types
    assert (kimi.moe.num_experts, kimi.moe.top_k, kimi.moe.shared_intermediate_size) == (
        hf.num_local_experts, hf.num_experts_per_tok, hf.moe_intermediate_size * hf.n_shared_experts
    )  # fmt: skip
    assert kimi.moe.norm_topk_prob == hf.norm_topk_prob
    assert (kimi.kda.num_heads, kimi.kda.head_dim, kimi.kda.conv_kernel) == (
        hf.linear_num_heads, hf.linear_head_dim, hf.linear_conv_kernel_dim
    )  # fmt: skip
    assert ModelConfig.from_dict(raw).max_position_embeddings == hf.max_position_embeddings


@pytest.mark.parametrize(
    "key,value", [("mla_use_nope", False), ("moe_router_activation_func", "softmax")]
)
def test_keys_transformers_would_silently_misrun_are_refused_by_name(key, value):
    raw = published() | {key: value}
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_dict(raw)


def test_published_config_runs_as_transformers_runs_it(tmp_path):
    raw = shrink(published())
    assert_runs_as_transformers(
        tmp_path,
        raw,
        "KimiLinearForCausalLM",
        model_seed=7,
        prompts=prompt_ids(3, (6, 70), VOCAB - 8),
        max_tokens=6,
        page_size=4,
        chunked_prefill_size=32,
    )
