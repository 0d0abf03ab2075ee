"""Tiers under the pools (engine/cache/tiers.py): returning conversations whose prefix blocks were
evicted from the pools resume from the file tier (and after a restart on the same directory) or
the host tier, with outputs identical to a server without prefix caching, token for token and
logprob for logprob."""

from __future__ import annotations

import json
import threading

import pytest

from baton import LLM
from baton.engine.cache.tier_format import PREFIX
from tests.hicache_helpers import (
    FAMILIES,
    INTERVAL,
    POOLS,
    block_files,
    conversations,
    family_model,
    first_turns,
    greedy,
    one_by_one,
    tiered,
    without_prefix_cache,
)
from tests.same_outputs import assert_same_outputs


@pytest.mark.parametrize("family", FAMILIES)
def test_returning_conversations_resume_from_files_also_after_a_restart(request, tmp_path, family):
    model_dir, vocab = family_model(request, family)
    store = tmp_path / "tier"
    with LLM(model_dir, **tiered(store)) as llm:
        returning = first_turns(llm, conversations(vocab))
        outs, hits = one_by_one(llm, returning)
        assert llm.stats().kv_pages_used == 0 and llm.stats().mamba_slots_used == 0
    expected = without_prefix_cache(model_dir, returning)
    assert_same_outputs(outs, expected)
    # the pools hold ~2 conversations: at least 8 of 10 come back from files
    assert sum(h > 0 for h in hits) >= 8, hits
    assert sum(o.num_cached_tokens >= 3 * INTERVAL for o in outs) >= 8
    assert block_files(store)

    with LLM(model_dir, **tiered(store)) as restarted:  # same directory, nothing in the pools
        again, hits = one_by_one(restarted, returning)
    assert_same_outputs(again, expected)
    assert sum(h > 0 for h in hits) >= 8, hits


def test_host_tier_alone_serves_returning_conversations(request):
    model_dir, vocab = family_model(request, "nemotron_h")
    with LLM(model_dir, **POOLS, enable_hierarchical_cache=True, hicache_size=0.01) as llm:
        returning = first_turns(llm, conversations(vocab))
        before = llm.engine.tier_stats()["hicache:host:hits"]
        outs, _ = one_by_one(llm, returning)
        stats = llm.engine.tier_stats()
    assert_same_outputs(outs, without_prefix_cache(model_dir, returning))
    assert stats["hicache:host:hits"] - before >= 8 * 3
    assert "hicache:file:hits" not in stats


def test_without_tiers_the_same_pools_miss(request):
    """The scenario's baseline: what the tiers fix (evicted checkpoints are lost)."""
    model_dir, vocab = family_model(request, "nemotron_h")
    with LLM(model_dir, **POOLS) as llm:
        returning = first_turns(llm, conversations(vocab))
        outs, _ = one_by_one(llm, returning)
    assert sum(o.num_cached_tokens > 0 for o in outs) <= 3


def test_host_and_file_tiers_write_through_and_host_hits_first(request, tmp_path):
    model_dir, vocab = family_model(request, "nemotron_h")
    with LLM(model_dir, **tiered(tmp_path / "tier", hicache_size=0.01)) as llm:
        returning = first_turns(llm, conversations(vocab))
        one_by_one(llm, returning)
        llm.engine.tiers.flush()  # the file tier writes behind: its last writes may be queued
        stats = llm.engine.tier_stats()
    assert stats["hicache:host:hits"] >= 8 * 3
    assert stats["hicache:file:hits"] == 0  # the host had every block the files had
    assert stats["hicache:file:writes"] == stats["hicache:host:writes"] > 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(hicache_size=1.0), "--hicache-size needs --enable-hierarchical-cache"),
        (dict(enable_hierarchical_cache=True), "needs a tier"),
        (dict(enable_hierarchical_cache=True, hicache_size=0.0), "--hicache-size must be > 0"),
        (
            dict(enable_hierarchical_cache=True, hicache_storage_backend="s3"),
            "--hicache-storage-backend must be one of file",
        ),
        (
            dict(enable_hierarchical_cache=True, hicache_storage_backend="file"),
            "needs --hicache-storage-dir",
        ),
        (
            dict(enable_hierarchical_cache=True, hicache_storage_dir="/tmp/x"),
            "--hicache-storage-dir needs --hicache-storage-backend file",
        ),
        (
            dict(enable_hierarchical_cache=True, hicache_size=1.0, enable_prefix_caching=False),
            "needs prefix caching",
        ),
        (
            dict(enable_hierarchical_cache=True, hicache_size=1.0, tensor_parallel_size=2),
            "not supported with --tensor-parallel-size > 1",
        ),
    ],
)
def test_bad_tier_settings_are_refused_naming_the_flag(flags, message):
    from baton.engine.core.engine_args import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(**flags)


