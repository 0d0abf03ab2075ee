"""MoE models on the serving paths that need no MoE branch: the prefix cache (on == off) and a
disaggregated prefill/decode pair (== colocated), for each tiny MoE config."""

from __future__ import annotations

import pytest
import torch
import zmq

from baton import LLM, SamplingParams
from baton.disagg.decode import DecodeWorker
from baton.disagg.prefill import PrefillWorker
from baton.engine.core.engine import Engine
from tests.conftest import MOE_CONFIGS
from tests.test_disagg_unit import assert_pools_empty, colocated_tokens, config, run_pair

MOE_NAMES = list(MOE_CONFIGS)


def shared_prefix_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(17)
    prefix = torch.randint(3, vocab, (70,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab, (5 + 3 * i,), generator=g).tolist() for i in range(4)]


@pytest.mark.parametrize("name", MOE_NAMES)
def test_moe_prefix_cache_on_matches_off(tiny_models, name):
    model_dir, hf = tiny_models(name)
    prompts = shared_prefix_prompts(hf.config.vocab_size)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    off = LLM(model_dir, page_size=4, enable_prefix_caching=False)
    expected = [o.token_ids for o in off.generate(prompts, params)]
    on = LLM(model_dir, page_size=4, mamba_track_interval=32, chunked_prefill_size=40)
    outs = on.generate(prompts[:1], params) + on.generate(prompts[1:], params)
    assert [o.token_ids for o in outs] == expected
    assert all(o.num_cached_tokens >= 64 for o in outs[1:])  # the shared prefix really hit
    stats = on.stats()
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


@pytest.mark.parametrize("name", MOE_NAMES)
def test_moe_disaggregated_pair_matches_colocated(tiny_models, name):
    model_dir, _ = tiny_models(name)
    ctx = zmq.Context()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 40)), list(range(5, 90)), [7]]
    expect = colocated_tokens(Engine(model_dir, page_size=4), prompts, params)
    # This test is about the handover's content, not its timeouts: generous ones, so that a
    # slow first step on a loaded machine cannot fail a room.
    slow_ok = dict(bootstrap_timeout_s=60.0, transfer_timeout_s=60.0)
    prefill = PrefillWorker(
        Engine(model_dir, page_size=4, chunked_prefill_size=32),
        config("prefill", **slow_ok),
        ctx,
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
