"""Compiled grammars kept for specs that come again, bounded by the memory they hold.

xgrammar's own compiler cache does not bound memory: its limit counts less than what a cached
grammar holds, so over many distinct schemas the process grows far past it (measured: a 16 MB
limit, 430 MB of growth before it levels; 256 MB, still rising past 1 GB) and clearing it
gives little back. baton compiles without xgrammar's cache and keeps this one instead: least
recently used first out, each grammar accounted as xgrammar's `memory_size_bytes` times
MEMORY_OVERHEAD (what the process grows by per grammar held, measured: 1.3 to 1.4 times the
reported size), so the process grows by no more than the limit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar as xgr

MEMORY_OVERHEAD = 1.5


class CompiledCache:
    """Used from one thread (the engine's compile thread)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._grammars: OrderedDict[Hashable, tuple[xgr.CompiledGrammar, int]] = OrderedDict()
        self.held_bytes = 0  # accounted, as MEMORY_OVERHEAD times the reported sizes

    def get(
        self, key: Hashable, compile_grammar: Callable[[], xgr.CompiledGrammar]
    ) -> xgr.CompiledGrammar:
        """The grammar for `key`, compiled by `compile_grammar` when it is not held; one larger
        than the limit is returned and not kept."""
        held = self._grammars.get(key)
        if held is not None:
            self._grammars.move_to_end(key)
            return held[0]
        compiled = compile_grammar()
        size = int(compiled.memory_size_bytes * MEMORY_OVERHEAD)
        if size <= self.limit_bytes:
            self._grammars[key] = (compiled, size)
            self.held_bytes += size
            while self.held_bytes > self.limit_bytes:
                _, (_, evicted) = self._grammars.popitem(last=False)
                self.held_bytes -= evicted
        return compiled

    def __len__(self) -> int:
        return len(self._grammars)

    def clear(self) -> None:
        self._grammars.clear()
        self.held_bytes = 0
