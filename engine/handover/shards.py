"""The handover of one request between engines of different tensor-parallel sizes, as every
rank of an engine sees it: its shard of the pools goes out (prefill) or comes in (decode) through
its own connector, straight between ranks, never through rank 0.

    prefill rank p:  SnapshotShard ─> Shard (copies) ─> SendShard ─> connector ─┐ ShardTransfer
    decode rank d:   InstallShard ─> connector.receive (pieces from each source) <┘ per (p, d)
                        ─> install_shard into the pages, slot and checkpoint slots
                        ─> all ranks agree (ok / not)

Rank 0 records these operations in the step messages like any pool operation, so every rank
does its part in the same order relative to the forwards. The connector (the wire) lives in
disagg/ and is handed to the engine as `EngineArgs.handover_connector` (a ConnectorSpec: the
factory itself), like vLLM's kv_connector: the engine never names disagg. Rank 0 records these operations
from engine/handover/ranks.py.
"""

from __future__ import annotations

import importlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from baton.engine.cache.pools import StateCache
from baton.engine.config import ModelConfig
from baton.engine.handover.io import StateIO
from baton.engine.handover.state import RequestState
from baton.engine.parallel.messages import (
    DropShard,
    HandoverOp,
    InstallShard,
    SendShard,
    SnapshotShard,
)

logger = logging.getLogger("baton.tp_handover")

ADDRESS_BYTES = 256  # a rank's receive address, padded, in the gather that tells rank 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Shard:
    """One rank's copy of a request's state from page `first_page` and block `first_block` on,
    by pool name (engine/handover/state.py's layouts, this rank's slices)."""

    first_page: int
    first_block: int
    pages: dict[str, torch.Tensor]  # (layers, pages, page_size, *shape)
    slots: dict[str, torch.Tensor]  # (layers, *shape)
    checkpoints: dict[str, torch.Tensor]  # (blocks, layers, *shape)

    def component(self, component: str) -> torch.Tensor:
        """ "pages/attention.k" -> self.pages["attention.k"] (disagg/tp_layout.py's names)."""
        field, name = component.split("/", 1)
        return getattr(self, field)[name]


# Where a component's units lie in its tensor: after these leading dims, the spec's unit dim.
LEADING_DIMS = {"pages": 3, "slots": 1, "checkpoints": 2}


def unit_dim(cache_spec, component: str) -> int:
    field, name = component.split("/", 1)
    return LEADING_DIMS[field] + cache_spec.tensor(name)[1].unit_dim


# component -> [(unit offset in the local tensor, tensor of the piece)]
Pieces = dict[str, list[tuple[int, torch.Tensor]]]


class ShardConnector(Protocol):
    """What each rank's handover connector does (disagg/tp_transfer.py moves the slices as ZMQ
    frames, disagg/nixl_shards.py has the decode ranks READ them in place)."""

    address: str  # where this rank receives shards ("" on the prefill side)
    # Rooms this rank has installed: asked again (another rank still waiting), it says so at
    # once. A room id is used once (the router mints it).
    installed: OrderedDict[str, None]

    def snapshot(self, op: SnapshotShard) -> None:
        """This rank's part of a finished prefill's state, kept for its decode side: a copy, or
        only where it sits when the connector reads it in place (the request's hold)."""
        ...

    def keep(self, room: str, shard: Shard) -> None: ...

    def send(self, op: SendShard) -> None: ...

    def drop(self, room: str) -> None: ...

    def receive(self, op: InstallShard) -> Pieces | None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class ConnectorSpec:
    """What builds each rank's wire connector, handed in by whoever builds the engine (a
    disaggregated worker): `factory(options, config=, rank=, size=, cache=)`."""

    factory: Callable[..., ShardConnector]
    options: dict[str, str]

    def to_wire(self) -> dict[str, str]:
        """The form a rank process receives (RankSpec, JSON): the factory by its import path,
        taken from the object itself."""
        path = f"{self.factory.__module__}:{self.factory.__qualname__}"
        return {"factory": path, **self.options}

    @classmethod
    def from_wire(cls, wire: dict[str, str]) -> ConnectorSpec:
        module, _, name = wire["factory"].partition(":")
        factory = getattr(importlib.import_module(module), name)
        return cls(factory=factory, options={k: v for k, v in wire.items() if k != "factory"})


def load_connector(
    spec: ConnectorSpec | None, config: ModelConfig, rank: int, size: int, cache: StateCache
) -> ShardConnector | None:
    """This rank's connector (None without a spec)."""
    if spec is None:
        return None
    return spec.factory(spec.options, config=config, rank=rank, size=size, cache=cache)


def export_shard(
    cache: StateCache, pages: tuple[int, ...], slot: int, checkpoint_slots: tuple[int, ...]
) -> Shard:
    """Copies of this rank's `pages`, `slot` and block `checkpoint_slots`."""
    io = StateIO(cache)
    return Shard(
        first_page=0,
        first_block=0,
        pages=io.gather_pages(pages),
        slots=io.copy_slot_state(slot),
        checkpoints=io.gather_checkpoints(checkpoint_slots),
    )


