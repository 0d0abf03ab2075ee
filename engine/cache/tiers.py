"""Tiers under the device pools: where an evicted prefix-cache block goes instead of being lost,
and where a prefix lookup that misses the device looks next (DESIGN.md section 14).

    PrefixCache._drop ──> Tiers.demote(block): copies of the block's pages and checkpoint
        (TierLayout: every paged tensor, every checkpointed slot tensor of the state spec),
        handed to every tier (write-through), nothing waited for:
            host  HostStore: an in-memory LRU of records within --hicache-size
            file  FileStore (engine/cache/tier_files.py): a file per block, written on a
                  background thread, within --hicache-storage-size
    admission ──> Tiers.restore(ids, chain): the device chain continued block by block from the
        first tier that has the next block: fresh pages and a fresh checkpoint slot (idle
        device blocks evicted for them, as for any admission), the record written in, the
        block registered in the prefix cache, locked for the request like a device hit. A
        block in a file is read on the file tier's reader thread first (with the blocks after
        it): the request waits in the queue meanwhile and other requests step.

Nothing here names a mixer: what a block holds is the state spec's (TierLayout). A block is
stored alone (its own pages, its own checkpoint), so a chain costs its length, not its square.
Restoring stops at the first block no tier has, or when the pools cannot take one more while
keeping the slot the admitted request needs. One engine at TP = 1 (the pools are this
process's); the engine refuses tiers at TP > 1.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

from baton.engine.cache.prefix_cache import CachedBlock, PrefixCache
from baton.engine.cache.tier_files import READING, FileStore
from baton.engine.cache.tier_records import BlockRecord, TierIdentity, TierLayout, chain_digests
from baton.engine.cache.tier_stats import TierCounters
from baton.engine.handover.io import StateIO


class Restored(NamedTuple):
    chain: list[CachedBlock]  # the device's match continued from the tiers, locked
    reading: bool  # its next block is being read from a file: admit the request later


class HostStore:
    """Evicted blocks in this process's memory, least recently used dropped past `capacity`
    bytes. On a GPU engine this is the host tier under the device; on the CPU it is the same
    memory, kept apart from the pools' budget."""

    name = "host"
    durable = False  # gone with the process

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.records: OrderedDict[bytes, BlockRecord] = OrderedDict()
        self.bytes = 0
        self.counters = TierCounters()

    def contains(self, digest: bytes) -> bool:
        """Whether the block is here (then it counts as just used)."""
        if digest not in self.records:
            return False
        self.records.move_to_end(digest)
        return True

    def put(self, record: BlockRecord, wait: bool = False) -> None:
        if record.digest in self.records:
            self.records.move_to_end(record.digest)
            return
        if record.nbytes > self.capacity:
            self.counters.add(dropped=1)
            return
        began = time.perf_counter()
        self.records[record.digest] = record
        self.bytes += record.nbytes
        while self.bytes > self.capacity:
            _, old = self.records.popitem(last=False)
            self.bytes -= old.nbytes
            self.counters.add(evictions=1)
        self.counters.add(
            writes=1, written_bytes=record.nbytes, write_seconds=time.perf_counter() - began
        )

    reading = False  # (memory: nothing is ever being read)

    def prefetch(self, digest: bytes, tokens: tuple[int, ...], ahead: bool = True) -> bool:
        return digest in self.records

    def take(self, digest: bytes, tokens: tuple[int, ...]) -> BlockRecord | None:
        return self.get(digest, tokens)

    def get(self, digest: bytes, tokens: tuple[int, ...]) -> BlockRecord | None:
        record = self.records.get(digest)
        if record is None or record.tokens != tokens:
            return None
        self.records.move_to_end(digest)
        return record

    def flush(self, timeout: float = 60.0) -> None:
        pass

    def close(self) -> None:
        self.records.clear()
        self.bytes = 0


Store = HostStore | FileStore


