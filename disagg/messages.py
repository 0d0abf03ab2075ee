"""The messages a prefill and a decode engine exchange, as dataclasses: their fields are the
wire form (baton.disagg.schema derives and checks it); baton.disagg.protocol frames, authenticates and
decodes them, and holds the room state machine they drive."""

from __future__ import annotations

import typing
from dataclasses import dataclass, fields
from typing import ClassVar

from baton.disagg.tp_layout import TPLayout
from baton.engine.handover.state import HandoverLayout


@dataclass(frozen=True, kw_only=True, slots=True)
class Compat:
    """What must match between the two engines for a handover to be meaningful. The transfer
    backend comes first (a pair that moves bytes differently cannot hand over at all), then the
    layout fields, so that a mismatch names the shapes that differ when there are any."""

    transfer_backend: str  # how the state's bytes move: "zmq" frames or "nixl" reads
    dtype: str  # the serving dtype (the state's may differ: an SSM state kept in float32)
    page_size: int
    # The whole model's (TP=1) state layout, whatever either side's TP size: one line per state
    # tensor of the spec, "pool: kind xlayers [shape] dtype" (baton.engine.handover.state.HandoverLayout).
    state: list[str]
    model: str  # fingerprint of the model config
    weights: str  # fingerprint of the checkpoint's tensors (same config, other weights)

    def mismatch(self, other: Compat) -> str | None:
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name == "state" and mine != theirs:  # name the first tensor that differs
                by_name = [{line.split(":")[0]: line for line in side} for side in (mine, theirs)]
                name = next(
                    n for n in [*by_name[0], *by_name[1]] if by_name[0].get(n) != by_name[1].get(n)
                )
                mine, theirs = (side.get(name, f"no {name}") for side in by_name)
            if mine != theirs:
                verb = "differ" if f.name == "weights" else "differs"
                return (
                    f"{f.name} {verb}: prefill worker has {mine!r}, decode worker has {theirs!r}"
                    + _WHY.get(f.name, "")
                )
        return None


def compat_of(layout: HandoverLayout, transfer_backend: str) -> Compat:
    """The facts both engines must share."""
    return Compat(
        transfer_backend=transfer_backend,
        dtype=layout.dtype,
        page_size=layout.page_size,
        state=layout.describe(),
        model=layout.model_fingerprint,
        weights=layout.weights_fingerprint,
    )


