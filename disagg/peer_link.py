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
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from disagg.rooms import now

# ZMTP heartbeats on each connection to a prefill worker: a ping a second, the connection dropped
# after 5 s without an answer (a host that vanished without closing its sockets).
ZMQ_HEARTBEAT_IVL_MS = 1000
ZMQ_HEARTBEAT_TIMEOUT_MS = 5000

# What a prefill worker advertises: tcp://host:port (a name, IPv4, or [IPv6]).
_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.\-]*):[0-9]{1,5}")


@dataclass
class PeerLink:
    socket: zmq.Socket
    monitor: zmq.Socket  # the socket's connection events: a disconnect means the peer is gone
    last_ack: float
    last_heartbeat: float = 0.0
    answered: bool = False  # a message from it passed authentication

    @classmethod
    def connect(cls, context: zmq.Context, address: str) -> PeerLink:
        """A DEALER connected to prefill worker `address`; ValueError naming the address when it
        is not a tcp://host:port endpoint ZMQ can connect to."""
        if not _ENDPOINT.fullmatch(address) or not 0 < int(address.rsplit(":", 1)[1]) < 65536:
            raise ValueError(
                f"baton_disagg.prefill_addr {address[:200]!r} is not a tcp://host:port address"
            )
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_IVL_MS)
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMQ_HEARTBEAT_TIMEOUT_MS)
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        link = cls(socket=socket, monitor=monitor, last_ack=now())
        try:
            socket.connect(address)
        except zmq.ZMQError as error:
            link.close()
            raise ValueError(
                f"baton_disagg.prefill_addr {address!r}: cannot connect ({error})"
            ) from None
        return link

    def connection_lost(self) -> bool:
        """Whether the connection dropped since the last call (the monitor's events drained)."""
        lost = False
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return lost
            lost |= event["event"] == zmq.EVENT_DISCONNECTED

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
