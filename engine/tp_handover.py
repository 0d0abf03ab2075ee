"""The handover of one request between engines of different tensor-parallel sizes, as every
rank of an engine sees it: its shard of the pools goes out (prefill) or comes in (decode) through
its own connector, straight between ranks, never through rank 0.

    prefill rank p:  SnapshotShard ─> Shard (copies) ─> SendShard ─> connector ─┐ ShardTransfer
    decode rank d:   InstallShard ─> connector.receive (pieces from each source) <┘ per (p, d)
                        ─> install_shard into the pages and slot ─> all ranks agree (ok / not)

Rank 0 records these operations in the step messages like any pool operation, so every rank
does its part in the same order relative to the forwards. The connector (the wire) lives in
disagg/ and is named to the engine by `EngineArgs.handover_connector` ("module:factory"), like
vLLM's kv_connector: the engine never imports disagg itself.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine import parallel
from engine.config import ModelConfig
from engine.handover import RequestState
from engine.prefix_cache import PrefixCache
from engine.request import Request
from engine.scheduler import Scheduler
from engine.state_cache import StateCache
from engine.tp_messages import (
    DropShard,
    HandoverOp,
    InstallShard,
    PoolOps,
    RankStep,
    SendShard,
    SnapshotShard,
)

logger = logging.getLogger("baton.tp_handover")

ADDRESS_BYTES = 256  # a rank's receive address, padded, in the gather that tells rank 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Shard:
    """One rank's copy of a request's state from page `first_page` and block `first_block` on."""

    first_page: int
    first_block: int
    k: torch.Tensor  # (attention_layers, pages, page_size, kv_heads, head_dim) this rank's heads
    v: torch.Tensor  # same
    conv: torch.Tensor  # (mamba_layers, conv_dim, K-1) this rank's x | B | C channels
    ssm: torch.Tensor  # (mamba_layers, heads, head_dim, d_state) this rank's heads
    checkpoint_conv: torch.Tensor  # (blocks, mamba_layers, conv_dim, K-1) at block ends
    checkpoint_ssm: torch.Tensor  # (blocks, mamba_layers, heads, head_dim, d_state)


# component -> [(unit offset in the local tensor, tensor of the piece)]
Pieces = dict[str, list[tuple[int, torch.Tensor]]]


class ShardConnector(Protocol):
    """What each rank's handover connector does (disagg/tp_transfer.py is the one there is)."""

    address: str  # where this rank receives shards ("" on the prefill side)
    # Rooms this rank has installed: asked again (another rank still waiting), it says so at
    # once. A room id is used once (the router mints it).
    installed: OrderedDict[str, None]

    def keep(self, room: str, shard: Shard) -> None: ...

    def send(self, op: SendShard) -> None: ...

    def drop(self, room: str) -> None: ...

    def receive(self, op: InstallShard) -> Pieces | None: ...

    def close(self) -> None: ...


def load_connector(
    spec: dict[str, str] | None, config: ModelConfig, rank: int, size: int, cache: StateCache
) -> ShardConnector | None:
    """The connector `spec["factory"]` ("module:callable") builds for this rank, with the
    spec's other keys as its options; None without a spec."""
    if spec is None:
        return None
    module, _, name = spec["factory"].partition(":")
    factory: Callable[..., ShardConnector] = getattr(importlib.import_module(module), name)
    options = {k: v for k, v in spec.items() if k != "factory"}
    return factory(options, config=config, rank=rank, size=size, cache=cache)


def export_shard(
    cache: StateCache, pages: tuple[int, ...], slot: int, checkpoint_slots: tuple[int, ...]
) -> Shard:
    """Copies of this rank's K/V `pages`, Mamba `slot` and block `checkpoint_slots`."""
    ps = cache.page_size
    index = torch.tensor(pages, dtype=torch.int64, device=cache.conv.device)
    blocks = torch.tensor(checkpoint_slots, dtype=torch.int64, device=cache.conv.device)

    def gather(pool: list[torch.Tensor]) -> torch.Tensor:
        if not pool:
            return torch.empty(0, len(pages), ps, 0, 0)
        return torch.stack([p.view(-1, ps, *p.shape[1:]).index_select(0, index) for p in pool])

    return Shard(
        first_page=0,
        first_block=0,
        k=gather(cache.k),
        v=gather(cache.v),
        conv=cache.conv[:, slot].clone(),
        ssm=cache.ssm[:, slot].clone(),
        checkpoint_conv=cache.conv.index_select(1, blocks).transpose(0, 1).contiguous(),
        checkpoint_ssm=cache.ssm.index_select(1, blocks).transpose(0, 1).contiguous(),
    )