# What a mismatch means, for the person who reads it.
_WHY = {
    "transfer_backend": " (start both workers with the same --disaggregation-transfer-backend)",
    "model": " (the two workers load models with different config.json: start both with the"
    " same --model)",
    "weights": " (the two workers load different checkpoints of the same model config, e.g. a"
    " base model and a fine-tune: start both with the same --model)",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Register:
    """decode -> prefill: pages and a slot are reserved for this room; send the state here."""

    tag: ClassVar[str] = "register"
    room: str
    compat: Compat
    num_prompt_tokens: int
    cached_tokens: int  # leading prompt tokens the decode engine caches itself: not sent
    track_interval: int  # decode engine's prefix-cache block size (0: no cache)
    # The decode engine ignores this room's state once this long has passed since it registered
    # (so the prefill engine may reuse pages that its sends for the room still read).
    transfer_timeout_s: float
    tp: TPLayout  # the decode engine's ranks and where each receives its shard


@dataclass(frozen=True, kw_only=True, slots=True)
class Reject:
    """prefill -> decode: this room cannot be served (incompatible, unknown, failed)."""

    tag: ClassVar[str] = "reject"
    room: str
    message: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Abort:
    """either direction: forget this room."""

    tag: ClassVar[str] = "abort"
    room: str
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Heartbeat:
    """decode -> prefill: these rooms are still wanted (keeps their lease alive)."""

    tag: ClassVar[str] = "heartbeat"
    rooms: list[str]


@dataclass(frozen=True, kw_only=True, slots=True)
class HeartbeatAck:
    """prefill -> decode: of the rooms asked about, these are unknown here (lost)."""

    tag: ClassVar[str] = "heartbeat_ack"
    unknown_rooms: list[str]


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorSpec:
    name: str
    dtype: str
    shape: list[int]


@dataclass(frozen=True, kw_only=True, slots=True)
class StateTransfer:
    """prefill -> decode: a RequestState (the prompt's remaining pages, final slot state, first
    token, block checkpoints). Build it with `state_message`, read it with `request_state`."""

    tag: ClassVar[str] = "state"
    carries: ClassVar[str] = "state"  # the field holding STATE_CARRIER's non-tensor fields
    room: str
    # The prefill engine's TP size. When either side's is > 1 the pages and slot state came
    # rank to rank as ShardTransfers and the tensors here hold no pages and no layers.
    tp_size: int
    state: dict[str, object]  # checked against STATE_CARRIER's annotations by `decode`
    # STATE_CARRIER's tensor fields, one frame per tensor: "field/pool" (pages/attention.k, ...)
    tensors: list[TensorSpec]


@dataclass(frozen=True, kw_only=True, slots=True)
class PagesChunk:
    """prefill -> decode: pages completed by a prefill chunk, sent while the prompt's later
    chunks still compute (frames "pool#layer" for every paged tensor and layer, each (n, page,
    *shape); on a CPU pool they are sent straight from it)."""

    tag: ClassVar[str] = "pages"
    room: str
    first_page: int
    tensors: list[TensorSpec]


@dataclass(frozen=True, kw_only=True, slots=True)
class SlotChunk:
    """prefill -> decode: the final slot state of slot units first_unit.. (one unit = one layer
    of one state kind, frames "pool#layer" per tensor of its kind; HandoverLayout.slot_units),
    pushed ahead of the StateTransfer so the decode side installs one group while the next is
    on the wire. A StateTransfer whose slot tensors carry no layers means all came this way."""

    tag: ClassVar[str] = "slots"
    room: str
    first_unit: int
    tensors: list[TensorSpec]


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardTransfer:
    """prefill rank -> decode rank, when either side runs TP > 1: the slices of one room's
    pages (from `first_page`), final slot state and block checkpoints (from `first_block`)
    that the decode rank owns and this prefill rank was planned to send it
    (baton.disagg.tp_layout.plan); frames named `component@offset`."""

    tag: ClassVar[str] = "shard"
    room: str
    source_rank: int
    source_size: int
    first_page: int
    first_block: int
    tensors: list[TensorSpec]


@dataclass(frozen=True, kw_only=True, slots=True)
class PoolRegion:
    """One pool tensor of an engine as its transfer engine registered it (engine/cache/pools.py's
    layout): `layers` blocks of `rows` rows of `row_bytes` each, layer-major, from `address`
    on memory `memory` ("DRAM" or "VRAM") of device `device`. Row r of layer l starts at
    address + (l * rows + r) * row_bytes; a paged pool's rows are token slots."""

    name: str  # the pool's ("attention.k", "mamba2.ssm", ...)
    address: int
    layers: int
    rows: int
    row_bytes: int
    memory: str
    device: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ReadOffer:
    """prefill -> decode, with the nixl transfer backend: the room's prefill is done and its
    state stays in the prefill engine's pools (held) until the decode side has READ it from
    there and said so (ReadDone), or its transfer timeout has passed. Indices, not addresses:
    the decode side derives every descriptor from `pools` and its own state spec, after checking
    each index and region (disagg/nixl_transfer.py)."""

    tag: ClassVar[str] = "read_offer"
    carries: ClassVar[str] = "state"  # the field holding STATE_CARRIER's non-tensor fields
    room: str
    agent: str  # the prefill engine's NIXL agent
    # Its NIXL metadata: deserialized by the library, so it only ever comes inside this
    # authenticated channel, from the prefill worker the room names.
    agent_metadata: bytes
    pools: list[PoolRegion]
    pages: list[int]  # the prompt's pool pages from state's first_page on
    slot: int  # the request's slot (its final state)
    checkpoint_slots: list[int]  # checkpoints of the prompt's blocks from state's first_block on
    state: dict[str, object]  # the first-token state: checked against STATE_CARRIER by `decode`


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardOffer:
    """prefill rank -> decode rank, with the nixl transfer backend when either side runs
    TP > 1: where this prefill rank's part of one room's state sits in its pools (held until
    the decode side's ReadDone, Abort or transfer timeout), for the decode rank to READ the
    slices it owns and was planned to take from this rank (baton.disagg.tp_layout.plan). As in
    a ReadOffer, indices and regions, never addresses to use as they are
    (disagg/nixl_shards.py checks both against this rank's plan and the prefill rank's shapes).
    It comes on the rank-to-rank channel (authenticated like every message here); the first
    token goes through rank 0 as a StateTransfer without tensors."""

    tag: ClassVar[str] = "shard_offer"
    room: str
    source_rank: int
    source_size: int
    first_page: int
    first_block: int
    agent: str  # the prefill rank's NIXL agent
    agent_metadata: bytes  # deserialized by the library: only inside the authenticated channel
    pools: list[PoolRegion]  # the prefill rank's pools (its slices' shapes)
    pages: list[int]  # the prompt's pool pages from first_page on
    slot: int  # the request's slot (its final state)
    checkpoint_slots: list[int]  # checkpoints of the prompt's blocks from first_block on


@dataclass(frozen=True, kw_only=True, slots=True)
class ReadDone:
    """decode -> prefill: the room's state has been read; its pages and slot may go."""

    tag: ClassVar[str] = "read_done"
    room: str


Message = (
    Register
    | Reject
    | Abort
    | Heartbeat
    | HeartbeatAck
    | StateTransfer
    | PagesChunk
    | SlotChunk
    | ShardTransfer
    | ReadOffer
    | ShardOffer
    | ReadDone
)
MESSAGES: dict[str, type] = {cls.tag: cls for cls in typing.get_args(Message)}
WITH_TENSORS = (StateTransfer, PagesChunk, SlotChunk, ShardTransfer)
