"""Prefix caching for hybrid models: blocks of `track_interval` tokens with a Mamba checkpoint.

Attention K/V could be reused from any prefix, but a Mamba state cannot be rebuilt from K/V: a
prefix is reusable only up to a position where its state was saved. So the cache is a chain of
blocks, each exactly `track_interval` tokens (a multiple of the KV page size and of the SSD chunk
size), holding that block's KV pages and a checkpoint slot with the conv window + SSM state at
the block's end:

    prompt:   [ block 0 ][ block 1 ][ block 2 ][ tail ... ]
    cache:    h0 -> B0   h1 -> B1   (miss)          h_k = hash(h_{k-1}, tokens of block k)
              pages, ckpt pages, ckpt
    a match:  KV pages of B0, B1 are shared (ref-counted); B1's checkpoint is copied into the
              request's working slot; prefill resumes at 2 * track_interval.

Blocks are page-aligned, so a request never writes into a cached page (no copy-on-write is
needed). Under a sliding window a block may hold the dummy page 0 where its request released a
page behind the window before the block closed (engine/core/scheduler_memory.py): a hit there
reads only the window of the block's end. A block is evictable when no request holds it and no cached block extends it; eviction
is LRU and gives back its pages and its checkpoint slot; with tiers under the pools
(engine/cache/tiers.py) the block is copied down to them first, and an admission continues its
match there (engine/core/scheduler_memory.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from baton.engine.cache.memory import IndexPool

if TYPE_CHECKING:
    from baton.engine.cache.tiers import Tiers


@dataclass(eq=False)
class CachedBlock:
    key: int  # chained hash of all tokens up to the block's end
    tokens: tuple[int, ...]  # this block's tokens (guards against hash collisions)
    parent: CachedBlock | None
    pages: list[int]
    checkpoint_slot: int
    adapter: str | None  # the LoRA adapter its tokens ran under (None: the base model)
    ref_count: int = 0  # running requests holding this block
    num_children: int = 0
    last_used: int = 0
    depth: int = 0  # block index in its chain

    @property
    def evictable(self) -> bool:
        return self.ref_count == 0 and self.num_children == 0


@dataclass
class PrefixCacheStats:
    query_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0
    inserted_blocks: int = 0


@dataclass
class PrefixCache:
    track_interval: int
    page_size: int
    pages: IndexPool
    slots: IndexPool
    # page tables a request holds (ModelStateSpec.page_tables): a block's page list interleaves
    # them, one entry per table per page of positions
    page_tables: int
    blocks: dict[int, CachedBlock] = field(default_factory=dict)
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    _clock: itertools.count = field(default_factory=itertools.count)
    # Tiers below the pools (engine/cache/tiers.py): an evicted block goes down to them, and a
    # lookup continues there where the device chain ends. None: evicted blocks are lost.
    tiers: Tiers | None = None

    def __post_init__(self) -> None:
        if self.track_interval % self.page_size:
            raise ValueError(
                f"mamba track interval {self.track_interval} must be a multiple of the page size {self.page_size}"
            )

    @property
    def pages_per_block(self) -> int:
        """Page entries of a block, every table's."""
        return self.track_interval // self.page_size * self.page_tables

    def block_key(self, parent: CachedBlock | int | None, tokens: tuple[int, ...]) -> int:
        parent_key = parent.key if isinstance(parent, CachedBlock) else parent
        return hash((parent_key, tokens))

    def chain_keys(
        self, token_ids: list[int], num_blocks: int, *, adapter: str | None
    ) -> list[int]:
        """adapter: the LoRA adapter the tokens ran under (None: the base model). Its name
        salts the chain's first parent key, so no chain is shared across adapters."""
        keys, prev = [], None if adapter is None else hash(("lora adapter", adapter))
        for k in range(num_blocks):
            prev = self.block_key(
                prev, tuple(token_ids[k * self.track_interval : (k + 1) * self.track_interval])
            )
            keys.append(prev)
        return keys

    # -- lookup -----------------------------------------------------------------------------

    def match(self, token_ids: list[int], *, adapter: str | None) -> list[CachedBlock]:
        """The longest chain of cached blocks that is a prefix of `token_ids`, leaving at least one
        token to compute (its logits are needed). Blocks are locked (ref-counted) for the caller.
        adapter: the LoRA adapter of the request (chain_keys)."""
        usable = (len(token_ids) - 1) // self.track_interval
        found: list[CachedBlock] = []
        for k, key in enumerate(self.chain_keys(token_ids, usable, adapter=adapter)):
            block = self.blocks.get(key)
            tokens = tuple(token_ids[k * self.track_interval : (k + 1) * self.track_interval])
            if block is None or block.tokens != tokens:
                break
            found.append(block)
        now = next(self._clock)
        for block in found:
            block.ref_count += 1
            block.last_used = now
        return found

    def record_lookup(self, num_tokens: int, found: list[CachedBlock]) -> None:
        """Count a lookup of `num_tokens` tokens whose match was used. A match given back for
        lack of memory is not counted: a request retried each step would inflate the hit rate's
        denominator."""
        self.stats.query_tokens += num_tokens
        self.stats.hit_tokens += len(found) * self.track_interval

    def lookup(self, key: int) -> CachedBlock | None:
        return self.blocks.get(key)

    # -- insertion / release ----------------------------------------------------------------

    def insert(
        self,
        key: int,
        tokens: tuple[int, ...],
        parent: CachedBlock | None,
        pages: list[int],
        checkpoint_slot: int,
        *,
        adapter: str | None,
    ) -> CachedBlock:
        """Register a block whose KV pages and checkpoint were just written; returned locked.
        adapter: the LoRA adapter its chain is salted with (chain_keys)."""
        block = CachedBlock(
            key=key,
            tokens=tokens,
            parent=parent,
            pages=list(pages),
            checkpoint_slot=checkpoint_slot,
            adapter=adapter,
            ref_count=1,
            last_used=next(self._clock),
            depth=0 if parent is None else parent.depth + 1,
        )
        if parent is not None:
            parent.num_children += 1
        self.blocks[key] = block
        self.stats.inserted_blocks += 1
        return block

    def release(self, blocks: list[CachedBlock]) -> None:
        now = next(self._clock)
        for block in blocks:
            block.ref_count -= 1
            block.last_used = now
            assert block.ref_count >= 0, "prefix cache block released more often than locked"

    # -- eviction ---------------------------------------------------------------------------

    def evict(self, *, pages: int = 0, slots: int = 0) -> bool:
        """Evict LRU unreferenced leaf blocks until `pages` pages and `slots` slots are free in
        the pools. Returns whether that was achieved."""
        while self.pages.available < pages or self.slots.available < slots:
            victims = [b for b in self.blocks.values() if b.evictable]
            if not victims:
                return False
            victim = min(victims, key=lambda b: (b.last_used, -b.depth))
            self._drop(victim)
        return True

    def _drop(self, block: CachedBlock) -> None:
        if self.tiers is not None:
            self.tiers.demote(block)  # copies its pages and checkpoint: freed right after
        del self.blocks[block.key]
        if block.parent is not None:
            block.parent.num_children -= 1
        self.pages.free([p for p in block.pages if p])  # 0: released behind a sliding window
        self.slots.free([block.checkpoint_slot])
        self.stats.evicted_blocks += 1

    def drop_adapter(self, adapter: str) -> int:
        """Drop every block cached under `adapter` (unloaded: an adapter loaded later under the
        same name must not resume from these), deepest first, not sent down a tier. Returns how
        many were dropped; a block a request still holds is an error (an adapter in use is not
        unloaded)."""
        mine = sorted((b for b in self.blocks.values() if b.adapter == adapter),
                      key=lambda b: -b.depth)  # fmt: skip
        tiers, self.tiers = self.tiers, None
        try:
            for block in mine:
                if block.ref_count:
                    raise RuntimeError(f"adapter {adapter!r}: a cached block is still in use")
                self._drop(block)
        finally:
            self.tiers = tiers
        return len(mine)

    def clear(self) -> None:
        """Drop every unreferenced block (all of them once no request runs)."""
        self.evict(pages=self.pages.capacity + 1)

    @property
    def idle_pages(self) -> int:
        """Pages held only by the cache (no request uses them): free for accounting purposes."""
        return sum(sum(1 for p in b.pages if p) for b in self.blocks.values() if b.ref_count == 0)

    @property
    def idle_slots(self) -> int:
        return sum(1 for b in self.blocks.values() if b.ref_count == 0)
