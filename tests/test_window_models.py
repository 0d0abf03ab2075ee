"""The sliding-window families (tests/window_models.py: LFM3 with sliding and full attention, LFM3
with sliding attention only, whose pages behind the window are released during decode) against
transformers in fp32, one engine per config: in one run, prompts batched, prefilled in chunks
beside decodes (mixed steps) and preempted for memory; greedy tokens are transformers' greedy
tokens, their logprobs and every prompt logprob within 1e-4 (teacher forcing,
tests/test_gdn_models.py). Every window is shorter than the longer prompts. Pools are empty at
the end. RecurrentGemma's recurrent block alone (no window, no pages) the same way, but for
preemption (nothing to preempt for)."""

from __future__ import annotations

import pytest

from baton import LLM, SamplingParams
from tests.test_gdn_models import ENGINE, NEW_TOKENS, assert_matches_transformers, prompts_for
from tests.window_models import RECURRENT_ONLY_CONFIGS, WINDOW_CONFIGS, preempting


@pytest.mark.parametrize("name", list(WINDOW_CONFIGS))
def test_engine_matches_transformers(window_models, name):
    model_dir, hf = window_models(name)
    prompts, args = preempting(model_dir, hf.config.vocab_size, prompts_for(hf.config.vocab_size))
    llm = LLM(model_dir, **args)
    modes = []
    original = llm.engine.forward
    llm.engine.forward = lambda sched: (modes.append(sched.mode), original(sched))[1]
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    outs = llm.generate(prompts, params)
    stats = llm.stats()
    assert {"mixed", "decode", "extend"} <= set(modes)
    assert stats.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == NEW_TOKENS and out.finish_reason == "length"
        assert_matches_transformers(hf, prompt, out)
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


def test_windowed_layers_release_their_own_page_table_beside_full_attention(window_models):
    """LFM3's full-attention layers read every page, so its sliding layers keep a page table of
    their own, whose pages behind the window go back during decode while the full table keeps
    every page; with sliding layers only there is one table, released the same way. Both
    tables draw from one pool whose page slots hold one layer of each kind at once (the
    sliding pool shares the full pool's memory)."""
    mixed = LLM(window_models("lfm3_mixed")[0], **ENGINE)
    sliding = LLM(window_models("lfm3_sliding")[0], **ENGINE)
    for llm, tables in ((mixed, (2, 16)), (sliding, (1, 10))):
        config = llm.engine.scheduler.config
        assert (config.page_tables, config.page_window) == tables
    pools = mixed.engine.cache.pools
    assert pools["sliding_attention.k"].untyped_storage().data_ptr() == (
        pools["attention.k"].untyped_storage().data_ptr()
    )
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    last_step, most = [], []
    for llm in (mixed, sliding):
        engine, used = llm.engine, []
        original = engine.forward
        engine.forward = lambda sched, e=engine, u=used, f=original: (
            u.append(e.pages.used),
            f(sched),
        )[1]
        llm.generate([list(range(3, 33))], params)
        last_step.append(used[-1])
        most.append(max(used))
        assert engine.pages.used == 0
    # The last step feeds position 68 (30 + 39 tokens in pages of 4). Mixed: the full table's
    # 18 pages and the window table's pages of positions 53..68 (pages 13..17: the window of
    # 16); sliding only: the pages of positions 59..68, the window of 10.
    assert last_step == [18 + 5, 4]
    # mixed peaks at its last step (the window table never holds more than 6 pages once
    # decoding: 16 tokens span 5 or 6 pages); sliding only at its second prefill chunk's (the
    # 30-token prompt in chunks of 16: positions 6..29, pages 1..7, as the first chunk's pages
    # behind the window went back before it)
    assert most == [18 + 5, 7]


@pytest.mark.parametrize("name", list(RECURRENT_ONLY_CONFIGS))
def test_recurrent_only_model_matches_transformers_without_pages(window_models, name):
    model_dir, hf = window_models(name)
    prompts = prompts_for(hf.config.vocab_size)
    llm = LLM(model_dir, **ENGINE)
    modes = []
    original = llm.engine.forward
    llm.engine.forward = lambda sched: (modes.append(sched.mode), original(sched))[1]
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    outs = llm.generate(prompts, params)
    stats = llm.stats()
    assert {"mixed", "decode", "extend"} <= set(modes)
    assert stats.kv_pages_total == 0
    for prompt, out in zip(prompts, outs):
        assert_matches_transformers(hf, prompt, out)
    assert stats.mamba_slots_used == 0
