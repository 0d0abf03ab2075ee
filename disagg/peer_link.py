"""The decode worker's connection to one prefill worker: a DEALER socket and what it knows of
the peer's liveness.

ZMTP heartbeats run in libzmq's I/O thread, so a prefill worker busy with a long step still
answers them; a peer that stops answering them, or whose process dies, drops the connection, and
the socket's monitor reports that at once. Liveness then does not depend on how long either
side's engine steps take (under load, prefill steps of several seconds made an
application-level lease fail healthy rooms); the lease (`last_ack`) only covers a peer that
keeps its connection up and stops acknowledging.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

import zmq
from zmq.utils.monitor import recv_monitor_message

from baton.disagg.rooms import now
from baton.disagg.schema import MAX_STRING
from baton.disagg.tp_layout import MAX_TP_SIZE
from baton.engine.handover.state import HandoverLayout
from baton.engine.runtime.socket_limits import ReceiveLimits, limit

# ZMTP heartbeats on each connection to a prefill worker: a ping a second, the connection dropped
# after 5 s without an answer (a host that vanished without closing its sockets).
ZMQ_HEARTBEAT_IVL_MS = 1000
ZMQ_HEARTBEAT_TIMEOUT_MS = 5000

# The longest room id a worker accepts from its router (server/openai/protocol.py's DisaggField; the
# router mints 32-character ones).
MAX_ROOM_ID = 128
# Unread messages libzmq keeps per connection: a decode worker's Registers and heartbeats, a
# prefill worker's chunks, come a few per room and step.
MAX_QUEUED = 256

# What a prefill worker advertises: tcp://host:port (a name, IPv4, or [IPv6]).
_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.\-]*):[0-9]{1,5}")


# Links dialed for requests whose prefill worker has not yet sent an authenticated message, at
# once. The address of a room comes in a request's baton_disagg field (the router's, but anyone
# holding the API key and reaching the worker can send one): links are per address, so this
# bounds what made-up addresses can open.
MAX_UNVERIFIED_LINKS = 16

ConnectionEvent = Literal["lost", "refused"]


@dataclass
class PeerLink:
    socket: zmq.Socket
    monitor: zmq.Socket  # the socket's connection events: a disconnect means the peer is gone
    last_ack: float
    last_heartbeat: float = 0.0
    answered: bool = False  # a message from it passed authentication
    connected: bool = False  # its TCP connection was established once

    @classmethod
    def connect(cls, context: zmq.Context, address: str, limits: ReceiveLimits) -> PeerLink:
        """A DEALER connected to prefill worker `address` (receiving within `limits`,
        decode_side_limits); ValueError naming the address when it is not a tcp://host:port
        endpoint ZMQ can connect to."""
        if not _ENDPOINT.fullmatch(address) or not 0 < int(address.rsplit(":", 1)[1]) < 65536:
            raise ValueError(
                f"baton_disagg.prefill_addr {address[:200]!r} is not a tcp://host:port address"
            )
        socket = limit(context.socket(zmq.DEALER), limits)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_IVL_MS)
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_HEARTBEAT_TIMEOUT_MS)
        monitor = socket.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
        )
        link = cls(socket=socket, monitor=monitor, last_ack=now())
        try:
            socket.connect(address)
        except zmq.ZMQError as error:
            link.close()
            raise ValueError(
                f"baton_disagg.prefill_addr {address!r}: cannot connect ({error})"
            ) from None
        return link

    def connection_event(self) -> ConnectionEvent | None:
        """What happened to the connection since the last call (the monitor's events drained):
        "lost" (it dropped), "refused" (it was never made, and ZMQ is retrying), or None."""
        happened: ConnectionEvent | None = None
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return happened
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                happened = "lost"
            elif event == zmq.EVENT_CONNECT_RETRIED and not self.connected:
                happened = happened or "refused"

    def silence(self, address: str) -> str:
        """What to say when this peer did not deliver in time."""
        if self.answered:
            return f"prefill worker {address} stopped answering"
        return (
            f"prefill worker {address} never answered (is it running, and do both workers use"
            " the same --disagg-secret?)"
        )

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=0)


@dataclass
class PeerLinks:
    """A decode worker's links to prefill workers, by transfer address. A link is dialed for the
    first room that names its address and kept while rooms use it or once its worker has
    answered; one whose connection failed or that never answered is closed as soon as no room
    waits on it (ZMQ would redial a closed port forever), and at most MAX_UNVERIFIED_LINKS
    unanswered ones exist at once."""

    context: zmq.Context
    limits: ReceiveLimits
    links: dict[str, PeerLink] = field(default_factory=dict)

    def dial(self, address: str) -> PeerLink:
        """The link to `address`, connected now if there is none (ValueError naming the address
        when it is malformed, or when MAX_UNVERIFIED_LINKS others are still unanswered)."""
        link = self.links.get(address)
        if link is None:
            unverified = sum(not link.answered for link in self.links.values())
            if unverified >= MAX_UNVERIFIED_LINKS:
                raise ValueError(
                    f"baton_disagg.prefill_addr {address[:200]!r}: {unverified} prefill workers"
                    " dialed for other requests have not answered yet; not dialing another"
                )
            link = self.links[address] = PeerLink.connect(self.context, address, self.limits)
        return link

    def get(self, address: str) -> PeerLink | None:
        return self.links.get(address)

    def __getitem__(self, address: str) -> PeerLink:
        return self.links[address]

    def items(self) -> list[tuple[str, PeerLink]]:
        return list(self.links.items())

    def close_unused(self, in_use: set[str], failed: set[str]) -> None:
        """Close the links no room uses (`in_use`: the addresses rooms wait on) that never
        answered or whose connection `failed`."""
        for address, link in self.items():
            if address not in in_use and (not link.answered or address in failed):
                del self.links[address]
                link.close()

    def sockets(self) -> list[zmq.Socket]:
        return [s for link in self.links.values() for s in (link.socket, link.monitor)]

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links.clear()


def transfer_port_limits(max_rooms_per_peer: int) -> ReceiveLimits:
    """A prefill worker's transfer port receives headers only (Register, Heartbeat, Abort),
    after the ROUTER's identity part: the largest is a Heartbeat naming every room one decode
    worker may hold there, or a Register with a TP layout of MAX_TP_SIZE addresses."""
    header = max(max_rooms_per_peer * (MAX_ROOM_ID + 8), MAX_TP_SIZE * (MAX_STRING + 8))
    return ReceiveLimits(
        name="prefill transfer port",
        max_part_bytes=header + (64 << 10),  # + the fixed fields
        max_parts=3,  # identity, header, MAC
        max_queued=MAX_QUEUED,
    )


def decode_side_limits(
    layout: HandoverLayout, max_model_len: int, track_interval: int
) -> ReceiveLimits:
    """What a decode worker receives from a prefill worker: a header, a MAC and tensor frames
    (the state spec's, disagg/frames.py). The largest frame is a paged tensor over a whole
    context's pages for every layer (a StateTransfer's pages), or a slot tensor at each of a
    context's checkpoints and its end for every layer; a message has at most a frame per layer
    of every paged tensor (PagesChunk), per layer of every slot tensor (SlotChunk), or per
    pool and field (StateTransfer)."""
    # (a page entry per page table at every position: HandoverLayout.page_tables)
    tokens = -(-max_model_len // layout.page_size) * layout.page_size * layout.page_tables
    states = 2 + max_model_len // max(1, track_interval)
    largest = [
        t.layers * t.bytes * (tokens if t.kind == "paged" else states) for t in layout.tensors
    ]
    frames = max(
        sum(t.layers for t in layout.of_kind("paged")),
        sum(t.layers for t in layout.of_kind("slot")),
        2 * len(layout.tensors),
    )
    return ReceiveLimits(
        name="decode worker's prefill links",
        max_part_bytes=max([*largest, 1 << 20]),  # 1 MiB: room for any header
        max_parts=2 + frames,
        max_queued=MAX_QUEUED,
    )
