"""The registry and each family's config keys: an unknown architecture is refused naming what
baton serves (also by `baton serve` at startup); `model_type` alone picks a family; a missing
required key is a ConfigError naming it; missing optional keys take the defaults of the
family's transformers config class; values baton cannot run are refused by name."""

from __future__ import annotations

import json
import subprocess

import pytest

from baton.engine.config import ModelConfig
from baton.engine.config_error import ConfigError
from baton.engine.models.registry import FAMILIES
from tests.server_process import BATON

BAMBA = {
    "architectures": ["BambaForCausalLM"],
    "model_type": "bamba",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "attn_layer_indices": [1],
    "mamba_n_heads": 8,
    "eos_token_id": 2,
}
GRANITE = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "layer_types": ["mamba", "attention"],
    "num_attention_heads": 4,
    "mamba_n_heads": 8,
    "eos_token_id": 2,
}


def test_unknown_architecture_lists_the_supported_ones():
    with pytest.raises(ConfigError) as error:
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    message = str(error.value)
    assert "GPT2LMHeadModel" in message and "'architectures'" in message
    for architecture in FAMILIES:
        assert architecture in message
    with pytest.raises(ConfigError, match="model_type 'gpt2'"):
        ModelConfig.from_dict({"model_type": "gpt2"})


def test_model_type_alone_picks_the_family():
    config = ModelConfig.from_dict({k: v for k, v in BAMBA.items() if k != "architectures"})
    assert config.architecture == "BambaForCausalLM"
    assert config.family.layer_types == ("mamba", "attention", "mamba")


def test_baton_serve_refuses_an_unknown_architecture_at_startup(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    result = subprocess.run(
        [str(BATON), "serve", "--model", str(tmp_path), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "unsupported architecture 'GPT2LMHeadModel'" in result.stderr
    assert "GraniteMoeHybridForCausalLM" in result.stderr  # the list of what baton serves


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        (BAMBA, "hidden_size"),
        (BAMBA, "num_hidden_layers"),
        (BAMBA, "eos_token_id"),
        (GRANITE, "vocab_size"),
        (GRANITE, "num_attention_heads"),
    ],
)
def test_missing_required_key_is_named(raw, key):
    broken = {k: v for k, v in raw.items() if k != key}
    with pytest.raises(ConfigError, match=f"missing required key '{key}'"):
        ModelConfig.from_dict(broken)


def test_missing_optional_keys_take_transformers_defaults():
    from transformers import BambaConfig, GraniteMoeHybridConfig

    bamba = ModelConfig.from_dict(BAMBA).family
    reference = BambaConfig(**{k: v for k, v in BAMBA.items() if k != "architectures"})
    head_dim = 64 // 4
    # transformers' Bamba rotates half of each head (partial_rotary_factor 0.5) at theta 1e4
    rotary = bamba.attention.rotary
    assert rotary is not None
    assert rotary.dim == int(head_dim * reference.rope_parameters["partial_rotary_factor"])
    assert rotary.theta == reference.rope_parameters["rope_theta"]
    assert bamba.mamba.head_dim == reference.mamba_d_head == 16
    assert bamba.mamba.state_size == reference.mamba_d_state
    assert bamba.mamba.chunk_size == reference.mamba_chunk_size
    assert bamba.norm_eps == reference.rms_norm_eps
    granite = ModelConfig.from_dict(GRANITE).family
    reference = GraniteMoeHybridConfig(**{k: v for k, v in GRANITE.items() if k != "architectures"})
    attention, moe = granite.hybrid.attention, granite.hybrid.moe
    assert attention.rotary is None  # position_embedding_type defaults to None: NoPE
    assert attention.num_kv_heads == reference.num_key_value_heads == 4
    assert attention.scale == reference.attention_multiplier
    assert granite.embedding_multiplier == reference.embedding_multiplier
    assert moe is not None and moe.num_experts == reference.num_local_experts
    assert moe.top_k == reference.num_experts_per_tok


@pytest.mark.parametrize(
    ("raw", "change", "named"),
    [
        (BAMBA, {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        (BAMBA, {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type='yarn'"),
        (BAMBA, {"attn_layer_indices": [7]}, "attn_layer_indices"),
        (BAMBA, {"mamba_d_head": 10}, "mamba_d_head=10"),
        # heads of 16 x 0.01 rotate no channel at all
        (
            BAMBA,
            {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.01}},
            "partial_rotary_factor=0.01",
        ),
        # an odd rotary dim rotates one channel more (transformers' rounding): 2 x 9 of 17
        (
            BAMBA,
            {"head_dim": 17, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 1.0}},
            "rotates 18 channels of head_dim 17",
        ),
        (GRANITE, {"position_embedding_type": "alibi"}, "position_embedding_type='alibi'"),
        (GRANITE, {"layer_types": ["mamba", "moe"]}, "'layer_types' has unknown"),
        (GRANITE, {"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ],
)
def test_values_baton_cannot_run_are_refused_by_name(raw, change, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[")):
        ModelConfig.from_dict({**raw, **change})
