"""A quantized checkpoint (ModelOpt mixed precision: NVFP4 experts, FP8 and NVFP4 linears, the
rest bf16) through the serving paths that hold no quantization code: tensor parallelism (each
rank loads its slice of codes and scales), a disaggregated prefill/decode pair, and the prefix
cache, each against colocated TP=1 on the same checkpoint."""

from __future__ import annotations

import pytest
import torch
import zmq

from disagg.decode import DecodeWorker
from disagg.prefill import PrefillWorker
from engine import LLM, SamplingParams
from engine.core.engine import Engine
from tests.test_disagg_unit import assert_pools_empty, colocated_tokens, config, run_pair

# small pools (preemption), checkpoints every 16 tokens (prefix hits), 16-token chunks
ENGINE_ARGS = dict(
    dtype="float32",
    page_size=4,
    max_num_batched_tokens=32,
    chunked_prefill_size=16,
    max_total_tokens=112,
    max_mamba_slots=4,
    mamba_track_interval=16,
)
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=gen).tolist() for n in lengths]


def assert_same(outs_1, outs_2, tolerance: float) -> None:
    for one, two in zip(outs_1, outs_2, strict=True):
        assert two.token_ids == one.token_ids
        for lp_1, lp_2 in zip(one.logprobs, two.logprobs, strict=True):
            assert lp_2.keys() == lp_1.keys()
            assert all(abs(lp_2[t] - v) <= tolerance for t, v in lp_1.items())


@pytest.fixture(scope="module")
def mixed(quantized_models):
    return quantized_models("nemotron_moe", "modelopt_mixed")[0]


def test_tp2_matches_tp1_on_a_quantized_checkpoint(mixed):
    """Rank 1 holds its rows / inputs of every quantized weight and its scales (experts' NVFP4
    groups of 16 whole, per-tensor FP8 scales on both ranks)."""
    first = prompts(0, (5, 40, 63))
    second = [p[:32] + q for p, q in zip(first[1:], prompts(1, (9, 20)))]  # prefix-cache hits
    tp1 = LLM(mixed, **ENGINE_ARGS)
    tp2 = LLM(mixed, tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        for batch in (first, second):
            assert_same(tp1.generate(batch, PARAMS), tp2.generate(batch, PARAMS), 1e-4)
        assert tp2.stats().prefix_cache_hit_tokens == tp1.stats().prefix_cache_hit_tokens > 0
        assert tp2.stats().kv_pages_used == 0 and tp2.stats().mamba_slots_used == 0
    finally:
        tp2.close()


def test_prefix_cache_on_equals_off_on_a_quantized_checkpoint(mixed):
    on = LLM(mixed, **ENGINE_ARGS)
    off = LLM(mixed, enable_prefix_caching=False, **ENGINE_ARGS)
    shared = prompts(2, (40,))[0]
    batch = [shared + tail for tail in prompts(3, (3, 11, 6))]
    for _ in range(2):  # the second round resumes from the first's checkpoints
        assert_same(off.generate(batch, PARAMS), on.generate(batch, PARAMS), 1e-4)
    assert on.stats().prefix_cache_hit_tokens > 0


def test_disaggregated_pair_equals_colocated_on_a_quantized_checkpoint(mixed):
    ctx = zmq.Context()
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    batch = prompts(4, (1, 6, 45))
    expect = colocated_tokens(Engine(mixed, page_size=4), batch, params)
    prefill = PrefillWorker(
        Engine(mixed, page_size=4, chunked_prefill_size=16), config("prefill"), ctx
    )
    decoder = DecodeWorker(Engine(mixed, page_size=4), config("decode"), ctx)
    try:
        assert run_pair(prefill, decoder, batch, params) == expect
        assert decoder.take_failures() == [] and prefill.take_failures() == []
        assert_pools_empty(prefill, decoder)
    finally:
        prefill.close()
        decoder.close()