class Tiers:
    def __init__(
        self,
        *,
        cache: PrefixCache,
        io: StateIO,
        identity: TierIdentity,
        layout: TierLayout,
        stores: list[Store],
        clock: Callable[[], float] = time.perf_counter,
    ):
        if not stores:
            raise ValueError("tiers need at least one store (host memory or files)")
        self.cache = cache
        self.io = io
        self.identity = identity
        self.layout = layout
        self.stores = stores
        self.clock = clock
        self.lookups = 0  # admissions that looked below the device
        self.lookup_misses = 0  # ... and found nothing there
        self._persisting = False
        cache.tiers = self

    # -- down: eviction ---------------------------------------------------------------------------

    def demote(self, block: CachedBlock) -> None:
        """Called by the prefix cache before it frees `block`'s pages and checkpoint slot. The
        tiers keep the base model's blocks only (engines with adapters have none: tier_config)."""
        if block.adapter is not None:
            return
        chain = []
        b: CachedBlock | None = block
        while b is not None:
            chain.append(b.tokens)
            b = b.parent
        ids = [t for tokens in reversed(chain) for t in tokens]
        interval = self.cache.track_interval
        digest = chain_digests(self.identity.fingerprint, ids, interval, len(chain))[-1]
        stores = [s for s in self.stores if s.durable] if self._persisting else self.stores
        missing = [store for store in stores if not store.contains(digest)]
        if missing:  # (a block restored from below and evicted again is there already)
            record = self.snapshot(block, digest)
            for store in missing:
                store.put(record, wait=self._persisting)

    def snapshot(self, block: CachedBlock, digest: bytes) -> BlockRecord:
        """Copies of `block`'s pages and checkpoint, out of the pools (they are reused next)."""
        tensors = {}
        if self.layout.pages_per_block:
            for name, t in self.io.gather_pages(block.pages).items():
                tensors[f"pages:{name}"] = t.cpu()
        for name, t in self.io.gather_checkpoints([block.checkpoint_slot]).items():
            tensors[f"checkpoint:{name}"] = t[0].cpu()
        return BlockRecord(
            digest=digest,
            tokens=block.tokens,
            live_pages=tuple(p != 0 for p in block.pages[: self.layout.pages_per_block]),
            tensors=tensors,
        )

    # -- up: admission ----------------------------------------------------------------------------

    def restore(self, ids: list[int], found: list[CachedBlock]) -> Restored:
        """`found` (the device's match for `ids`, locked) continued with the blocks the tiers
        hold, each loaded into the pools, registered and locked. `reading`: the chain goes on
        in a file being read (the reads of the blocks after it are started too): the caller
        gives the chain back and admits the request on a later step, when they are in memory."""
        cache = self.cache
        interval = cache.track_interval
        usable = (len(ids) - 1) // interval
        k = len(found)
        if k >= usable:
            return Restored(found, False)
        keys = cache.chain_keys(ids, usable, adapter=None)  # tiers serve the base model only
        digests = chain_digests(self.identity.fingerprint, ids, interval, usable)
        chain, reading = list(found), False
        while k < usable:
            tokens = tuple(ids[k * interval : (k + 1) * interval])
            if cache.lookup(keys[k]) is not None:
                break  # a device block under this key with other tokens: the match stopped here
            began = self.clock()
            store, record = self._fetch(digests[k], tokens)
            if record is READING:
                reading = True
                for later in range(k + 1, usable):
                    block = tuple(ids[later * interval : (later + 1) * interval])
                    if not any(s.prefetch(digests[later], block) for s in self.stores):
                        break
                break
            if record is None:
                break
            live = [i for i, alive in enumerate(record.live_pages) if alive]
            # two free slots: this block's checkpoint and the admitted request's working slot
            if not cache.evict(pages=len(live), slots=2):
                break
            pages = cache.pages.alloc(len(live))
            slot = cache.slots.alloc(1)[0]
            self._install(record, live, pages, slot)
            block_pages = [0] * len(record.live_pages)
            for i, page in zip(live, pages):
                block_pages[i] = page
            parent = chain[-1] if chain else None
            chain.append(cache.insert(keys[k], tokens, parent, block_pages, slot, adapter=None))
            store.counters.add(hits=1, hit_bytes=record.nbytes, load_seconds=self.clock() - began)
            k += 1
        if not reading:  # (a lookup that waits for a read counts once, when it is done)
            self.lookups += 1
            self.lookup_misses += len(chain) == len(found)
        return Restored(chain, reading)

    @property
    def reading(self) -> bool:
        """Whether a file is being read for an admission (an idle engine waits a moment)."""
        return any(store.reading for store in self.stores)

    def _fetch(
        self, digest: bytes, tokens: tuple[int, ...]
    ) -> tuple[Store | None, BlockRecord | str | None]:
        """The first tier's answer that is not None: the block, or READING (file tier)."""
        for store in self.stores:
            record = store.take(digest, tokens)
            if record is not None:
                return store, record
        return None, None

    def _install(self, record: BlockRecord, live: list[int], pages: list[int], slot: int) -> None:
        if pages:
            self.io.write_pages(
                pages,
                {
                    key.removeprefix("pages:"): t[:, live] if len(live) < t.shape[1] else t
                    for key, t in record.tensors.items()
                    if key.startswith("pages:")
                },
            )
        checkpoint = {
            key.removeprefix("checkpoint:"): t.unsqueeze(0)
            for key, t in record.tensors.items()
            if key.startswith("checkpoint:")
        }
        self.io.write_checkpoint(slot, checkpoint, 0)

    # -- housekeeping -----------------------------------------------------------------------------

    def flush(self, timeout: float = 60.0) -> None:
        """Wait for the writes queued so far (the file tier's thread)."""
        for store in self.stores:
            store.flush(timeout)

    def persist(self) -> None:
        """Every idle block of the pools down to the durable tiers (the files), waiting for
        room in their write queues: what a restart on the same directory finds. For a server
        that stops; the pools' idle blocks are dropped."""
        if not any(store.durable for store in self.stores):
            return
        self._persisting = True
        try:
            self.cache.clear()
        finally:
            self._persisting = False

    def close(self) -> None:
        for store in self.stores:
            store.close()

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            "hicache:lookups": self.lookups,
            "hicache:lookup_misses": self.lookup_misses,
        }
        for store in self.stores:
            out |= store.counters.flat(store.name)
        return out
