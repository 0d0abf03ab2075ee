"""The routing policies alone, on stand-in workers: which worker each one picks, and why."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from baton.server.router.policies import POLICY_NAMES, make_policy
from baton.server.router.policies.cache_aware import CacheAware, CacheAwareSettings
from baton.server.router.policies.power_of_two import PowerOfTwo
from baton.server.router.policies.prefix_blocks import PrefixBlocks, block_chain
from baton.server.router.policies.random_choice import RandomChoice
from baton.server.router.policies.round_robin import RoundRobin

SETTINGS = CacheAwareSettings(
    cache_threshold=0.3, balance_abs_threshold=64, balance_rel_threshold=1.5, max_tree_size=1000
)


@dataclass
class StandIn:
    url: str
    load: int = 0
    track_interval: int = 64


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def test_round_robin_takes_the_workers_in_turn():
    workers = [StandIn("a"), StandIn("b"), StandIn("c")]
    policy = RoundRobin()
    assert [policy.pick(workers, None).worker.url for _ in range(6)] == list("abcabc")


def test_random_reaches_every_worker():
    workers = [StandIn("a"), StandIn("b"), StandIn("c")]
    policy = RandomChoice(random.Random(0))
    assert {policy.pick(workers, None).worker.url for _ in range(60)} == {"a", "b", "c"}


def test_power_of_two_takes_the_less_loaded_of_its_two_draws():
    """With three workers, the most loaded is never the less loaded of two distinct ones."""
    workers = [StandIn("idle", load=0), StandIn("busy", load=5), StandIn("busiest", load=9)]
    policy = PowerOfTwo(random.Random(0))
    picked = [policy.pick(workers, None).worker.url for _ in range(200)]
    assert "busiest" not in picked and {"idle", "busy"} <= set(picked)


def test_every_policy_name_makes_its_policy():
    for name in POLICY_NAMES:
        assert make_policy(name, SETTINGS, random.Random(0)).name == name
    with pytest.raises(ValueError, match="unknown routing policy 'least_load'"):
        make_policy("least_load", SETTINGS, random.Random(0))


def test_a_match_counts_only_whole_blocks_up_to_a_checkpoint_before_the_last_token():
    record = PrefixBlocks(track_interval=64, capacity=100)
    held = tokens(0, 200)
    record.record(block_chain(held, 64))  # 3 whole blocks: 0..191
    # The same 200 tokens again: the 200th is computed anyway, the state at 192 is saved.
    assert record.usable_tokens(200, block_chain(held, 64)) == 192
    # A prompt of exactly 128 held tokens: its last token must be computed, so only block 0.
    assert record.usable_tokens(128, block_chain(held[:128], 64)) == 64
    # 150 shared tokens (K/V would match 150): the last checkpoint inside them is at 128.
    other = held[:150] + tokens(1, 100)
    assert record.usable_tokens(250, block_chain(other, 64)) == 128
    # Nothing shared in the first block: nothing usable, whatever follows.
    assert record.usable_tokens(200, block_chain(tokens(2, 10) + held[10:], 64)) == 0


def test_cache_aware_picks_the_longest_usable_prefix_not_the_longest_kv_match():
    """Worker "coarse" checkpoints every 128 tokens and shares 250 tokens with the prompt (the
    longer K/V match) but can resume only from 128; worker "fine" checkpoints every 64 and
    shares 200, resuming from 192: that is the one to pick."""
    prompt = tokens(0, 400)
    coarse = StandIn("coarse", track_interval=128)
    fine = StandIn("fine", track_interval=64)
    policy = CacheAware(SETTINGS)
    policy.pick([coarse], prompt[:250] + tokens(1, 50))
    policy.pick([fine], prompt[:200] + tokens(2, 100))
    choice = policy.pick([coarse, fine], prompt)
    assert choice.worker is fine and choice.cached_tokens == 192


def test_cache_aware_sends_each_conversation_back_to_the_worker_that_holds_it():
    workers = [StandIn("a"), StandIn("b")]
    policy = CacheAware(SETTINGS)
    first = {seed: policy.pick(workers, tokens(seed, 300)).worker for seed in range(6)}
    assert {w.url for w in first.values()} == {"a", "b"}  # new prompts spread (smallest record)
    for seed, worker in first.items():
        next_turn = tokens(seed, 300) + tokens(100 + seed, 80)
        choice = policy.pick(workers, next_turn)
        assert choice.worker is worker and choice.cached_tokens == 256


def test_cache_aware_balances_load_past_both_imbalance_thresholds():
    holder, idle = StandIn("holder"), StandIn("idle")
    policy = CacheAware(SETTINGS)
    prompt = tokens(0, 300)
    policy.pick([holder], prompt)
    holder.load = 64  # max - min = 64: not above --balance-abs-threshold
    assert policy.pick([holder, idle], prompt).worker is holder
    holder.load = 65  # above both (65 > 0 * 1.5): the least loaded, whatever it holds
    assert policy.pick([holder, idle], prompt).worker is idle
    # That pick was recorded: both hold the prompt now, and balanced again (65 - 50 = 15),
    # the tie goes to the less loaded.
    idle.load = 50
    choice = policy.pick([holder, idle], prompt)
    assert choice.worker is idle and choice.cached_tokens == 256
    holder.load = 10
    assert policy.pick([holder, idle], prompt).worker is holder


def test_cache_aware_below_the_cache_threshold_goes_where_the_least_is_remembered():
    busy_cache, empty = StandIn("busy_cache"), StandIn("empty")
    policy = CacheAware(SETTINGS)
    policy.pick([busy_cache], tokens(0, 640))
    # A new prompt sharing one block of 64 of its 400 tokens (16%, under 0.3) with busy_cache:
    prompt = tokens(0, 64) + tokens(1, 336)
    choice = policy.pick([busy_cache, empty], prompt)
    assert choice.worker is empty and choice.cached_tokens == 0


def test_cache_aware_forgets_a_worker_whose_cache_is_gone():
    worker = StandIn("a")
    policy = CacheAware(SETTINGS)
    prompt = tokens(0, 300)
    policy.pick([worker], prompt)
    assert policy.pick([worker], prompt).cached_tokens == 256
    policy.forget(worker)
    assert policy.pick([worker], prompt).cached_tokens == 0


def test_a_worker_without_a_prefix_cache_is_never_expected_to_hold_anything():
    worker = StandIn("a", track_interval=0)
    policy = CacheAware(SETTINGS)
    policy.pick([worker], tokens(0, 300))
    assert policy.pick([worker], tokens(0, 300)).cached_tokens == 0


def test_the_record_forgets_the_least_recently_used_blocks_deepest_first():
    record = PrefixBlocks(track_interval=64, capacity=4)
    old, new = tokens(0, 192), tokens(1, 128)
    record.record(block_chain(old, 64))  # 3 blocks
    record.record(block_chain(new, 64))  # 2 more: one must go, the old chain's deepest
    assert len(record) == 4
    assert record.usable_tokens(193, block_chain(old, 64)) == 128
    assert record.usable_tokens(129, block_chain(new, 64)) == 128
