"""MoE NemotronH (tests/conftest.py MOE_CONFIGS) against transformers: the engine batched,
chunked, mixed and preempted gives transformers' greedy tokens with logprobs within 1e-4."""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from tests.conftest import MOE_CONFIGS
from tests.reference import hf_greedy, hf_prompt_logprobs
from tests.test_engine import check_against_reference

MOE_NAMES = list(MOE_CONFIGS)
LENGTHS = [1, 5, 17, 40, 90]
NEW_TOKENS = [16, 9, 20, 14, 12]


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(13)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def moe_references(tiny_models):
    """name -> (model_dir, prompts, [(tokens, logprobs)]), transformers run once per config."""
    built = {}

    def get(name: str):
        if name not in built:
            model_dir, hf = tiny_models(name)
            prompts = prompts_for(hf.config.vocab_size)
            refs = [hf_greedy(hf, p, m) for p, m in zip(prompts, NEW_TOKENS)]
            built[name] = (model_dir, prompts, refs)
        return built[name]

    return get


def greedy_params():
    return [
        SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=1) for m in NEW_TOKENS
    ]


@pytest.mark.parametrize("name", MOE_NAMES)
def test_moe_batched_chunked_matches_transformers(moe_references, name):
    model_dir, prompts, refs = moe_references(name)
    llm = LLM(model_dir, page_size=4, max_num_batched_tokens=48, chunked_prefill_size=20)
    modes = []
    original = llm.engine.forward
    llm.engine.forward = lambda sched: (modes.append(sched.mode), original(sched))[1]
    outs = llm.generate(prompts, greedy_params())
    assert {"mixed", "decode"} <= set(modes)  # prefill chunks really shared steps with decodes
    check_against_reference(outs, prompts, refs)
    stats = llm.stats()
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


@pytest.mark.parametrize("name", MOE_NAMES)
def test_moe_preempted_matches_transformers(moe_references, name):
    model_dir, prompts, refs = moe_references(name)
    llm = LLM(
        model_dir,
        page_size=4,
        max_num_batched_tokens=64,
        chunked_prefill_size=32,
        max_total_tokens=112,  # the longest request needs 26 of these 28 pages
        max_mamba_slots=4,
    )
    outs = llm.generate(prompts, greedy_params())
    stats = llm.stats()
    assert stats.num_preemptions > 0
    check_against_reference(outs, prompts, refs)
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


@pytest.mark.parametrize("name", MOE_NAMES)
def test_moe_prompt_logprobs_match_transformers(tiny_models, name):
    model_dir, hf = tiny_models(name)
    prompts = prompts_for(hf.config.vocab_size)[2:]
    llm = LLM(model_dir, page_size=4, chunked_prefill_size=24, max_num_batched_tokens=32)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    for prompt, out in zip(prompts, outs):
        ref = hf_prompt_logprobs(hf, prompt)
        for pos in range(1, len(prompt)):
            for token, lp in out.prompt_logprobs[pos].items():
                assert abs(lp - float(ref[pos - 1, token])) < 1e-4, (name, len(prompt), pos)
