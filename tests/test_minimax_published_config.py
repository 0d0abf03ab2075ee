"""MiniMax-Text-01's config in transformers' format (tests/fixtures/published_configs/
minimax_text_01_hf, with its SOURCES.md): read as transformers 5.25 reads it, refused by name for
the one key transformers ignores and the release needs (`rotary_dim` 64 of 128: transformers
rotates whole heads), and, shrunk in sizes only with `rotary_dim` left out (what transformers
runs), built by transformers from that file and run by baton from that same file: greedy tokens
and logprobs must be transformers' (fp32), across several lightning chunks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton.engine.config import ModelConfig
from baton.engine.config_error import ConfigError
from tests.published_runs import assert_runs_as_transformers, prompt_ids

FIXTURE = Path(__file__).parent / "fixtures" / "published_configs" / "minimax_text_01_hf"
VOCAB, LAYERS = 512, 8  # 7 lightning layers, then softmax attention: the release's first 8
SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=LAYERS,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
)  # fmt: skip


# what the copy lacks and any reader needs to know the file's family (SOURCES.md)
IDENTITY = {"architectures": ["MiniMaxForCausalLM"], "model_type": "minimax"}


def published() -> dict:
    return json.loads((FIXTURE / "config.json").read_text()) | IDENTITY


def runnable(raw: dict) -> dict:
    return {k: v for k, v in raw.items() if k != "rotary_dim"}


def test_config_reads_as_transformers_reads_it():
    import transformers

    raw = runnable(published())
    hf = transformers.MiniMaxConfig(**raw)
    family = ModelConfig.from_dict(raw).family
    assert list(family.layer_types) == hf.layer_types
    assert (family.head_dim, family.num_kv_heads, family.sliding_window) == (
        hf.head_dim, hf.num_key_value_heads, hf.sliding_window
    )  # fmt: skip
    assert family.rotary.dim == hf.head_dim and family.rotary.theta == 1e7
    assert (family.moe.num_experts, family.moe.top_k) == (32, 2)
    assert family.linear_attn_factors == (hf.linear_attn_alpha_factor, 1.0)
    assert family.mlp_factors == (hf.mlp_alpha_factor, hf.mlp_beta_factor)


@pytest.mark.parametrize(
    "change, key",
    [
        ({}, "rotary_dim"),  # the published file itself
        ({"postnorm": False}, "postnorm"),
        ({"shared_intermediate_size": 1024}, "shared_intermediate_size"),
        ({"attn_type_list": [1] * 80}, "attn_type_list"),
        ({"layernorm_mlp_alpha": 1.0}, "layernorm_mlp_alpha"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_keys_transformers_would_misrun_are_refused_by_name(change, key):
    raw = published() if key == "rotary_dim" else runnable(published())
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_dict(raw | change)


def test_config_runs_as_transformers_runs_it(tmp_path):
    raw = runnable(published()) | SIZES
    raw["layer_types"] = raw["layer_types"][:LAYERS]
    assert_runs_as_transformers(
        tmp_path,
        raw,
        "MiniMaxForCausalLM",
        model_seed=9,
        prompts=prompt_ids(3, (6, 150), VOCAB),
        max_tokens=4,
        page_size=16,
        chunked_prefill_size=64,
    )
