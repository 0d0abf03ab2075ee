"""Allocators for KV pages and Mamba slots, and the coordinator that sizes and composes them.

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
