"""Pages behind a sliding window (the state spec's `page_window`) go back to the pool during
decode, on fake model outputs (no model): what a request keeps is exactly the pages its window
still covers, the pool's occupancy stays flat over a long decode, nothing is released while a
full-attention kind reads every page, and pages the prefix cache owns stay where they are."""

from __future__ import annotations

import torch

from baton.engine.cache.memory import IndexPool
from baton.engine.cache.prefix_cache import PrefixCache
from baton.engine.cache.spec import ModelStateSpec
from baton.engine.core.scheduler import Scheduler, SchedulerConfig
from baton.engine.layers.attention import attention_state
from baton.engine.layers.short_conv import ShortConv, ShortConvConfig
from tests.test_scheduler import RecordedSlotOps, fake_step, make, req

CONV = ShortConv.state_spec(ShortConvConfig(channels=8, conv_kernel=3, bias=False), torch.float32)


def test_page_window_is_the_widest_window_and_none_beside_full_attention():
    sliding = [attention_state(2, 8, torch.float32, w) for w in (16,)] * 2
    assert ModelStateSpec.of([CONV, *sliding]).page_window == 16
    full = attention_state(2, 8, torch.float32)
    assert ModelStateSpec.of([CONV, *sliding, full]).page_window is None  # full reads all
    assert ModelStateSpec.of([CONV]).page_window is None  # no paged state at all
    assert ModelStateSpec.of(sliding).names("paged") == (
        "sliding_attention.k",
        "sliding_attention.v",
    )


def live_pages(r) -> list[int]:
    return [i for i, p in enumerate(r.kv_pages) if p]


def test_decode_keeps_only_the_pages_its_window_still_reads():
    window, page = 10, 4
    sched, _ = make(budget=64, chunk=64, pages=64, page_size=page, page_window=window)
    r = req("r", 5, max_tokens=60)
    sched.add(r)
    while sched.has_work():
        fake_step(sched)
        if r.finished:
            break
        # the step's query sat at num_computed - 1 and read back to num_computed - window
        first_read = max(0, r.num_computed - window) // page
        assert live_pages(r) == list(range(first_read, len(r.kv_pages)))
        assert sched.pages.used == len(live_pages(r))
    assert sched.pages.used == 0 and sched.slots.used == 0


def peak_pages(page_window: int | None) -> int:
    """The most pages a 16-token prompt decoding 2,048 tokens holds (page size 16)."""
    sched, _ = make(budget=64, chunk=64, pages=200, page_size=16, page_window=page_window)
    r = req("r", 16, max_tokens=2048)
    sched.add(r)
    peak = 0
    while not r.finished:
        fake_step(sched)
        peak = max(peak, sched.pages.used)
    assert len(r.output_ids) == 2048 and sched.pages.used == 0
    return peak


def test_occupancy_stays_flat_over_a_2k_token_decode_with_a_256_token_window():
    """What the note reports: page size 16, window 256, a 16-token prompt decoding 2,048 tokens
    holds at most 17 pages (the 256 tokens its queries read and the page being written) where
    it would hold all 129 without the window."""
    assert peak_pages(256) == 17
    assert peak_pages(None) == 129


def test_nothing_is_released_without_a_page_window():
    sched, _ = make(budget=64, chunk=64, pages=64, page_size=4, page_window=None)
    r = req("r", 5, max_tokens=40)
    sched.add(r)
    for _ in range(30):
        fake_step(sched)
    assert 0 not in r.kv_pages and sched.pages.used == len(r.kv_pages)


def test_cached_blocks_keep_their_pages_and_a_released_block_still_commits():
    """Blocks of 8 tokens (2 pages), window 3: a block closed after its first page was released
    is cached with the dummy page there (a hit at its end reads only its last 5 tokens), the
    pages of committed blocks are never released by the request, and ending it gives back only
    what it owns."""
    pages, slots = IndexPool(64, "pages"), IndexPool(8, "slots")
    cache = PrefixCache(track_interval=8, page_size=4, pages=pages, slots=slots)
    config = SchedulerConfig(
        max_num_batched_tokens=64,
        chunked_prefill_size=64,
        max_running_requests=4,
        page_size=4,
        page_window=3,
        policy="mixed",
        max_prefill_tokens=64,
        max_model_len=4096,
        eos_token_ids=(0,),
    )
    sched = Scheduler(config, pages, slots, RecordedSlotOps(), prefix_cache=cache)
    r = req("r", 3, max_tokens=30)
    sched.add(r)
    while not r.finished:
        fake_step(sched)
        for block in r.cached_blocks:
            k = block.depth
            assert r.kv_pages[2 * k : 2 * k + 2] == block.pages
    blocks = sorted(cache.blocks.values(), key=lambda b: b.depth)
    assert len(blocks) == 4  # 32 tokens fed (3 + 29 decoded): four blocks of 8
    # each block's first page fell behind the window before the block closed; the window of a
    # block's end (its last page) is always there
    assert all(b.pages[0] == 0 and b.pages[1] != 0 for b in blocks)
    assert pages.used == sum(1 for b in blocks for p in b.pages if p)  # only the cache's
    cache.clear()
    assert pages.used == 0 and slots.used == 0
