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
import math
import random
from dataclasses import dataclass, field

import zmq

from disagg.messages import (
    Abort,
    Heartbeat,
    HeartbeatAck,
    KVChunk,
    MambaChunk,
    Message,
    Register,
    Reject,
    StateTransfer,
    TensorSpec,
)
from disagg.protocol import (
    ProtocolError,
    ReplayGuard,
    decode,
    encode,
    state_message,
    tensor_specs,
)
from disagg.rooms import (
    DisaggConfig,
    FaultInjection,
    RoomState,
    TransferCounters,
    compat_of,
    is_loopback,
    now,
)
from disagg.schema import MAX_STRING
from disagg.tp_layout import refusal
from engine.engine import Engine
from engine.engine_args import EngineStats
from engine.handover import HandoverLayout, RequestState
from engine.sampling_params import SamplingParams

logger = logging.getLogger("baton.disagg.prefill")


# K/V bytes per message: small enough that the decode side installs one while the next is on
# the wire, large enough that per-message overhead stays negligible.
PUSH_BYTES = 4 << 20
# Mamba state per message: it is all ready at once when the prefill ends and is most of what a
# short prompt moves, so smaller messages (about one layer each) let the decode side install
# layer i while the next is on the wire (-20% handover time at 128..512 tokens on the 110M config
# than with 4 MiB groups, in alternated runs of bench.transfer).
MAMBA_PUSH_BYTES = 1 << 20


# How long past the decode side's transfer timeout (sent in its Register) the pages and slot of a
# room whose sends it never read stay held: it has failed the room by then, and never installs
# what arrives later (another request's state, once they are reused).
HOLD_GRACE_S = 1.0


class PendingSends:
    """The request's hold (engine Request.hold) while ZMQ still reads frames that are views of
    its pages and Mamba slot: the engine gives them back only once every tracked frame has left
    (or was dropped with a dead peer's connection), or once the decode side can no longer use
    them: a decode worker that stopped reading (hung, or its socket full) while its connection
    stays up would otherwise keep them forever."""

    def __init__(self, room: str, counters: TransferCounters) -> None:
        self.room, self.counters = room, counters
        self.trackers: list[zmq.MessageTracker] = []
        self.deadline = math.inf  # set when the decode side registers
        self.expired = False

    def add(self, tracker: zmq.MessageTracker) -> None:
        self.trackers = [t for t in self.trackers if not t.done]
        self.trackers.append(tracker)

    @property
    def done(self) -> bool:
        if self.expired or all(t.done for t in self.trackers):
            return True
        if now() > self.deadline:
            self.expired = True
            self.counters.holds_expired += 1
            logger.warning(
                "room %s: the decode worker has not read its state within its transfer timeout;"
                " giving the request's pages and slot back",
                self.room,
            )
        return self.expired


