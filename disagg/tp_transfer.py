"""Each rank's handover connector when either side of a disaggregated pair runs TP > 1: a prefill
rank sends every decode rank the slices it was planned to (baton.disagg.tp_layout.plan); a decode rank
receives its pieces from each planned source, checks every byte against its own plan, and hands
them to the engine to install (engine/handover/shards.py). Nothing is gathered through rank 0.

    prefill rank p ── PUSH ──(ShardTransfer: room, p, P, first page, frames component@offset)──>
        PULL on decode rank d (its address is in the decode side's Register, TPLayout)

Messages use the disaggregation protocol (MAC with the shared secret, replay guard). What a peer
sent stays hostile until `receive` has checked its source, sizes, names, shapes and dtypes
against this rank's plan; a bad or missing piece fails that room only.

A decode rank's port is read all the time, by a thread of its own, whether or not a room waits
(a TP=1 decode worker needs it when its prefill peer runs TP > 1, and is never told in advance):
each message is authenticated and parsed on arrival, what fails is dropped and counted, and what
passes is kept at most ARRIVED_TTL_S and within the bytes this rank's pools hold
(engine/runtime/socket_limits.py bounds each part and the queue before that).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict

import torch
import zmq

from baton.disagg.messages import ShardTransfer
from baton.disagg.protocol import (
    ProtocolError,
    ReplayGuard,
    decode,
    dtype_name,
    encode,
    tensor_specs,
)
from baton.disagg.rooms import is_loopback
from baton.disagg.tp_layout import ENDPOINT, MAX_TP_SIZE, Piece, check_prefill_size, plan
from baton.engine.cache.pools import StateCache
from baton.engine.config import ModelConfig
from baton.engine.handover.shards import ConnectorSpec, Pieces, Shard, unit_dim
from baton.engine.parallel.messages import InstallShard, SendShard
from baton.engine.runtime.cpu_allocator import release_freed_memory
from baton.engine.runtime.socket_limits import (
    LARGE_FRAME_BYTES,
    REFUSALS,
    SEND_ONLY,
    ReceiveLimits,
    limit,
    receive,
)

logger = logging.getLogger("baton.disagg.tp_transfer")

SECRET_ENV = "BATON_DISAGG_SECRET"
# Bounds on what peers can make a rank hold: rooms whose pieces arrived but were never asked for
# (their room failed on rank 0 first) are forgotten after this long, or beyond this many.
ARRIVED_TTL_S = 600.0
MAX_ARRIVED_ROOMS = 1024
MAX_KEPT_ROOMS = 4096  # prefill snapshots waiting for their decode side
MAX_OUTBOXES = 64  # connections to decode ranks kept open
POLL_MS = 100  # how often the receiving thread looks up from its port to see if it must stop
MAX_QUEUED = 64  # unread messages per sender (a room brings one per prefill rank)


def connector_spec(role: str, host: str) -> ConnectorSpec:
    """EngineArgs.handover_connector for a disaggregated worker of `role` whose decode ranks
    bind on `host`."""
    return ConnectorSpec(factory=ZmqShardConnector, options={"role": role, "host": host})


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
        secret = os.environ.get(SECRET_ENV) or None
        self.secret = secret.encode() if secret else None
        self.replay = ReplayGuard()
        self.context = zmq.Context()
        self.kept: OrderedDict[str, Shard] = OrderedDict()
        self.installed: OrderedDict[str, None] = OrderedDict()
        self.outboxes: OrderedDict[str, zmq.Socket] = OrderedDict()
        # room -> source rank -> (when it arrived, message, tensors)
        self.arrived: OrderedDict[str, dict[int, tuple[float, ShardTransfer, dict]]] = OrderedDict()
        self.bytes_sent = 0
        self.bytes_received = (
            0  # bench/offline/tp.py: what this rank received, against what it owns
        )
        self.refusals = REFUSALS  # this process's: rank 0 reports them in its stats
        self.inbox: zmq.Socket | None = None
        self.address = ""
        self.lock = threading.Lock()  # `arrived`, shared with the receiving thread
        self.stopping = threading.Event()
        self.reader: threading.Thread | None = None
        if options["role"] == "decode":
            host = options["host"]
            if self.secret is None and not is_loopback(host):
                raise ValueError(
                    f"decode rank {rank} would receive shards on {host} without a shared secret"
                    f" (set --disagg-secret or {SECRET_ENV})"
                )
            self.limits = receive_limits(cache, rank)
            self.inbox = limit(self.context.socket(zmq.PULL), self.limits)
            self.inbox.setsockopt(zmq.LINGER, 0)
            port = self.inbox.bind_to_random_port(f"tcp://{host}")
            self.address = f"tcp://{host}:{port}"
            self.max_arrived_bytes = cache.bytes()
            self.reader = threading.Thread(
                target=self._read_forever, name=f"shards-rank{rank}", daemon=True
            )
            self.reader.start()

    # -- prefill side ---------------------------------------------------------------------------

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
                self._outbox(address).send_multipart(frames, zmq.NOBLOCK, copy=False)
            except (zmq.ZMQError, ValueError) as error:
                logger.warning("room %s: cannot send to decode rank %d: %s", room, dst, error)
                continue
            self.bytes_sent += sum(t.numel() * t.element_size() for _, t in named)

    def _outbox(self, address: str) -> zmq.Socket:
        if not ENDPOINT.fullmatch(address):
            raise ValueError(f"{address[:80]!r} is not a tcp://host:port address")
        sock = self.outboxes.pop(address, None)
        if sock is None:
            sock = limit(self.context.socket(zmq.PUSH), SEND_ONLY)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        self.outboxes[address] = sock  # most recently used last
        while len(self.outboxes) > MAX_OUTBOXES:
            _, old = self.outboxes.popitem(last=False)
            old.close(linger=0)
        return sock

    # -- decode side ----------------------------------------------------------------------------

    def receive(self, op: InstallShard) -> Pieces | None:
        """This rank's pieces of `op.room`, every one checked against the plan and the op's
        pages and blocks; None while some have not arrived (the caller asks again; the room's
        timeout is its own). ValueError naming what is wrong."""
        if self.inbox is None:
            raise ValueError("a prefill rank does not receive shards")
        room, prefill_size = op.room, op.prefill_size
        check_prefill_size(self.config, self.cache.spec, prefill_size)
        expected = plan(self.cache.spec, prefill_size, self.size, self.rank)
        sources = {p.source for p in expected}
        with self.lock:
            if not sources <= set(self.arrived.get(room, {})):
                return None
            arrived = self.arrived.pop(room)
        pieces: Pieces = {}
        for source in sorted(sources):
            _, message, tensors = arrived[source]
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

    def _read_forever(self) -> None:
        """The receiving thread: every message on the port, as it arrives, until close()."""
        while not self.stopping.is_set():
            if self.inbox.poll(POLL_MS):
                self._take_messages()

    def _take_messages(self) -> None:
        """Everything waiting on the inbox, authenticated and parsed; the rest counted and
        dropped (its room then fails by its wait)."""
        while True:
            try:
                frames = receive(self.inbox, self.limits, self.refusals, copy=False)
            except zmq.Again:
                return
            if frames is None:
                continue
            try:
                message, tensors = decode([f.buffer for f in frames], self.secret, self.replay)
            except ProtocolError as error:
                self.refusals.refuse(self.limits.name, str(error))
                size = sum(len(f.buffer) for f in frames)
                del frames
                if size >= LARGE_FRAME_BYTES:  # and none of the memory it took stays
                    release_freed_memory()
                continue
            if (
                not isinstance(message, ShardTransfer)
                or message.source_rank >= message.source_size
                or message.source_size > MAX_TP_SIZE
            ):
                self.refusals.refuse(self.limits.name, f"a {message.tag} message")
                continue
            with self.lock:
                room = self.arrived.setdefault(message.room, {})
                room[message.source_rank] = (time.monotonic(), message, tensors)
                self._forget_old()

    def _forget_old(self) -> None:
        """Rooms past ARRIVED_TTL_S, beyond MAX_ARRIVED_ROOMS, or beyond the bytes this rank's
        pools hold (more than any rooms it waits for can bring) go, oldest first."""
        oldest = time.monotonic() - ARRIVED_TTL_S
        held = sum(
            t.numel() * t.element_size()
            for room in self.arrived.values()
            for _, _, tensors in room.values()
            for t in tensors.values()
        )
        while self.arrived:
            first = next(iter(self.arrived.values()))
            if (
                len(self.arrived) <= MAX_ARRIVED_ROOMS
                and held <= self.max_arrived_bytes
                and min(t for t, _, _ in first.values()) >= oldest
            ):
                return
            _, dropped = self.arrived.popitem(last=False)
            held -= sum(
                t.numel() * t.element_size() for _, _, ts in dropped.values() for t in ts.values()
            )

    def close(self) -> None:
        self.stopping.set()
        if self.reader is not None:
            self.reader.join()
        for sock in self.outboxes.values():
            sock.close(linger=0)
        if self.inbox is not None:
            self.inbox.close(linger=0)
        self.context.term()


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
