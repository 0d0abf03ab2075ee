"""The tensors that hold per-request state, one pool tensor per state tensor of the model's spec
(engine/cache/spec.py), layer-major:

    paged "attention.k":  (layers, num_pages * page_size, *one token's shape)   page 0 = dummy
                          token slot = page * page_size + offset
    slot  "mamba2.conv":  (layers, num_slots, *one slot's shape)               slot 0 = dummy
          "mamba2.ssm":   ...

Layer-major means one (layer, slot) and one (layer, page) are contiguous blocks, so copying a
slot (checkpoints, transfers) or a page run is a plain strided copy. Shapes are this rank's
(the spec's local shapes under tensor parallelism).

On the CPU a pool is fresh anonymous memory (mmap), which the kernel hands out zeroed and
commits page by page as it is first written: pools sized for the whole context budget cost the
memory their requests use, not their size, and no time to clear at start (clearing 1 GB of
pools was ~1 s of a start on 2 busy cores). The allocators hand out low pages and slots first
and take freed ones back first, so what is committed follows the peak of what was in use.
"""

from __future__ import annotations

import math
import mmap

import torch

from baton.engine.cache.spec import ModelStateSpec


class StateCache:
    def __init__(
        self,
        spec: ModelStateSpec,
        *,
        num_pages: int,
        page_size: int,
        num_slots: int,
        device: torch.device | str,
        tp_size: int = 1,
        tp_rank: int = 0,
    ):
        self.spec = spec
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.pools: dict[str, torch.Tensor] = {}
        # With two page tables a windowed pool shares the memory of a full one (spec.aliases):
        # one tensor with the larger layer count, each kind viewing its first layers.
        aliases = spec.aliases()
        layers = {name: group.num_layers for name, group, _ in spec.entries()}
        for window, full in aliases.items():
            layers[full] = max(layers[full], layers[window])
        for name, _, tensor in spec.entries():
            if name in aliases:
                continue
            rows = num_pages * page_size if tensor.kind == "paged" else num_slots
            shape = (layers[name], rows, *tensor.local_shape(tp_size, tp_rank))
            self.pools[name] = zeroed(shape, tensor.dtype, torch.device(device))
        for window, full in aliases.items():
            self.pools[window] = self.pools[full][: spec.tensor(window)[0].num_layers]
        for name, group, _ in spec.entries():
            if self.pools[name].shape[0] != group.num_layers:
                self.pools[name] = self.pools[name][: group.num_layers]
        self.aliases = aliases
        # page entries per page of positions (spec.page_tables): every paged pool is indexed
        # by every entry, and a layer reads only its own table's
        self.page_tables = spec.page_tables
        # the recurrent kinds' shared geometry, which every metadata build reads (the spec
        # derives it over its groups on each ask)
        self.chunk_size, self.window_width = spec.chunk_size, spec.window_width
        # the paged pools whose bytes move (a handover, a tier record): each memory once, by the
        # pool spanning all of it (spec.covered_pools); every pool has its own layer views
        self.covered = spec.covered_pools()
        self.paged = tuple(n for n in spec.names("paged") if n not in self.covered)
        self.slotted = spec.names("slot")
        self.checkpointed = frozenset(spec.checkpointed())
        # (kind, layer) -> {tensor name: this layer's pool view}: what a layer's forward reads
        self._layers: dict[tuple[str, int], dict[str, torch.Tensor]] = {
            (group.kind, i): {
                t.name: self.pools[f"{group.kind}.{t.name}"][i] for t in group.tensors
            }
            for group in spec.groups
            for i in range(group.num_layers)
        }

    def nbytes(self) -> int:
        """The pools' size (on the CPU, the memory they may grow to as requests write them);
        an aliased pool (two page tables) counts once."""
        return sum(
            pool.untyped_storage().nbytes()
            for name, pool in self.pools.items()
            if name not in self.aliases
        )

    def moved_pools(self) -> dict[str, torch.Tensor]:
        """Every pool by name but those another pool's memory holds (spec.covered_pools): what a
        transfer engine registers and reads."""
        return {name: pool for name, pool in self.pools.items() if name not in self.covered}

    def entries(self, pages: int) -> int:
        """A request's page entries covering `pages` pages of positions, every table's."""
        return pages * self.page_tables

    def layer(self, kind: str, index: int) -> dict[str, torch.Tensor]:
        """Layer `index` of state kind `kind`: its pool views by tensor name (a paged tensor's
        rows are token slots, a slot tensor's rows are slots)."""
        return self._layers[(kind, index)]

    @property
    def device(self) -> torch.device:
        return next(iter(self.pools.values())).device if self.pools else torch.device("cpu")

    def reset_slot(self, slot: int) -> None:
        """A fresh request starts from zero recurrent state."""
        for name in self.slotted:
            self.pools[name][:, slot].zero_()

    def copy_slot(self, src: int, dst: int) -> None:
        """Resume from a checkpoint: what it keeps is copied, the rest starts from zero."""
        for name in self.slotted:
            pool = self.pools[name]
            if name in self.checkpointed:
                pool[:, dst].copy_(pool[:, src])
            else:
                pool[:, dst].zero_()

    def page_view(self, name: str) -> torch.Tensor:
        """A paged pool as (layers, num_pages, page_size, *shape)."""
        pool = self.pools[name]
        return pool.view(pool.shape[0], self.num_pages, self.page_size, *pool.shape[2:])

    def bytes(self) -> int:
        return self.nbytes()

    @classmethod
    def for_model(
        cls,
        config,
        *,
        num_pages: int,
        page_size: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> StateCache:
        """The pools of a ModelConfig's state spec (its family's) at the serving dtype."""
        from baton.engine.models.registry import model_state_spec

        return cls(
            model_state_spec(config, dtype),
            num_pages=num_pages,
            page_size=page_size,
            num_slots=num_slots,
            device=device,
            tp_size=tp_size,
            tp_rank=tp_rank,
        )


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero pool tensor; on the CPU, committed as it is written (see the module docstring)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # the tensor keeps the mapping alive; it is unmapped with the tensor's storage
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
