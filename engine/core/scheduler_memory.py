"""What requests hold of the pools, for the scheduler: KV pages, a working Mamba slot and the
cached blocks of their prefix.

    admit / reserve_transfer   a slot (fresh, or a copy of the deepest cached checkpoint) and
                               the pages of the cached prefix plus what is asked for
    grow / trim                pages for more tokens (nothing preempted here: the scheduler
                               picks victims) / back to fewer (a verify's rejected drafts)
    release_window             a running request's own pages wholly behind the model's
                               sliding window (ModelStateSpec.page_window) go back to the pool;
                               their entries in its page list become the dummy page 0
    release -> held -> free    what an ended or preempted request held goes back to the pools,
                               or is parked while its hold (a disaggregated prefill's send)
                               still reads it, and freed once the hold is done

Under memory pressure idle cached blocks are evicted before an admission fails. A match that ends
in the pools continues in the tiers below them when the engine has some (engine/cache/tiers.py);
an admission whose next blocks are being read from a file waits (OutOfMemory: not now). Plain
Python on host data, like the scheduler (engine/core/scheduler.py) that owns every call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from baton.engine.cache.memory import IndexPool, OutOfMemory
from baton.engine.cache.prefix_cache import PrefixCache
from baton.engine.core.request import Hold, Request


class SlotOps(Protocol):
    """What the scheduler does to a slot's state outside the forward (engine/parallel/messages.py's
    PoolOps applies it on every rank)."""

    def reset(self, slot: int) -> None: ...

    def copy(self, src: int, dst: int) -> None: ...


class RequestMemory:
    def __init__(
        self,
        page_size: int | None,
        page_tables: int,
        pages: IndexPool,
        slots: IndexPool,
        slot_ops: SlotOps,
        prefix_cache: PrefixCache | None,
    ):
        self.page_size = page_size  # None: the model keeps no paged state
        # One page entry per table per page of positions, interleaved (ModelStateSpec.page_tables)
        self.page_tables = page_tables
        self.pages = pages
        self.slots = slots
        self.slot_ops = slot_ops
        self.prefix_cache = prefix_cache
        # What released requests still held (Request.hold): (hold, pages, slot, cached blocks)
        self.held: list[tuple[Hold, list[int], int, list]] = []

    def pages_for(self, num_tokens: int) -> int:
        """Page entries (every table's) covering `num_tokens` positions."""
        return 0 if self.page_size is None else -(-num_tokens // self.page_size) * self.page_tables

    def _slot_and_prefix(
        self,
        ids: list[int],
        adapter: str | None,
        pages_needed: Callable[[int], int],
        match: bool,
        what: str,
    ) -> tuple[list, int]:
        """A free slot, and the pages `pages_needed(number of cached blocks matched)` beyond
        the cached prefix of `ids` (matched when `match`), evicting idle cached blocks if
        needed: (the matched blocks, the pages to allocate). OutOfMemory naming what is short
        for `what` (the matched blocks released again)."""
        cache = self.prefix_cache
        if self.slots.available == 0 and not (cache and cache.evict(slots=1)):
            raise OutOfMemory(f"no free slot for {what}")
        blocks = cache.match(ids, adapter=adapter) if cache is not None and match else []
        if cache is not None and match and cache.tiers is not None:
            # continued from the tiers below (never with adapters: tier_config refuses them)
            blocks, reading = cache.tiers.restore(ids, blocks)
            if reading:  # ... whose next blocks are being read: admitted once they are here
                cache.release(blocks)
                raise OutOfMemory(f"{what}: its cached prefix is being read from the tiers")
        shared = len(blocks) * cache.pages_per_block if blocks else 0
        need = pages_needed(len(blocks)) - shared
        if self.pages.available < need and not (cache and cache.evict(pages=need)):
            if blocks:
                cache.release(blocks)
            raise OutOfMemory(f"need {need} free KV pages for {what}, {self.pages.available} free")
        if cache is not None and match:
            cache.record_lookup(len(ids), blocks)
        return blocks, need

    def admit(self, req: Request, chunk_size: int, budget: int) -> bool:
        """Give `req` a working slot (fresh, or a copy of its deepest cached checkpoint) and the
        pages of its cached prefix and first chunk; False if memory does not allow it now."""
        cache = self.prefix_cache
        match = cache is not None and not req.wants_prompt_logprobs

        def num_pages(num_blocks: int) -> int:
            cached = num_blocks * cache.track_interval if num_blocks else 0
            return self.pages_for(cached + min(req.num_tokens - cached, chunk_size, budget))

        try:
            blocks, _ = self._slot_and_prefix(
                req.all_ids, req.params.lora_name, num_pages, match, "a request"
            )
        except OutOfMemory:
            return False
        req.mamba_slot = self.slots.alloc(1)[0]
        if blocks:
            cached = len(blocks) * cache.track_interval
            self.slot_ops.copy(blocks[-1].checkpoint_slot, req.mamba_slot)
            req.cached_blocks = blocks
            req.kv_pages = [p for b in blocks for p in b.pages]
            req.num_computed = cached
            req.num_cached_tokens = max(req.num_cached_tokens, cached)
        else:
            self.slot_ops.reset(req.mamba_slot)
        return True

    def reserve_transfer(self, req: Request) -> None:
        """A slot and pages for the prompt plus the first generated token (the decode side of a
        disaggregated pair); blocks of the prompt this engine caches are shared, not reserved.
        OutOfMemory when the pools cannot hold it now."""
        pages = self.pages_for(len(req.prompt_ids) + 1)
        blocks, need = self._slot_and_prefix(
            req.prompt_ids,
            req.params.lora_name,
            lambda _: pages,
            match=True,
            what="a transferred request",
        )
        req.mamba_slot = self.slots.alloc(1)[0]
        req.kv_pages = [p for b in blocks for p in b.pages] + self.pages.alloc(need)
        req.cached_blocks = blocks
        req.num_cached_tokens = len(blocks) * self.prefix_cache.track_interval if blocks else 0

    def grow(self, req: Request, num_tokens: int, evict: bool = True) -> int:
        """Pages for `num_tokens` tokens, taken if they are free (idle cached blocks evicted
        first, when `evict`); the number still missing (0: done)."""
        need = self.pages_for(num_tokens) - len(req.kv_pages)
        cache = self.prefix_cache
        if evict and need > self.pages.available and cache is not None:
            cache.evict(pages=need)
        if 0 < need <= self.pages.available:
            req.kv_pages.extend(self.pages.alloc(need))
            return 0
        return max(0, need)

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back the pages past the first `num_tokens` tokens (a verify's rejected drafts);
        a cached block's pages are never among them (they hold computed tokens)."""
        keep = self.pages_for(num_tokens)
        if len(req.kv_pages) > keep:
            self.pages.free(req.kv_pages[keep:])
            del req.kv_pages[keep:]

    def release_window(self, req: Request, window: int | None) -> int:
        """Give back the pages of `req` that no query of it will read again: the paged state of
        its last page table reads only the last `window` tokens (None: some reads them all),
        and the next query sits at position num_computed, so a page of that table whose last
        token is at or before num_computed - window is dead. Its entry in `req.kv_pages`
        becomes the dummy page 0 (the list stays indexed by page; nothing reads those slots:
        kernels/window_attention.py). With two tables only the windowed one's entries go.

        Kept: the pages of the request's cached blocks (the prefix cache owns them, and a later
        hit reads them), and everything of a request whose hold still reads its pages in place
        (a disaggregated prefill's sends). A block committed later with released pages is
        still a correct checkpoint: its released pages lie behind the window of its end, which
        is all a hit resuming there reads (engine/core/scheduler_blocks.py). Returns the
        number of pages released."""
        if window is None or self.page_size is None or req.hold is not None:
            return 0
        cache = self.prefix_cache
        tables = self.page_tables
        first = len(req.cached_blocks) * cache.pages_per_block if cache is not None else 0
        dead = (req.num_computed - window + 1) // self.page_size  # pages [0, dead) are behind
        dead *= tables  # ... entries: the last table's of those pages
        if dead <= first:
            return 0
        entries = range(first + tables - 1, dead, tables)
        released = [req.kv_pages[i] for i in entries if req.kv_pages[i]]
        if released:
            self.pages.free(released)
            for i in entries:
                req.kv_pages[i] = 0
        return len(released)

    def release(self, req: Request) -> None:
        """Give back what `req` holds, or park it while its hold reads it. The hold stays on the
        request: a preempted one that runs again writes new pages that its hold reads too (a
        disaggregated prefill streams pages while it computes), and they must outlive its end."""
        pages, slot, blocks = req.kv_pages, req.mamba_slot, req.cached_blocks
        req.kv_pages, req.mamba_slot, req.cached_blocks = [], 0, []
        if req.hold is not None and not req.hold.done:
            self.held.append((req.hold, pages, slot, blocks))
        else:
            self._free(pages, slot, blocks)

    def release_held(self) -> None:
        """Give back the pages and slots of released requests whose holds are done."""
        if not self.held:
            return
        still = []
        for hold, pages, slot, blocks in self.held:
            if hold.done:
                self._free(pages, slot, blocks)
            else:
                still.append((hold, pages, slot, blocks))
        self.held = still

    def _free(self, pages: list[int], slot: int, blocks: list) -> None:
        shared = 0
        if blocks:
            self.prefix_cache.release(blocks)
            shared = len(blocks) * self.prefix_cache.pages_per_block
        own = [p for p in pages[shared:] if p]  # 0: released behind a sliding window
        if own:
            self.pages.free(own)
        if slot:
            self.slots.free([slot])
