"""The step message rank 0 sends every other tensor-parallel rank (msgpack over ZMQ, no pickle).

    rank 0: schedule ─> pool operations done outside the forward (PoolOps) ─┐
                                                                            ├─> RankStep ─> rank r
            ScheduledBatch (None when only operations are pending) ─────────┘
    rank r: apply the operations in order, then build the metadata with the one builder and run
            the forward (whose collectives meet rank 0's).

The wire form of every carrier is derived from its dataclass fields (a new field travels
without anyone listing it); tuples come back as tuples, nested carriers by their type name.
Only the carriers registered here can be decoded.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from typing import Any

import msgpack
import torch

from baton.engine.cache.pools import StateCache
from baton.engine.executor.draft_batch import DraftBatch
from baton.engine.executor.forward_metadata import ScheduledBatch, TrackPoint


@dataclass(frozen=True, kw_only=True, slots=True)
class RankSpec:
    """Everything a rank process needs, passed as JSON on its command line."""

    model: str
    dtype: str
    device: str
    rank: int
    size: int
    store_port: int  # rank 0's TCP store on 127.0.0.1
    step_addr: str  # rank 0's PUSH socket for this rank
    timeout_s: float  # a collective that waits longer fails (a peer hung)
    load_timeout_s: float  # how long every rank may take to load its shard
    num_pages: int
    page_size: int
    num_mamba_slots: int
    threads: int
    parent_pid: int
    # module:factory and options of the per-rank handover connector (a disaggregated worker's
    # ranks each send or receive their own shard); None: no handover on this engine
    handover_connector: dict[str, str] | None
    with_mtp: bool  # the model's MTP head is built (speculative decoding drafts with it)
    quantization: str | None  # --quantization (engine/quantization)
    lora: dict[str, int] | None  # LoRALimits as a dict (engine/lora/model.py); None: LoRA off

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        return cls(**json.loads(text))


@dataclass(frozen=True, kw_only=True, slots=True)
class ResetSlot:
    """A fresh request starts from zero recurrent state in `slot`."""

    slot: int


@dataclass(frozen=True, kw_only=True, slots=True)
class CopySlot:
    """Copy the recurrent state of slot `src` into `dst` (a prefix-cache hit resumes from its
    checkpoint)."""

    src: int
    dst: int


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadAdapterSlot:
    """Adapter slot `slot` now holds LoRA adapter `name` (read from `path`, each rank its own
    slice: engine/lora/slots.py)."""

    slot: int
    name: str
    path: str


PoolOp = ResetSlot | CopySlot | LoadAdapterSlot


# Handover operations (disaggregation across TP sizes): every rank does its part with its own
# shard and its own connector (engine/handover/shards.py); nothing travels through rank 0.


@dataclass(frozen=True, kw_only=True, slots=True)
class SnapshotShard:
    """Prefill side: copy this rank's shard of the room's K/V `pages`, Mamba `slot` and the
    checkpoint slots of its prompt's prefix-cache blocks, in block order (the request ends and
    its pages are freed; the copy waits for the decode side)."""

    room: str
    pages: tuple[int, ...]
    slot: int
    checkpoint_slots: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class SendShard:
    """Prefill side: send the room's snapshot, from page `first_page` on, with the checkpoints
    of blocks [first_block, first_block + num_blocks), to the decode ranks that own parts of it
    (baton.disagg.tp_layout.plan), then forget it."""

    room: str
    first_page: int
    first_block: int
    num_blocks: int
    decode_size: int
    decode_addresses: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class DropShard:
    """Prefill side: the room failed; forget its snapshot."""

    room: str


@dataclass(frozen=True, kw_only=True, slots=True)
class InstallShard:
    """Decode side: once this rank's pieces of the room from the prefill ranks have all
    arrived, check them and write them into `pages` (the prompt's pages from `first_page` on),
    `slot` and the checkpoint slots; then every rank reports installed, waiting or failed (one
    gather). Rank 0 asks again each step while some rank waits.

    The pieces hold the checkpoints of blocks [first_block, first_block + num_blocks) (rank 0
    bounded the count by the prompt's blocks); `checkpoint_slots[i]` receives block
    first_block + i, where 0 (the dummy slot) means "not wanted" (cached here already), and
    blocks past the tuple's end are checked but not kept (no slot could be had)."""

    room: str
    pages: tuple[int, ...]
    slot: int
    first_page: int
    prefill_size: int
    first_block: int
    num_blocks: int
    checkpoint_slots: tuple[int, ...]


HandoverOp = SnapshotShard | SendShard | DropShard | InstallShard


@dataclass(frozen=True, kw_only=True, slots=True)
class RankStep:
    ops: tuple[PoolOp | HandoverOp, ...]  # in the order rank 0 applied them
    # None: operations only, no forward; a DraftBatch: a drafter forward (the MTP head)
    batch: ScheduledBatch | DraftBatch | None


@dataclass(frozen=True, kw_only=True, slots=True)
class RankShutdown:
    """Rank 0 is stopping: exit."""

    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ReportPools:
    """Every rank contributes the digest of its pools (`pool_digest`) to a gather on rank 0:
    a check that all ranks' pools follow rank 0's bookkeeping."""

    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class UseGraphs:
    """Rank 0 runs the decode and verify steps its graph runner takes through one of these
    settings (engine/executor/graph_runner.py's DecodeGraphRunner); every rank builds the same,
    so that each pads a step alike and replays a plan whose collectives meet rank 0's. Sent
    once, before the first step."""

    max_bs: int
    kv_capacity: int
    capture: str | None  # "cuda", "cpu" or None (the padded step run eagerly)
    verify_width: int | None


RankMessage = RankStep | RankShutdown | ReportPools | UseGraphs

_CARRIERS: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        ResetSlot,
        CopySlot,
        LoadAdapterSlot,
        SnapshotShard,
        SendShard,
        DropShard,
        InstallShard,
        RankStep,
        RankShutdown,
        ReportPools,
        UseGraphs,
        ScheduledBatch,
        DraftBatch,
        TrackPoint,
    )
}


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        fields = {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"type": type(value).__name__, "fields": fields}
    if isinstance(value, (tuple, list)):
        return [_to_wire(v) for v in value]
    return value


