"""Every non-NemotronH family (tests/families.py, two tiny configs each) against transformers:
greedy tokens identical and logprobs within 1e-4 (tie-aware) batched + chunked + mixed and
preempted; prompt logprobs; prefix cache on == off (tokens and logprobs); a disaggregated pair
in process == colocated."""

from __future__ import annotations

import pytest
import torch
import zmq

from baton import LLM, SamplingParams
from baton.disagg.decode import DecodeWorker
from baton.disagg.prefill import PrefillWorker
from baton.engine.core.engine import Engine
from tests.families import FAMILY_CONFIGS
from tests.reference import hf_greedy, hf_prompt_logprobs
from tests.same_outputs import assert_same_outputs
from tests.test_disagg_unit import assert_pools_empty, colocated_tokens, config, run_pair
from tests.test_engine import check_against_reference

NAMES = list(FAMILY_CONFIGS)
# One config per family for the serving paths that hold no family-specific code.
FIRST_OF_EACH = list({FAMILY_CONFIGS[n][1]: n for n in reversed(NAMES)}.values())
LENGTHS = [1, 5, 17, 40, 90]
NEW_TOKENS = [16, 9, 20, 14, 12]


def prompts_for(vocab: int, seed: int = 13) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def greedy_params():
    return [
        SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=1) for m in NEW_TOKENS
    ]


@pytest.fixture(scope="module")
def references(family_models):
    """name -> (model_dir, prompts, [(tokens, logprobs)]), transformers run once per config."""
    built = {}

    def get(name: str):
        if name not in built:
            model_dir, hf = family_models(name)
            prompts = prompts_for(hf.config.vocab_size)
            refs = [hf_greedy(hf, p, m) for p, m in zip(prompts, NEW_TOKENS)]
            built[name] = (model_dir, prompts, refs)
        return built[name]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_batched_chunked_mixed_matches_transformers(references, name):
    model_dir, prompts, refs = references(name)
    llm = LLM(model_dir, page_size=4, max_num_batched_tokens=48, chunked_prefill_size=20)
    modes = []
    original = llm.engine.forward
    llm.engine.forward = lambda sched: (modes.append(sched.mode), original(sched))[1]
    outs = llm.generate(prompts, greedy_params())
    assert {"mixed", "decode"} <= set(modes)  # prefill chunks really shared steps with decodes
    check_against_reference(outs, prompts, refs)
    stats = llm.stats()
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


@pytest.mark.parametrize("name", FIRST_OF_EACH)
def test_preempted_matches_transformers(references, name):
    model_dir, prompts, refs = references(name)
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


@pytest.mark.parametrize("name", NAMES)
def test_prompt_logprobs_match_transformers(family_models, name):
    model_dir, hf = family_models(name)
    prompts = prompts_for(hf.config.vocab_size)[2:]
    llm = LLM(model_dir, page_size=4, chunked_prefill_size=24, max_num_batched_tokens=32)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    for prompt, out in zip(prompts, outs):
        ref = hf_prompt_logprobs(hf, prompt)
        for pos in range(1, len(prompt)):
            for token, lp in out.prompt_logprobs[pos].items():
                assert abs(lp - float(ref[pos - 1, token])) < 1e-4, (name, len(prompt), pos)


def shared_prefix_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(17)
    prefix = torch.randint(3, vocab, (70,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab, (5 + 3 * i,), generator=g).tolist() for i in range(4)]


@pytest.mark.parametrize("name", FIRST_OF_EACH)
def test_prefix_cache_on_matches_off(family_models, name):
    model_dir, hf = family_models(name)
    prompts = shared_prefix_prompts(hf.config.vocab_size)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)
    off = LLM(model_dir, page_size=4, enable_prefix_caching=False)
    expected = off.generate(prompts, params)
    on = LLM(model_dir, page_size=4, mamba_track_interval=32, chunked_prefill_size=40)
    outs = on.generate(prompts[:1], params) + on.generate(prompts[1:], params)
    assert_same_outputs(outs, expected)
    assert all(o.num_cached_tokens >= 64 for o in outs[1:])  # the shared prefix really hit
    stats = on.stats()
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


@pytest.mark.parametrize("name", FIRST_OF_EACH)
def test_disaggregated_pair_matches_colocated(family_models, name):
    model_dir, _ = family_models(name)
    ctx = zmq.Context()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 40)), list(range(5, 90)), [7]]
    expect = colocated_tokens(Engine(model_dir, page_size=4), prompts, params)
    # About the handover's content, not its timeouts: generous ones for a loaded machine.
    slow_ok = dict(bootstrap_timeout_s=60.0, transfer_timeout_s=60.0)
    prefill = PrefillWorker(
        Engine(model_dir, page_size=4, chunked_prefill_size=32), config("prefill", **slow_ok), ctx
    )
    decoder = DecodeWorker(Engine(model_dir, page_size=4), config("decode", **slow_ok), ctx)
    try:
        got = run_pair(prefill, decoder, prompts, params, timeout=120.0)
        assert got == expect
        assert decoder.take_failures() == [] and prefill.take_failures() == []
        assert_pools_empty(prefill, decoder)
    finally:
        prefill.close()
        decoder.close()
