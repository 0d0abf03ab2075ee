"""The prefill side of a disaggregated pair: run prompts, push their state to decode engines.

A room needs two things before its state can leave: the request itself (from the router via
this worker's server) and the decode engine's Register (which says where the state goes and
proves the two engines are compatible). They arrive in either order. K/V pages stream as the
prefill computes them; once it has sampled the first token, a registered room gets the rest of
the pages and the Mamba state straight from the pools (the request's pages and slot are held
until ZMQ has sent them), then a StateTransfer with the first token. A room not yet registered
gets a snapshot (copies) instead, pushed once it registers.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from dataclasses import dataclass, field

import zmq

from baton.disagg.messages import (
    Abort,
    Heartbeat,
    HeartbeatAck,
    Message,
    ReadDone,
    Register,
    Reject,
    compat_of,
)
from baton.disagg.nixl_shards import engine_agent
from baton.disagg.nixl_transfer import NixlAgent
from baton.disagg.peer_link import transfer_port_limits
from baton.disagg.prefill_sends import PendingSends, PrefillRoom, RoomSender
from baton.disagg.protocol import ProtocolError, ReplayGuard, decode, encode
from baton.disagg.rooms import DisaggConfig, FaultInjection, TransferCounters, is_loopback, now
from baton.disagg.schema import MAX_STRING
from baton.disagg.tp_layout import refusal
from baton.engine.core.engine import Engine
from baton.engine.core.engine_args import EngineStats
from baton.engine.core.sampling_params import SamplingParams
from baton.engine.runtime.socket_limits import Refusals, limit, receive

logger = logging.getLogger("baton.disagg.prefill")
PEER_REFUSALS = Refusals()  # rate-limited logs of the refusals `counters` counts


# How long past the decode side's transfer timeout (sent in its Register) the pages and slot of a
# room whose sends it never read stay held: it has failed the room by then, and never installs
# what arrives later (another request's state, once they are reused).
HOLD_GRACE_S = 1.0


@dataclass
class PrefillWorker:
    """Wraps an Engine with the same step interface; the engine loop drives it."""

    engine: Engine
    config: DisaggConfig
    context: zmq.Context
    rooms: dict[str, PrefillRoom] = field(default_factory=dict)
    counters: TransferCounters = field(default_factory=TransferCounters)
    faults: FaultInjection = field(default_factory=FaultInjection.from_env)
    failures: list[tuple[str, str]] = field(default_factory=list)  # (request_id, message)

    def __post_init__(self) -> None:
        if self.config.secret is None and not is_loopback(self.config.host):
            raise ValueError(
                f"the transfer port would listen on {self.config.host} without a shared secret:"
                " anyone who reaches it could send messages (pass --disagg-secret)"
            )
        self.limits = transfer_port_limits(self.config.max_rooms_per_peer)
        self.socket = limit(self.context.socket(zmq.ROUTER), self.limits)
        self.socket.setsockopt(zmq.LINGER, 0)
        if self.config.port:
            self.socket.bind(f"tcp://{self.config.host}:{self.config.port}")
            self.port = self.config.port
        else:
            self.port = self.socket.bind_to_random_port(f"tcp://{self.config.host}")
        self.address = f"tcp://{self.config.host}:{self.port}"
        self.handover = self.engine.handover
        self.layout = self.handover.layout()
        self.compat = compat_of(self.layout, self.config.transfer_backend)
        self.counters.backend = self.config.transfer_backend
        self.tp_size = self.layout.tp_size
        # nixl: this engine's pools registered once; decode workers READ rooms' state from them
        self.agent: NixlAgent | None = None
        self.owns_agent = False  # (rank 0's connector's agent is the engine's to close)
        if self.config.transfer_backend == "nixl":
            self.agent, self.owns_agent = engine_agent(self.handover, "prefill", self.config.host)
        self.sender = RoomSender(
            self.engine,
            self.socket,
            self.config.secret,
            self.layout,
            self.compat.page_size,
            self.counters,
        )
        self.rng = random.Random()
        self.replay = ReplayGuard()

    # -- the engine interface ---------------------------------------------------------------

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def add_lora(self, name: str, path: str) -> None:
        """Serve a LoRA adapter (the other half of the pair must serve it under that name too)."""
        self.engine.add_lora(name, path)

    def remove_lora(self, name: str) -> None:
        self.engine.remove_lora(name)

    def computing(self) -> bool:
        """Whether the engine itself has requests to step (not just rooms waiting on peers)."""
        return self.engine.has_unfinished_requests()

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        room: str = "",
        prefill_addr: str = "",
    ) -> None:
        """`prefill_addr` is the decode side's to use (DisaggWorker's signature): ignored."""
        if not room:
            self.engine.add_request(request_id, prompt_token_ids, params)
            return
        # The prefill worker computes the prompt and the first token only (with EOS and the
        # stop tokens banned for it if min_tokens asks for at least one token).
        first_only = dataclasses.replace(
            params, max_tokens=1, min_tokens=min(params.min_tokens, 1), n=1
        )
        self.engine.add_request(request_id, prompt_token_ids, first_only)
        r = self._room(room)
        r.request_id = request_id
        self.handover.hold_request(request_id, r.sends)
        self.handover.on_finish(request_id, lambda req, r=r: self._prefilled(r, req))

    def abort_request(self, request_id: str) -> None:
        for r in list(self.rooms.values()):
            if r.request_id == request_id and r.snapshot is None:
                self._fail(r, "prefill request aborted")
        self.engine.abort_request(request_id)

    def reading(self) -> bool:
        """A prefill worker is read from (its agent's progress thread serves the READs)."""
        return False

    def has_unfinished_requests(self) -> bool:
        return (
            self.engine.has_unfinished_requests()
            or self.handover.has_held()  # pages and slots wait for their sends
            or any(r.snapshot is not None for r in self.rooms.values())
        )

    def step(self):
        self.poll()
        deltas = self.engine.step() if self.engine.has_unfinished_requests() else []
        self.handover.release_held()
        self._stream_pages()
        self._flush()
        self.poll()  # heartbeats that arrived during a long step count before leases expire
        self._expire()
        return deltas

    def take_failures(self) -> list[tuple[str, str]]:
        failures, self.failures = self.failures, []
        return failures

    def take_refused(self) -> list[tuple[str, str]]:
        """The engine's requests refused for their grammar (structured outputs): their rooms
        forget them without failing, so the decode side hears nothing that would race the
        client's 400 with a transfer error; the router cancels the decode half, whose Abort
        closes the room (else it expires as a room whose request never came)."""
        refused = self.engine.take_refused()
        for request_id, _ in refused:
            for r in self.rooms.values():
                if r.request_id == request_id:
                    r.request_id = None
                    r.sends.release()  # (nixl) nothing of it will be read
        return refused

    def extra_stats(self) -> dict:
        by_state: dict[str, int] = {}
        for r in self.rooms.values():
            by_state[r.state] = by_state.get(r.state, 0) + 1
        return (
            self.counters.as_dict(by_state)
            | self.engine.tier_stats()
            | {"disagg_transfer_address": self.address}
        )

    def sockets(self) -> list[zmq.Socket]:
        return [self.socket]

    @property
    def transfer_address(self) -> str:
        """Where decode workers register (EngineReady.transfer_addr)."""
        return self.address

    def close(self) -> None:
        self.socket.close(linger=0)
        if self.agent is not None and self.owns_agent:
            self.agent.close()

    # -- protocol -----------------------------------------------------------------------------

    def poll(self) -> None:
        while True:
            try:
                parts = receive(self.socket, self.limits)
            except zmq.Again:
                return
            if parts is None:  # too many parts: counted and logged there, and here
                self.counters.messages_refused += 1
                continue
            identity, *frames = parts
            try:
                message, _ = decode(frames, self.config.secret, self.replay)
            except ProtocolError as error:
                self._refuse(identity, error.room, f"rejected a message: {error}")
                continue
            try:
                self._handle(identity, message)
            except Exception as error:  # one peer message never takes the engine down
                room = getattr(message, "room", None)
                self._refuse(identity, room, f"could not use its {message.tag}: {error}")

    def _refuse(self, identity: bytes, room: str | None, reason: str) -> None:
        """Logged and counted; a message that named its room gets a Reject for it (one that
        failed authentication names nothing: its sender hears nothing back)."""
        PEER_REFUSALS.refuse("prefill transfer port", f"{identity[:64]!r}: {reason}")
        self.counters.messages_refused += 1
        if isinstance(room, str):
            self._send(identity, Reject(room=room[:MAX_STRING], message=reason[:MAX_STRING]))

    def _handle(self, identity: bytes, message: Message) -> None:
        if isinstance(message, Register):
            self._register(identity, message)
        elif isinstance(message, Heartbeat):
            unknown = []
            for room in message.rooms:
                r = self.rooms.get(room)
                if r is None:
                    unknown.append(room)
                else:
                    r.lease = now()
            self._send(identity, HeartbeatAck(unknown_rooms=unknown))
        elif isinstance(message, Abort):
            r = self.rooms.get(message.room)
            if r is not None and r.peer in (None, identity):
                logger.info("room %s aborted by decode: %s", r.room, message.reason)
                r.sends.release()  # (nixl) the decode side stopped its read before it said so
                self._drop(r, notify=False, reason=message.reason)
        elif isinstance(message, ReadDone):
            self._read_done(identity, message)
        else:
            raise ValueError("a prefill worker receives Register, Heartbeat, Abort, ReadDone only")

    def _read_done(self, identity: bytes, message: ReadDone) -> None:
        """nixl: the decode side has read the room's state: its pages and slot may go."""
        r = self.rooms.get(message.room)
        if r is None or r.peer != identity or not r.offered:
            raise ValueError(f"no read of room {message.room} is pending for this decode worker")
        r.sends.release()
        self.counters.transfers_ok += 1
        self.counters.bytes_total += r.read_bytes
        self.counters.observe_latency(now() - r.ready_at)
        r.state = "success"
        del self.rooms[r.room]

    def _register(self, identity: bytes, message: Register) -> None:
        mismatch = self.compat.mismatch(message.compat)
        why = (
            f"incompatible workers: {mismatch}"
            if mismatch
            else refusal(self.engine.model_config, self.engine.state_spec, self.tp_size, message.tp)
        )
        if why:
            self._send(identity, Reject(room=message.room, message=why[:MAX_STRING]))
            # The decode side fails the room on the Reject: its prefill here is of no use (it
            # would run and keep its snapshot until the bootstrap timeout).
            r = self.rooms.get(message.room)
            if r is not None and r.peer is None:
                self._fail(r, f"room {r.room}: {why}", notify=False)
            return
        r = self.rooms.get(message.room)
        if r is not None and r.peer is not None:
            raise ValueError(f"room {message.room} is registered already")
        if r is None and self._rooms_of(identity) >= self.config.max_rooms_per_peer:
            raise ValueError(
                f"this decode worker holds {self.config.max_rooms_per_peer} open rooms here"
                " already (--disagg-max-rooms-per-peer)"
            )
        r = self._room(message.room)
        r.peer, r.lease, r.registration = identity, now(), message
        r.sends.deadline = now() + message.transfer_timeout_s + HOLD_GRACE_S
        r.pages_sent = max(r.pages_sent, self.layout.pages_of(message.cached_tokens))
        if r.state == "bootstrapping":
            r.state = "waiting_for_input"
        if r.snapshot is not None:
            r.ready_at = now()
            self._schedule_send(r)

    def _rooms_of(self, identity: bytes) -> int:
        return sum(1 for r in self.rooms.values() if r.peer == identity)

    def _room(self, room: str) -> PrefillRoom:
        r = self.rooms.get(room)
        if r is None:
            sends = PendingSends(room, self.counters, awaiting_read=self.agent is not None)
            r = self.rooms[room] = PrefillRoom(room=room, created=now(), sends=sends)
        return r

    def _prefilled(self, r: PrefillRoom, req) -> None:
        """The prefill finished. When the decode side is registered and the send is due now,
        push the remaining K/V pages and the Mamba state at once in batches (the decode side
        installs one while the next is on the wire); then snapshot what is left: the first
        token and the prefix-cache checkpoints (and everything, if nothing was pushed)."""
        if r.peer is not None:
            r.ready_at = now()
        if self.agent is not None:  # nixl: the state stays in place (held) and is read there
            r.place = self.handover.place_of(req)
            r.snapshot = self.handover.first_token_state(req)
            if r.peer is not None:
                self._schedule_send(r)
            return
        if self.tp_size > 1:  # every rank snapshots its shard; the message carries no tensors
            self.handover.shards.snapshot(r.room, req)
            r.snapshot = self.handover.first_token_state(req)
            if r.peer is not None:
                self._schedule_send(r)
            return
        pushed = r.peer is not None and not self.faults.delay_ms and not self.sender.sharded(r)
        if pushed:
            self.sender.push_pages(r)
            self.sender.push_slots(r, req)
        r.snapshot = self.handover.export_state(req, first_page=r.pages_sent, with_slots=not pushed)
        if r.peer is not None:
            self._schedule_send(r)

    def _schedule_send(self, r: PrefillRoom) -> None:
        r.state = "transferring"
        r.send_at = now() + self.faults.delay_ms / 1000

    def _flush(self) -> None:
        for r in list(self.rooms.values()):
            if r.send_at is None or now() < r.send_at:
                continue
            if self.faults.should_drop(self.rng):
                logger.warning("fault injection: dropping the transfer of room %s", r.room)
                self.counters.transfers_failed += 1
                if self.tp_size > 1:
                    self.handover.shards.drop(r.room)
                r.sends.release()
                del self.rooms[r.room]
                continue
            if self.agent is not None:  # the room stays until the decode side has read it
                r.send_at = None
                if self.sender.sharded(r):  # every decode rank reads from every prefill rank
                    r.read_bytes = self.sender.offer_shards(r)
                else:
                    r.read_bytes = self.sender.send_offer(r, self.agent)
                continue
            self.sender.send_final(r)
            self.counters.transfers_ok += 1
            self.counters.observe_latency(now() - r.ready_at)
            r.state = "success"
            del self.rooms[r.room]

    def _stream_pages(self) -> None:
        """Push the K/V pages each registered room's prefill completed this step, so the final
        message carries only the last pages and the Mamba state."""
        for r in self.rooms.values():
            if r.peer is None or r.snapshot is not None or r.request_id is None:
                continue
            if self.agent is None and not self.sender.sharded(r):
                self.sender.push_pages(r)

    def expire_idle(self) -> bool:
        """Timeouts between steps (the engine loop calls it while idle too); True if a room
        failed."""
        before = self.counters.transfers_failed
        self._expire()
        return self.counters.transfers_failed > before

    def _expire(self) -> None:
        t = now()
        for r in list(self.rooms.values()):
            if r.peer is None and t - r.created > self.config.bootstrap_timeout_s:
                self._fail(
                    r,
                    f"room {r.room}: no decode worker registered within {self.config.bootstrap_timeout_s:.0f} s",
                )
            elif r.offered and r.sends.expired:
                self._fail(r, f"room {r.room}: the decode worker did not read its state in time")
            elif r.request_id is None and t - r.created > self.config.bootstrap_timeout_s:
                # Registered, but its request never came here: heartbeats do not keep it.
                self._fail(r, f"room {r.room}: its request never reached this prefill worker")
            elif r.peer is not None and t - r.lease > max(
                self.config.lease_timeout_s, self.config.bootstrap_timeout_s
            ):
                # Generous on this side: a lost decode worker only costs a held snapshot here.
                self._fail(
                    r, f"room {r.room}: decode worker stopped sending heartbeats", notify=False
                )

    def _fail(self, r: PrefillRoom, reason: str, notify: bool = True) -> None:
        logger.warning("%s", reason)
        self.counters.transfers_failed += 1
        self._drop(r, notify=notify, reason=reason)

    def _drop(self, r: PrefillRoom, notify: bool, reason: str) -> None:
        r.state = "failed"
        self.rooms.pop(r.room, None)
        if not r.offered:
            # (nixl) nothing reads its pages yet; once offered, the decode side may be reading
            # them until it says otherwise or its transfer timeout has passed (the hold's
            # deadline), and a page reused meanwhile would reach it as another request's state
            r.sends.release()
        if r.snapshot is not None and self.tp_size > 1:
            self.handover.shards.drop(r.room)  # every rank's copy
        if r.request_id is not None:
            self.handover.on_finish(r.request_id, None)
            if r.snapshot is None and self.handover.has_request(r.request_id):
                self.failures.append((r.request_id, reason))  # its client gets the error
            self.engine.abort_request(r.request_id)
        if notify and r.peer is not None:
            self._send(r.peer, Abort(room=r.room, reason=reason))

    def _send(self, identity: bytes, message) -> None:
        self.socket.send_multipart([identity, *encode(message, secret=self.config.secret)])
