"""Counters of one tier below the device pools, flattened into the engine's stats for /metrics
(server/metrics.py turns `hicache:<tier>:<counter>` into `baton:hicache_<counter>{tier=...}`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

STATS_PREFIX = "hicache:"


@dataclass
class TierCounters:
    hits: int = 0  # blocks restored from this tier
    hit_bytes: int = 0
    load_seconds: float = 0.0  # reading, checking and installing the hits
    writes: int = 0  # blocks stored in this tier
    written_bytes: int = 0
    write_seconds: float = 0.0  # snapshot to stored (the file tier: on its writer thread)
    evictions: int = 0  # blocks this tier dropped for its size bound
    dropped: int = 0  # snapshots not stored: the write queue was full, or one is over the bound
    write_errors: int = 0  # writes that failed (a full disk, an I/O error)
    corrupt: int = 0  # files found truncated or damaged: deleted, never loaded
    foreign: int = 0  # files of another model or layout: ignored
    # the file tier counts from three threads (the step's, its reader's and its writer's)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **amounts: int | float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def flat(self, tier: str) -> dict[str, int | float]:
        with self._lock:
            values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}
        return {f"{STATS_PREFIX}{tier}:{name}": value for name, value in values.items()}
