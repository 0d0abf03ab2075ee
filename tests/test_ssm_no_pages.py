"""A model with no attention layer (a pure SSM: Mamba) and one whose only state is a conv window
(LFM2 with conv layers only) run with no K/V pool and no page accounting: no request holds a page,
no page budget bounds their context, and still prefix caching (state checkpoints only) and a
disaggregated pair (state only) work, with caches on both sides: outputs equal a colocated run
with the cache off."""

from __future__ import annotations

import pytest
import torch
import zmq

from disagg.decode import DecodeWorker
from disagg.prefill import PrefillWorker
from engine import LLM, SamplingParams
from engine.core.engine import Engine
from tests.same_outputs import assert_same_tokens_and_logprobs, chosen
from tests.test_disagg_unit import assert_pools_empty, collect, config

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
    original = engine.runner.forward
    engine.runner.forward = lambda sched: (pages_seen.extend(sched.kv_pages), original(sched))[1]
    outs = llm.generate([list(range(3, 90)), [7, 8]], SamplingParams(max_tokens=5, temperature=0))
    assert all(len(o.token_ids) == 5 for o in outs)
    assert pages_seen and all(pages == () for pages in pages_seen)
    stats = llm.stats()
    assert stats.kv_pages_total == 0 and stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


@pytest.mark.parametrize("name", STATE_ONLY)
def test_disaggregated_pair_with_caches_on_both_sides_matches_colocated(ssm_models, name):
    """Shared prefixes hit the prefill worker's checkpoints; the decode worker registers the
    transferred ones, so its next request skips them (nothing but state crosses)."""
    model_dir, hf = ssm_models(name)
    ctx = zmq.Context()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    args = dict(page_size=4, mamba_track_interval=64, chunked_prefill_size=48)
    prefill = PrefillWorker(Engine(model_dir, **args), config("prefill"), ctx)
    decoder = DecodeWorker(Engine(model_dir, **args), config("decode"), ctx)
    reference = Engine(model_dir, page_size=4, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, hf.config.vocab_size, (140,), generator=g).tolist()
    questions = [shared + [3 + i, 9, 4 + i] for i in range(3)]
    try:
        results = collect(prefill, decoder, [("q0", questions[0])], params)
        results |= collect(prefill, decoder, [("q1", questions[1]), ("q2", questions[2])], params)
        for i, question in enumerate(questions):
            reference.add_request(f"ref{i}", question, params)
        expected: dict[str, tuple[list, list]] = {}
        while reference.has_unfinished_requests():
            for d in reference.step():
                tokens, logprobs = expected.setdefault(d.request_id, ([], []))
                tokens.extend(d.new_token_ids)
                logprobs.extend(chosen(d.new_token_ids, d.new_logprobs))
        for i in range(3):
            tokens, cached, logprobs = results[f"q{i}"]
            assert_same_tokens_and_logprobs(tokens, logprobs, *expected[f"ref{i}"], f"q{i}")
        assert prefill.engine.stats().prefix_cache_hit_tokens >= 2 * 128
        assert all(results[f"q{i}"][1] >= 128 for i in (1, 2))  # the decode side's own blocks
        assert prefill.counters.kv_chunks == 0  # no page ever streamed
        assert decoder.take_failures() == [] and prefill.take_failures() == []
        assert_pools_empty(prefill, decoder)
    finally:
        prefill.close()
        decoder.close()
