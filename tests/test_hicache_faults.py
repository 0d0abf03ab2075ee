"""Faults under a serving engine (NemotronH, the file tier): damaged files, another model's files,
a tiny size bound, writes interrupted by a kill. Outputs always equal a run without prefix
caching; a damaged file is deleted, never loaded; the tier keeps working."""

from __future__ import annotations

import shutil

import pytest

from baton import LLM
from baton.engine.cache.tier_format import PREFIX
from baton.engine.cache.tier_records import chain_digests
from tests.hicache_helpers import (
    INTERVAL,
    block_files,
    conversations,
    family_model,
    first_turns,
    one_by_one,
    tiered,
    without_prefix_cache,
)
from tests.same_outputs import assert_same_outputs
from tests.tiny import save_tiny_model


@pytest.fixture(scope="module")
def filled(request, tmp_path_factory):
    """(model dir, a tier directory after ten conversations' first turns, the second-turn
    prompts, their outputs without prefix caching, the digest seed)."""
    model_dir, vocab = family_model(request, "nemotron_h")
    store = tmp_path_factory.mktemp("filled") / "tier"
    with LLM(model_dir, **tiered(store)) as llm:
        returning = first_turns(llm, conversations(vocab))
        seed = llm.engine.tiers.identity.fingerprint
    return model_dir, store, returning, without_prefix_cache(model_dir, returning), seed


def copy_of(filled, tmp_path):
    model_dir, store, returning, expected, _ = filled
    mine = tmp_path / "tier"
    shutil.copytree(store, mine)
    return model_dir, mine, returning, expected


def first_block_files(filled, store):
    """The files of the conversations' first blocks: a returning conversation looks its up first."""
    *_, returning, _, seed = filled
    names = [f"{chain_digests(seed, p, INTERVAL, 1)[0].hex()}.blk" for p in returning]
    return [store / n for n in names if (store / n).exists()]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_files_are_recomputed_and_deleted(filled, tmp_path, damage):
    model_dir, store, returning, expected = copy_of(filled, tmp_path)
    damaged = {}
    for path in first_block_files(filled, store):
        data = bytearray(path.read_bytes())
        if damage == "truncate":
            data = data[: PREFIX.size + 40]
        else:
            data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
        damaged[path] = bytes(data)
    assert len(damaged) >= 5
    with LLM(model_dir, **tiered(store)) as llm:
        outs, hits = one_by_one(llm, returning)
        stats = llm.engine.tier_stats()
        llm.engine.tiers.flush()
    assert_same_outputs(outs, expected)
    assert stats["hicache:file:corrupt"] == len(damaged)
    # each damaged file was deleted when looked up (some were written again, soundly, since)
    assert all(not p.exists() or p.read_bytes() != data for p, data in damaged.items())


def test_files_of_another_model_are_ignored(filled, tmp_path):
    """Model B (same config, other weights) finds model A's files under its own names: it reads
    their headers, ignores them, computes, and never outputs A's states."""
    model_a, store, returning, _ = copy_of(filled, tmp_path)
    other = tmp_path / "other-model"
    save_tiny_model(other, seed=5)
    expected = without_prefix_cache(other, returning)
    theirs = block_files(store)
    assert theirs
    with LLM(other, **tiered(tmp_path / "empty")) as llm:
        seed = llm.engine.tiers.identity.fingerprint
    # A's files for the first blocks of each conversation, renamed to what B asks for
    seed_a = filled[-1]
    moved = 0
    for prompt in returning:
        for a_digest, b_digest in zip(
            chain_digests(seed_a, prompt, INTERVAL, 3), chain_digests(seed, prompt, INTERVAL, 3)
        ):
            src = store / f"{a_digest.hex()}.blk"
            if src.exists():
                src.rename(store / f"{b_digest.hex()}.blk")
                moved += 1
    assert moved >= 10
    with LLM(other, **tiered(store)) as llm:
        outs, hits = one_by_one(llm, returning)
        stats = llm.engine.tier_stats()
    assert_same_outputs(outs, expected)
    assert stats["hicache:file:foreign"] >= 1 and stats["hicache:file:corrupt"] == 0
    assert all(o.num_cached_tokens <= 3 * INTERVAL for o in outs)


def test_a_tiny_size_bound_holds_under_load_and_outputs_stay_right(request, tmp_path):
    model_dir, vocab = family_model(request, "nemotron_h")
    store = tmp_path / "tier"
    bound_gib = 200_000 / 2**30  # a few blocks' files (~27 KB each)
    with LLM(model_dir, **tiered(store, hicache_storage_size=bound_gib)) as llm:
        returning = first_turns(llm, conversations(vocab))
        outs = []
        for prompt in returning:
            outs += one_by_one(llm, [prompt])[0]
            llm.engine.tiers.flush()
            assert sum(p.stat().st_size for p in block_files(store)) <= 200_000
        stats = llm.engine.tier_stats()
    assert_same_outputs(outs, without_prefix_cache(model_dir, returning))
    assert stats["hicache:file:evictions"] > 0 and stats["hicache:file:writes"] > 0


def test_a_restart_after_a_kill_mid_write_serves_right_and_recovers(filled, tmp_path):
    model_dir, store, returning, expected = copy_of(filled, tmp_path)
    files = block_files(store)
    dead = 2**22 + 1  # above Linux's pid_max: a writer that is gone
    leftover = store / f".{files[0].stem}.{dead}.7.tmp"
    leftover.write_bytes(files[0].read_bytes()[:500])
    torn = files[1]
    torn.write_bytes(torn.read_bytes()[:-100])  # a half-written file where a whole one belongs
    with LLM(model_dir, **tiered(store)) as llm:
        assert not leftover.exists()
        outs, hits = one_by_one(llm, returning)
        stats = llm.engine.tier_stats()
    assert_same_outputs(outs, expected)
    assert sum(h > 0 for h in hits) >= 8
    assert stats["hicache:file:write_errors"] == 0
