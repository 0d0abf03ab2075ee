"""Allocators for KV pages and Mamba slots, and how many of each the pools hold.

    PagePool  : pages 1..num_pages-1 are handed out; page 0 is the dummy page for padding.
    SlotPool  : Mamba slots 1..num_slots-1; slot 0 is the dummy slot padded rows write to.

Both expose alloc / free / available / used; after every request finishes or aborts, `used`
must be back to zero (tests assert it).
"""

from __future__ import annotations

from dataclasses import dataclass


class OutOfMemory(RuntimeError):
    """The pool cannot satisfy this allocation now (the scheduler preempts or waits)."""


class IndexPool:
    """A free list over indices 1..capacity (index 0 is reserved as the dummy)."""

    def __init__(self, capacity: int, what: str):
        self.what = what
        self.capacity = capacity
        self._free = list(range(capacity, 0, -1))  # pop() hands out low indices first
        self._in_use: set[int] = set()

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return len(self._in_use)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfMemory(f"{self.what}: need {n}, {len(self._free)} free of {self.capacity}")
        taken = [self._free.pop() for _ in range(n)]
        self._in_use.update(taken)
        return taken

    def free(self, indices: list[int]) -> None:
        for i in indices:
            if i not in self._in_use:
                raise RuntimeError(f"{self.what}: double free or foreign index {i}")
            self._in_use.remove(i)
        # Reversed onto the stack so that the next alloc pops them in their old order: a run of
        # consecutive pages comes back as a run (one slice to copy, one frame to send).
        self._free.extend(reversed(indices))


@dataclass(frozen=True, kw_only=True, slots=True)
class PoolSizes:
    num_pages: int  # including the dummy page 0
    page_size: int
    num_mamba_slots: int  # including the dummy slot 0


def size_pools(
    *,
    max_total_tokens: int,
    max_mamba_slots: int,
    page_size: int,
) -> PoolSizes:
    """Pool sizes from explicit token / slot budgets (the GPU memory-fraction path computes
    these budgets from free memory first, see Engine)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    usable_pages = max(1, max_total_tokens // page_size)
    return PoolSizes(
        num_pages=usable_pages + 1, page_size=page_size, num_mamba_slots=max_mamba_slots + 1
    )


# The pools' memory on the CPU when neither --kv-cache-memory-bytes nor explicit sizes say
# otherwise: vLLM's CPU backend keeps 4 GiB for its KV cache by default (VLLM_CPU_KVCACHE_SPACE).
# baton's CPU pools are committed as requests write them (engine/cache/pools.py), so this bounds
# what they may grow to (a full context budget, or a prefix cache that kept everything), not what
# a start costs.
DEFAULT_CPU_POOL_BYTES = 4 << 30


@dataclass(frozen=True, kw_only=True, slots=True)
class PoolBudget:
    tokens: int  # KV token slots (pages * page size)
    slots: int  # recurrent-state slots (without the dummy)


def budget_pools(
    *,
    token_bytes: int,
    slot_bytes: int,
    memory_bytes: int,
    max_running_requests: int,
    max_model_len: int,
    prefix_cache: bool,
    max_total_tokens: int | None,
    max_mamba_slots: int | None,
    slots_per_request: int,
    page_tables: int,
) -> PoolBudget:
    """The pools' sizes from the model's state spec (`token_bytes` of paged state per token,
    `slot_bytes` per slot, every layer) and the context budget, as vLLM and SGLang size theirs:

    slots   one per running request (--max-running-requests), at most half of `memory_bytes`;
    tokens  every running request at its full length (--max-model-len), twice over with a prefix
            cache (it keeps finished requests' pages for reuse), within what `memory_bytes`
            leaves after the slots.

    `slots_per_request`: 1, or 1 + k under speculative decoding (a speculating request keeps
    the state after each of its k drafts in a slot of its own). `page_tables`: 2 when windowed
    layers beside full ones keep a page table of their own (ModelStateSpec.page_tables): a
    token then takes a page slot in each table until its windowed page is released, and
    `token_bytes` is one page slot's (ModelStateSpec.bytes_per_page_token), so every count
    of tokens asked for is doubled.
    --max-total-tokens / --max-mamba-slots set either outright. A model without paged state
    (no attention) still counts tokens, in pages that hold nothing: the context budget."""
    slots = max_mamba_slots or max_running_requests * slots_per_request
    if max_mamba_slots is None and slot_bytes:
        slots = max(1, min(slots, memory_bytes // 2 // slot_bytes))
    if max_total_tokens is not None:
        return PoolBudget(tokens=max_total_tokens * page_tables, slots=slots)
    tokens = max_running_requests * max_model_len * (2 if prefix_cache else 1) * page_tables
    if token_bytes:
        tokens = min(tokens, max(0, memory_bytes - slots * slot_bytes) // token_bytes)
    return PoolBudget(tokens=max(1, tokens), slots=slots)
