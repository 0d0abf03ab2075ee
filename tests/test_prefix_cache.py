"""Prefix caching with Mamba checkpoints: cache on == cache off, token for token, with logprobs
within 1e-4 (fp32)."""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.cache.pools import StateCache
from baton.engine.checkpoint.loader import load_model
from baton.engine.config import ModelConfig
from baton.engine.executor.forward_metadata import ScheduledBatch, TrackPoint
from baton.engine.executor.model_runner import ModelRunner
from baton.engine.models.nemotron_h import Mamba2Mixer
from tests.same_outputs import assert_same_outputs

INTERVAL = 32  # tiny base model: chunk 16, page 4


def few_shot_prompts(vocab: int, num_questions: int = 32, prefix_len: int = 5 * 29):
    """A shared 5-shot-like prefix (several times the interval) + different questions."""
    g = torch.Generator().manual_seed(21)
    prefix = torch.randint(3, vocab, (prefix_len,), generator=g).tolist()
    return [
        prefix
        + torch.randint(
            3, vocab, (int(torch.randint(5, 40, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(num_questions)
    ]


def greedy(max_tokens=16):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)


def run_sequentially_then_batched(llm, prompts):
    first = llm.generate(prompts[:1], greedy())
    return first + llm.generate(prompts[1:], greedy())


@pytest.fixture(scope="module")
def cache_off_outputs(base_model):
    model_dir, hf = base_model
    prompts = few_shot_prompts(hf.config.vocab_size)
    off = LLM(model_dir, page_size=4, enable_prefix_caching=False)
    return prompts, off.generate(prompts, greedy())


def test_shared_few_shot_prefix_hits_and_matches_cache_off(base_model, cache_off_outputs):
    model_dir, _ = base_model
    prompts, expected = cache_off_outputs
    on = LLM(model_dir, page_size=4, mamba_track_interval=INTERVAL)
    outs = run_sequentially_then_batched(on, prompts)
    assert_same_outputs(outs, expected)
    assert outs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 4 * INTERVAL for o in outs[1:])
    stats = on.stats()
    assert (
        stats.prefix_cache_hit_tokens > 0
        and stats.kv_pages_used == 0
        and stats.mamba_slots_used == 0
    )


def test_multi_turn_chat_hits_on_previous_answer(base_model):
    model_dir, hf = base_model
    g = torch.Generator().manual_seed(4)
    turn1 = torch.randint(3, hf.config.vocab_size, (50,), generator=g).tolist()
    results = {}
    for enabled in (False, True):
        llm = LLM(
            model_dir, page_size=4, mamba_track_interval=INTERVAL, enable_prefix_caching=enabled
        )
        (a1,) = llm.generate([turn1], greedy(40))
        turn2 = (
            turn1
            + a1.token_ids
            + torch.randint(3, 300, (9,), generator=torch.Generator().manual_seed(5)).tolist()
        )
        (a2,) = llm.generate([turn2], greedy(20))
        results[enabled] = (a1, a2)
    assert_same_outputs(list(results[True]), list(results[False]))
    # The first turn computed 50 prompt tokens (one block: 32) and 39 of its answer's: the block
    # ending at 64 was checkpointed in a decode step, and the second turn resumes from it.
    assert results[True][1].num_cached_tokens == 64 and results[False][1].num_cached_tokens == 0


def test_small_pools_force_evictions_and_outputs_stay_identical(base_model, cache_off_outputs):
    model_dir, _ = base_model
    prompts, expected = cache_off_outputs
    small = LLM(
        model_dir,
        page_size=4,
        mamba_track_interval=INTERVAL,
        max_total_tokens=900,
        max_mamba_slots=10,
        max_running_requests=4,
    )
    outs = run_sequentially_then_batched(small, prompts)
    stats = small.stats()
    assert stats.prefix_cache_evictions > 0
    assert_same_outputs(outs, expected)
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0
    small.engine.reset_prefix_cache()
    assert small.engine.pages.used == 0 and small.engine.slots.used == 0


def test_batched_unaligned_checkpoints_hold_true_states(base_model):
    """Three sequences resumed at unaligned positions in one batch checkpoint at chunk-aligned
    positions; each checkpoint equals a single-request run that stopped there."""
    model_dir, _ = base_model
    config = ModelConfig.from_hf(model_dir)
    model = load_model(model_dir, torch.float32, "cpu")
    cs = config.family.mamba.chunk_size
    g = torch.Generator().manual_seed(8)
    seqs = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in (70, 53, 90)]
    starts = [5, 19, 33]  # already computed before the batched step
    page_sets = [tuple(range(1 + 30 * i, 31 + 30 * i)) for i in range(3)]

    def fresh():
        cache = StateCache.for_model(
            config,
            num_pages=100,
            page_size=4,
            num_slots=32,
            dtype=torch.float32,
            device="cpu",
        )
        return cache, ModelRunner(model, cache, "cpu")

    def batch(parts, points=()):
        return ScheduledBatch(
            mode="extend",
            request_ids=tuple(f"r{i}" for i, _ in parts),
            num_decode_seqs=0,
            num_verify_seqs=0,
            input_ids=tuple(t for _, (toks, _) in parts for t in toks),
            seq_lens=tuple(len(toks) for _, (toks, _) in parts),
            start_positions=tuple(start for _, (_, start) in parts),
            kv_pages=tuple(page_sets[i] for i, _ in parts),
            mamba_slots=tuple(1 + i for i, _ in parts),
            verify_slots=(),
            logits_seqs=tuple(range(len(parts))),
            prompt_logprob_seqs=(),
            has_mamba_track_mask=bool(points),
            track_points=tuple(points),
            lora_slots=(-1,) * len(tuple(f"r{i}" for i, _ in parts)),
        )

    cache, runner = fresh()
    runner.forward(batch([(i, (seqs[i][: starts[i]], 0)) for i in range(3)]))
    points, expect = [], []
    dst = 8
    for i in range(3):
        for boundary in range((starts[i] // cs + 1) * cs, len(seqs[i]) + 1, cs):
            points.append(
                TrackPoint(seq_index=i, token_offset=boundary - starts[i] - 1, dst_slot=dst)
            )
            expect.append((dst, i, boundary))
            dst += 1
    runner.forward(batch([(i, (seqs[i][starts[i] :], starts[i])) for i in range(3)], points))
    assert len(expect) >= 6
    for dst, i, boundary in expect:
        ref_cache, ref_runner = fresh()
        ref_runner.forward(batch([(i, (seqs[i][:boundary], 0))]))
        torch.testing.assert_close(
            cache.pools["mamba2.ssm"][:, dst],
            ref_cache.pools["mamba2.ssm"][:, 1 + i],
            atol=1e-5,
            rtol=1e-5,
        )
        torch.testing.assert_close(
            cache.pools["mamba2.conv"][:, dst],
            ref_cache.pools["mamba2.conv"][:, 1 + i],
            atol=1e-6,
            rtol=1e-6,
        )


def test_skipping_the_ssm_checkpoint_copy_is_caught(base_model, cache_off_outputs, monkeypatch):
    """The seed bug end to end: without the checkpoint copy, cache hits resume from stale state
    and outputs differ from cache off, so the equality test above would catch it."""
    model_dir, _ = base_model
    prompts, expected = cache_off_outputs
    monkeypatch.setattr(Mamba2Mixer, "checkpoint", lambda self, *args: None)
    on = LLM(model_dir, page_size=4, mamba_track_interval=INTERVAL)
    outs = run_sequentially_then_batched(on, prompts[:8])
    assert all(o.num_cached_tokens > 0 for o in outs[1:])
    with pytest.raises(AssertionError, match="differ"):
        assert_same_outputs(outs, expected[:8])


def test_track_interval_must_align_with_chunk_and_page(base_model):
    model_dir, _ = base_model
    with pytest.raises(ValueError, match="multiple of the state.s chunk size"):
        LLM(model_dir, page_size=4, mamba_track_interval=24)


def test_a_request_waiting_for_memory_is_looked_up_once(base_model):
    """Prefix-cache lookups count when their match is used: a request retried every step while
    the pool is full must not inflate the queries (the hit rate's denominator)."""
    from baton.engine.core.engine import Engine

    model_dir, _ = base_model
    engine = Engine(model_dir, page_size=4, mamba_track_interval=INTERVAL, max_total_tokens=160)
    first, second = list(range(3, 120)), list(range(5, 100))
    engine.add_request("a", first, greedy(max_tokens=30))
    engine.step()
    engine.add_request("b", second, greedy(max_tokens=4))
    waited = 0
    while engine.has_unfinished_requests():
        waited += "b" in engine.requests and engine.requests["b"].num_computed == 0
        engine.step()
    assert waited >= 3  # b waited for a's pages over several steps
    assert engine.stats().prefix_cache_query_tokens == len(first) + len(second)


def test_an_unloaded_adapters_blocks_are_dropped_and_only_its_own():
    """remove_lora's cleanup (PrefixCache.drop_adapter): the blocks salted with one adapter go,
    the base model's and another adapter's stay, nothing is sent down a tier."""
    from baton.engine.cache.memory import IndexPool
    from baton.engine.cache.prefix_cache import PrefixCache

    cache = PrefixCache(track_interval=4, page_size=4, pages=IndexPool(16, "pages"),
                        slots=IndexPool(8, "slots"), page_tables=1)  # fmt: skip
    demoted = []
    cache.tiers = type("Tiers", (), {"demote": lambda self, block: demoted.append(block)})()
    ids = list(range(3, 12))
    for adapter in (None, "a", "b"):
        parent = None
        for k, key in enumerate(cache.chain_keys(ids, 2, adapter=adapter)):
            pages, slot = cache.pages.alloc(1), cache.slots.alloc(1)[0]
            parent = cache.insert(key, tuple(ids[4 * k : 4 * k + 4]), parent, pages, slot,
                                  adapter=adapter)  # fmt: skip
            cache.release([parent])
    free = cache.pages.available
    assert cache.drop_adapter("a") == 2 and not demoted
    assert cache.pages.available == free + 2
    assert {b.adapter for b in cache.blocks.values()} == {None, "b"}
    assert len(cache.match(ids, adapter="a")) == 0 and len(cache.match(ids, adapter="b")) == 2


def test_tiers_are_refused_with_adapters():
    from baton.engine.core.engine_args import EngineArgs

    with pytest.raises(ValueError, match="enable-hierarchical-cache with --enable-lora"):
        EngineArgs(enable_lora=True, enable_hierarchical_cache=True, hicache_size=1.0)