def _from_wire(value: Any) -> Any:
    if isinstance(value, dict):
        cls = _CARRIERS.get(value.get("type"))
        if cls is None:
            raise ValueError(f"unknown rank message carrier {value.get('type')!r}")
        return cls(**{name: _from_wire(v) for name, v in value["fields"].items()})
    if isinstance(value, list):
        return tuple(_from_wire(v) for v in value)
    return value


def encode(message: RankMessage) -> bytes:
    return msgpack.packb(_to_wire(message), use_bin_type=True)


def decode(frame: bytes) -> RankMessage:
    message = _from_wire(msgpack.unpackb(frame, raw=False))
    if not isinstance(message, (RankStep, RankShutdown, ReportPools, UseGraphs)):
        raise ValueError(
            f"a rank message must be RankStep, RankShutdown, ReportPools or UseGraphs, got"
            f" {message!r}"
        )
    return message


class PoolOps:
    """Applies the scheduler's pool operations to this rank's cache and, when other ranks exist,
    records them for the next RankStep (the scheduler calls `reset` / `copy`)."""

    def __init__(self, cache: StateCache, record: bool):
        self.cache = cache
        self.record = record
        self.pending: list[PoolOp] = []

    def reset(self, slot: int) -> None:
        self.cache.reset_slot(slot)
        if self.record:
            self.pending.append(ResetSlot(slot=slot))

    def copy(self, src: int, dst: int) -> None:
        self.cache.copy_slot(src, dst)
        if self.record:
            self.pending.append(CopySlot(src=src, dst=dst))

    def adapter_slot(self, slot: int, name: str, path: str) -> None:
        """Rank 0's slot table wrote adapter `name` into `slot`: the other ranks do it too."""
        if self.record:
            self.pending.append(LoadAdapterSlot(slot=slot, name=name, path=path))

    def drain(self) -> tuple[PoolOp, ...]:
        ops, self.pending = tuple(self.pending), []
        return ops


def pool_digest(cache: StateCache) -> torch.Tensor:
    """float64, per pool tensor of the spec and per row (slot or token slot) the sum of its
    values over every layer, concatenated in spec order."""
    parts = [pool.double().transpose(0, 1).flatten(1).sum(-1) for pool in cache.pools.values()]
    return torch.cat(parts).cpu() if parts else torch.zeros(0, dtype=torch.float64)


def apply(op: PoolOp, cache: StateCache) -> None:
    """What a rank other than 0 does with one recorded operation."""
    if isinstance(op, ResetSlot):
        cache.reset_slot(op.slot)
    else:
        cache.copy_slot(op.src, op.dst)
