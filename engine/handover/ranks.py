"""The handover between engines of different tensor-parallel sizes, as rank 0 drives it: each
operation is recorded as a rank operation (engine/parallel/messages.py) that every rank does with its
own shard and its own wire connector (engine/handover/shards.py).

    prefill:  snapshot (every rank copies its shard) ─> first-token state through rank 0 ─> send
    decode:   install (checkpoint slots allocated on the first try, asked again while a rank
              waits) ─> register_checkpoints (rank 0 registers the blocks once every rank
              installed)

Held by the engine's Handover (engine/handover/connector.py); at TP=1 with a wire connector the
same operations run on rank 0 alone.
"""

from __future__ import annotations

import contextlib

from baton.engine import parallel
from baton.engine.cache.pools import StateCache
from baton.engine.core.request import Request
from baton.engine.core.scheduler import Scheduler
from baton.engine.handover.shards import (
    WAITING,
    WAITING_TEXT,
    ShardConnector,
    apply_handover,
    install_report,
    shard_of_state,
)
from baton.engine.handover.state import RequestState, StatePlace
from baton.engine.parallel.messages import (
    DropShard,
    HandoverOp,
    InstallShard,
    PoolOps,
    RankStep,
    SendShard,
    SnapshotShard,
)


class ShardHandover:
    def __init__(
        self,
        *,
        cache: StateCache,
        scheduler: Scheduler,
        pool_ops: PoolOps,
        ranks,  # baton.engine.parallel.ranks.Ranks | None
        connector: ShardConnector | None,
        addresses: list[str],
    ):
        self.cache = cache
        self.scheduler = scheduler
        self.pool_ops = pool_ops
        self.ranks = ranks
        self.connector = connector
        self.addresses = addresses  # every rank's shard receive address, rank 0's first
        # per decode rank: shard bytes it has received in all (as of the last install)
        self.bytes_received = [0] * self.tp_size
        # request id -> the checkpoint slots its sharded install writes (InstallShard), held
        # from the first try until the blocks are registered or the install fails
        self.checkpoint_slots: dict[str, tuple[int, ...]] = {}

    @property
    def tp_size(self) -> int:
        return self.ranks.size if self.ranks is not None else 1

    def _rank_op(self, op: HandoverOp) -> str:
        """Send `op` (after the pool operations pending) to every other rank, do rank 0's part;
        an InstallShard then learns from one collective whether every rank did its part."""
        if self.ranks is not None:
            self.ranks.send(RankStep(ops=(*self.pool_ops.drain(), op), batch=None))
        error = apply_handover(op, self.cache, self.connector)
        if isinstance(op, InstallShard):
            tp = self.ranks.tp if self.ranks is not None else parallel.SINGLE
            with contextlib.ExitStack() as failures:
                if self.ranks is not None:
                    failures.enter_context(self.ranks.failures("installing a handed-over shard"))
                report = install_report(tp, error, self.connector)
            self.bytes_received = report.received
            failure = report.failure()
            if failure and (not error or error == WAITING_TEXT):
                error = failure  # another rank's own words (its shard arrived first)
            elif not failure and WAITING in report.statuses:
                error = WAITING_TEXT
        return error

    # -- prefill side -------------------------------------------------------------------------

    def snapshot(self, room: str, req: Request) -> None:
        """Every rank copies its shard of the finished prefill's pages, slot and block
        checkpoints for `room`."""
        num_pages = self.cache.entries(-(-len(req.prompt_ids) // self.cache.page_size))
        self._rank_op(
            SnapshotShard(
                room=room,
                pages=tuple(req.kv_pages[:num_pages]),
                slot=req.mamba_slot,
                checkpoint_slots=tuple(b.checkpoint_slot for b in req.cached_blocks),
            )
        )

    def snapshot_place(self, room: str, place: StatePlace) -> None:
        """Every rank keeps its part of `place` (a held request's prompt pages, slot and block
        checkpoint slots, the same indices on every rank) for `room`: a connector that reads
        in place notes it, one that sends copies copies it."""
        self._rank_op(
            SnapshotShard(
                room=room,
                pages=place.pages,
                slot=place.slot,
                checkpoint_slots=place.checkpoint_slots,
            )
        )

    def keep(self, room: str, state: RequestState) -> None:
        """Rank 0 of a TP=1 engine: a whole snapshot is the shard to send."""
        if self.connector is None:
            raise ValueError("this engine has no handover connector")
        self.connector.keep(room, shard_of_state(state))

    def send(
        self, room: str, control: RequestState, decode_size: int, decode_addresses: list[str]
    ) -> None:
        """Every rank sends its slices of `room` from the page and block `control` (the
        first-token state that goes through rank 0) starts at."""
        self._rank_op(
            SendShard(
                room=room,
                first_page=control.first_page,
                first_block=control.first_block,
                num_blocks=control.num_blocks,
                decode_size=decode_size,
                decode_addresses=tuple(decode_addresses),
            )
        )

    def drop(self, room: str) -> None:
        self._rank_op(DropShard(room=room))

    # -- decode side --------------------------------------------------------------------------

    def install(self, request_id: str, room: str, prefill_size: int, control: RequestState) -> bool:
        """Every rank installs its shard of `room` into the request's pages (from
        `control.first_page` to the prompt's end), slot and checkpoint slots once all its pieces
        have arrived: True when every rank has, False while some wait (ask again later);
        ValueError if any rank cannot (the checkpoint slots are given back then)."""
        req = self.scheduler.get(request_id)
        if req is None:
            raise ValueError(f"request {request_id} is gone")
        num_pages = self.cache.entries(-(-len(req.prompt_ids) // self.cache.page_size))
        first_page = control.first_page
        # The pages before are this engine's cached prefix, shared with other requests: a peer
        # may not write them (an honest one starts right after them).
        cached_pages = self.cache.entries(req.num_cached_tokens // self.cache.page_size)
        if not cached_pages == first_page <= num_pages:
            raise ValueError(
                f"the prefill worker sends pages from {first_page}, expected from"
                f" {cached_pages} (the first {cached_pages} of {num_pages} are cached here)"
            )
        slots = self.checkpoint_slots.get(request_id)
        if slots is None:  # the first try: the same slots on every later one
            slots = self.reserve_checkpoints(req, control.first_block, control.num_blocks)
        error = self._rank_op(
            InstallShard(
                room=room,
                pages=tuple(req.kv_pages[first_page:num_pages]),
                slot=req.mamba_slot,
                first_page=first_page,
                prefill_size=prefill_size,
                first_block=control.first_block,
                num_blocks=control.num_blocks,
                checkpoint_slots=slots,
            )
        )
        if error == WAITING_TEXT:
            return False
        if error:
            self.release_checkpoints(request_id)
            raise ValueError(error)
        return True

    def reserve_checkpoints(self, req: Request, first: int, count: int) -> tuple[int, ...]:
        """Checkpoint slots for blocks first..first + count - 1 that the prefill side says it
        sends, from the first on that this engine's prefix cache does not hold (0 for those it
        holds), stopping at the first it cannot allocate; kept for the request until
        `register_checkpoints` or `release_checkpoints`. ValueError when the claim exceeds the
        prompt's blocks past those cached here."""
        slots = self._checkpoint_slots(req, first, count)
        self.checkpoint_slots[req.request_id] = slots
        return slots

    def _checkpoint_slots(self, req: Request, first: int, count: int) -> tuple[int, ...]:
        cache = self.scheduler.prefix_cache
        total = len(req.prompt_ids) // cache.track_interval if cache is not None else 0
        if first < 0 or count > max(0, total - first):
            raise ValueError(
                f"the prefill worker sends checkpoints of blocks {first}..{first + count - 1};"
                f" this prompt has {total} blocks to cache here"
            )
        if cache is None or first != len(req.cached_blocks):  # not the next blocks of its
            return ()  # chain here: checked, none kept
        slots: list[int] = []
        for key in cache.chain_keys(req.prompt_ids, first + count, adapter=req.params.lora_name)[
            first:
        ]:
            slot = 0 if cache.lookup(key) is not None else self.scheduler.checkpoint_slot()
            if slot is None:
                break
            slots.append(slot)
        return tuple(slots)

    def release_checkpoints(self, request_id: str) -> None:
        """Give back the checkpoint slots of a request whose sharded install failed or ended."""
        self.scheduler.slots.free([s for s in self.checkpoint_slots.pop(request_id, ()) if s])

    def register_checkpoints(self, req: Request, first_block: int) -> bool:
        """After every rank has installed: register the blocks whose checkpoints the ranks
        wrote into the request's checkpoint slots, in order; the slots not registered go back.
        False when the request had no sharded install."""
        slots = self.checkpoint_slots.pop(req.request_id, None)
        if slots is None:
            return False
        for i, slot in enumerate(slots):
            k = first_block + i
            if k != len(req.cached_blocks) or not self.scheduler.extend_chain(req, k, slot or None):
                self.scheduler.slots.free([s for s in slots[i:] if s])
                break
        return True
