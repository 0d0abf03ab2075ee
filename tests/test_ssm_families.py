"""Jamba, LFM2, LFM2-MoE, Mamba, Mamba2 and Falcon-Mamba (tests/ssm_families.py, two tiny configs
each) against transformers in fp32: greedy tokens identical and logprobs within 1e-4 (tie-aware)
batched with chunked prefills sharing steps with decodes, and prompt logprobs; preempted for the
hybrids (page pressure is all that preempts, and only they hold pages); prefix cache on, with
decodes in the padded static-shape step, = cache off, with hits."""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from tests.reference import hf_greedy, hf_prompt_logprobs
from tests.same_outputs import assert_same_outputs
from tests.ssm_families import SSM_CONFIGS
from tests.test_engine import check_against_reference

NAMES = list(SSM_CONFIGS)
ONE_PER_FAMILY = list({SSM_CONFIGS[n][1]: n for n in reversed(NAMES)}.values())
HYBRIDS = [n for n in ONE_PER_FAMILY if SSM_CONFIGS[n][1].startswith(("Jamba", "Lfm2"))]
LENGTHS, NEW_TOKENS = [5, 23, 50], [7, 5, 6]


@pytest.fixture(scope="module")
def references(ssm_models):
    """name -> (model_dir, prompts, [(tokens, logprobs)], prompt logprobs of prompts[1])."""
    built = {}

    def get(name: str):
        if name not in built:
            model_dir, hf = ssm_models(name)
            g = torch.Generator().manual_seed(13)
            prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist()
                       for n in LENGTHS]  # fmt: skip
            refs = [hf_greedy(hf, p, m) for p, m in zip(prompts, NEW_TOKENS)]
            built[name] = (model_dir, prompts, refs, hf_prompt_logprobs(hf, prompts[1]))
        return built[name]

    return get


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **extra)


@pytest.mark.parametrize("name", NAMES)
def test_batched_chunked_mixed_and_prompt_logprobs_match_transformers(references, name):
    model_dir, prompts, refs, prompt_ref = references(name)
    llm = LLM(model_dir, page_size=4, max_num_batched_tokens=40, chunked_prefill_size=16)
    modes = []
    original = llm.engine.forward
    llm.engine.forward = lambda sched: (modes.append(sched.mode), original(sched))[1]
    params = [greedy(m, logprobs=1) for m in NEW_TOKENS] + [greedy(1, prompt_logprobs=2)]
    outs = llm.generate(prompts + [prompts[1]], params)
    assert {"mixed", "decode"} <= set(modes)  # prefill chunks really shared steps with decodes
    check_against_reference(outs[:3], prompts, refs)
    scored = outs[3].prompt_logprobs
    for pos in range(1, len(prompts[1])):
        for token, lp in scored[pos].items():
            assert abs(lp - float(prompt_ref[pos - 1, token])) < 1e-4, (pos, token)
    stats = llm.stats()
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


@pytest.mark.parametrize("name", HYBRIDS)
def test_preempted_matches_transformers(references, name):
    model_dir, prompts, refs, _ = references(name)
    llm = LLM(
        model_dir,
        page_size=4,
        max_num_batched_tokens=64,
        chunked_prefill_size=32,
        max_total_tokens=60,  # 15 pages: the longest request needs 14 of them
        max_mamba_slots=3,
    )
    outs = llm.generate(prompts, [greedy(m, logprobs=1) for m in NEW_TOKENS])
    stats = llm.stats()
    assert stats.num_preemptions > 0
    check_against_reference(outs, prompts, refs)
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_prefix_cache_with_padded_decode_matches_cache_off(ssm_models, name):
    """Prompts sharing 120 tokens, checkpoints every 32: the later ones resume from the shared
    prefix's checkpoint, and decodes cross a checkpoint inside the padded decode step."""
    model_dir, hf = ssm_models(name)
    g = torch.Generator().manual_seed(17)
    vocab = hf.config.vocab_size
    prefix = torch.randint(3, vocab, (120,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, vocab, (3 + 2 * i,), generator=g).tolist()
               for i in range(3)]  # fmt: skip
    params = greedy(8, logprobs=1)
    expected = LLM(model_dir, page_size=4, enable_prefix_caching=False).generate(prompts, params)
    on = LLM(
        model_dir,
        page_size=4,
        mamba_track_interval=64,
        chunked_prefill_size=48,
        cpu_padded_decode=True,
    )
    outs = on.generate(prompts[:1], params) + on.generate(prompts[1:], params)
    assert_same_outputs(outs, expected)
    assert all(o.num_cached_tokens >= 64 for o in outs[1:])  # the shared prefix really hit
    stats = on.stats()
    assert stats.mamba_checkpoints_decode > 0  # a decode crossed position 128
    assert on.engine.graph_runner.num_padded_steps > 0
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0
