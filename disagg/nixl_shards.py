"""Each rank's handover connector with the nixl transfer backend (`connector_spec(role, host,
"nixl")`): when either side of a pair runs TP > 1, every decode rank READs the slices it owns
straight from each prefill rank's pools, the ranges the TP layout derives for the zmq path
(baton.disagg.tp_layout.plan: K/V heads, conv channels per x | B | C segment, SSM heads, ...).

    prefill rank p: SnapshotShard ─> the place (pages, slot, checkpoint slots) noted, no copy:
                    rank 0's hold keeps it in every rank's pools (ranks mirror rank 0's pages)
                    SendShard ─> a ShardOffer to each decode rank that takes slices from p ─┐
    decode rank d:  InstallShard ─> every planned source's offer in? checked, READs posted <┘
                    (one per source) ─> asked again each step until done ─> installed
                    DropShard (the room failed) ─> READs cancelled before the pages may go

    rank 0 (decode): once every rank has installed, ReadDone to the prefill worker, whose hold
    then lets the pages and slot go; a failed room is dropped on every rank, then Abort.

One NIXL agent per rank process, registered once with that rank's pools; on rank 0 the worker
uses the same agent for the rooms both sides run at TP=1 (disagg/decode_reads.py). An offer is
hostile until checked: its regions against the prefill rank's own shapes (from the state spec:
rows of `local_shape(P, p)`), every index against its region, its counts against the op's; the
decode rank computes every address itself, and NIXL checks once more that each lies in memory
the prefill agent registered. Agent metadata only arrives on the authenticated rank channel.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import zmq

from baton.disagg.messages import ShardOffer
from baton.disagg.nixl_transfer import (
    Descriptor,
    NixlAgent,
    ReadPlan,
    check_pool_regions,
    index_in,
    runs_of,
)
from baton.disagg.protocol import encode
from baton.disagg.rooms import FaultInjection, now
from baton.disagg.schema import MAX_BLOB
from baton.disagg.shard_channel import MAX_QUEUED, ShardChannel
from baton.disagg.tp_layout import Piece, check_prefill_size, piece_segments, plan
from baton.engine.cache.pools import StateCache
from baton.engine.config import ModelConfig
from baton.engine.handover.connector import Handover
from baton.engine.handover.shards import Pieces, Shard
from baton.engine.handover.state import StatePlace
from baton.engine.parallel.messages import InstallShard, SendShard, SnapshotShard
from baton.engine.runtime.socket_limits import ReceiveLimits

logger = logging.getLogger("baton.disagg.nixl_shards")

MAX_KEPT_ROOMS = 4096  # prefill places noted, waiting for their decode side
MAX_PEER_AGENTS = 64  # prefill agents a decode rank keeps loaded (least recently used go)
# An offer is one header: the agent's metadata (at most MAX_BLOB) and the prompt's page indices
OFFER_BYTES = 4 * MAX_BLOB
OFFERS_HELD_BYTES = 64 << 20  # offers arrived and not yet taken, in all


@dataclass(eq=False)
class RankRead:
    """A decode rank's READs of one room, one per prefill rank it takes slices from."""

    handles: list  # NIXL transfer handles still held
    agents: set[str]  # the prefill agents read from (kept loaded while reading)
    bytes: int
    started: float