def _mamba_groups(layout: HandoverLayout) -> list[tuple[int, int, list[TensorSpec]]]:
    """(first layer, end layer, frame specs) of each MambaChunk: the same for every room."""
    groups = []
    step = max(1, MAMBA_PUSH_BYTES // max(1, layout.mamba_layer_bytes))
    for first in range(0, layout.mamba_layers, step):
        end = min(first + step, layout.mamba_layers)
        specs = [
            TensorSpec(name=f"conv{i}", dtype=layout.dtype, shape=list(layout.conv_shape))
            for i in range(first, end)
        ]
        specs += [
            TensorSpec(name=f"ssm{i}", dtype=layout.ssm_dtype, shape=list(layout.ssm_shape))
            for i in range(first, end)
        ]
        groups.append((first, end, specs))
    return groups


@dataclass
class PrefillRoom:
    room: str
    created: float
    sends: PendingSends
    state: RoomState = "bootstrapping"
    request_id: str | None = None
    peer: bytes | None = None  # ROUTER identity of the registered decode engine
    registration: Register | None = None
    pages_sent: int = 0  # K/V pages already streamed (or cached by the decode engine)
    lease: float = 0.0  # last heartbeat
    snapshot: RequestState | None = None
    ready_at: float | None = None  # prefill done and decode side registered
    send_at: float | None = None  # fault injection: delayed send


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
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if self.config.port:
            self.socket.bind(f"tcp://{self.config.host}:{self.config.port}")
            self.port = self.config.port
        else:
            self.port = self.socket.bind_to_random_port(f"tcp://{self.config.host}")
        self.address = f"tcp://{self.config.host}:{self.port}"
        self.layout = self.engine.handover_layout()
        self.compat = compat_of(self.layout)
        self.tp_size = self.layout.tp_size
        self.mamba_groups = _mamba_groups(self.layout)
        self.rng = random.Random()
        self.replay = ReplayGuard()

    # -- the engine interface ---------------------------------------------------------------

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def computing(self) -> bool:
        """Whether the engine itself has requests to step (not just rooms waiting on peers)."""
        return self.engine.has_unfinished_requests()

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, room: str = ""
    ) -> None:
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
        self.engine.hold_request(request_id, r.sends)
        self.engine.on_finish(request_id, lambda req, r=r: self._prefilled(r, req))

    def abort_request(self, request_id: str) -> None:
        for r in list(self.rooms.values()):
            if r.request_id == request_id and r.snapshot is None:
                self._fail(r, "prefill request aborted")
        self.engine.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return (
            self.engine.has_unfinished_requests()
            or self.engine.has_held()  # pages and slots wait for their sends
            or any(r.snapshot is not None for r in self.rooms.values())
        )

    def step(self):
        self.poll()
        deltas = self.engine.step() if self.engine.has_unfinished_requests() else []
        self.engine.release_held()
        self._stream_pages()
        self._flush()
        self.poll()  # heartbeats that arrived during a long step count before leases expire
        self._expire()
        return deltas

    def take_failures(self) -> list[tuple[str, str]]:
        failures, self.failures = self.failures, []
        return failures

    def extra_stats(self) -> dict:
        by_state: dict[str, int] = {}
        for r in self.rooms.values():
            by_state[r.state] = by_state.get(r.state, 0) + 1
        return self.counters.as_dict(by_state) | {"disagg_transfer_address": self.address}

    def sockets(self) -> list[zmq.Socket]:
        return [self.socket]

    def close(self) -> None:
        self.socket.close(linger=0)

    # -- protocol -----------------------------------------------------------------------------

    def poll(self) -> None:
        while True:
            try:
                identity, *frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
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
        logger.warning("decode worker %r: %s", identity[:64], reason)
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
            if r is not None:
                logger.info("room %s aborted by decode: %s", r.room, message.reason)
                self._drop(r, notify=False, reason=message.reason)
        else:
            raise ValueError("a prefill worker receives Register, Heartbeat and Abort only")

    def _register(self, identity: bytes, message: Register) -> None:
        mismatch = self.compat.mismatch(message.compat)
        if mismatch:
            self._send(
                identity, Reject(room=message.room, message=f"incompatible workers: {mismatch}")
            )
            return
        why = refusal(self.engine.model_config, self.tp_size, message.tp)
        if why:
            self._send(identity, Reject(room=message.room, message=why[:MAX_STRING]))
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
        r.pages_sent = max(r.pages_sent, message.cached_tokens // self.compat.page_size)
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
            r = self.rooms[room] = PrefillRoom(
                room=room, created=now(), sends=PendingSends(room, self.counters)
            )
        return r

    def _prefilled(self, r: PrefillRoom, req) -> None:
        """The prefill finished. When the decode side is registered and the send is due now,
        push the remaining K/V pages and the Mamba state at once in batches (the decode side
        installs one while the next is on the wire); then snapshot what is left: the first
        token and the prefix-cache checkpoints (and everything, if nothing was pushed)."""
        if r.peer is not None:
            r.ready_at = now()
        if self.tp_size > 1:  # every rank snapshots its shard; the message carries no tensors
            self.engine.snapshot_shards(r.room, req)
            r.snapshot = self.engine.first_token_state(req)
            if r.peer is not None:
                self._schedule_send(r)
            return
        pushed = r.peer is not None and not self.faults.delay_ms and not self._sharded(r)
        if pushed:
            self._push_pages(r)
            self._push_mamba(r, req)
        r.snapshot = self.engine.export_state(req, first_page=r.pages_sent, with_mamba=not pushed)
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
                    self.engine.drop_shards(r.room)
                del self.rooms[r.room]
                continue
            if self._sharded(r):
                message, tensors = self._send_shards(r)
            else:
                message, tensors = state_message(r.room, self._needed_part(r))
            self._send_tensors(r, message, tensors, track=False)  # copies
            self.counters.transfers_ok += 1
            self.counters.observe_latency(now() - r.ready_at)
            r.state = "success"
            del self.rooms[r.room]

    def _sharded(self, r: PrefillRoom) -> bool:
        """Whether the room's state goes rank to rank (either side at TP > 1)."""
        reg = r.registration
        return self.tp_size > 1 or (reg is not None and reg.tp.size > 1)

    def _send_shards(self, r: PrefillRoom) -> tuple[StateTransfer, list]:
        """Every rank sends its planned slices straight to the decode ranks; the StateTransfer
        that follows from here carries the first token and no tensors (its checkpoints no
        layers: their block count says which blocks the ranks sent)."""
        reg, state = r.registration, r.snapshot
        first_page = min(reg.cached_tokens, state.num_prompt_tokens) // self.compat.page_size
        first_page = max(first_page, state.first_page)
        if self.tp_size == 1:  # the whole snapshot is this only rank's shard
            self.engine.keep_shard(r.room, state)
        control = self.engine.first_token_state(state.skip(0, self._skipped_blocks(r)), first_page)
        self.engine.send_shards(r.room, control, reg.tp.size, reg.tp.rank_addresses)
        return state_message(r.room, control, tp_size=self.tp_size)

    def _stream_pages(self) -> None:
        """Push the K/V pages each registered room's prefill completed this step, so the final
        message carries only the last pages and the Mamba state."""
        for r in self.rooms.values():
            if r.peer is None or r.snapshot is not None or r.request_id is None:
                continue
            if not self._sharded(r):
                self._push_pages(r)

    def _push_pages(self, r: PrefillRoom) -> None:
        """Send the completed pages from r.pages_sent on as KVChunks of ~PUSH_BYTES each."""
        page_bytes = self.layout.kv_page_bytes
        batch = max(1, PUSH_BYTES // page_bytes) if page_bytes else None
        chunks = []
        while (exported := self.engine.export_pages(r.request_id, r.pages_sent, batch)) is not None:
            end, k, v = exported
            named = [(f"k{i}", t) for i, t in enumerate(k)] + [
                (f"v{i}", t) for i, t in enumerate(v)
            ]
            message = KVChunk(room=r.room, first_page=r.pages_sent, tensors=tensor_specs(named))
            chunks.append((message, [t for _, t in named]))
            r.pages_sent = end
        for i, (message, tensors) in enumerate(chunks):
            self._send_tensors(r, message, tensors, track=i == len(chunks) - 1)
        self.counters.kv_chunks += len(chunks)

    def _push_mamba(self, r: PrefillRoom, req) -> None:
        """Send the final conv + SSM state in groups of layers of ~MAMBA_PUSH_BYTES each."""
        groups = self.mamba_groups
        for first, end, specs in groups:
            conv, ssm = self.engine.export_mamba(req, first, end)
            self._send_tensors(
                r,
                MambaChunk(room=r.room, first_layer=first, tensors=specs),
                [*conv, *ssm],
                track=end == groups[-1][1],
            )

    def _send_tensors(self, r: PrefillRoom, message, tensors: list, track: bool) -> None:
        """Send `message` to the room's decode side with its tensors as zero-copy frames.

        They may be views of the engine's pools, which the room's PendingSends (the request's
        hold) keeps in place until ZMQ has sent them: every batch of such messages ends with a
        tracked one (`track`). ZMQ writes, then releases, the messages to one peer in order, so
        the last one's release means that all before it are off the pools too."""
        header, mac, *payload = encode(message, tensors, self.config.secret)
        self.counters.bytes_total += sum(len(f) for f in payload)
        if track and payload:
            payload[-1] = zmq.Frame(payload[-1], copy=False, track=True)
            r.sends.add(payload[-1].tracker)
        self.socket.send_multipart([r.peer, header, mac, *payload], copy=False)

    def _needed_part(self, r: PrefillRoom) -> RequestState:
        """Skip what the decode engine caches: its pages, and its blocks' checkpoints."""
        state = r.snapshot
        # Pages before r.pages_sent were streamed or are cached there (registration raised it).
        skip_pages = min(max(r.pages_sent - state.first_page, 0), state.k_pages.shape[1])
        return state.skip(skip_pages, self._skipped_blocks(r))

    def _skipped_blocks(self, r: PrefillRoom) -> int:
        """Leading block checkpoints of the room's snapshot not to send: those the decode
        engine caches, or every one when the two sides cut blocks at different intervals."""
        reg, state = r.registration, r.snapshot
        num_blocks = state.checkpoint_conv.shape[0]
        if not reg.track_interval or reg.track_interval != self.engine.track_interval:
            return num_blocks
        cached = min(reg.cached_tokens, state.num_prompt_tokens)
        return min(max(cached // reg.track_interval - state.first_block, 0), num_blocks)

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
        if r.snapshot is not None and self.tp_size > 1:
            self.engine.drop_shards(r.room)  # every rank's copy
        if r.request_id is not None:
            self.engine.on_finish(r.request_id, None)
            if r.snapshot is None and self.engine.has_request(r.request_id):
                self.failures.append((r.request_id, reason))  # its client gets the error
            self.engine.abort_request(r.request_id)
        if notify and r.peer is not None:
            self._send(r.peer, Abort(room=r.room, reason=reason))

    def _send(self, identity: bytes, message) -> None:
        self.socket.send_multipart([identity, *encode(message, secret=self.config.secret)])
