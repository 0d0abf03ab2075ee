"""The adapters an engine serves: a registry by name, host copies (an LRU of `max_cpu_loras`),
and the slot table the forward reads (an LRU of `max_loras` slots, each pinned while a running
request uses it).

    registry:  name -> path                      (--lora-modules, load_lora_adapter)
    host:      name -> LoRAWeights  (LRU, <= max_cpu_loras; re-read from its path when evicted)
    slots:     slot s -> name       (LRU over unpinned slots, <= max_loras)
               every LoRALinear's a_rows / b_rows [s * R : (s + 1) * R] hold that adapter's
               A and scaled B (R = max_lora_rank, ranks below R padded with zeros); every
               ExpertLoRA's [s * E * R : (s + 1) * E * R] its E experts' (engine/lora/experts.py)

The scheduler acquires a request's slot when it admits it (`acquire`: None when every slot is
pinned by other adapters, and the request waits) and releases it when the request finishes or
is preempted. Host data and device copies between steps only; the forward sees the slot of each
row through the metadata (ScheduledBatch.lora_slots, -1 for none).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

from baton.engine.lora.adapter import AdapterError, LoRAWeights, read_adapter
from baton.engine.lora.experts import ExpertLoRA
from baton.engine.lora.layer import LoRALinear

# The registry is names and paths only, but every one is kept until unloaded: a bound, so that
# a client loading adapters in a loop cannot grow an engine for good.
MAX_REGISTERED_ADAPTERS = 1024
MAX_NAME_LENGTH = 256


class AdapterTable:
    def __init__(
        self,
        targets: dict[str, LoRALinear | ExpertLoRA],
        rename: Callable[[str], str | None],
        *,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
    ):
        if max_loras < 1 or max_rank < 1:
            raise ValueError(
                f"max_loras and max_lora_rank must be >= 1, got {max_loras}, {max_rank}"
            )
        if max_cpu_loras < max_loras:
            raise ValueError(
                f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({max_loras})"
            )
        self.targets = targets
        self.rename = rename
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.paths: dict[str, str] = {}
        self.host: OrderedDict[str, LoRAWeights] = OrderedDict()
        self.slot_names: list[str | None] = [None] * max_loras
        self.pins = [0] * max_loras
        self.recency: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))
        # Called (slot, name, path) after a slot is written: at TP > 1 the engine records it
        # for the other ranks, which `install` the same adapter in the same slot.
        self.on_write: Callable[[int, str, str], None] | None = None
        device = next(iter(targets.values())).a_rows.device if targets else torch.device("cpu")
        # (S * R,) the slot of each column of every a_rows.T / b_rows (layer.SlotRows)
        self.slot_of_column = torch.arange(max_loras, device=device).repeat_interleave(max_rank)

    # -- registry -------------------------------------------------------------------------------

    def add(self, name: str, path: str | Path) -> LoRAWeights:
        """Register (and read, so that a bad adapter is refused now) adapter `name`."""
        if not name:
            raise AdapterError("an adapter needs a non-empty name")
        if len(name) > MAX_NAME_LENGTH:
            raise AdapterError(f"an adapter name is at most {MAX_NAME_LENGTH} characters")
        if len(self.paths) >= MAX_REGISTERED_ADAPTERS:
            raise AdapterError(
                f"{MAX_REGISTERED_ADAPTERS} adapters are loaded: unload one before loading another"
            )
        if name in self.paths:
            raise AdapterError(f"adapter {name!r} is already loaded")
        weights = read_adapter(name, path, self.targets, self.rename, self.max_rank)
        self.paths[name] = str(path)
        self._keep(weights)
        return weights

    def remove(self, name: str) -> None:
        if name not in self.paths:
            raise AdapterError(f"adapter {name!r} is not loaded")
        if name in self.slot_names and self.pins[self.slot_names.index(name)]:
            raise AdapterError(f"adapter {name!r} is in use by running requests")
        del self.paths[name]
        self.host.pop(name, None)
        if name in self.slot_names:
            self.slot_names[self.slot_names.index(name)] = None

    def names(self) -> list[str]:
        return list(self.paths)

    def has(self, name: str) -> bool:
        return name in self.paths

    # -- slots ----------------------------------------------------------------------------------

    def acquire(self, name: str) -> int | None:
        """Pin adapter `name` in a slot (loading it into the least recently used free one if it
        has none); None when every slot is pinned by another adapter."""
        if name not in self.paths:
            raise AdapterError(f"adapter {name!r} is not loaded")
        if name in self.slot_names:
            slot = self.slot_names.index(name)
        else:
            slot = next((s for s in self.recency if not self.pins[s]), None)
            if slot is None:
                return None
            self._write(slot, self._weights(name))
            self.slot_names[slot] = name
            if self.on_write is not None:
                self.on_write(slot, name, self.paths[name])
        self.pins[slot] += 1
        self.recency.move_to_end(slot)
        return slot

    def install(self, slot: int, name: str, path: str) -> None:
        """A TP rank other than 0: write the slot rank 0 wrote (its own slice of the adapter)."""
        if self.paths.get(name) != path:  # new here, or another adapter under that name now
            self.host.pop(name, None)
        self.paths[name] = path
        self._write(slot, self._weights(name))
        self.slot_names[slot] = name

    def release(self, slot: int) -> None:
        if self.pins[slot] <= 0:
            raise ValueError(f"adapter slot {slot} released more often than acquired")
        self.pins[slot] -= 1

    def _weights(self, name: str) -> LoRAWeights:
        weights = self.host.get(name)
        if weights is None:
            weights = read_adapter(name, self.paths[name], self.targets, self.rename, self.max_rank)
            self._keep(weights)
        self.host.move_to_end(name)
        return weights

    def _keep(self, weights: LoRAWeights) -> None:
        self.host[weights.name] = weights
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)

    def _write(self, slot: int, weights: LoRAWeights) -> None:
        """Slot `slot` of every adapted projection and expert stack := this adapter's A and B
        (zeros where the adapter leaves one alone, and in the rank padding)."""
        for name, target in self.targets.items():
            target.write(slot, weights.weights.get(name))