class NixlShardConnector:
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
        role = options["role"]
        self.agent = NixlAgent(role, options["host"], cache.moved_pools())
        decoding = role == "decode"
        self.channel = ShardChannel(
            role=role,
            host=options["host"],
            rank=rank,
            carries=ShardOffer,
            limits=ReceiveLimits(
                name=f"decode rank {rank} offers",
                max_part_bytes=OFFER_BYTES,
                max_parts=2,
                max_queued=MAX_QUEUED,
            )
            if decoding
            else None,
            max_held_bytes=OFFERS_HELD_BYTES,
        )
        self.address = self.channel.address
        self.refusals = self.channel.refusals
        self.faults = FaultInjection.from_env()
        self.places: OrderedDict[str, StatePlace] = OrderedDict()
        self.installed: OrderedDict[str, None] = OrderedDict()
        self.reads: dict[str, RankRead] = {}
        self.loaded: OrderedDict[str, None] = OrderedDict()  # peer agents, least recent first
        self.bytes_sent = 0  # what decode ranks were offered to read here
        self.bytes_received = 0  # what this rank read, against what it owns

    # -- prefill side ---------------------------------------------------------------------------

    def snapshot(self, op: SnapshotShard) -> None:
        """Note where the room's state sits: it is read in place (the request's hold keeps it)."""
        self.places[op.room] = StatePlace(
            pages=op.pages, slot=op.slot, checkpoint_slots=op.checkpoint_slots
        )
        while len(self.places) > MAX_KEPT_ROOMS:
            dropped, _ = self.places.popitem(last=False)
            logger.warning("room %s: place forgotten (too many waiting)", dropped)

    def keep(self, room: str, shard: Shard) -> None:
        raise ValueError("the nixl backend reads a request's state in place: it keeps no copies")

    def send(self, op: SendShard) -> None:
        """Offer each decode rank that takes slices from this rank the room's place, from page
        `op.first_page` and block `op.first_block` on. A decode rank that cannot be reached
        fails the room there (by its wait), not here."""
        room = op.room
        place = self.places.pop(room, None)
        if place is None:
            raise ValueError(f"no place of room {room} on prefill rank {self.rank}")
        paged = bool(self.cache.paged)
        if paged and not 0 <= op.first_page <= len(place.pages):
            raise ValueError(f"room {room}: page {op.first_page} is outside the prompt's pages")
        blocks = slice(op.first_block, op.first_block + op.num_blocks)
        if op.num_blocks < 0 or blocks.stop > len(place.checkpoint_slots):
            raise ValueError(
                f"room {room}: blocks {op.first_block}..+{op.num_blocks} are outside the prompt's"
            )
        for dst, address in enumerate(op.decode_addresses):
            if not any(
                p.source == self.rank for p in plan(self.cache.spec, self.size, op.decode_size, dst)
            ):
                continue
            offer = ShardOffer(
                room=room,
                source_rank=self.rank,
                source_size=self.size,
                first_page=op.first_page,
                first_block=op.first_block,
                agent=self.agent.name,
                agent_metadata=self.agent.metadata,
                pools=self.agent.regions,
                pages=list(place.pages[op.first_page :]) if paged else [],
                slot=place.slot,
                checkpoint_slots=list(place.checkpoint_slots[blocks]),
            )
            try:
                self.channel.send(address, encode(offer, [], self.channel.secret))
            except (zmq.ZMQError, ValueError) as error:
                logger.warning("room %s: cannot offer to decode rank %d: %s", room, dst, error)

    # -- decode side ----------------------------------------------------------------------------

    def receive(self, op: InstallShard) -> Pieces | None:
        """Once this rank's READs of `op.room` are done, nothing more to install (they wrote
        into the op's pages, slot and checkpoint slots): empty pieces. None while offers are
        missing or READs are in flight (the caller asks again; the room's timeout is its own).
        ValueError naming what is wrong (an offer that does not fit, a failed READ)."""
        if self.channel.inbox is None:
            raise ValueError("a prefill rank does not read shards")
        read = self.reads.get(op.room)
        if read is None:
            read = self._start(op)
            if read is None:
                return None
        states = [self.agent.state(h) for h in read.handles]
        if self.faults.stall_reads or ("ERR" not in states and any(s != "DONE" for s in states)):
            return None
        self._release(op.room)
        if "ERR" in states:
            raise ValueError(f"decode rank {self.rank}: the NIXL read of room {op.room} failed")
        self.bytes_received += read.bytes
        return {}

    def drop(self, room: str) -> None:
        """The room failed: its READs stop here (its pages may go once this returns), its
        offers and place are forgotten."""
        self._release(room)
        self.places.pop(room, None)
        self.channel.forget(room)

    def _start(self, op: InstallShard) -> RankRead | None:
        """Check every planned source's offer against the plan and the op, then post one READ
        per source; None while some offer has not arrived."""
        spec, room, prefill_size = self.cache.spec, op.room, op.prefill_size
        check_prefill_size(self.config, spec, prefill_size)
        expected = plan(spec, prefill_size, self.size, self.rank)
        sources = {p.source for p in expected}
        arrived = self.channel.take(room, sources)
        if arrived is None:
            return None
        plans: list[tuple[ShardOffer, ReadPlan]] = []
        for source in sorted(sources):
            offer: ShardOffer = arrived[source][1]
            sent = (offer.source_size, offer.first_page, offer.first_block)
            if sent != (prefill_size, op.first_page, op.first_block):
                raise ValueError(
                    f"decode rank {self.rank}: prefill rank {source} offers TP={sent[0]} from page"
                    f" {sent[1]} and block {sent[2]}, expected TP={prefill_size} from page"
                    f" {op.first_page} and block {op.first_block}"
                )
            if len(offer.pages) != (len(op.pages) if self.cache.paged else 0):
                raise ValueError(
                    f"decode rank {self.rank}: prefill rank {source} offers {len(offer.pages)}"
                    f" pages, this request needs {len(op.pages)}"
                )
            if len(offer.checkpoint_slots) != op.num_blocks:
                raise ValueError(
                    f"decode rank {self.rank}: prefill rank {source} offers"
                    f" {len(offer.checkpoint_slots)} block checkpoints of {op.num_blocks}"
                )
            mine = [p for p in expected if p.source == source]
            plans.append((offer, self._plan(op, offer, prefill_size, mine)))
        read = RankRead(
            handles=[], agents={offer.agent for offer, _ in plans}, bytes=0, started=now()
        )
        self.reads[room] = read  # from here on, _release undoes what was posted
        try:
            for offer, read_plan in plans:
                self._load(offer)
                handle = self.agent.start_read(offer.agent, read_plan)
                if handle is not None:
                    read.handles.append(handle)
                read.bytes += read_plan.bytes
        except (RuntimeError, ValueError) as error:
            self._release(room)
            raise ValueError(f"decode rank {self.rank}: {error}") from None
        return read

    def _plan(
        self, op: InstallShard, offer: ShardOffer, prefill_size: int, pieces: list[Piece]
    ) -> ReadPlan:
        """The descriptors of this rank's pieces from one prefill rank: per piece, layer and
        row (page token, slot, checkpoint slot) the piece's units, each run of them that is
        contiguous in both rows one descriptor (a whole row when the piece is one, runs of
        pages then merged). Every index of the offer is checked against its regions first,
        those this rank reads and the others."""
        spec, source = self.cache.spec, offer.source_rank
        whose = f"prefill rank {source}"
        expected = {
            name: (group.num_layers, tensor.bytes(prefill_size, source))
            for name, group, tensor in spec.entries()
            if name not in self.cache.covered
        }
        local_regions = self.agent.region_by_name
        remote_regions = check_pool_regions(
            {n: v for n, v in expected.items() if v[1]}, offer.pools, whose
        )
        ps = self.cache.page_size
        for name, region in remote_regions.items():
            where = f"{name} of {whose}"
            if spec.tensor(name)[1].kind == "paged":
                for p in offer.pages:
                    index_in("page", p, region.rows // ps, where)
                continue
            index_in("slot", offer.slot, region.rows, where)
            for slot in offer.checkpoint_slots:
                index_in("checkpoint slot", slot, region.rows, where)
        local_d: list[Descriptor] = []
        remote_d: list[Descriptor] = []
        for piece in pieces:
            field, name = piece.component.split("/", 1)
            group, tensor = spec.tensor(name)
            lr, rr = local_regions[name], remote_regions[name]
            segments = piece_segments(spec, name, prefill_size, source, self.size, self.rank, piece)
            whole = segments == [(0, 0, lr.row_bytes)] and lr.row_bytes == rr.row_bytes
            if field == "pages":
                rows = [(a * ps, b * ps, n * ps) for a, b, n in runs_of(op.pages, offer.pages)]
            elif field == "slots":
                rows = [(op.slot, offer.slot, 1)]
            else:
                wanted = zip(op.checkpoint_slots, offer.checkpoint_slots)
                rows = [(a, b, 1) for a, b in wanted if a]
            if not whole:  # row by row
                rows = [(a + i, b + i, 1) for a, b, n in rows for i in range(n)]
            for layer in range(group.num_layers):
                for local_row, remote_row, n in rows:
                    local_at = lr.address + (layer * lr.rows + local_row) * lr.row_bytes
                    remote_at = rr.address + (layer * rr.rows + remote_row) * rr.row_bytes
                    if whole:
                        local_d.append((local_at, n * lr.row_bytes, lr.device))
                        remote_d.append((remote_at, n * rr.row_bytes, rr.device))
                        continue
                    for local_off, remote_off, nbytes in segments:
                        local_d.append((local_at + local_off, nbytes, lr.device))
                        remote_d.append((remote_at + remote_off, nbytes, rr.device))
        memory = {r.memory for r in local_regions.values()} or {"DRAM"}
        remote_memory = {r.memory for r in remote_regions.values()} or {"DRAM"}
        return ReadPlan(
            local=local_d,
            remote=remote_d,
            local_memory=memory.pop(),
            remote_memory=remote_memory.pop(),
            bytes=sum(n for _, n, _ in local_d),
        )

    def _load(self, offer: ShardOffer) -> None:
        """The offer's agent, loaded once (ValueError for metadata of another agent than the
        offer names); beyond MAX_PEER_AGENTS, the least recently used that nothing reads from
        are forgotten."""
        key = f"rank peer {offer.agent}"
        self.agent.load_peer(key, offer.agent, offer.agent_metadata)
        self.loaded.pop(key, None)
        self.loaded[key] = None
        reading = {f"rank peer {a}" for read in self.reads.values() for a in read.agents}
        for old in [k for k in self.loaded if k not in reading]:
            if len(self.loaded) <= MAX_PEER_AGENTS:
                break
            self.loaded.pop(old)
            self.agent.forget_peer(old)

    def _release(self, room: str) -> None:
        read = self.reads.pop(room, None)
        for handle in read.handles if read is not None else ():
            self.agent.release(handle)

    def close(self) -> None:
        for room in list(self.reads):
            self._release(room)
        self.channel.close()
        self.agent.close()


def engine_agent(handover: Handover, role: str, host: str) -> tuple[NixlAgent, bool]:
    """The NIXL agent a worker uses on rank 0 (for the rooms both sides run at TP=1), and
    whether it is the worker's to close: its engine's rank-0 connector's when the ranks read by
    nixl (one agent per process: each runs its own UCX worker, a prefill agent its progress
    thread), else a new one over the engine's pools. ValueError for an engine at TP > 1 whose
    ranks move their slices another way."""
    connector = handover.shards.connector
    if isinstance(connector, NixlShardConnector):
        return connector.agent, False
    if handover.shards.tp_size > 1:
        raise ValueError(
            f"--disaggregation-transfer-backend nixl at --tensor-parallel-size"
            f" {handover.shards.tp_size} needs every rank's handover connector to read by nixl"
            " (EngineArgs.handover_connector=connector_spec(role, host, 'nixl'))"
        )
    return NixlAgent(role, host, handover.pool_tensors()), True
