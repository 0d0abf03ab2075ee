"""The tiers under a disaggregated pair (both workers in one process, as tests/test_disagg_unit.py
runs them): each worker's prefix cache writes its evicted blocks to one shared file directory and
continues its matches from it, so returning conversations skip their prefill on the prefill side
and their transfer on the decode side, token for token as a colocated run without a cache."""

from __future__ import annotations

import zmq

from baton.disagg.decode import DecodeWorker
from baton.disagg.prefill import PrefillWorker
from baton.engine.core.engine import Engine
from tests.hicache_helpers import conversations, greedy, tiered
from tests.same_outputs import assert_same_tokens_and_logprobs, chosen
from tests.test_disagg_unit import assert_pools_empty, collect, config


def reference(model_dir, prompts) -> list[tuple[list[int], list[float]]]:
    engine = Engine(model_dir, page_size=4, enable_prefix_caching=False)
    out = []
    for prompt in prompts:
        engine.add_request("ref", prompt, greedy())
        tokens, logprobs = [], []
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens.extend(delta.new_token_ids)
                logprobs.extend(chosen(delta.new_token_ids, delta.new_logprobs))
        out.append((tokens, logprobs))
    return out


def test_both_workers_of_a_pair_resume_returning_conversations_from_one_directory(
    base_model, tmp_path
):
    model_dir, _ = base_model
    ctx = zmq.Context()
    store = tmp_path / "tier"
    prefill = PrefillWorker(Engine(model_dir, **tiered(store)), config("prefill"), ctx)
    decoder = DecodeWorker(Engine(model_dir, **tiered(store)), config("decode"), ctx)
    convs = conversations(300)
    firsts = [
        collect(prefill, decoder, [(f"a{i}", c)], greedy())[f"a{i}"] for i, c in enumerate(convs)
    ]
    returning = [c + tokens + list(range(20, 30)) for c, (tokens, _, _) in zip(convs, firsts)]
    decode_hits, prefill_hits, results = [], [], []
    for i, prompt in enumerate(returning):
        before = (
            decoder.engine.tier_stats()["hicache:file:hits"],
            prefill.engine.tier_stats()["hicache:file:hits"],
        )
        results.append(collect(prefill, decoder, [(f"b{i}", prompt)], greedy())[f"b{i}"])
        decode_hits.append(decoder.engine.tier_stats()["hicache:file:hits"] - before[0])
        prefill_hits.append(prefill.engine.tier_stats()["hicache:file:hits"] - before[1])
    for i, ((tokens, _, logprobs), (ref_tokens, ref_logprobs)) in enumerate(
        zip(results, reference(model_dir, returning))
    ):
        assert_same_tokens_and_logprobs(
            tokens, logprobs, ref_tokens, ref_logprobs, f"turn 2 of {i}"
        )
    assert sum(h > 0 for h in decode_hits) >= 8, decode_hits
    assert sum(h > 0 for h in prefill_hits) >= 8, prefill_hits
    assert all(cached >= 3 * 64 for _, cached, _ in results)
    assert_pools_empty(prefill, decoder)
    prefill.close()
    decoder.close()
    prefill.engine.close()
    decoder.engine.close()
