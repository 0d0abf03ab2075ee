"""Where a prefill worker's state lands on the decode side: page and slot chunks as they come,
then the final state, whole or, between TP ranks, as the shards each rank receives straight
from the prefill ranks; the room's first-token delta once everything is in.

A message for a room that is gone (aborted, failed) or past its transfer timeout installs
nothing: after that timeout the prefill engine may reuse the pages its unsent frames still read
(Register told it the timeout), so late frames may hold another request's state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from baton.disagg.frames import check_state, pages_chunk, slot_chunk
from baton.disagg.messages import PagesChunk, SlotChunk, StateTransfer
from baton.disagg.protocol import frame_bytes, request_state
from baton.disagg.rooms import DecodeRoom, DisaggConfig, TransferCounters, now
from baton.engine.handover.connector import Handover
from baton.engine.handover.state import HandoverLayout


@dataclass
class RoomInstaller:
    handover: Handover
    layout: HandoverLayout
    config: DisaggConfig
    counters: TransferCounters
    rooms: dict[str, DecodeRoom]  # the decode worker's pending rooms (shared)
    fail: Callable[[DecodeRoom, str], None]  # the worker's: frees the room, tells its client
    ready: list = field(default_factory=list)  # first-token deltas of installed rooms
    # rooms installed from their ranks' shards since the last `take_sharded` (nixl: each
    # prefill side waits for its ReadDone)
    sharded_installed: list[DecodeRoom] = field(default_factory=list)

    def receive(
        self, message: PagesChunk | SlotChunk | StateTransfer, tensors: dict[str, torch.Tensor]
    ) -> None:
        """Install a state message (ValueError for one that does not fit its room: the caller
        fails the room and tells its peer)."""
        r = self._room_for(message)
        if r is None:
            return  # aborted or timed out meanwhile
        layout = self.layout
        if isinstance(message, PagesChunk):
            r.state = "transferring"
            pages = pages_chunk(layout, tensors)
            self.handover.install_pages(r.request_id, message.first_page, pages)
        elif isinstance(message, SlotChunk):
            r.state = "transferring"
            for unit in slot_chunk(layout, message.first_unit, tensors):
                if self.handover.install_unit(r.request_id, unit, tensors):
                    r.slot_units += 1
        else:
            state = request_state(message, tensors)
            sharded = message.tp_size > 1 or layout.tp_size > 1  # the state comes rank to rank
            check_state(layout, state, sharded)
            if sharded:
                r.state, r.sharded = "transferring", (state, message.tp_size, now())
                self.install_shards(r)
                return
            units = len(layout.slot_units())
            if not any(t.shape[0] for t in state.slots.values()) and r.slot_units != units:
                raise ValueError(f"slot state incomplete: {r.slot_units} of {units} units arrived")
            self._install(r, state)
        self.counters.bytes_total += frame_bytes(tensors)

    def install_shards(self, r: DecodeRoom) -> None:
        """Try to install a room whose ranks receive (or read) their shards straight from the
        prefill ranks: done once every rank has all its pieces; until then it is tried again
        each step (the room's transfer timeout still applies); a rank's bad piece fails it."""
        state, prefill_size, arrived = r.sharded
        shards = self.handover.shards
        before = sum(shards.bytes_received)
        try:
            installed = shards.install(r.request_id, r.room, prefill_size, state)
        except ValueError as error:
            self.fail(r, f"room {r.room}: could not use its state: {error}")
            return
        finally:  # what the ranks took of this room in this try (each reports with it)
            self.counters.bytes_total += sum(shards.bytes_received) - before
        if not installed:
            return
        try:
            self._install(r, state)
        except ValueError as error:
            self.fail(r, f"room {r.room}: could not use its state: {error}")
            return
        if self.config.transfer_backend == "nixl":  # the ranks' READs, posted as it came
            self.counters.transfer_seconds_sum += now() - arrived
        self.sharded_installed.append(r)

    def install_read(self, r: DecodeRoom, read) -> None:
        """A room whose READ (disagg/decode_reads.py's PendingRead) wrote its state straight into
        its place: the first token installed, its blocks registered. ValueError when it does
        not fit (the caller fails the room)."""
        self.handover.clear_unkept(read.place)
        self._install(r, read.state)
        self.counters.bytes_total += read.bytes

    def expired(self, r: DecodeRoom) -> bool:
        """Whether the room is past its transfer timeout (failed here and now if so)."""
        return self._room_for(r) is None

    def take_sharded(self) -> list[DecodeRoom]:
        installed, self.sharded_installed = self.sharded_installed, []
        return installed

    def take_ready(self) -> list:
        ready, self.ready = self.ready, []
        return ready

    def _install(self, r: DecodeRoom, state) -> None:
        del self.rooms[r.room]
        try:
            delta = self.handover.install(r.request_id, state)
        except ValueError:
            self.rooms[r.room] = r  # failed by the caller, with its peer told
            raise
        self.counters.transfers_ok += 1
        self.counters.observe_latency(now() - r.registered)
        if delta is not None:
            self.ready.append(delta)

    def _room_for(self, message) -> DecodeRoom | None:
        """The pending room a state message is for, or None: gone, or past its transfer
        timeout (then it fails here and now, whatever the timers say)."""
        r = self.rooms.get(message.room)
        if r is not None and now() - r.registered > self.config.transfer_timeout_s:
            self.fail(
                r,
                f"room {r.room}: state arrived after the transfer timeout "
                f"({self.config.transfer_timeout_s:g} s)",
            )
            return None
        return r
