"""The decode side of a disaggregated pair: reserve, register, receive, install, decode.

For each room the decode engine preallocates pages and a state slot, sends Register to the
prefill engine's transfer socket (a DEALER per prefill address), and waits for the StateTransfer.
Every pending room has a deadline; heartbeats go to each prefill peer with pending rooms, and a
peer whose connection drops (its process died, or it stopped answering ZMTP heartbeats) or that
stops acknowledging for the lease timeout is declared lost. A failed room frees its pages and slot and its
client gets an error, never garbage tokens, never a hang.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch
import zmq

from baton.disagg.decode_install import RoomInstaller
from baton.disagg.decode_reads import RoomReader
from baton.disagg.messages import (
    Abort,
    Heartbeat,
    HeartbeatAck,
    Message,
    PagesChunk,
    ReadDone,
    ReadOffer,
    Register,
    Reject,
    SlotChunk,
    StateTransfer,
    compat_of,
)
from baton.disagg.nixl_shards import engine_agent
from baton.disagg.peer_link import PeerLink, PeerLinks, decode_side_limits
from baton.disagg.protocol import (
    ProtocolError,
    ReplayGuard,
    decode,
    encode,
)
from baton.disagg.rooms import (
    DecodeRoom,
    DisaggConfig,
    FaultInjection,
    QueuedRoom,
    TransferCounters,
    now,
)
from baton.disagg.tp_layout import TPLayout
from baton.engine.cache.memory import OutOfMemory
from baton.engine.core.engine import Engine
from baton.engine.core.engine_args import EngineStats
from baton.engine.core.sampling_params import SamplingParams
from baton.engine.runtime.socket_limits import Refusals, receive

logger = logging.getLogger("baton.disagg.decode")
PEER_REFUSALS = Refusals()  # rate-limited logs of the refusals `counters` counts


@dataclass
class DecodeWorker:
    engine: Engine
    config: DisaggConfig
    context: zmq.Context
    rooms: dict[str, DecodeRoom] = field(default_factory=dict)
    counters: TransferCounters = field(default_factory=TransferCounters)
    failures: list[tuple[str, str]] = field(default_factory=list)
    queued: deque[QueuedRoom] = field(default_factory=deque)  # waiting for pages or a slot
    faults: FaultInjection = field(default_factory=FaultInjection.from_env)

    def __post_init__(self) -> None:
        self.handover = self.engine.handover
        self.layout = self.handover.layout()
        self.compat = compat_of(self.layout, self.config.transfer_backend)
        self.counters.backend = self.config.transfer_backend
        # nixl: this engine's pools registered once, and the rooms' READs (None with zmq)
        self.reader: RoomReader | None = None
        self.owns_agent = False  # (rank 0's connector's agent is the engine's to close)
        if self.config.transfer_backend == "nixl":
            agent, self.owns_agent = engine_agent(self.handover, "decode", self.config.host)
            self.reader = RoomReader(agent, self.handover, self.layout, self.faults)
        self.replay = ReplayGuard()
        self.peer_limits = decode_side_limits(
            self.layout, self.engine.max_model_len, self.handover.track_interval
        )
        self.peers = PeerLinks(self.context, self.peer_limits)
        self.installer = RoomInstaller(
            handover=self.handover,
            layout=self.layout,
            config=self.config,
            counters=self.counters,
            rooms=self.rooms,
            fail=self._fail,
        )

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

    # -- the engine interface ---------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        room: str = "",
        prefill_addr: str = "",
    ) -> None:
        if not room:
            self.engine.add_request(request_id, prompt_token_ids, params)
            return
        if not prefill_addr:
            raise ValueError(
                "a disaggregated decode request needs the prefill worker's transfer address"
            )
        self._peer(prefill_addr)  # a malformed address fails here, before any reservation
        queued = QueuedRoom(
            room=room,
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            params=params,
            peer=prefill_addr,
            queued=now(),
        )
        if self.queued:  # behind earlier ones; an invalid request is still refused now
            self.engine.validate_request(prompt_token_ids, params)
            self.queued.append(queued)
        elif not self._register(queued):  # (validated there) no room now
            self.queued.append(queued)

    def _register(self, q: QueuedRoom) -> bool:
        """Reserve pages and a slot for the room and register it with its prefill engine; False
        if the pools cannot hold it now. ValueError for a request the engine refuses."""
        try:
            reserved = self.handover.preallocate(q.request_id, q.prompt_token_ids, q.params)
        except OutOfMemory:
            return False
        self.rooms[q.room] = DecodeRoom(
            room=q.room, request_id=q.request_id, peer=q.peer, registered=now()
        )
        register = Register(
            room=q.room,
            compat=self.compat,
            num_prompt_tokens=len(q.prompt_token_ids),
            cached_tokens=reserved.cached_tokens,
            track_interval=self.handover.track_interval,
            transfer_timeout_s=self.config.transfer_timeout_s,
            tp=TPLayout(size=self.layout.tp_size, rank_addresses=self.handover.shards.addresses),
        )
        self._peer(q.peer).socket.send_multipart(encode(register, secret=self.config.secret))
        return True

    def _register_queued(self) -> None:
        """Register queued rooms, oldest first, while the pools hold them."""
        while self.queued:
            q = self.queued[0]
            try:
                if not self._register(q):
                    return
            except ValueError as error:  # e.g. its request id is in use by now
                self.failures.append((q.request_id, str(error)))
            self.queued.popleft()

    def abort_request(self, request_id: str) -> None:
        self.queued = deque(q for q in self.queued if q.request_id != request_id)
        for r in list(self.rooms.values()):
            if r.request_id == request_id:
                self._cancel_read(r)
                self._send(r.peer, Abort(room=r.room, reason="decode request aborted"))
                del self.rooms[r.room]
        self.handover.shards.release_checkpoints(request_id)
        self.engine.abort_request(request_id)

    def reading(self) -> bool:
        """nixl: READs this worker polls (its own at TP=1, every rank's for a sharded room)."""
        return self.reader is not None and (
            bool(self.reader.reads) or any(r.sharded is not None for r in self.rooms.values())
        )

    def has_unfinished_requests(self) -> bool:
        return (
            self.engine.has_unfinished_requests()
            or bool(self.rooms)
            or bool(self.installer.ready)
            or bool(self.queued)
            or self.handover.has_held()  # pages a cancelled READ may still have written
        )

    def step(self):
        self.poll()
        for r in [r for r in self.rooms.values() if r.sharded is not None]:
            self.installer.install_shards(r)
        self._sharded_read_done()
        self.finish_reads()
        self.handover.release_held()
        self._heartbeat_and_expire()
        self._register_queued()  # pages and slots the last step freed
        deltas = self.installer.take_ready()
        if self.engine.has_unfinished_requests():
            deltas += self.engine.step()
        return deltas

    def take_failures(self) -> list[tuple[str, str]]:
        failures, self.failures = self.failures, []
        return failures

    def take_refused(self) -> list[tuple[str, str]]:
        """The engine's requests refused for their grammar (structured outputs)."""
        return self.engine.take_refused()

    def extra_stats(self) -> dict:
        by_state: dict[str, int] = {"bootstrapping": len(self.queued)}
        for r in self.rooms.values():
            by_state[r.state] = by_state.get(r.state, 0) + 1
        return self.counters.as_dict(by_state) | self.engine.tier_stats()

    def sockets(self) -> list[zmq.Socket]:
        return self.peers.sockets()

    @property
    def transfer_address(self) -> str:
        """A decode worker listens on no transfer socket of its own (it connects to prefill
        workers); its ranks' shard addresses travel in its Register."""
        return ""

    def close(self) -> None:
        self.peers.close()
        if self.reader is not None:
            self.reader.close()
            if self.owns_agent:
                self.reader.agent.close()

    # -- protocol -----------------------------------------------------------------------------

    def _peer(self, address: str) -> PeerLink:
        """The link to prefill worker `address`, connected on first use (ValueError naming an
        address that is not a tcp://host:port endpoint, or one too many unanswered dials)."""
        return self.peers.dial(address)

    def expire_idle(self) -> bool:
        """Timeouts and heartbeats between steps (the engine loop calls it while idle too);
        True if a room failed."""
        failed = len(self.failures)
        self._heartbeat_and_expire()
        self.peers.close_unused(self._addresses_in_use(), failed=set())
        return len(self.failures) > failed

    def _addresses_in_use(self) -> set[str]:
        return {r.peer for r in self.rooms.values()} | {q.peer for q in self.queued}

    def poll(self) -> None:
        failed = set()
        for address, peer in self.peers.items():
            if self._watch_connection(address, peer):
                failed.add(address)
                continue
            while True:
                try:
                    frames = receive(peer.socket, self.peer_limits, copy=False)
                except zmq.Again:
                    break
                if frames is None:  # too many parts: counted and logged there, and here
                    self.counters.messages_refused += 1
                    continue
                try:
                    message, tensors = decode(
                        [f.buffer for f in frames], self.config.secret, self.replay
                    )
                except ProtocolError as error:
                    self._refuse(address, error.room, f"rejected a message: {error}")
                    continue
                peer.last_ack, peer.answered = now(), True
                try:
                    self._handle(message, tensors, address)
                except Exception as error:  # one peer message never takes the engine down
                    room = getattr(message, "room", None)
                    self._refuse(address, room, f"could not use its {message.tag}: {error}")
        self.peers.close_unused(self._addresses_in_use(), failed)
        self._sharded_read_done()  # (a StateTransfer tries its room's install at once)

    def _sharded_read_done(self) -> None:
        """nixl: tell the prefill side of each room its ranks have all read and installed, so
        that its pages and slot may go."""
        for r in self.installer.take_sharded():
            if self.reader is not None:
                self._send(r.peer, ReadDone(room=r.room))

    def _watch_connection(self, address: str, peer: PeerLink) -> bool:
        """Fail the rooms (and queued rooms) of a peer whose connection dropped, its process
        gone (or deaf to ZMTP heartbeats) with what it had in flight, or was never made (nothing
        listens there); True then, and the link is closed once no room uses it."""
        event = peer.connection_event()
        if event is None:
            return False
        # A peer that never authenticated a message did not "stop": the connection that dropped
        # may not even have been to a prefill worker (a self-connection, say).
        what = "connection refused" if event == "refused" else "connection lost"
        reason = f"{peer.silence(address)} ({what})"
        rooms = [r for r in self.rooms.values() if r.peer == address]
        queued = [q for q in self.queued if q.peer == address]
        if rooms or queued:
            logger.warning("%s", reason)
        for r in rooms:
            self._fail(r, reason, notify=False)
        if queued:
            self.queued = deque(q for q in self.queued if q.peer != address)
            for q in queued:
                self._report(q.request_id, f"room {q.room}: {reason}")
        return True

    def _refuse(self, address: str, room: str | None, reason: str) -> None:
        """A message from `address` was malformed or unusable: logged and counted, and the room
        it names (when that room waits on this peer) fails now rather than at its timeout."""
        PEER_REFUSALS.refuse(f"prefill worker {address}", reason)  # a log line every 10 s
        self.counters.messages_refused += 1
        r = self.rooms.get(room) if isinstance(room, str) else None
        if r is not None and r.peer == address:
            self._fail(r, f"room {r.room}: {reason}")

    def _handle(self, message: Message, tensors: dict[str, torch.Tensor], address: str) -> None:
        if isinstance(message, (PagesChunk, SlotChunk, StateTransfer)):
            sharded = isinstance(message, StateTransfer) and (
                message.tp_size > 1 or self.layout.tp_size > 1
            )
            if self.reader is not None and not sharded:  # (sharded: the first token only)
                raise ValueError("this decode worker reads its state over nixl, not from frames")
            self.installer.receive(message, tensors)
        elif isinstance(message, ReadOffer):
            r = self.rooms.get(message.room)
            if self.reader is None:
                raise ValueError("this decode worker takes its state as zmq frames, not reads")
            if r is not None and not self.installer.expired(r):
                self.reader.start(r, message, address)
        elif isinstance(message, (Reject, Abort)):
            r = self.rooms.pop(message.room, None)
            if r is not None:
                text = (
                    message.message
                    if isinstance(message, Reject)
                    else f"prefill worker aborted: {message.reason}"
                )
                self._fail(r, text, notify=False)
        elif isinstance(message, HeartbeatAck):
            for room in message.unknown_rooms:
                r = self.rooms.get(room)
                # A room whose final state arrived waits on the other ranks' shards only: the
                # prefill side forgot it once sent, and an ack to a heartbeat sent before the
                # state came may still say so (the shards have their own timeout).
                if (
                    r is not None
                    and (r.sharded is None or self.reader is not None)
                    and now() - r.registered > self.config.heartbeat_interval_s
                ):
                    self._fail(r, f"room {room}: the prefill worker has lost it")

    def _heartbeat_and_expire(self) -> None:
        t = now()
        while self.queued and t - self.queued[0].queued > self.config.bootstrap_timeout_s:
            q = self.queued.popleft()
            self._report(
                q.request_id,
                f"room {q.room}: no free KV pages or Mamba slot on the decode worker within "
                f"{self.config.bootstrap_timeout_s:g} s",
            )
        pending_by_peer: dict[str, list[str]] = {}
        for r in list(self.rooms.values()):
            if t - r.registered > self.config.transfer_timeout_s:
                peer = self.peers[r.peer]
                hint = "" if peer.answered else f"; {peer.silence(r.peer)}"
                what = "no state" if r.sharded is None else "not every rank's shard"
                self._fail(
                    r,
                    f"room {r.room}: {what} from the prefill worker within "
                    f"{self.config.transfer_timeout_s:g} s{hint}",
                )
            elif r.sharded is None or self.reader is not None:
                # (zmq: the prefill side is done with a room it sent; nixl: it holds the state
                # until the ranks have read it)
                pending_by_peer.setdefault(r.peer, []).append(r.room)
        for address, rooms in pending_by_peer.items():
            peer = self.peers[address]
            if (
                t - peer.last_ack > self.config.lease_timeout_s
                and t - min(self.rooms[x].registered for x in rooms) > self.config.lease_timeout_s
            ):
                for room in rooms:
                    self._fail(
                        self.rooms[room],
                        peer.silence(address),
                        notify=False,
                    )
                continue
            if t - peer.last_heartbeat >= self.config.heartbeat_interval_s:
                peer.last_heartbeat = t
                peer.socket.send_multipart(
                    encode(Heartbeat(rooms=rooms), secret=self.config.secret)
                )

    def finish_reads(self) -> None:
        """nixl: install the rooms whose READ is done (and tell their prefill side, which lets
        its pages and slot go); fail those whose READ failed. Each step does it (a benchmark
        timing the handover alone may too)."""
        if self.reader is None:
            return
        for read, error in self.reader.progress():
            r = self.rooms.get(read.room)
            if r is None:
                continue
            if error is not None:
                self._fail(r, f"room {r.room}: {error}")
                continue
            self._send(r.peer, ReadDone(room=r.room))
            self.counters.transfer_seconds_sum += now() - read.started
            try:
                self.installer.install_read(r, read)
            except ValueError as error:
                self._fail(r, f"room {r.room}: could not use its state: {error}")

    def _cancel_read(self, r: DecodeRoom) -> None:
        """Before a room's pages may go: its READ, if one is in flight, is stopped (a sharded
        room's on every rank: each stops its own before any later step of it)."""
        if self.reader is None:
            return
        self.reader.cancel(r.room)
        if r.sharded is not None:
            self.handover.shards.drop(r.room)

    def _fail(self, r: DecodeRoom, reason: str, notify: bool = True) -> None:
        r.state = "failed"
        self._cancel_read(r)
        self.rooms.pop(r.room, None)
        if notify:
            self._send(r.peer, Abort(room=r.room, reason=reason))
        self.handover.shards.release_checkpoints(r.request_id)
        self.engine.abort_request(r.request_id)
        self._report(r.request_id, reason)

    def _report(self, request_id: str, reason: str) -> None:
        """A failed handover: logged, counted, and its client gets `reason`."""
        logger.warning("%s", reason)
        self.counters.transfers_failed += 1
        self.failures.append((request_id, reason))

    def _send(self, address: str, message) -> None:
        """To a peer still linked (a closed link's worker is not dialed again to be told)."""
        peer = self.peers.get(address)
        if peer is not None:
            peer.socket.send_multipart(encode(message, secret=self.config.secret))
