"""The handover's worker half on one rank: copies between a request's place in the pools (its
pages, its slot, its checkpoint slots) and the tensors that travel, for every tensor of the
model's state spec by its pool name. Nothing here knows which tensors a layer keeps.

    pages        name -> (layers, n, page_size, *shape)   rows of the paged pools
    slot state   name -> (layers, *shape)                 one slot of the slot pools
    checkpoints  name -> (blocks, layers, *shape)         checkpoint slots, checkpointed only
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from baton.engine.cache.pools import StateCache
from baton.engine.handover.state import SlotUnit


def run_length(pages: Sequence[int]) -> int:
    """How many of `pages` from the first on are consecutive pool pages (one slice of a pool)."""
    run = 1
    while run < len(pages) and pages[run] == pages[0] + run:
        run += 1
    return run


class StateIO:
    def __init__(self, cache: StateCache):
        self.cache = cache

    @property
    def device(self) -> torch.device:
        return self.cache.device

    # -- pages --------------------------------------------------------------------------------

    def gather_pages(self, pages: Sequence[int]) -> dict[str, torch.Tensor]:
        """Copies of `pages` of every paged tensor, (layers, n, page, *shape) each (the frames
        of a whole snapshot)."""
        index = torch.tensor(list(pages), dtype=torch.int64, device=self.device)
        return {
            name: self.cache.page_view(name).index_select(1, index) for name in self.cache.paged
        }

    def page_run(self, pages: Sequence[int]) -> tuple[int, dict[str, list[torch.Tensor]]]:
        """(n, per paged tensor one view per layer of the first n pages, (n, page, *shape)): a run
        of consecutive pool pages, sent straight from the pool (the caller keeps the pages in
        place until they are sent)."""
        n = run_length(pages)
        first = pages[0]
        return n, {
            name: list(self.cache.page_view(name)[:, first : first + n].unbind(0))
            for name in self.cache.paged
        }

    def write_pages(
        self, pages: Sequence[int], tensors: Mapping[str, Sequence[torch.Tensor] | torch.Tensor]
    ) -> None:
        """tensors[name][layer]: (len(pages), page, *shape), for every paged tensor."""
        if not pages:
            return
        n = len(pages)
        if run_length(pages) == n:  # one run of pool pages: plain slice copies
            for name, per_layer in tensors.items():
                view = self.cache.page_view(name)[:, pages[0] : pages[0] + n]
                for layer, src in enumerate(per_layer):
                    view[layer].copy_(src)
            return
        index = torch.tensor(list(pages), device=self.device)
        for name, per_layer in tensors.items():
            view = self.cache.page_view(name)
            for layer, src in enumerate(per_layer):
                view[layer, index] = src.to(self.device, view.dtype)

    # -- slots --------------------------------------------------------------------------------

    def copy_slot_state(self, slot: int) -> dict[str, torch.Tensor]:
        """Copies of one slot of every slot tensor, (layers, *shape) each."""
        return {name: self.cache.pools[name][:, slot].clone() for name in self.cache.slotted}

    def no_slot_state(self) -> dict[str, torch.Tensor]:
        """Every slot tensor with no layers (it all travelled ahead, or goes rank to rank)."""
        return {name: self.cache.pools[name][:0, 0] for name in self.cache.slotted}

    def write_slot_state(self, slot: int, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            if t.shape[0]:  # (no layers: every layer came ahead)
                pool = self.cache.pools[name]
                pool[:, slot] = t.to(pool.device, pool.dtype)

    def unit_views(self, slot: int, unit: SlotUnit) -> list[tuple[str, torch.Tensor]]:
        """One layer's slot state as (frame name, view of the pool)."""
        return [(frame, self.cache.pools[name][layer, slot]) for frame, name, layer in unit.frames]

    def write_unit(self, slot: int, unit: SlotUnit, frames: Mapping[str, torch.Tensor]) -> None:
        for frame, name, layer in unit.frames:
            self.cache.pools[name][layer, slot].copy_(frames[frame])

    def clear_unkept(self, slot: int) -> None:
        """The slot tensors that checkpoints do not keep start from zero in checkpoint `slot`
        (its kept tensors were written straight into the pool)."""
        for name in self.cache.slotted:
            if name not in self.cache.checkpointed:
                self.cache.pools[name][:, slot].zero_()

    # -- checkpoints ----------------------------------------------------------------------------

    def gather_checkpoints(self, slots: Sequence[int]) -> dict[str, torch.Tensor]:
        """Copies of checkpoint `slots` (in block order) of every checkpointed tensor, (blocks,
        layers, *shape) each."""
        index = torch.tensor(list(slots), dtype=torch.int64, device=self.device)
        return {
            name: self.cache.pools[name].index_select(1, index).transpose(0, 1).contiguous()
            for name in self.cache.slotted
            if name in self.cache.checkpointed
        }

    def no_checkpoints(self, num_blocks: int) -> dict[str, torch.Tensor]:
        """`num_blocks` blocks with no layers: they say how many blocks go rank to rank."""
        return {
            name: self.cache.pools[name].new_empty(num_blocks, 0, *self.cache.pools[name].shape[2:])
            for name in self.cache.slotted
            if name in self.cache.checkpointed
        }

    def write_checkpoint(self, slot: int, tensors: Mapping[str, torch.Tensor], block: int) -> None:
        """Block `block` of `tensors` ((blocks, layers, *shape) each) into checkpoint `slot`;
        the slot tensors that are not checkpointed start from zero there."""
        for name in self.cache.slotted:
            pool = self.cache.pools[name]
            if name in tensors:
                pool[:, slot] = tensors[name][block].to(pool.device, pool.dtype)
            else:
                pool[:, slot].zero_()
