"""Each rank's handover connector when either side of a disaggregated pair runs TP > 1 and the
bytes move as ZMQ frames: a prefill rank sends every decode rank the slices it was planned to
(baton.disagg.tp_layout.plan); a decode rank receives its pieces from each planned source, checks
every byte against its own plan, and hands them to the engine to install
(engine/handover/shards.py). Nothing is gathered through rank 0.

    prefill rank p ── PUSH ──(ShardTransfer: room, p, P, first page, frames component@offset)──>
        PULL on decode rank d (its address is in the decode side's Register, TPLayout)

The messages go over the rank-to-rank channel (disagg/shard_channel.py: authenticated, read by
a thread of its own, bounded). What a peer sent stays hostile until `receive` has checked its
source, sizes, names, shapes and dtypes against this rank's plan; a bad or missing piece fails
that room only. With the nixl backend the same places are READ instead
(disagg/nixl_shards.py).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
import zmq

from baton.disagg.messages import ShardTransfer
from baton.disagg.nixl_shards import NixlShardConnector
from baton.disagg.nixl_transfer import TransferBackend
from baton.disagg.protocol import dtype_name, encode, tensor_specs
from baton.disagg.shard_channel import MAX_QUEUED, SECRET_ENV, ShardChannel
from baton.disagg.tp_layout import Piece, check_prefill_size, plan
from baton.engine.cache.pools import StateCache
from baton.engine.config import ModelConfig
from baton.engine.handover.shards import ConnectorSpec, Pieces, Shard, export_shard, unit_dim
from baton.engine.parallel.messages import InstallShard, SendShard, SnapshotShard
from baton.engine.runtime.socket_limits import ReceiveLimits

logger = logging.getLogger("baton.disagg.tp_transfer")

__all__ = ["SECRET_ENV", "connector_spec"]

MAX_KEPT_ROOMS = 4096  # prefill snapshots waiting for their decode side


def connector_spec(role: str, host: str, backend: TransferBackend = "zmq") -> ConnectorSpec:
    """EngineArgs.handover_connector for a disaggregated worker of `role` whose decode ranks
    bind on `host`, moving its bytes by `backend` (both workers of a pair use the same)."""
    factory = NixlShardConnector if backend == "nixl" else ZmqShardConnector
    return ConnectorSpec(factory=factory, options={"role": role, "host": host})


class ZmqShardConnector:
    def __init__(
        self,
        options: dict[str, str],
        *,
        config: ModelConfig,
        rank: int,
        size: int,
        cache: StateCache,
    ) -> None:
        self.config, self.rank, self.size, self.cache = config, rank, size, cache
        decoding = options["role"] == "decode"
        self.channel = ShardChannel(
            role=options["role"],
            host=options["host"],
            rank=rank,
            carries=ShardTransfer,
            limits=receive_limits(cache, rank) if decoding else None,
            max_held_bytes=cache.bytes(),
        )
        self.secret = self.channel.secret
        self.address = self.channel.address
        self.refusals = self.channel.refusals
        self.kept: OrderedDict[str, Shard] = OrderedDict()
        self.installed: OrderedDict[str, None] = OrderedDict()
        self.bytes_sent = 0
        # bench/offline/tp.py: what this rank received, against what it owns
        self.bytes_received = 0

    # -- prefill side ---------------------------------------------------------------------------

    def snapshot(self, op: SnapshotShard) -> None:
        """A copy of this rank's shard: the request's pages and slot go once it ends."""
        self.keep(op.room, export_shard(self.cache, op.pages, op.slot, op.checkpoint_slots))

    def keep(self, room: str, shard: Shard) -> None:
        self.kept[room] = shard
        while len(self.kept) > MAX_KEPT_ROOMS:
            dropped, _ = self.kept.popitem(last=False)
            logger.warning("room %s: snapshot forgotten (too many waiting)", dropped)

    def drop(self, room: str) -> None:
        self.kept.pop(room, None)

    def send(self, op: SendShard) -> None:
        """This rank's planned pieces of `op.room` to every decode rank that takes any. A decode
        rank that cannot be reached fails the room there (by its wait), not here."""
        room = op.room
        shard = self.kept.pop(room, None)
        if shard is None:
            raise ValueError(f"no snapshot of room {room} on prefill rank {self.rank}")
        skip = op.first_page - shard.first_page
        num_pages = next((t.shape[1] for t in shard.pages.values()), 0)
        if not 0 <= skip <= num_pages:
            raise ValueError(f"room {room}: page {op.first_page} is outside the snapshot")
        first = op.first_block - shard.first_block
        blocks = slice(first, first + op.num_blocks)
        num_blocks = next((t.shape[0] for t in shard.checkpoints.values()), 0)
        if first < 0 or op.num_blocks < 0 or blocks.stop > num_blocks:
            raise ValueError(
                f"room {room}: blocks {op.first_block}..+{op.num_blocks} are outside the snapshot"
            )
        for dst, address in enumerate(op.decode_addresses):
            pieces = [
                p
                for p in plan(self.cache.spec, self.size, op.decode_size, dst)
                if p.source == self.rank
            ]
            if not pieces:
                continue
            named = [(p.name, self._cut(shard, p, skip, blocks)) for p in pieces]
            message = ShardTransfer(
                room=room,
                source_rank=self.rank,
                source_size=self.size,
                first_page=op.first_page,
                first_block=op.first_block,
                tensors=tensor_specs(named),
            )
            frames = encode(message, [t for _, t in named], self.secret)
            try:
                self.channel.send(address, frames)
            except (zmq.ZMQError, ValueError) as error:
                logger.warning("room %s: cannot send to decode rank %d: %s", room, dst, error)
                continue
            self.bytes_sent += sum(t.numel() * t.element_size() for _, t in named)

    # -- decode side ----------------------------------------------------------------------------

    def receive(self, op: InstallShard) -> Pieces | None:
        """This rank's pieces of `op.room`, every one checked against the plan and the op's
        pages and blocks; None while some have not arrived (the caller asks again; the room's
        timeout is its own). ValueError naming what is wrong."""
        if self.channel.inbox is None:
            raise ValueError("a prefill rank does not receive shards")
        room, prefill_size = op.room, op.prefill_size
        check_prefill_size(self.config, self.cache.spec, prefill_size)
        expected = plan(self.cache.spec, prefill_size, self.size, self.rank)
        sources = {p.source for p in expected}
        arrived = self.channel.take(room, sources)
        if arrived is None:
            return None
        pieces: Pieces = {}
        for source in sorted(sources):
            _, message, tensors, _ = arrived[source]
            sent = (message.source_size, message.first_page, message.first_block)
            if sent != (prefill_size, op.first_page, op.first_block):
                raise ValueError(
                    f"decode rank {self.rank}: prefill rank {source} sent TP={sent[0]} from page"
                    f" {sent[1]} and block {sent[2]}, expected TP={prefill_size} from page"
                    f" {op.first_page} and block {op.first_block}"
                )
            mine = [p for p in expected if p.source == source]
            if set(tensors) != {p.name for p in mine}:
                raise ValueError(
                    f"decode rank {self.rank}: prefill rank {source} sent {sorted(tensors)},"
                    f" expected {sorted(p.name for p in mine)}"
                )
            for p in mine:
                t = tensors[p.name]
                shape, dtype = self._expected(p, len(op.pages), op.num_blocks)
                if tuple(t.shape) != shape or dtype_name(t.dtype) != dtype:
                    raise ValueError(
                        f"decode rank {self.rank}: {p.name} from prefill rank {source} is"
                        f" {dtype_name(t.dtype)} {list(t.shape)}, expected {dtype} {list(shape)}"
                    )
                pieces.setdefault(p.component, []).append((p.dst_offset, t))
                self.bytes_received += t.numel() * t.element_size()
        return pieces

    def _expected(self, p: Piece, num_pages: int, num_blocks: int) -> tuple[tuple[int, ...], str]:
        """The shape and dtype piece `p` must have: its component's, `p.length` units wide."""
        field, name = p.component.split("/", 1)
        pool = self.cache.pools[name]  # (layers, rows, *shape)
        layers, shape = pool.shape[0], list(pool.shape[2:])
        leading = {
            "pages": (layers, num_pages, self.cache.page_size),
            "slots": (layers,),
            "checkpoints": (num_blocks, layers),
        }[field]
        full = [*leading, *shape]
        full[unit_dim(self.cache.spec, p.component)] = p.length
        return tuple(full), dtype_name(pool.dtype)

    def _cut(self, shard: Shard, p: Piece, skip_pages: int, blocks: slice) -> torch.Tensor:
        """Piece `p` of this rank's snapshot, from page `skip_pages` of it on and of its
        checkpoints `blocks` (a copy, contiguous: the frame keeps it alive until ZMQ has sent
        it)."""
        whole = shard.component(p.component)
        field = p.component.split("/", 1)[0]
        if field == "pages":
            whole = whole[:, skip_pages:]
        elif field == "checkpoints":
            whole = whole[blocks]
        dim = unit_dim(self.cache.spec, p.component)
        return whole.narrow(dim, p.src_offset, p.length).contiguous()

    def close(self) -> None:
        self.channel.close()


def receive_limits(cache: StateCache, rank: int) -> ReceiveLimits:
    """A ShardTransfer is a header, a MAC and one frame per planned piece (a component's slice,
    at most a whole pool of this rank): the largest part is the largest pool, and a message has
    at most one piece per component and split segment (the state spec's)."""
    largest = max([p.numel() * p.element_size() for p in cache.pools.values()] + [1 << 20])
    pieces = 0
    for _, _, tensor in cache.spec.entries():
        segments = len(tensor.split.segments) if tensor.split is not None else 1
        pieces += segments * (2 if tensor.checkpointed and tensor.kind == "slot" else 1)
    return ReceiveLimits(
        name=f"decode rank {rank} shards",
        max_part_bytes=largest,
        max_parts=2 + pieces,
        max_queued=MAX_QUEUED,
    )
