"""What a prefill worker sends each room's decode side, and the hold that keeps the request's
pages and Mamba slot in place while ZMQ reads them (disagg/prefill.py runs the rooms).

Pages leave as PagesChunks as the prefill completes them, the final slot state as SlotChunks of
about one layer, then a StateTransfer with the first token and whatever the decode side does not
cache; across tensor-parallel ranks every rank sends its own shards and the StateTransfer
carries no tensors. Which tensors travel is the engine's state spec (HandoverLayout). Frames that are views of the engine's pools are sent zero-copy, the last of
each batch tracked.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import zmq

from baton.disagg.messages import (
    PagesChunk,
    ReadOffer,
    Register,
    SlotChunk,
    StateTransfer,
    TensorSpec,
)
from baton.disagg.protocol import encode, state_header, state_message, tensor_specs
from baton.disagg.rooms import RoomState, TransferCounters, now
from baton.disagg.tp_layout import planned_bytes
from baton.engine.core.engine import Engine
from baton.engine.handover.state import HandoverLayout, RequestState, SlotUnit, StatePlace

logger = logging.getLogger("baton.disagg.prefill")

# Page bytes per message: small enough that the decode side installs one while the next is on
# the wire, large enough that per-message overhead stays negligible.
PUSH_BYTES = 4 << 20
# Slot state per message: it is all ready at once when the prefill ends and is most of what a
# short prompt moves, so smaller messages (about one layer each) let the decode side install
# layer i while the next is on the wire (-20% handover time at 128..512 tokens on the 110M config
# than with 4 MiB groups, in alternated runs of baton.bench.serving.transfer).
SLOT_PUSH_BYTES = 1 << 20


class PendingSends:
    """The request's hold (engine Request.hold) while ZMQ still reads frames that are views of
    its pages and Mamba slot: the engine gives them back only once every tracked frame has left
    (or was dropped with a dead peer's connection), or once the decode side can no longer use
    them: a decode worker that stopped reading (hung, or its socket full) while its connection
    stays up would otherwise keep them forever."""

    def __init__(self, room: str, counters: TransferCounters, awaiting_read: bool) -> None:
        self.room, self.counters = room, counters
        self.trackers: list[zmq.MessageTracker] = []
        self.deadline = math.inf  # set when the decode side registers
        self.expired = False
        # nixl: the decode side READs the pages and slot in place, from the request's end until
        # its ReadDone (or Abort, or the deadline); cleared by `release`
        self.awaiting_read = awaiting_read

    def release(self) -> None:
        """Nothing will read the request's pages and slot any more (nixl)."""
        self.awaiting_read = False

    def add(self, tracker: zmq.MessageTracker) -> None:
        self.trackers = [t for t in self.trackers if not t.done]
        self.trackers.append(tracker)

    @property
    def done(self) -> bool:
        if self.expired or (not self.awaiting_read and all(t.done for t in self.trackers)):
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


def slot_groups(layout: HandoverLayout) -> list[tuple[int, list[SlotUnit], list[TensorSpec]]]:
    """(first unit, units, frame specs) of each SlotChunk: consecutive slot units of about
    SLOT_PUSH_BYTES together; the same for every room."""
    groups: list[tuple[int, list[SlotUnit], list[TensorSpec]]] = []
    units = layout.slot_units()
    first = 0
    while first < len(units):
        end, size = first, 0
        while end < len(units) and (end == first or size + units[end].bytes <= SLOT_PUSH_BYTES):
            size += units[end].bytes
            end += 1
        specs = [
            TensorSpec(
                name=frame,
                dtype=layout.tensor(name).dtype,
                shape=list(layout.tensor(name).shape),
            )
            for unit in units[first:end]
            for frame, name, _ in unit.frames
        ]
        groups.append((first, list(units[first:end]), specs))
        first = end
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
    pages_sent: int = 0  # pages already streamed (or cached by the decode engine)
    lease: float = 0.0  # last heartbeat
    snapshot: RequestState | None = None
    ready_at: float | None = None  # prefill done and decode side registered
    send_at: float | None = None  # fault injection: delayed send
    place: StatePlace | None = None  # nixl: where the finished prefill's state sits, held
    offered: bool = False  # nixl: its ReadOffer went out (the decode side may be reading)
    read_bytes: int = 0  # nixl: what the offer lets the decode side read


class RoomSender:
    """Sends rooms their state over a prefill worker's ROUTER socket (`r.peer` is the decode
    engine's identity on it)."""

    def __init__(
        self,
        engine: Engine,
        socket: zmq.Socket,
        secret: bytes | None,
        layout: HandoverLayout,
        page_size: int,
        counters: TransferCounters,
    ) -> None:
        self.engine, self.socket, self.secret = engine, socket, secret
        self.layout, self.page_size, self.counters = layout, page_size, counters
        self.tp_size = layout.tp_size
        self.slot_groups = slot_groups(layout)

    def send_final(self, r: PrefillRoom) -> None:
        """The room's StateTransfer: its snapshot less what the decode side caches, or, where
        the state goes rank to rank, the control message after every rank's shards."""
        if self.sharded(r):
            message, tensors = self.send_shards(r)
        else:
            message, tensors = state_message(r.room, self.needed_part(r))
        self.send_tensors(r, message, tensors, track=False)  # copies

    def send_offer(self, r: PrefillRoom, agent) -> int:
        """nixl: tell the room's decode side where its state is to be read (what it does not
        cache: its pages from the first after its cached prefix, its blocks' checkpoints from
        the first it does not cache), with this engine's agent and pool regions; the bytes the
        decode side will read."""
        reg, state, place = r.registration, r.snapshot, r.place
        first_page = self.layout.pages_of(min(reg.cached_tokens, state.num_prompt_tokens))
        first_page = min(first_page, len(place.pages))  # (a model with no pages: 0)
        skip = self.skipped_blocks(r)
        control = self.engine.handover.first_token_state(state.skip(0, skip), first_page)
        checkpoint_slots = list(place.checkpoint_slots[skip:])
        offer = ReadOffer(
            room=r.room,
            agent=agent.name,
            agent_metadata=agent.metadata,
            pools=agent.regions,
            pages=list(place.pages[first_page:]),
            slot=place.slot,
            checkpoint_slots=checkpoint_slots,
            state=state_header(control),
        )
        self.send_tensors(r, offer, [], track=False)
        r.offered = True
        layout = self.layout
        slot_bytes = sum(t.layers * t.bytes for t in layout.of_kind("slot"))
        kept_bytes = sum(t.layers * t.bytes for t in layout.of_kind("slot") if t.checkpointed)
        pages = len(place.pages) - first_page
        return pages * layout.page_bytes + slot_bytes + len(checkpoint_slots) * kept_bytes

    def offer_shards(self, r: PrefillRoom) -> int:
        """nixl, either side at TP > 1: every rank offers each decode rank that takes slices
        from it where they sit (disagg/nixl_shards.py), then the first token goes to the decode
        side as a StateTransfer without tensors (as `send_shards` sends it); the bytes the
        decode ranks will read in all."""
        reg, state, place = r.registration, r.snapshot, r.place
        first_page = self.layout.pages_of(min(reg.cached_tokens, state.num_prompt_tokens))
        skip = self.skipped_blocks(r)
        handover = self.engine.handover
        control = handover.first_token_state(state.skip(0, skip), first_page)
        handover.shards.snapshot_place(r.room, place)
        handover.shards.send(r.room, control, reg.tp.size, reg.tp.rank_addresses)
        message, tensors = state_message(r.room, control, tp_size=self.tp_size)
        self.send_tensors(r, message, tensors, track=False)
        r.offered = True
        tokens = (
            (len(place.pages) - first_page) // self.layout.page_tables * self.page_size
            if self.layout.page_bytes
            else 0
        )
        return planned_bytes(
            self.engine.state_spec,
            reg.tp.size,
            tokens=max(tokens, 0),
            states=1,
            blocks=control.num_blocks,
        )

    def sharded(self, r: PrefillRoom) -> bool:
        """Whether the room's state goes rank to rank (either side at TP > 1)."""
        reg = r.registration
        return self.tp_size > 1 or (reg is not None and reg.tp.size > 1)

    def send_shards(self, r: PrefillRoom) -> tuple[StateTransfer, list]:
        """Every rank sends its planned slices straight to the decode ranks; the StateTransfer
        that follows from here carries the first token and no tensors (its checkpoints no
        layers: their block count says which blocks the ranks sent)."""
        reg, state = r.registration, r.snapshot
        first_page = self.layout.pages_of(min(reg.cached_tokens, state.num_prompt_tokens))
        first_page = max(first_page, state.first_page)
        handover = self.engine.handover
        if self.tp_size == 1:  # the whole snapshot is this only rank's shard
            handover.shards.keep(r.room, state)
        control = handover.first_token_state(state.skip(0, self.skipped_blocks(r)), first_page)
        handover.shards.send(r.room, control, reg.tp.size, reg.tp.rank_addresses)
        return state_message(r.room, control, tp_size=self.tp_size)

    def push_pages(self, r: PrefillRoom) -> None:
        """Send the completed pages from r.pages_sent on as PagesChunks of ~PUSH_BYTES each."""
        page_bytes = self.layout.page_bytes
        batch = max(1, PUSH_BYTES // page_bytes) if page_bytes else None
        chunks = []
        handover = self.engine.handover
        while (exported := handover.export_pages(r.request_id, r.pages_sent, batch)) is not None:
            end, pages = exported
            named = [
                (f"{name}#{layer}", t)
                for name, per_layer in pages.items()
                for layer, t in enumerate(per_layer)
            ]
            message = PagesChunk(room=r.room, first_page=r.pages_sent, tensors=tensor_specs(named))
            chunks.append((message, [t for _, t in named]))
            r.pages_sent = end
        for i, (message, tensors) in enumerate(chunks):
            self.send_tensors(r, message, tensors, track=i == len(chunks) - 1)
        self.counters.kv_chunks += len(chunks)

    def push_slots(self, r: PrefillRoom, req) -> None:
        """Send the final slot state in groups of layers of ~SLOT_PUSH_BYTES each."""
        groups = self.slot_groups
        for i, (first, units, specs) in enumerate(groups):
            views = [t for unit in units for _, t in self.engine.handover.export_unit(req, unit)]
            self.send_tensors(
                r,
                SlotChunk(room=r.room, first_unit=first, tensors=specs),
                views,
                track=i == len(groups) - 1,
            )

    def send_tensors(self, r: PrefillRoom, message, tensors: list, track: bool) -> None:
        """Send `message` to the room's decode side with its tensors as zero-copy frames.

        They may be views of the engine's pools, which the room's PendingSends (the request's
        hold) keeps in place until ZMQ has sent them: every batch of such messages ends with a
        tracked one (`track`). ZMQ writes, then releases, the messages to one peer in order, so
        the last one's release means that all before it are off the pools too."""
        header, mac, *payload = encode(message, tensors, self.secret)
        self.counters.bytes_total += sum(len(f) for f in payload)
        if track and payload:
            payload[-1] = zmq.Frame(payload[-1], copy=False, track=True)
            r.sends.add(payload[-1].tracker)
        self.socket.send_multipart([r.peer, header, mac, *payload], copy=False)

    def needed_part(self, r: PrefillRoom) -> RequestState:
        """Skip what the decode engine caches: its pages, and its blocks' checkpoints."""
        state = r.snapshot
        # Pages before r.pages_sent were streamed or are cached there (registration raised it).
        skip_pages = min(max(r.pages_sent - state.first_page, 0), state.num_pages)
        return state.skip(skip_pages, self.skipped_blocks(r))

    def skipped_blocks(self, r: PrefillRoom) -> int:
        """Leading block checkpoints of the room's snapshot not to send: those the decode
        engine caches, or every one when the two sides cut blocks at different intervals."""
        reg, state = r.registration, r.snapshot
        num_blocks = state.num_blocks
        if not reg.track_interval or reg.track_interval != self.engine.handover.track_interval:
            return num_blocks
        cached = min(reg.cached_tokens, state.num_prompt_tokens)
        return min(max(cached // reg.track_interval - state.first_block, 0), num_blocks)