def shard_of_state(state: RequestState) -> Shard:
    """A whole (TP=1) snapshot is rank 0's shard: it holds every unit."""
    return Shard(
        first_page=state.first_page,
        first_block=state.first_block,
        k=state.k_pages,
        v=state.v_pages,
        conv=state.conv,
        ssm=state.ssm,
        checkpoint_conv=state.checkpoint_conv,
        checkpoint_ssm=state.checkpoint_ssm,
    )


def install_shard(cache: StateCache, op: InstallShard, pieces: Pieces) -> None:
    """Write checked pieces into the op's pages (k/v: (layers, len(pages), page, n, head_dim)),
    its slot (conv: (layers, n, K-1), ssm: (layers, n, head_dim, d_state)) and its checkpoint
    slots (checkpoint_conv / _ssm: the same with a leading block dimension)."""
    ps = cache.page_size
    index = torch.tensor(op.pages, dtype=torch.int64, device=cache.conv.device)
    for component, pool in (("k", cache.k), ("v", cache.v)):
        for offset, t in pieces.get(component, ()):
            for layer, dst in enumerate(pool):
                view = dst.view(-1, ps, *dst.shape[1:])
                view[index, :, offset : offset + t.shape[3]] = t[layer].to(dst.device, dst.dtype)
    for component, pool in (("conv", cache.conv), ("ssm", cache.ssm)):
        for offset, t in pieces.get(component, ()):
            pool[:, op.slot, offset : offset + t.shape[1]] = t.to(pool.device, pool.dtype)
        for offset, t in pieces.get(f"checkpoint_{component}", ()):
            for block, slot in enumerate(op.checkpoint_slots):
                if slot:  # (0: cached here already)
                    pool[:, slot, offset : offset + t.shape[2]] = t[block].to(
                        pool.device, pool.dtype
                    )


# What a rank reports after its part of an InstallShard.
FAILED, WAITING, INSTALLED = 0, 1, 2
INSTALLED_MEMORY = 4096  # rooms a rank remembers having installed (asked again until all have)


def apply_handover(op: HandoverOp, cache: StateCache, connector: ShardConnector | None) -> str:
    """Do this rank's part of `op`; "" when done, WAITING_TEXT while an InstallShard's pieces
    are still on their way, else why not (logged here: a rank other than 0 has no one else to
    tell)."""
    if connector is None:
        return "this engine has no handover connector"
    try:
        if isinstance(op, SnapshotShard):
            connector.keep(op.room, export_shard(cache, op.pages, op.slot, op.checkpoint_slots))
        elif isinstance(op, SendShard):
            connector.send(op)
        elif isinstance(op, DropShard):
            connector.drop(op.room)
        elif op.room not in connector.installed:
            pieces = connector.receive(op)
            if pieces is None:
                return WAITING_TEXT
            install_shard(cache, op, pieces)
            connector.installed[op.room] = None
            while len(connector.installed) > INSTALLED_MEMORY:
                connector.installed.popitem(last=False)
    except ValueError as error:  # a peer's missing, late or malformed part: this room only
        logger.warning("room %s: %s", op.room, error)
        return str(error)
    return ""


WAITING_TEXT = "waiting for pieces"


def install_report(tp, error: str, connector: ShardConnector | None) -> torch.Tensor:
    """Every rank's (FAILED / WAITING / INSTALLED, shard bytes received so far) after an
    InstallShard, on rank 0 as (size, 2); one gather, which every rank joins."""
    received = getattr(connector, "bytes_received", 0)
    status = INSTALLED if not error else WAITING if error == WAITING_TEXT else FAILED
    own = torch.tensor([[status, received]], dtype=torch.int64)
    return tp.gather_last_dim(own).view(-1, 2)


def gather_addresses(tp, connector: ShardConnector | None) -> list[str]:
    """Every rank's receive address on rank 0 (rank order); [] on the others. Each rank calls
    it once, after loading."""
    own = (connector.address if connector is not None else "").encode()[:ADDRESS_BYTES]
    padded = torch.zeros(1, ADDRESS_BYTES, dtype=torch.uint8)
    padded[0, : len(own)] = torch.tensor(list(own), dtype=torch.uint8)
    every = tp.gather_last_dim(padded)
    if not tp.is_first:
        return []
    return [bytes(row.tolist()).rstrip(b"\0").decode() for row in every.view(-1, ADDRESS_BYTES)]


class ShardHandoverMixin:
    """The engine's typed methods for a worker that hands requests over across TP sizes. Mixed
    into Engine, which provides what is declared here."""

    cache: StateCache
    pool_ops: PoolOps
    ranks: object  # engine.tp_ranks.Ranks | None
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
            self.shard_bytes_received = report[:, 1].tolist()
            statuses = report[:, 0].tolist()
            failed = [rank for rank, status in enumerate(statuses) if status == FAILED]
            if failed and (not error or error == WAITING_TEXT):
                error = f"decode rank(s) {failed} could not install their shard (see their log)"
            elif not failed and any(status == WAITING for status in statuses):
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
