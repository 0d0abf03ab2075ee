"""The rank-to-rank channel of a handover between engines when either side runs TP > 1: every
prefill rank PUSHes its messages for a room straight to the decode ranks (their addresses come
in the decode side's Register), and each decode rank reads its PULL port all the time, by a
thread of its own, whether or not a room waits (a TP=1 decode worker needs it when its prefill
peer runs TP > 1, and is never told in advance). Nothing goes through rank 0.

    prefill rank p ── PUSH ──(a ShardTransfer with frames, or a ShardOffer: room, p, P, ...)──>
        PULL on decode rank d ── `take(room, sources)` once every planned source's is in

Messages use the disaggregation protocol (MAC with the shared secret, replay guard); each is
authenticated and parsed on arrival, one of another type than the channel carries is refused
and counted, and what passes is kept at most ARRIVED_TTL_S and within the bytes this rank's
pools hold (engine/runtime/socket_limits.py bounds each part and the queue before that). What
a peer sent stays hostile until the connector that takes it has checked it against its plan.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict

import torch
import zmq

from baton.disagg.protocol import ProtocolError, ReplayGuard, decode
from baton.disagg.rooms import is_loopback
from baton.disagg.tp_layout import ENDPOINT, MAX_TP_SIZE
from baton.engine.runtime.cpu_allocator import release_freed_memory
from baton.engine.runtime.socket_limits import (
    LARGE_FRAME_BYTES,
    REFUSALS,
    SEND_ONLY,
    ReceiveLimits,
    limit,
    receive,
)

logger = logging.getLogger("baton.disagg.shard_channel")

SECRET_ENV = "BATON_DISAGG_SECRET"
# Bounds on what peers can make a rank hold: rooms whose messages arrived but were never asked
# for (their room failed on rank 0 first) are forgotten after this long, or beyond this many.
ARRIVED_TTL_S = 600.0
MAX_ARRIVED_ROOMS = 1024
MAX_OUTBOXES = 64  # connections to decode ranks kept open
POLL_MS = 100  # how often the receiving thread looks up from its port to see if it must stop
MAX_QUEUED = 64  # unread messages per sender (a room brings one per prefill rank)

# room -> source rank -> (when it arrived, message, tensors by name, bytes it holds)
Arrived = dict[int, tuple[float, object, dict[str, torch.Tensor], int]]


def channel_secret() -> bytes | None:
    """The shared secret every rank's channel authenticates with (the ranks inherit it)."""
    secret = os.environ.get(SECRET_ENV) or None
    return secret.encode() if secret else None


class ShardChannel:
    """One rank's end: outboxes to decode ranks (a prefill rank), or the inbox and its reading
    thread (a decode rank: `host` is where it binds, `carries` the message type it takes)."""

    def __init__(
        self,
        *,
        role: str,
        host: str,
        rank: int,
        carries: type,
        limits: ReceiveLimits | None,
        max_held_bytes: int,
    ) -> None:
        self.rank = rank
        self.carries = carries
        self.secret = channel_secret()
        self.replay = ReplayGuard()
        self.context = zmq.Context()
        self.outboxes: OrderedDict[str, zmq.Socket] = OrderedDict()
        self.arrived: OrderedDict[str, Arrived] = OrderedDict()
        self.refusals = REFUSALS  # this process's: rank 0 reports them in its stats
        self.max_held_bytes = max_held_bytes
        self.inbox: zmq.Socket | None = None
        self.address = ""
        self.lock = threading.Lock()  # `arrived`, shared with the receiving thread
        self.stopping = threading.Event()
        self.reader: threading.Thread | None = None
        if role == "decode":
            if self.secret is None and not is_loopback(host):
                raise ValueError(
                    f"decode rank {rank} would receive shards on {host} without a shared secret"
                    f" (set --disagg-secret or {SECRET_ENV})"
                )
            self.limits = limits
            self.inbox = limit(self.context.socket(zmq.PULL), limits)
            self.inbox.setsockopt(zmq.LINGER, 0)
            port = self.inbox.bind_to_random_port(f"tcp://{host}")
            self.address = f"tcp://{host}:{port}"
            self.reader = threading.Thread(
                target=self._read_forever, name=f"shards-rank{rank}", daemon=True
            )
            self.reader.start()

    # -- prefill side ---------------------------------------------------------------------------

    def send(self, address: str, frames: list) -> None:
        """Queue one message's frames for the decode rank at `address`, without blocking
        (zmq.ZMQError when its queue is full, ValueError for an address that is none)."""
        self._outbox(address).send_multipart(frames, zmq.NOBLOCK, copy=False)

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

    def take(self, room: str, sources: set[int]) -> Arrived | None:
        """The messages of `room` from every rank in `sources` (and any other that came), gone
        from the channel; None while some have not arrived."""
        with self.lock:
            if not sources <= set(self.arrived.get(room, {})):
                return None
            return self.arrived.pop(room)

    def forget(self, room: str) -> None:
        with self.lock:
            self.arrived.pop(room, None)

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
            size = sum(len(f.buffer) for f in frames)
            try:
                message, tensors = decode([f.buffer for f in frames], self.secret, self.replay)
            except ProtocolError as error:
                self.refusals.refuse(self.limits.name, str(error))
                del frames
                if size >= LARGE_FRAME_BYTES:  # and none of the memory it took stays
                    release_freed_memory()
                continue
            if (
                not isinstance(message, self.carries)
                or message.source_rank >= message.source_size
                or message.source_size > MAX_TP_SIZE
            ):
                self.refusals.refuse(self.limits.name, f"a {message.tag} message")
                continue
            with self.lock:
                room = self.arrived.setdefault(message.room, {})
                room[message.source_rank] = (time.monotonic(), message, tensors, size)
                self._forget_old()

    def _forget_old(self) -> None:
        """Rooms past ARRIVED_TTL_S, beyond MAX_ARRIVED_ROOMS, or beyond the bytes this rank's
        pools hold (more than any rooms it waits for can bring) go, oldest first."""
        oldest = time.monotonic() - ARRIVED_TTL_S
        held = sum(size for room in self.arrived.values() for _, _, _, size in room.values())
        while self.arrived:
            first = next(iter(self.arrived.values()))
            if (
                len(self.arrived) <= MAX_ARRIVED_ROOMS
                and held <= self.max_held_bytes
                and min(t for t, _, _, _ in first.values()) >= oldest
            ):
                return
            _, dropped = self.arrived.popitem(last=False)
            held -= sum(size for _, _, _, size in dropped.values())

    def close(self) -> None:
        self.stopping.set()
        if self.reader is not None:
            self.reader.join()
        for sock in self.outboxes.values():
            sock.close(linger=0)
        if self.inbox is not None:
            self.inbox.close(linger=0)
        self.context.term()