def shard_of_state(state: RequestState) -> Shard:
    """A whole (TP=1) snapshot is rank 0's shard: it holds every unit."""
    return Shard(
        first_page=state.first_page,
        first_block=state.first_block,
        pages=state.pages,
        slots=state.slots,
        checkpoints=state.checkpoints,
    )


def install_shard(cache: StateCache, op: InstallShard, pieces: Pieces) -> None:
    """Write checked pieces (component -> [(unit offset, tensor)], disagg/tp_layout.py's
    components) into the op's pages, its slot and its checkpoint slots (0: cached here
    already, not written); a checkpoint slot's tensors that are not checkpointed start from
    zero (also when a connector that reads in place wrote the rest: no pieces then)."""
    index = torch.tensor(op.pages, dtype=torch.int64, device=cache.device)
    for component, parts in pieces.items():
        field, name = component.split("/", 1)
        dim = unit_dim(cache.spec, component)
        pool = cache.page_view(name) if field == "pages" else cache.pools[name]
        for offset, t in parts:
            dst = pool.narrow(dim + (field == "slots"), offset, t.shape[dim])
            t = t.to(pool.device, pool.dtype)
            if field == "pages":
                dst[:, index] = t
            elif field == "slots":
                dst[:, op.slot] = t
            else:
                for block, slot in enumerate(op.checkpoint_slots):
                    if slot:
                        dst[:, slot] = t[block]
    for slot in op.checkpoint_slots:
        for name in cache.slotted:
            if slot and name not in cache.checkpointed:
                cache.pools[name][:, slot].zero_()


# What a rank reports after its part of an InstallShard.
FAILED, WAITING, INSTALLED = 0, 1, 2
INSTALLED_MEMORY = 4096  # rooms a rank remembers having installed (asked again until all have)


def apply_handover(op: HandoverOp, cache: StateCache, connector: ShardConnector | None) -> str:
    """Do this rank's part of `op`; "" when done, WAITING_TEXT while an InstallShard's pieces
    are still on their way, else why not (logged here: a rank other than 0 has no one else to
    tell)."""
    if connector is None:
        return "this engine has no handover connector"
    try:
        if isinstance(op, SnapshotShard):
            connector.snapshot(op)
        elif isinstance(op, SendShard):
            connector.send(op)
        elif isinstance(op, DropShard):
            connector.drop(op.room)
        elif op.room not in connector.installed:
            pieces = connector.receive(op)
            if pieces is None:
                return WAITING_TEXT
            install_shard(cache, op, pieces)
            connector.installed[op.room] = None
            while len(connector.installed) > INSTALLED_MEMORY:
                connector.installed.popitem(last=False)
    except ValueError as error:  # a peer's missing, late or malformed part: this room only
        logger.warning("room %s: %s", op.room, error)
        return str(error)
    return ""


WAITING_TEXT = "waiting for pieces"


REASON_BYTES = 480  # a failed rank's reason (UTF-8, cut to fit) in its install report


@dataclass(frozen=True)
class InstallReport:
    """Every rank's part of an InstallShard, on rank 0 (rank order)."""

    statuses: list[int]  # FAILED / WAITING / INSTALLED
    received: list[int]  # shard bytes received so far
    reasons: list[str]  # why a FAILED rank failed ("" for the others)

    def failure(self) -> str:
        """What the failed ranks said, "" when none failed."""
        return "; ".join(
            self.reasons[rank] or f"decode rank {rank} could not install its shard"
            for rank, status in enumerate(self.statuses)
            if status == FAILED
        )


def install_report(tp, error: str, connector: ShardConnector | None) -> InstallReport:
    """Every rank's status, shard bytes received and failure reason after an InstallShard; one
    gather, which every rank joins (the result is rank 0's to read)."""
    received = getattr(connector, "bytes_received", 0)
    status = INSTALLED if not error else WAITING if error == WAITING_TEXT else FAILED
    reason = error.encode()[:REASON_BYTES] if status == FAILED else b""
    own = torch.zeros(1, 2 + REASON_BYTES, dtype=torch.int64)
    own[0, 0], own[0, 1] = status, received
    own[0, 2 : 2 + len(reason)] = torch.tensor(list(reason), dtype=torch.int64)
    rows = tp.gather_last_dim(own).view(-1, 2 + REASON_BYTES)
    return InstallReport(
        statuses=rows[:, 0].tolist(),
        received=rows[:, 1].tolist(),
        reasons=[bytes(row[2:].tolist()).rstrip(b"\0").decode(errors="replace") for row in rows],
    )


def gather_addresses(tp, connector: ShardConnector | None) -> list[str]:
    """Every rank's receive address on rank 0 (rank order); [] on the others. Each rank calls
    it once, after loading."""
    own = (connector.address if connector is not None else "").encode()[:ADDRESS_BYTES]
    padded = torch.zeros(1, ADDRESS_BYTES, dtype=torch.uint8)
    padded[0, : len(own)] = torch.tensor(list(own), dtype=torch.uint8)
    every = tp.gather_last_dim(padded)
    if not tp.is_first:
        return []
    return [bytes(row.tolist()).rstrip(b"\0").decode() for row in every.view(-1, ADDRESS_BYTES)]
