"""The decode side of the nixl transfer backend: a ReadOffer becomes one READ from the prefill
engine's pools straight into the room's preallocated pages, slot and checkpoint slots
(disagg/nixl_transfer.py has the whole exchange).

Everything in an offer is checked before its metadata is loaded or a byte moves: the room is
this peer's, the regions fit this engine's layout, every index lies in its region, the page
count is the request's, the blocks are the prompt's. While the READ is in flight the request's
hold (Request.hold) keeps its pages and slot in place, so that a room failed meanwhile (peer
lost, deadline, client gone) frees them only once the READ has been cancelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from baton.disagg.messages import ReadOffer
from baton.disagg.nixl_transfer import NixlAgent, check_regions, plan_read
from baton.disagg.rooms import DecodeRoom, FaultInjection, now
from baton.engine.handover.connector import Handover
from baton.engine.handover.state import HandoverLayout, RequestState, StatePlace


@dataclass(eq=False)
class PendingRead:
    """A room's READ in flight; the decode request's hold while it may still write the pools."""

    room: str
    handle: object | None  # None once released (done, failed or cancelled)
    started: float
    state: RequestState  # the first-token state installed once the READ is done
    place: StatePlace
    bytes: int

    @property
    def done(self) -> bool:
        return self.handle is None


class RoomReader:
    def __init__(
        self,
        agent: NixlAgent,
        handover: Handover,
        layout: HandoverLayout,
        faults: FaultInjection,
    ) -> None:
        self.agent, self.handover, self.layout, self.faults = agent, handover, layout, faults
        self.reads: dict[str, PendingRead] = {}

    def start(self, r: DecodeRoom, offer: ReadOffer, address: str) -> None:
        """Check `offer` (from the prefill worker at `address`) and post its READ. ValueError
        naming what does not fit (the caller fails the room and tells its peer)."""
        if r.peer != address:
            raise ValueError(f"room {r.room} waits on {r.peer}, not on {address}")
        if r.room in self.reads:
            raise ValueError(f"room {r.room} is being read already")
        remote_regions = check_regions(self.layout, offer.pools)
        header = dict(offer.state)
        state = self.handover.direct_state(header, len(offer.checkpoint_slots))
        place = self.handover.reserve_place(
            r.request_id, state.first_page, state.first_block, state.num_blocks
        )
        remote = StatePlace(
            pages=tuple(offer.pages),
            slot=offer.slot,
            checkpoint_slots=tuple(offer.checkpoint_slots),
        )
        plan = plan_read(self.layout, self.agent.region_by_name, remote_regions, remote, place)
        agent = self.agent.load_peer(address, offer.agent, offer.agent_metadata)
        try:
            handle = self.agent.start_read(agent, plan)
        except RuntimeError as error:
            raise ValueError(str(error)) from None
        read = PendingRead(
            room=r.room, handle=handle, started=now(), state=state, place=place, bytes=plan.bytes
        )
        self.reads[r.room] = read
        self.handover.hold_request(r.request_id, read)
        r.state = "transferring"

    def progress(self) -> list[tuple[PendingRead, str | None]]:
        """The READs that ended since the last call: (read, None) when done, (read, why) when
        failed; their handles released."""
        ended = []
        for read in list(self.reads.values()):
            if read.handle is None:
                state = "DONE"
            elif self.faults.stall_reads:
                continue
            else:
                state = self.agent.state(read.handle)
            if state == "PROC":
                continue
            self._release(read)
            ended.append((read, None if state == "DONE" else "the NIXL read failed"))
        return ended

    def cancel(self, room: str) -> None:
        """Stop the room's READ if one is in flight (its pages may go once this returns)."""
        read = self.reads.get(room)
        if read is not None:
            self._release(read)

    def close(self) -> None:
        """Cancel every READ in flight (the agent is its owner's to close)."""
        for read in list(self.reads.values()):
            self._release(read)

    def _release(self, read: PendingRead) -> None:
        self.reads.pop(read.room, None)
        if read.handle is not None:
            handle, read.handle = read.handle, None
            self.agent.release(handle)
