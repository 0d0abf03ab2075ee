"""Falcon-H1's parallel block: every layer owns a KV pool and a Mamba state, and each branch
alone (the other's output multiplier set to 0) matches transformers, so the sum of the two
matches for the right reason; the Mamba input multiplier and in_proj segment multipliers
(`mup_vector`) are applied exactly where transformers applies them."""

from __future__ import annotations

import pytest
import torch
import transformers

from baton import LLM, SamplingParams
from tests.families import FAMILY_CONFIGS
from tests.reference import hf_prompt_logprobs
from tests.tiny import align_dt_limit, save_tokenizer, spread_parameters

PROMPT = [(5 * i + 7) % 300 + 3 for i in range(41)]


def save_falcon(path, **overrides):
    _, _, kwargs = FAMILY_CONFIGS["falcon_mup"]
    config = transformers.FalconH1Config(**{**kwargs, **overrides})
    torch.manual_seed(7)
    model = transformers.FalconH1ForCausalLM(config).eval()
    spread_parameters(model)
    align_dt_limit(model)
    model.save_pretrained(str(path))
    save_tokenizer(path, vocab_size=config.vocab_size)
    return model


def prompt_logprobs(model_dir) -> torch.Tensor:
    """(len(PROMPT) - 1, vocab) rows of baton's prompt logprobs for the reference's top tokens."""
    llm = LLM(model_dir, page_size=4, chunked_prefill_size=16, max_num_batched_tokens=16)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))[0]
    stats = llm.stats()
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0
    return out.prompt_logprobs


def assert_matches(model_dir, hf) -> dict:
    ours = prompt_logprobs(model_dir)
    ref = hf_prompt_logprobs(hf, PROMPT)
    for pos in range(1, len(PROMPT)):
        for token, lp in ours[pos].items():
            assert abs(lp - float(ref[pos - 1, token])) < 1e-4, pos
    return ours[-1]


def test_every_falcon_layer_owns_a_kv_pool_and_a_mamba_state(family_models):
    model_dir, hf = family_models("falcon_mup")
    llm = LLM(model_dir, page_size=4)
    cache = llm.engine.cache
    layers = hf.config.num_hidden_layers
    assert len(cache.pools["attention.k"]) == len(cache.pools["attention.v"]) == layers
    assert cache.pools["mamba2.conv"].shape[0] == cache.pools["mamba2.ssm"].shape[0] == layers


@pytest.mark.parametrize(
    "branch", ["attention_only", "mamba_only"], ids=["attention-only", "mamba-only"]
)
def test_each_branch_of_the_parallel_block_matches_transformers(tmp_path, branch):
    silence = (
        dict(ssm_out_multiplier=0.0)
        if branch == "attention_only"
        else dict(attention_out_multiplier=0.0)
    )
    hf = save_falcon(tmp_path / branch, **silence)
    last = assert_matches(tmp_path / branch, hf)
    both = save_falcon(tmp_path / "both")
    last_both = assert_matches(tmp_path / "both", both)
    # The silenced branch really contributed in the full model.
    assert any(abs(last[t] - last_both.get(t, last[t] + 1)) > 1e-3 for t in last)


def test_mamba_multipliers_are_applied_where_transformers_applies_them(tmp_path):
    """ssm_in_multiplier and mup_vector changed: still equal to transformers, and different
    from the model without them (they are not silently ignored)."""
    plain = save_falcon(tmp_path / "plain", ssm_in_multiplier=1.0, ssm_multipliers=[1.0] * 5)
    last_plain = assert_matches(tmp_path / "plain", plain)
    scaled = save_falcon(
        tmp_path / "scaled", ssm_in_multiplier=2.5, ssm_multipliers=[1.5, 0.5, 2.0, 0.7, 1.8]
    )
    last_scaled = assert_matches(tmp_path / "scaled", scaled)
    assert any(abs(last_scaled[t] - last_plain.get(t, 99.0)) > 1e-3 for t in last_scaled)
