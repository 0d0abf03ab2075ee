"""A model with no attention layer (a pure SSM: Mamba) and one whose only state is a conv window
(LFM2 with conv layers only) run with no K/V pool and no page accounting: no request holds a page
and no page budget bounds their context (their prefix caching and PD: tests/test_ssm_pd.py)."""

from __future__ import annotations

import pytest

from baton import LLM, SamplingParams

STATE_ONLY = ["mamba_a", "lfm2_conv_only"]


@pytest.mark.parametrize("name", STATE_ONLY)
def test_no_request_holds_a_page_and_no_page_budget_bounds_the_context(ssm_models, name):
    model_dir, _ = ssm_models(name)
    # a token budget of 8 would cap a paged model's context at 8 tokens
    llm = LLM(model_dir, page_size=4, max_total_tokens=8, chunked_prefill_size=32)
    engine = llm.engine
    assert not engine.cache.paged and engine.pages.capacity == 0
    assert engine.max_model_len == engine.model_config.max_position_embeddings
    pages_seen = []
    original = engine.forward
    engine.forward = lambda sched: (pages_seen.extend(sched.kv_pages), original(sched))[1]
    outs = llm.generate([list(range(3, 90)), [7, 8]], SamplingParams(max_tokens=5, temperature=0))
    assert all(len(o.token_ids) == 5 for o in outs)
    assert pages_seen and all(pages == () for pages in pages_seen)
    stats = llm.stats()
    assert stats.kv_pages_total == 0 and stats.kv_pages_used == 0 and stats.mamba_slots_used == 0
