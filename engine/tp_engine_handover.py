"""The engine's side of a handover between engines of different tensor-parallel sizes: the
typed methods a disaggregation worker calls on rank 0, each recorded as a rank operation
(engine/parallel/messages.py) that every rank does with its own shard (engine/handover/shards.py).

    prefill:  snapshot_shards ─> first_token_state (through rank 0) ─> send_shards
    decode:   install_shards (checkpoint slots allocated on the first try, asked again while a
              rank waits) ─> install (rank 0 registers the blocks once every rank installed)
"""

from __future__ import annotations

import contextlib

import torch

from engine import parallel
from engine.cache.pools import StateCache
from engine.cache.prefix_cache import PrefixCache
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.handover.shards import (
    WAITING,
    WAITING_TEXT,
    ShardConnector,
    apply_handover,
    install_report,
    shard_of_state,
)
from engine.handover.state import RequestState
from engine.parallel.messages import (
    DropShard,
    HandoverOp,
    InstallShard,
    PoolOps,
    RankStep,
    SendShard,
    SnapshotShard,
)


class ShardHandoverMixin:
    """The engine's typed methods for a worker that hands requests over across TP sizes. Mixed
    into Engine, which provides what is declared here."""

    cache: StateCache
    pool_ops: PoolOps
    ranks: object  # engine.parallel.ranks.Ranks | None
    shard_connector: ShardConnector | None
    shard_addresses: list[str]
    # per decode rank: shard bytes it has received in all (as of the last install), rank order
    shard_bytes_received: list[int]
    # request id -> the checkpoint slots its sharded install writes (InstallShard), held from
    # the first try until the blocks are registered or the install fails
    shard_checkpoints: dict[str, tuple[int, ...]]
    requests: dict[str, Request]
    scheduler: Scheduler
    prefix_cache: PrefixCache | None

    @property
    def tp_size(self) -> int:
        return self.ranks.size if self.ranks is not None else 1

    def _rank_op(self, op: HandoverOp) -> str:
        """Send `op` (after the pool operations pending) to every other rank, do rank 0's part;
        an InstallShard then learns from one collective whether every rank did its part."""
        if self.ranks is not None:
            self.ranks.send(RankStep(ops=(*self.pool_ops.drain(), op), batch=None))
        error = apply_handover(op, self.cache, self.shard_connector)
        if isinstance(op, InstallShard):
            tp = self.ranks.tp if self.ranks is not None else parallel.SINGLE
            with contextlib.ExitStack() as failures:
                if self.ranks is not None:
                    failures.enter_context(self.ranks.failures("installing a handed-over shard"))
                report = install_report(tp, error, self.shard_connector)
            self.shard_bytes_received = report.received
            failure = report.failure()
            if failure and (not error or error == WAITING_TEXT):
                error = failure  # another rank's own words (its shard arrived first)
            elif not failure and WAITING in report.statuses:
                error = WAITING_TEXT
        return error

    def snapshot_shards(self, room: str, req: Request) -> None:
        """Every rank copies its shard of the finished prefill's pages, slot and block
        checkpoints for `room`."""
        num_pages = -(-len(req.prompt_ids) // self.cache.page_size)
        self._rank_op(
            SnapshotShard(
                room=room,
                pages=tuple(req.kv_pages[:num_pages]),
                slot=req.mamba_slot,
                checkpoint_slots=tuple(b.checkpoint_slot for b in req.cached_blocks),
            )
        )

    def first_token_state(
        self, source: Request | RequestState, first_page: int = 0
    ) -> RequestState:
        """The part of a handed-over state that goes through rank 0: the first token (of a
        finished request, or of a whole snapshot) with no pages and no Mamba layers (those go
        rank to rank), from page `first_page` on. Its checkpoints keep their block count, with
        no layers: they tell the decode side which blocks the ranks send."""
        if isinstance(source, RequestState):
            num_prompt_tokens = source.num_prompt_tokens
            first_token, first_logprobs = source.first_token, source.first_logprobs
            first_block, num_blocks = source.first_block, source.checkpoint_conv.shape[0]
        else:
            num_prompt_tokens = len(source.prompt_ids)
            first_token = source.output_ids[0]
            first_logprobs = source.logprobs[0] if source.logprobs else None
            first_block, num_blocks = 0, len(source.cached_blocks)
        cache = self.cache
        no_pages = torch.empty(len(cache.k), 0, dtype=cache.conv.dtype)
        return RequestState(
            num_prompt_tokens=num_prompt_tokens,
            first_token=first_token,
            first_logprobs=first_logprobs,
            first_page=first_page,
            first_block=first_block,
            k_pages=no_pages,
            v_pages=no_pages,
            conv=cache.conv[:0, 0],
            ssm=cache.ssm[:0, 0],
            checkpoint_conv=cache.conv.new_empty(num_blocks, 0, *cache.conv.shape[2:]),
            checkpoint_ssm=cache.ssm.new_empty(num_blocks, 0, *cache.ssm.shape[2:]),
        )

    def keep_shard(self, room: str, state: RequestState) -> None:
        """Rank 0 of a TP=1 engine: a whole snapshot is the shard to send."""
        if self.shard_connector is None:
            raise ValueError("this engine has no handover connector")
        self.shard_connector.keep(room, shard_of_state(state))

    def send_shards(
        self, room: str, control: RequestState, decode_size: int, decode_addresses: list[str]
    ) -> None:
        """Every rank sends its slices of `room` from the page and block `control` (the
        first-token state that goes through rank 0) starts at."""
        self._rank_op(
            SendShard(
                room=room,
                first_page=control.first_page,
                first_block=control.first_block,
                num_blocks=control.checkpoint_conv.shape[0],
                decode_size=decode_size,
                decode_addresses=tuple(decode_addresses),
            )
        )

    def drop_shards(self, room: str) -> None:
        self._rank_op(DropShard(room=room))

    def install_shards(
        self, request_id: str, room: str, prefill_size: int, control: RequestState
    ) -> bool:
        """Every rank installs its shard of `room` into the request's pages (from
        `control.first_page` to the prompt's end), slot and checkpoint slots once all its pieces
        have arrived: True when every rank has, False while some wait (ask again later);
        ValueError if any rank cannot (the checkpoint slots are given back then)."""
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"request {request_id} is gone")
        num_pages = -(-len(req.prompt_ids) // self.cache.page_size)
        first_page = control.first_page
        # The pages before are this engine's cached prefix, shared with other requests: a peer
        # may not write them (an honest one starts right after them).
        cached_pages = req.num_cached_tokens // self.cache.page_size
        if not cached_pages == first_page <= num_pages:
            raise ValueError(
                f"the prefill worker sends pages from {first_page}, expected from"
                f" {cached_pages} (the first {cached_pages} of {num_pages} are cached here)"
            )
        slots = self.shard_checkpoints.get(request_id)
        if slots is None:  # the first try: the same slots on every later one
            slots = self.shard_checkpoints[request_id] = self._checkpoint_slots(req, control)
        error = self._rank_op(
            InstallShard(
                room=room,
                pages=tuple(req.kv_pages[first_page:num_pages]),
                slot=req.mamba_slot,
                first_page=first_page,
                prefill_size=prefill_size,
                first_block=control.first_block,
                num_blocks=control.checkpoint_conv.shape[0],
                checkpoint_slots=slots,
            )
        )
        if error == WAITING_TEXT:
            return False
        if error:
            self.release_shard_checkpoints(request_id)
            raise ValueError(error)
        return True

    def _checkpoint_slots(self, req: Request, control: RequestState) -> tuple[int, ...]:
        """Checkpoint slots for the blocks the prefill side says it sends, from the first on
        that this engine's prefix cache does not hold (0 for those it holds), stopping at the
        first it cannot allocate, as `_register_transferred_blocks` does for a whole state.
        ValueError when the claim exceeds the prompt's blocks past those cached here."""
        first, count = control.first_block, control.checkpoint_conv.shape[0]
        cache = self.prefix_cache
        total = len(req.prompt_ids) // cache.track_interval if cache is not None else 0
        if first < 0 or count > max(0, total - first):
            raise ValueError(
                f"the prefill worker sends checkpoints of blocks {first}..{first + count - 1};"
                f" this prompt has {total} blocks to cache here"
            )
        if cache is None or first != len(req.cached_blocks):  # not the next blocks of its
            return ()  # chain here: checked, none kept
        slots: list[int] = []
        for key in cache.chain_keys(req.prompt_ids, first + count)[first:]:
            slot = 0 if cache.lookup(key) is not None else self.scheduler.checkpoint_slot()
            if slot is None:
                break
            slots.append(slot)
        return tuple(slots)

    def release_shard_checkpoints(self, request_id: str) -> None:
        """Give back the checkpoint slots of a request whose sharded install failed or ended."""
        self.scheduler.slots.free([s for s in self.shard_checkpoints.pop(request_id, ()) if s])

    def register_shard_checkpoints(self, req: Request, first_block: int) -> bool:
        """After every rank has installed: register the blocks whose checkpoints the ranks
        wrote into the request's checkpoint slots, in order; the slots not registered go back.
        False when the request had no sharded install."""
        slots = self.shard_checkpoints.pop(req.request_id, None)
        if slots is None:
            return False
        for i, slot in enumerate(slots):
            k = first_block + i
            if k != len(req.cached_blocks) or not self.scheduler.extend_chain(req, k, slot or None):
                self.scheduler.slots.free([s for s in slots[i:] if s])
                break
        return True
