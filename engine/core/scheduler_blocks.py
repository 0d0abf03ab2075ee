"""The scheduler's prefix-cache bookkeeping: which steps checkpoint recurrent state, and how the
blocks those checkpoints close join the radix tree (DESIGN.md section 6).

    schedule() ──track_points──> TrackPoints in the batch (+ pending blocks)
    forward writes the checkpoints
    update_from_output() ──commit──> cached blocks (adopted when someone cached them meanwhile)

Held by the `Scheduler` (engine/core/scheduler.py), the only writer of request state: these methods
extend a request's page list and cached blocks on its behalf.
"""

from __future__ import annotations

from baton.engine.cache.memory import IndexPool
from baton.engine.cache.prefix_cache import PrefixCache
from baton.engine.core.request import Request
from baton.engine.executor.forward_metadata import TrackPoint


class PrefixBlocks:
    def __init__(self, cache: PrefixCache, pages: IndexPool, slots: IndexPool):
        self.cache = cache
        self.pages = pages
        self.slots = slots
        # (request, block index, block key, checkpoint slot) awaiting this step's forward
        self.pending: list[tuple[Request, int, int, int]] = []
        self.verified_checkpoints = 0  # copied from accepted verify positions (decode work)

    def track_points(self, rows: list[tuple[Request, int]], skip: range) -> list[TrackPoint]:
        """Checkpoint every block boundary crossed this step that is not cached yet. Rows in
        `skip` (speculative verifies) are checkpointed after acceptance (`verified_points`)."""
        cache = self.cache
        interval, points = cache.track_interval, []
        for s, (req, n) in enumerate(rows):
            if s in skip:
                continue
            start, end = req.num_computed, req.num_computed + n
            first = (start // interval + 1) * interval
            for boundary in range(first, end + 1, interval):
                k = boundary // interval - 1
                if k < len(req.cached_blocks):
                    continue
                key = cache.chain_keys(req.all_ids, k + 1, adapter=req.params.lora_name)[-1]
                if cache.lookup(key) is not None:
                    continue  # someone cached it meanwhile: adopted in commit
                slot = self.checkpoint_slot()
                if slot is None:
                    break
                points.append(
                    TrackPoint(seq_index=s, token_offset=boundary - start - 1, dst_slot=slot)
                )
                self.pending.append((req, k, key, slot))
        return points

    def verified_points(
        self, req: Request, start: int, kept: int, slots: tuple[int, ...], slot_ops
    ) -> None:
        """A verify fed tokens from `start` on, keeping the state after token i in slots[i];
        the first `kept` were accepted. Every block end they crossed that is not cached yet is
        checkpointed by a copy of its position's slot (commit registers it)."""
        cache = self.cache
        interval = cache.track_interval
        first = (start // interval + 1) * interval
        for boundary in range(first, start + kept + 1, interval):
            k = boundary // interval - 1
            if k < len(req.cached_blocks):
                continue
            key = cache.chain_keys(req.all_ids, k + 1, adapter=req.params.lora_name)[-1]
            if cache.lookup(key) is not None:
                continue  # someone cached it meanwhile: adopted in commit
            slot = self.checkpoint_slot()
            if slot is None:
                break
            slot_ops.copy(slots[boundary - start - 1], slot)
            self.pending.append((req, k, key, slot))
            self.verified_checkpoints += 1

    def commit(self, running: list[Request]) -> None:
        """After the forward: register the blocks whose checkpoints it wrote, in order, and
        adopt blocks other requests cached meanwhile (freeing our duplicate pages)."""
        pending = {(id(req), k): slot for req, k, _, slot in self.pending}
        self.pending = []
        for req in running:
            full = req.num_computed // self.cache.track_interval
            while len(req.cached_blocks) < full:
                k = len(req.cached_blocks)
                if not self.extend_chain(req, k, pending.pop((id(req), k), None)):
                    break  # no checkpoint of this block: the chain stops here for this request
        for slot in pending.values():  # checkpoints that could not be registered
            self.slots.free([slot])

    def extend_chain(self, req: Request, k: int, checkpoint_slot: int | None) -> bool:
        """Make block k (== len(req.cached_blocks)) of `req` cached: adopt an identical cached
        block (our duplicate pages and checkpoint are freed) or insert our own pages with the
        checkpoint already written to `checkpoint_slot`. False when neither is possible."""
        cache = self.cache
        ppb, interval = cache.pages_per_block, cache.track_interval
        tokens = tuple(req.all_ids[k * interval : (k + 1) * interval])
        key = cache.chain_keys(req.all_ids, k + 1, adapter=req.params.lora_name)[-1]
        own = req.kv_pages[k * ppb : (k + 1) * ppb]
        existing = cache.lookup(key)
        if existing is not None and existing.tokens == tokens:
            existing.ref_count += 1
            self.pages.free([p for p in own if p])  # 0: released behind a sliding window
            req.kv_pages[k * ppb : (k + 1) * ppb] = existing.pages
            req.cached_blocks.append(existing)
            if checkpoint_slot is not None:
                self.slots.free([checkpoint_slot])
            return True
        if checkpoint_slot is None or existing is not None:
            return False
        # Pages of `own` released behind a sliding window (0) lie behind the window of the
        # block's end (they were dead before the step that closed the block): a hit resuming
        # there never reads them, so the block is a correct checkpoint with them missing.
        parent = req.cached_blocks[-1] if req.cached_blocks else None
        req.cached_blocks.append(
            cache.insert(key, tokens, parent, own, checkpoint_slot, adapter=req.params.lora_name)
        )
        return True

    def checkpoint_slot(self) -> int | None:
        """A free slot for a checkpoint (evicting idle cached blocks if needed), or None."""
        if self.slots.available == 0 and not self.cache.evict(slots=1):
            return None
        return self.slots.alloc(1)[0]
