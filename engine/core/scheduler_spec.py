"""The scheduler's speculative-decoding bookkeeping: which decoding requests verify drafts this
step, the scratch slots that keep their recurrent state after each drafted position, and what
acceptance does to a request (its rollback).

    drafts (engine/spec_decode/)  ──req.drafts──>  schedule: a verify row [last token | k drafts]
    forward: every recurrent layer writes the state after token i into verify_slots[i]:
             [working slot (token 0, in place) | scratch 1 .. k]
    acceptance keeps j drafts ──accept()──> prefix checkpoints at crossed block ends are copied
             from their positions' slots; the slot of position j becomes the working slot (the
             old working slot becomes a scratch slot): nothing is replayed or copied back

Keeping every position's state costs k slots per speculating request and k extra state writes
per layer and step; snapshot-and-replay would write once but needs a second pass over every
recurrent layer after acceptance (an extra synchronisation with every tensor-parallel rank,
outside any CUDA graph). bench/offline/spec_rollback.py measures both on the CPU kernels.

Held by the `Scheduler` (engine/core/scheduler.py), the only writer of request state: these
methods change a request's slots and pages on its behalf.
"""

from __future__ import annotations

from dataclasses import dataclass

from baton.engine.cache.memory import IndexPool
from baton.engine.cache.prefix_cache import PrefixCache
from baton.engine.core.request import Request
from baton.engine.core.scheduler_blocks import PrefixBlocks


@dataclass(frozen=True, kw_only=True, slots=True)
class SpecSchedule:
    num_speculative_tokens: int  # k: a verify row feeds k + 1 tokens
    disable_by_batch_size: int | None  # no verify rows while this many requests are in
    # Positions past the accepted ones the drafter writes K/V at (an MTP head chained k times:
    # k - 1; n-gram: 0): pages for them are reserved with the step.
    draft_lookahead: int


class Speculation:
    def __init__(
        self,
        config: SpecSchedule,
        slots: IndexPool,
        slot_ops,
        prefix_cache: PrefixCache | None,
        blocks: PrefixBlocks | None,
        max_model_len: int,
    ):
        self.config = config
        self.slots = slots
        self.slot_ops = slot_ops
        self.prefix_cache = prefix_cache
        self.blocks = blocks
        self.max_model_len = max_model_len

    @property
    def k(self) -> int:
        return self.config.num_speculative_tokens

    def active(self, num_requests: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is None or num_requests < limit

    def drafts_to_verify(self, req: Request) -> list[int]:
        """The drafts `req` (decoding) verifies this step, or [] for a plain decode row: none
        were proposed, the drafted positions would pass the context, or no scratch slots can
        be had now."""
        if len(req.drafts) != self.k or req.num_tokens + self.k > self.max_model_len:
            return []
        if not req.spec_slots:
            if self.slots.available < self.k and not (
                self.prefix_cache is not None and self.prefix_cache.evict(slots=self.k)
            ):
                return []
            req.spec_slots = self.slots.alloc(self.k)
        return req.drafts

    @staticmethod
    def verify_slots(req: Request) -> tuple[int, ...]:
        """The slot keeping the state after each of the k + 1 fed tokens."""
        return (req.mamba_slot, *req.spec_slots)

    def accept(self, req: Request, start: int, slots: tuple[int, ...], kept: int) -> None:
        """After a verify that fed its tokens from position `start` with states in `slots`:
        the first `kept` tokens (the last one and the accepted drafts) stay. Block ends they
        crossed are checkpointed from those positions' slots (before any slot is reused), and
        the slot of the last kept position becomes the working slot."""
        if self.blocks is not None:
            self.blocks.verified_points(req, start, kept, slots, self.slot_ops)
        last = slots[kept - 1]
        if last != req.mamba_slot:
            scratch = req.spec_slots.index(last)
            req.spec_slots[scratch], req.mamba_slot = req.mamba_slot, last

    def release(self, req: Request) -> None:
        """The request ends or is preempted: its scratch slots and drafts go."""
        if req.spec_slots:
            self.slots.free(req.spec_slots)
            req.spec_slots = []
        req.drafts = []
