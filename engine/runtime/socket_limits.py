"""What a ZMQ socket may be made to hold: every socket baton binds or connects gets limits here.

A peer (or anyone who reaches a bound port) decides what arrives; libzmq reads and queues it
before baton looks. Three limits keep that bounded, set before the socket binds or connects:

* `max_part_bytes` (ZMQ_MAXMSGSIZE, which applies to each part of a message, not to the whole):
  the largest part a legal message of this channel has. A peer that sends a larger one has its
  connection dropped by libzmq before the part is allocated.
* `max_queued` (ZMQ_RCVHWM): how many unread messages libzmq keeps per connection; past it, it
  stops reading from that peer (TCP pushes back).
* `max_parts`: the parts a legal message has at most, checked as each part is read (libzmq has
  no option for it); a longer message is read to its end part by part, dropped and counted.
  libzmq hands a message over only once all its parts are in, and bounds neither their number
  nor the parts of a message still arriving: a peer that sends a message of very many small
  parts is held to its sum, not to max_parts (MAC-authenticated channels drop it once read; only
  a transport-level handshake, such as CURVE, would keep an unauthenticated peer out earlier).

A part over `max_part_bytes` is refused by libzmq itself (the connection is dropped); it never
reaches baton, so it is not in the refusal counts.

A socket that never receives (PUSH) gets `SEND_ONLY`: one short message queued at most, so frames
forged at its port cost nothing (a PUSH socket queues what a connected peer sends, up to its
high-water mark: 1,000 messages of any size by default).

Messages baton reads and refuses (too many parts here; bad MAC, schema or content in the
protocol above) are counted per socket and logged at most once per LOG_INTERVAL_S per socket
(`Refusals`), so a flood costs a log line, not a log.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import zmq

logger = logging.getLogger("baton.sockets")

LOG_INTERVAL_S = 10.0
# A refused message at least this large is followed by malloc_trim: its memory goes back.
LARGE_FRAME_BYTES = 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class ReceiveLimits:
    name: str  # the channel, for logs and counters ("engine inbox", "decode rank 1 shards")
    max_part_bytes: int
    max_parts: int
    max_queued: int


# A socket that only sends: whatever arrives on it is not part of any protocol. Its part bound
# still admits the ZMTP handshake's commands (READY with the socket type and identity), which
# libzmq reads through the same size check: a ZMTP "short" frame.
SEND_ONLY = ReceiveLimits(name="send-only socket", max_part_bytes=255, max_parts=1, max_queued=1)


def limit(sock: zmq.Socket, limits: ReceiveLimits) -> zmq.Socket:
    """Set `limits` on `sock` (before it binds or connects: libzmq copies them to each new
    connection). Returns the socket."""
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_part_bytes)
    sock.setsockopt(zmq.RCVHWM, limits.max_queued)
    return sock


class Refusals:
    """Refused messages by channel, with a log line per channel at most every LOG_INTERVAL_S."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._logged: dict[str, tuple[float, int]] = {}  # channel -> (when, count then)

    def refuse(self, channel: str, why: str) -> None:
        count = self.counts[channel] = self.counts.get(channel, 0) + 1
        when, logged = self._logged.get(channel, (-LOG_INTERVAL_S, 0))
        now = time.monotonic()
        if now - when >= LOG_INTERVAL_S:
            self._logged[channel] = (now, count)
            logger.warning(
                "%s: refused a message (%s); %d refused since the last report",
                channel,
                why,
                count - logged,
            )

    @property
    def total(self) -> int:
        return sum(self.counts.values())


# This process's refusals, every socket's: the engine loop reports the total in its stats.
REFUSALS = Refusals()
REFUSED_STAT = "zmq_messages_refused_total"


def receive(
    sock: zmq.Socket, limits: ReceiveLimits, refusals: Refusals = REFUSALS, copy: bool = True
) -> list | None:
    """One whole message, part by part (zmq.Again when none is waiting), or None when it has
    more than `limits.max_parts` parts: read to its end (libzmq hands a message over whole, so
    the rest is there), dropped and counted."""
    parts = [sock.recv(zmq.NOBLOCK, copy=copy)]
    too_many = False
    while sock.getsockopt(zmq.RCVMORE):
        part = sock.recv(copy=copy)
        if len(parts) < limits.max_parts:
            parts.append(part)
        else:
            too_many = True
    if too_many:
        refusals.refuse(limits.name, f"more than {limits.max_parts} parts")
        return None
    return parts


def ipc_limits(name: str, max_part_bytes: int) -> ReceiveLimits:
    """A channel of engine/runtime/ipc.py: one msgpack frame per message."""
    return ReceiveLimits(name=name, max_part_bytes=max_part_bytes, max_parts=1, max_queued=1000)


def add_request_bytes(max_model_len: int, max_request_bytes: int) -> int:
    """The largest AddRequest a server sends: its prompt's token ids (msgpack: at most 9 bytes
    each) and its sampling parameters, which come from one HTTP body (their msgpack is no larger
    than their JSON), plus room for the envelope."""
    return 9 * max_model_len + 2 * max_request_bytes + (1 << 20)
