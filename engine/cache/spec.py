"""State specs: every layer kind declares the per-request state it keeps, and everything that
holds, copies, checkpoints, hands over or splits that state is derived from the declaration.

    layer file:  Mamba2Mixer.state_spec(config, dtype) -> LayerState("mamba2", conv, ssm)
                 attention_state(...)                  -> LayerState("attention", k, v)
    family file: state_spec(config, dtype)             -> ModelStateSpec (one entry per use)
    derived:     pools and memory sizing (engine/cache/pools.py), slot reset / copy, prefix
                 checkpoints, the handover snapshot and install (engine/engine_handover.py),
                 wire frames and their validation (disagg/), the TP handover plan
                 (disagg/tp_layout.py) and the layout both sides of a PD pair must agree on.

A state tensor is either

    paged  one row per token, in the KV pages (K/V): shape = one token's, e.g. (kv_heads, hd)
    slot   one per request, in a slot of the recurrent pool: shape = one slot's, e.g.
           (heads, head_dim, d_state); every slot tensor of the model shares the slot index
           space, so a checkpoint, a working slot or a speculative scratch position is one
           slot index for all of them (slot 0 is the dummy that padded rows read and write)

Shapes here are the whole model's. Under tensor parallelism a tensor is split along one dim
(`TPSplit`) in segments of atoms (heads, groups) that the ranks share evenly, or that are
replicated when there are fewer atoms than ranks (KV heads, a single Mamba group); `split=None`
means every rank holds all of it. A unit is one index along the split dim: the TP plan moves
units. `checkpointed`: the prefix cache keeps the tensor at block ends (paged tensors are kept
through their pages; a slot tensor that is not checkpointed starts from zero when a request
resumes from a checkpoint).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from baton.engine.config_error import ConfigError

StateKind = Literal["paged", "slot"]
Ranges = tuple[tuple[int, int], ...]  # (start, length) along one dim of the whole tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """`atoms` consecutive atoms of `atom_units` units each along the split dim."""

    atoms: int
    atom_units: int
    # Fewer atoms than ranks: each atom is replicated on size / atoms ranks (KV heads, one Mamba
    # group); else the atoms must divide evenly.
    replicate_below: bool
    what: str  # the config key the atoms come from, for the error that refuses a TP size


@dataclass(frozen=True, kw_only=True, slots=True)
class TPSplit:
    dim: int  # of the per-token / per-slot shape
    segments: tuple[Segment, ...]

    def ranges(self, size: int, rank: int) -> Ranges:
        """The whole-tensor unit ranges rank `rank` of `size` holds, in its local order
        (ConfigError naming the key when the atoms cannot be shared by `size` ranks)."""
        out, base = [], 0
        for seg in self.segments:
            if seg.atoms >= size or not seg.replicate_below:
                if seg.atoms % size:
                    raise ConfigError(
                        f"{seg.what}={seg.atoms} is not divisible by the tensor-parallel size {size}"
                    )
                per = seg.atoms // size
                first = rank * per
            else:
                if size % seg.atoms:
                    raise ConfigError(
                        f"{seg.what}={seg.atoms} must divide the tensor-parallel size {size}"
                        " when it is smaller"
                    )
                per, first = 1, rank // (size // seg.atoms)
            out.append((base + first * seg.atom_units, per * seg.atom_units))
            base += seg.atoms * seg.atom_units
        return tuple(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class StateTensor:
    name: str
    kind: StateKind
    shape: tuple[int, ...]  # the whole model's, per token (paged) or per slot
    dtype: torch.dtype
    split: TPSplit | None  # None: replicated on every rank
    checkpointed: bool

    def ranges(self, size: int, rank: int) -> Ranges:
        """Units (along `unit_dim`) rank `rank` of `size` holds, in local order."""
        if self.split is None or size == 1:
            return ((0, self.shape[self.unit_dim]),) if self.shape else ((0, 1),)
        return self.split.ranges(size, rank)

    @property
    def unit_dim(self) -> int:
        return self.split.dim if self.split is not None else 0

    def local_shape(self, size: int, rank: int) -> tuple[int, ...]:
        shape = list(self.shape)
        if self.split is not None and size > 1:
            shape[self.split.dim] = sum(n for _, n in self.ranges(size, rank))
        return tuple(shape)

    def bytes(self, size: int = 1, rank: int = 0) -> int:
        """One token's (paged) or one slot's bytes on that rank."""
        return math.prod(self.local_shape(size, rank)) * self.dtype.itemsize


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerState:
    """What one layer kind keeps per request. `kind` names the pool group: every layer of a
    model with the same kind has the same tensors (they share pool tensors, layer-major).

    A recurrent kind also says how its prefill cuts sequences: `chunk_size`, the per-sequence
    chunk grid its true states sit on (checkpoints are taken at multiples of it), and
    `window_width`, the causal conv window its varlen conv gathers (None: it has neither).

    A paged kind says how far back it reads: `page_window`, the number of most recent tokens
    (its own included) a query attends to (sliding-window attention), or None when it reads
    every token. Pages wholly behind every paged kind's window are released during decode
    (ModelStateSpec.page_window)."""

    kind: str
    tensors: tuple[StateTensor, ...]
    chunk_size: int | None
    window_width: int | None
    page_window: int | None


@dataclass(frozen=True, kw_only=True, slots=True)
class StateGroup:
    """One layer kind and how many layers (uses) of it the model has, in pool order."""

    kind: str
    num_layers: int
    tensors: tuple[StateTensor, ...]
    chunk_size: int | None
    window_width: int | None
    page_window: int | None


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelStateSpec:
    """A model's state: the list over its stateful layer uses, grouped by kind (first
    appearance order). A layer's index in its group is its pool index."""

    groups: tuple[StateGroup, ...]

    @classmethod
    def of(cls, uses: list[LayerState]) -> ModelStateSpec:
        """From one LayerState per stateful layer use, in forward order."""
        by_kind: dict[str, list[LayerState]] = {}
        for use in uses:
            by_kind.setdefault(use.kind, []).append(use)
        groups = []
        for kind, states in by_kind.items():
            if any(s.tensors != states[0].tensors for s in states):
                raise ValueError(f"layers of state kind {kind!r} declare different tensors")
            names = [t.name for t in states[0].tensors]
            if len(set(names)) != len(names):
                raise ValueError(f"state kind {kind!r} names a tensor twice: {names}")
            first = states[0]
            if any(s != first for s in states):
                raise ValueError(f"layers of state kind {kind!r} declare different geometry")
            groups.append(
                StateGroup(
                    kind=kind,
                    num_layers=len(states),
                    tensors=first.tensors,
                    chunk_size=first.chunk_size,
                    window_width=first.window_width,
                    page_window=first.page_window,
                )
            )
        return cls(groups=tuple(groups))

    def _geometry(self, field: str) -> int:
        """The value every recurrent kind agrees on (1 when no kind has one: nothing reads
        it then); ValueError when kinds disagree (one metadata builder serves them all)."""
        values = {getattr(g, field) for g in self.groups} - {None}
        if len(values) > 1:
            raise ValueError(f"the model's state kinds declare different {field}s: {values}")
        return values.pop() if values else 1

    @property
    def chunk_size(self) -> int:
        return self._geometry("chunk_size")

    @property
    def window_width(self) -> int:
        return self._geometry("window_width")

    def _paged_groups(self) -> list[StateGroup]:
        return [g for g in self.groups if any(t.kind == "paged" for t in g.tensors)]

    @property
    def page_tables(self) -> int:
        """How many page tables a request holds: 2 when some paged kinds read every token (full
        attention, MLA) and others only a window (sliding-window attention), else 1. The
        windowed kinds then have a table of their own (table 1), whose pages behind the window
        are released while the other table keeps every page (vLLM's hybrid KV allocator, with
        one table per window instead of one per layer group). Both tables draw pages from one
        pool, and a windowed kind's pool shares its memory with a full kind's of the same
        shape (`aliases`), so a released page serves either table.

        A request's page list interleaves its tables (engine/core/request.py): entry
        `i * page_tables + t` is table t's page for positions [i * page_size, (i + 1) *
        page_size). What treats the list as a list (the prefix cache's blocks, freeing,
        trimming) is table-blind; what maps positions to pages takes the stride."""
        windows = {g.page_window is None for g in self._paged_groups()}
        return 2 if windows == {True, False} else 1

    def table_of(self, kind: str) -> int:
        """The page table a paged state kind reads: 1 for a windowed kind beside full ones."""
        group = next(g for g in self.groups if g.kind == kind)
        return 1 if self.page_tables == 2 and group.page_window is not None else 0

    @property
    def page_window(self) -> int | None:
        """How many most recent tokens the paged state of the request's last page table is
        still read at: the widest window over its kinds, or None when one of them reads every
        token (full attention, MLA) or there is no paged state. That table's pages wholly
        behind it can be given back (engine/core/scheduler_memory.py); with None every page is
        kept while the request runs. With two tables (`page_tables`) it is the windowed
        kinds' table."""
        windows = [g.page_window for g in self._paged_groups()]
        if self.page_tables == 2:
            windows = [w for w in windows if w is not None]
        if not windows or None in windows:
            return None
        return max(windows)

    def aliases(self) -> dict[str, str]:
        """Pool name of a windowed kind's paged tensor -> the full kind's pool it shares memory
        with (same shape, dtype and split: the pool holds the larger layer count, each kind
        reads its first layers). Pages come from one pool and a page id belongs to one table
        at a time, so the two never hold a page at once. Empty with one page table."""
        if self.page_tables == 1:
            return {}
        out: dict[str, str] = {}
        taken: set[str] = set()
        full = [(n, t) for n, g, t in self.entries("paged") if self.table_of(g.kind) == 0]
        for name, group, tensor in self.entries("paged"):
            if self.table_of(group.kind) == 0:
                continue
            for other, t in full:
                if other not in taken and (t.shape, t.dtype, t.split) == (
                    tensor.shape,
                    tensor.dtype,
                    tensor.split,
                ):
                    out[name] = other
                    taken.add(other)
                    break
        return out

    def covered_pools(self) -> dict[str, str]:
        """Paged pool name -> the pool whose memory holds all of it: of a windowed pool and the
        full pool it aliases (`aliases`), the one with fewer layers (the windowed one on a tie).
        What moves the pools' bytes (a handover, a tier record) moves only the wider of the two,
        at every page entry: it holds both kinds' layers, so moving both sent each page's memory
        twice. Empty with one page table."""
        out: dict[str, str] = {}
        for window, full in self.aliases().items():
            wide = self.tensor(window)[0].num_layers > self.tensor(full)[0].num_layers
            narrow, wider = (full, window) if wide else (window, full)
            out[narrow] = wider
        return out

    def entries(self, kind: StateKind | None = None) -> list[tuple[str, StateGroup, StateTensor]]:
        """(pool name "kind.tensor", group, tensor) of every state tensor, in spec order."""
        return [
            (f"{g.kind}.{t.name}", g, t)
            for g in self.groups
            for t in g.tensors
            if kind is None or t.kind == kind
        ]

    def names(self, kind: StateKind | None = None) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.entries(kind))

    def tensor(self, name: str) -> tuple[StateGroup, StateTensor]:
        for pool_name, group, tensor in self.entries():
            if pool_name == name:
                return group, tensor
        raise KeyError(name)

    @property
    def has_pages(self) -> bool:
        return bool(self.entries("paged"))

    @property
    def has_slots(self) -> bool:
        return bool(self.entries("slot"))

    def checkpointed(self) -> tuple[str, ...]:
        return tuple(name for name, _, t in self.entries("slot") if t.checkpointed)

    def bytes_per_token(self, size: int = 1, rank: int = 0) -> int:
        """Paged state of one token over every layer, on that rank."""
        return sum(g.num_layers * t.bytes(size, rank) for _, g, t in self.entries("paged"))

    def bytes_per_page_token(self, size: int = 1, rank: int = 0) -> int:
        """The pools' bytes per token of one page id, on that rank: bytes_per_token with one
        page table; with two, a windowed pool and the full pool it aliases count once, at the
        larger layer count. A token then takes one page id in each table until its windowed
        page is released."""
        aliases = self.aliases()
        layers = {name: g.num_layers for name, g, _ in self.entries("paged")}
        for window, full in aliases.items():
            layers[full] = max(layers[full], layers[window])
        return sum(
            layers[name] * t.bytes(size, rank)
            for name, _, t in self.entries("paged")
            if name not in aliases
        )

    def bytes_per_slot(self, size: int = 1, rank: int = 0) -> int:
        """Slot state of one request over every layer, on that rank."""
        return sum(g.num_layers * t.bytes(size, rank) for _, g, t in self.entries("slot"))

    def check_tp(self, size: int) -> None:
        """ConfigError naming the key when some state cannot be shared by `size` ranks."""
        for _, _, t in self.entries():
            for rank in range(size):
                t.ranges(size, rank)

    def describe(self) -> list[str]:
        """One line per tensor (the PD layout check compares these, by name)."""
        return [
            f"{name} {t.kind} x{g.num_layers} {list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
            for name, g, t in self.entries()
        ]
