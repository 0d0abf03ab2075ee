"""What a request's state looks like when it leaves one engine and enters another, all derived
from the model's state spec (engine/cache/spec.py): tensors travel by pool name.

The prefill engine snapshots a finished prefill (its pages of every paged tensor, the final
state of every slot tensor, the block checkpoints of its prefix, first token) before its pages
and slot are freed; the decode engine preallocates pages and a slot, then installs the snapshot
and continues decoding as if it had run the prefill itself.

    RequestState.pages["attention.k"]        (layers, pages, page_size, *one token's shape)
    RequestState.slots["mamba2.ssm"]         (layers, *one slot's shape); 0 layers: every layer
                                             came ahead (SlotChunk)
    RequestState.checkpoints["mamba2.ssm"]   (blocks, layers, *one slot's shape), checkpointed
                                             slot tensors only

What else a request carries across is rebuilt from `first_token`: the decode side's seeded
sampler skips the draw the prefill side made, and a structured-output matcher replays it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from baton.engine.cache.spec import ModelStateSpec, StateKind
from baton.engine.core.outputs import TokenLogprobs


@dataclass(frozen=True, kw_only=True, slots=True)
class RequestState:
    """A prefill's state from page `first_page` and prefix-cache block `first_block` on (the
    decode engine already holds what comes before: its own cached prefix)."""

    num_prompt_tokens: int
    first_token: int
    first_logprobs: TokenLogprobs | None
    first_page: int
    first_block: int
    pages: dict[str, torch.Tensor]
    slots: dict[str, torch.Tensor]
    checkpoints: dict[str, torch.Tensor]

    @property
    def num_blocks(self) -> int:
        return next((t.shape[0] for t in self.checkpoints.values()), 0)

    @property
    def num_pages(self) -> int:
        return next((t.shape[1] for t in self.pages.values()), 0)

    def skip(self, pages: int, blocks: int) -> RequestState:
        """The part a decode engine that caches `pages` pages / `blocks` blocks still needs."""
        return dataclasses.replace(
            self,
            first_page=self.first_page + pages,
            first_block=self.first_block + blocks,
            pages={name: t[:, pages:] for name, t in self.pages.items()},
            checkpoints={name: t[blocks:] for name, t in self.checkpoints.items()},
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Preallocation:
    pages: tuple[int, ...]  # decode-side pages the prompt's paged state goes to
    slot: int
    num_prompt_tokens: int
    cached_tokens: int  # prompt tokens this engine already caches (their pages need no transfer)


@dataclass(frozen=True, kw_only=True, slots=True)
class StatePlace:
    """Where a request's handed-over state sits in an engine's pools, for a transfer engine that
    reads it straight from one engine's pools into the other's: the prompt's pages from the
    first that travels, the request's slot (its final state), and the checkpoint slots of the
    prompt's blocks from the first that travels (on the decode side 0 marks a block cached
    there already: not written)."""

    pages: tuple[int, ...]
    slot: int
    checkpoint_slots: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorLayout:
    """One pool tensor as a handover sees it."""

    name: str  # the pool's: "kind.tensor"
    kind: StateKind
    layers: int
    shape: tuple[int, ...]  # this rank's, per token (paged) or per slot
    model_shape: tuple[int, ...]  # the whole model's
    dtype: str
    checkpointed: bool

    @property
    def bytes(self) -> int:
        """One token's (paged) or one slot's, one layer, this rank."""
        n = 1
        for s in self.shape:
            n *= s
        return n * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True, kw_only=True, slots=True)
class SlotUnit:
    """One layer's slot state as it travels ahead of the final StateTransfer: frame
    `"{pool}#{layer}"` for each slot tensor of its kind."""

    frames: tuple[tuple[str, str, int], ...]  # (frame name, pool name, layer)
    bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class HandoverLayout:
    """What a disaggregation worker knows of its engine's pools (the same for every request):
    the facts both sides of a handover must share, and the sizes its messages are cut by."""

    model_fingerprint: str  # of the model config
    weights_fingerprint: str  # of the checkpoint's tensors (engine/checkpoint/fingerprint.py)
    dtype: str  # the serving dtype
    page_size: int
    # Page entries per page of positions (ModelStateSpec.page_tables): a handover's page
    # counts and first pages are in entries, interleaved as the request holds them; every
    # paged tensor travels at every entry (a layer reads only its table's), but a pool that
    # another's memory holds (ModelStateSpec.covered_pools) is not among `tensors`
    page_tables: int
    tp_size: int
    tensors: tuple[TensorLayout, ...]  # in spec order

    @classmethod
    def of(
        cls,
        spec: ModelStateSpec,
        *,
        model_fingerprint: str,
        weights_fingerprint: str,
        dtype: torch.dtype,
        page_size: int,
        tp_size: int,
        tp_rank: int,
    ) -> HandoverLayout:
        covered = spec.covered_pools()
        return cls(
            model_fingerprint=model_fingerprint,
            weights_fingerprint=weights_fingerprint,
            dtype=str(dtype).removeprefix("torch."),
            page_size=page_size,
            page_tables=spec.page_tables,
            tp_size=tp_size,
            tensors=tuple(
                TensorLayout(
                    name=name,
                    kind=t.kind,
                    layers=g.num_layers,
                    shape=t.local_shape(tp_size, tp_rank),
                    model_shape=t.shape,
                    dtype=str(t.dtype).removeprefix("torch."),
                    checkpointed=t.checkpointed,
                )
                for name, g, t in spec.entries()
                if name not in covered
            ),
        )

    def of_kind(self, kind: StateKind) -> tuple[TensorLayout, ...]:
        return tuple(t for t in self.tensors if t.kind == kind)

    def tensor(self, name: str) -> TensorLayout:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def pages_of(self, tokens: int) -> int:
        """The page entries holding `tokens` positions (whole pages only)."""
        return tokens // self.page_size * self.page_tables

    @property
    def page_bytes(self) -> int:
        """One page entry of every paged tensor over every layer."""
        return sum(t.layers * t.bytes * self.page_size for t in self.of_kind("paged"))

    def slot_units(self) -> tuple[SlotUnit, ...]:
        """Every (kind, layer) of slot state, kinds in spec order then layers."""
        kinds: dict[str, list[TensorLayout]] = {}
        for t in self.of_kind("slot"):
            kinds.setdefault(t.name.rsplit(".", 1)[0], []).append(t)
        return tuple(
            SlotUnit(
                frames=tuple((f"{t.name}#{layer}", t.name, layer) for t in tensors),
                bytes=sum(t.bytes for t in tensors),
            )
            for tensors in kinds.values()
            for layer in range(tensors[0].layers)
        )

    def describe(self) -> list[str]:
        """The whole model's layout, one line per tensor (what two engines must share)."""
        return [
            f"{t.name}: {t.kind} x{t.layers} {list(t.model_shape)} {t.dtype}" for t in self.tensors
        ]
