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


def test_page_window_is_the_widest_window_and_windowed_kinds_beside_full_get_a_table():
    sliding = [attention_state(2, 8, torch.float32, w) for w in (16,)] * 2
    alone = ModelStateSpec.of([CONV, *sliding])
    assert (alone.page_window, alone.page_tables) == (16, 1)
    full = attention_state(2, 8, torch.float32)
    mixed = ModelStateSpec.of([CONV, *sliding, full])
    # the windowed kinds read a page table of their own (1), released behind the window
    assert (mixed.page_window, mixed.page_tables) == (16, 2)
    assert (mixed.table_of("attention"), mixed.table_of("sliding_attention")) == (0, 1)
    # ... whose pools share the full kind's memory: a page slot holds 2 layers, not 3
    assert mixed.aliases() == {
        "sliding_attention.k": "attention.k",
        "sliding_attention.v": "attention.v",
    }
    assert mixed.bytes_per_page_token() == 2 * 2 * (2 * 8 * 4)
    assert mixed.bytes_per_token() == 3 * 2 * (2 * 8 * 4)
    # the two sliding layers' pools hold the full layer's: only they move (handover, tiers)
    assert mixed.covered_pools() == {
        "attention.k": "sliding_attention.k",
        "attention.v": "sliding_attention.v",
    }
    only_full = ModelStateSpec.of([CONV, full])
    assert (only_full.page_window, only_full.page_tables) == (None, 1)
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


def peak_pages(page_window: int | None, page_tables: int = 1) -> int:
    """The most page entries a 16-token prompt decoding 2,048 tokens holds (page size 16)."""
    sched, _ = make(
        budget=64,
        chunk=64,
        pages=400,
        page_size=16,
        page_window=page_window,
        page_tables=page_tables,
    )
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


def test_beside_full_attention_only_the_window_table_stays_flat():
    """Two page tables (sliding layers beside full ones): the full table holds all 129 pages,
    the window table 17, where a single table would hold 129 pages of every layer."""
    assert peak_pages(256, page_tables=2) == 129 + 17


def test_published_lfm3_pools_share_memory_between_its_tables():
    """LFM3-1.7B's published layout (6 full, 5 sliding attention layers, window 256): a page
    slot holds 6 layers (the sliding pool inside the full one), so a 2,064-token sequence
    (the 2k decode above) holds 129 + 17 slots of 6 layers, 876 layer-pages, where one table
    would hold 129 pages of 11 layers, 1,419: 62% of the memory."""
    from baton.engine.config import ModelConfig
    from baton.engine.models.registry import model_state_spec
    from tests.test_lfm3_published_config import published

    spec = model_state_spec(ModelConfig.from_dict(published()), torch.bfloat16)
    assert (spec.page_tables, spec.page_window) == (2, 256)
    layer_token = 2 * 4 * 128 * 2  # K and V, 4 KV heads of 128, bf16
    assert spec.bytes_per_token() == 11 * layer_token
    assert spec.bytes_per_page_token() == 6 * layer_token
    assert (129 + 17) * 6 == 876 and 129 * 11 == 1419


def test_a_mixed_window_model_moves_each_page_memory_once():
    """LFM3-1.7B's layout: the sliding pools lie inside the full ones, so a handover, a TP
    shard plan and a tier record move the full pools at every page entry, 6 layers an entry:
    moving every pool (as before) sent 11, each sliding page's memory twice."""
    from baton.disagg.tp_layout import owned
    from baton.engine.cache.pools import StateCache
    from baton.engine.cache.tier_records import TierLayout
    from baton.engine.config import ModelConfig
    from baton.engine.handover.state import HandoverLayout
    from baton.engine.models.registry import model_state_spec
    from tests.test_lfm3_published_config import published

    spec = model_state_spec(ModelConfig.from_dict(published()), torch.bfloat16)
    full = ["attention.k", "attention.v"]
    assert spec.covered_pools() == {"sliding_attention.k": full[0], "sliding_attention.v": full[1]}
    layout = HandoverLayout.of(
        spec,
        model_fingerprint="m",
        weights_fingerprint="w",
        dtype=torch.bfloat16,
        page_size=16,
        tp_size=1,
        tp_rank=0,
    )
    assert [t.name for t in layout.of_kind("paged")] == full
    assert layout.page_bytes == 16 * 6 * (2 * 4 * 128 * 2)
    assert [c for c in owned(spec, 2, 1) if c.startswith("pages/")] == [f"pages/{n}" for n in full]
    cache = StateCache(spec, num_pages=8, page_size=16, num_slots=2, device="cpu")
    assert cache.paged == tuple(full) and set(cache.moved_pools()) == set(cache.pools) - set(
        spec.covered_pools()
    )
    # the moved pools span the memory of the ones left out: every layer of both kinds
    for narrow, wide in spec.covered_pools().items():
        assert cache.pools[narrow].data_ptr() == cache.pools[wide].data_ptr()
        assert cache.pools[narrow].shape[0] < cache.pools[wide].shape[0]
    tier = TierLayout.of(cache, pages_per_block=4)
    assert [t.key for t in tier.tensors if t.key.startswith("pages:")] == [
        f"pages:{n}" for n in full
    ]


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
    cache = PrefixCache(track_interval=8, page_size=4, pages=pages, slots=slots, page_tables=1)
    config = SchedulerConfig(
        max_num_batched_tokens=64,
        chunked_prefill_size=64,
        max_running_requests=4,
        page_size=4,
        page_tables=1,
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


def test_the_occupancy_benchmark_reports_the_release_on_a_real_engine(capsys):
    """bench/offline/window_pages.py on LFM3-1.7B's layers, short: 16 + 40 tokens, window 16,
    pages of 16. The last step feeds position 55: the full table's 4 pages and the sliding
    table's pages of positions 40..55 (pages 2 and 3), 6 slots of 6 layers, where one table
    held 4 pages of 11 layers: 36 / 44."""
    from baton.bench.offline.window_pages import main

    main(["--tokens", "40", "--window", "16"])
    out = capsys.readouterr().out
    assert "(2 page tables, window 16)" in out
    assert "last step: 6 page entries" in out and "4 pages" in out and "82% of it" in out
