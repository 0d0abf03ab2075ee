"""RecurrentGemma-2B's config (tests/fixtures/published_configs/recurrentgemma_2b, with its
SOURCES.md), shrunk in sizes only, built by transformers from that file and run by baton from
that same file: greedy tokens and logprobs must be transformers' (fp32), with the window cut
below the long prompt (the 2048 of the release would not bind at test sizes). The file's legacy
keys read as transformers reads them, and keys transformers would misread are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from baton.engine.config import ModelConfig
from baton.engine.config_error import ConfigError
from tests.published_runs import assert_runs_as_transformers, prompt_ids

FIXTURE = Path(__file__).parent / "fixtures" / "published_configs" / "recurrentgemma_2b"
VOCAB, LAYERS = 512, 4  # recurrent, recurrent, attention, recurrent
SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=LAYERS,
    num_attention_heads=4, head_dim=16, lru_width=64, attention_window_size=24,
)  # fmt: skip


def published() -> dict:
    return json.loads((FIXTURE / "config.json").read_text())


def test_config_reads_as_transformers_reads_it():
    import transformers

    raw = published()
    hf = transformers.RecurrentGemmaConfig(**raw)
    family = ModelConfig.from_dict(raw).family
    assert [
        "linear_attention" if b == "recurrent" else "sliding_attention" for b in family.blocks
    ] == hf.layers_block_type
    assert (family.head_dim, family.num_kv_heads, family.window) == (
        hf.head_dim, hf.num_key_value_heads, hf.attention_window_size
    )  # fmt: skip
    assert family.intermediate_size == hf.intermediate_size // 2
    assert family.rotary.dim == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"])
    assert family.rotary.theta == hf.rope_parameters["rope_theta"]
    assert family.embedding_scale == float(torch.tensor(2560**0.5, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "change, key",
    [
        ({"_block_types": ["recurrent", "attention"]}, "_block_types"),
        ({"embeddings_scale_by_sqrt_dim": False}, "embeddings_scale_by_sqrt_dim"),
        ({"sliding_window": 512}, "sliding_window"),
        ({"logits_soft_cap": None}, "logits_soft_cap"),
        ({"hidden_activation": "relu"}, "hidden_activation"),
        ({"block_types": ["recurrent", "mlp"]}, "block_types"),
    ],
)
def test_keys_transformers_would_misrun_are_refused_by_name(change, key):
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_dict(published() | change)


def test_config_runs_as_transformers_runs_it(tmp_path):
    raw = published() | SIZES
    assert_runs_as_transformers(
        tmp_path,
        raw,
        "RecurrentGemmaForCausalLM",
        model_seed=9,
        prompts=prompt_ids(3, (6, 150), VOCAB),
        max_tokens=4,
        page_size=16,
        chunked_prefill_size=64,
    )
