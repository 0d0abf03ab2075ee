"""Disaggregated pairs with prefix caches on both workers, for the state-only models (Mamba; LFM2
of conv layers only: nothing but slot state crosses) and the hybrids (LFM2, Jamba): shared
prefixes hit the prefill worker's checkpoints, the decode worker registers the transferred ones
and skips them on its next request, and outputs equal a colocated run with the cache off."""

from __future__ import annotations

import pytest
import torch
import zmq

from baton import SamplingParams
from baton.disagg.decode import DecodeWorker
from baton.disagg.prefill import PrefillWorker
from baton.engine.core.engine import Engine
from tests.same_outputs import assert_same_tokens_and_logprobs, chosen
from tests.test_disagg_unit import assert_pools_empty, collect, config


@pytest.mark.parametrize("name", ["mamba_a", "lfm2_conv_only", "lfm2_a", "jamba_moe"])
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
        if not prefill.engine.cache.paged:
            assert prefill.counters.kv_chunks == 0  # state only: no page ever streamed
        assert decoder.take_failures() == [] and prefill.take_failures() == []
        assert_pools_empty(prefill, decoder)
    finally:
        prefill.close()
        decoder.close()