@pytest.mark.parametrize("family", ["rgemma_local", "lfm3_mixed"])
def test_a_block_closed_behind_a_sliding_window_comes_back_with_its_dead_pages(
    request, tmp_path, family
):
    """RecurrentGemma's local attention (window 10), or LFM3's sliding layers beside full
    attention (window 16, a page table of their own): a block that closes during decode has
    given back its pages behind the window (the dummy page 0 in its list; LFM3: in its sliding
    table only); its file says so, and the hit resumes with the dummy there again, as a
    device hit would."""
    model_dir, vocab = family_model(request, family)
    store = tmp_path / "tier"
    with LLM(model_dir, **tiered(store)) as llm:
        convs = conversations(vocab, length=230)
        returning = first_turns(llm, convs, max_tokens=30)  # block 3 closes at 256, in decode
        outs, hits = one_by_one(llm, returning)
    headers = [
        json.loads(
            p.read_bytes()[PREFIX.size : PREFIX.size + PREFIX.unpack_from(p.read_bytes())[2]]
        )
        for p in block_files(store)
    ]
    assert any(not all(h["live_pages"]) for h in headers)  # dead pages were not stored as live
    assert_same_outputs(outs, without_prefix_cache(model_dir, returning))
    assert sum(o.num_cached_tokens >= 4 * INTERVAL for o in outs) >= 8


def test_running_requests_step_while_a_returning_prefix_is_read_from_files(
    request, tmp_path, monkeypatch
):
    """The file read happens off the step: a returning conversation waits in the queue while its
    blocks are read (held here until released), and a running request keeps decoding."""
    model_dir, vocab = family_model(request, "nemotron_h")
    with LLM(model_dir, **tiered(tmp_path / "tier")) as llm:
        returning = first_turns(llm, conversations(vocab))
        engine = llm.engine
        files = engine.tiers.stores[0]
        gate, read = threading.Event(), files.get
        monkeypatch.setattr(files, "get", lambda *a: (gate.wait(30), read(*a))[1])
        engine.add_request("running", returning[9][:40], greedy(30))
        engine.step()
        engine.add_request("returning", returning[0], greedy())
        tokens: dict[str, list[int]] = {"running": [], "returning": []}
        for _ in range(5):
            for delta in engine.step():
                tokens[delta.request_id] += delta.new_token_ids
        assert len(tokens["running"]) >= 5 and not tokens["returning"]
        assert engine.tiers.reading and engine.scheduler.waiting[0].request_id == "returning"
        gate.set()
        cached = 0
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens[delta.request_id] += delta.new_token_ids
                if delta.request_id == "returning":
                    cached = delta.num_cached_tokens
    (expected,) = without_prefix_cache(model_dir, [returning[0]])
    assert tokens["returning"] == expected.token_ids and cached >= 3 * INTERVAL


def test_a_stopping_engine_persists_what_its_pools_hold(request, tmp_path):
    """Two conversations fit the pools: nothing is evicted while they run, yet the engine that
    stops writes their blocks down, and the next one on the directory starts from them."""
    model_dir, vocab = family_model(request, "nemotron_h")
    store = tmp_path / "tier"
    with LLM(model_dir, **tiered(store)) as llm:
        returning = first_turns(llm, conversations(vocab, n=2))
        assert llm.stats().prefix_cache_evictions == 0 and not block_files(store)
    assert len(block_files(store)) >= 2 * 3
    with LLM(model_dir, **tiered(store)) as restarted:
        outs, hits = one_by_one(restarted, returning)
    assert all(h >= 3 for h in hits), hits
    assert_same_outputs(outs, without_prefix_cache(model_dir, returning))
