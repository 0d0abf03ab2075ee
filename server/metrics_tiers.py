"""/metrics for the tiers under the device pools (engine/cache/tiers.py): the engine's flat
`hicache:<tier>:<counter>` stats as `baton:hicache_<counter>{tier="host"|"file"}` counters."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily

from baton.engine.cache.tier_stats import STATS_PREFIX as TIER_STATS_PREFIX

# engine/cache/tier_stats.py counter -> help (metric baton:hicache_<counter>, label `tier`)
_TIER_HELP = {
    "hits": "Prefix blocks restored from a tier below the device pools.",
    "hit_bytes": "Bytes of prefix blocks restored from a tier.",
    "load_seconds": "Seconds spent reading, checking and installing tier hits (mean latency:"
    " this over hits).",
    "writes": "Evicted prefix blocks stored in a tier.",
    "written_bytes": "Bytes stored in a tier (files: with their headers).",
    "write_seconds": "Seconds spent storing blocks (files: on the writer thread; mean latency:"
    " this over writes).",
    "evictions": "Blocks a tier dropped to stay within its size bound.",
    "dropped": "Evicted blocks a tier did not store (its write queue was full, or the block"
    " exceeds the bound).",
    "write_errors": "Tier writes that failed (a full disk, an I/O error).",
    "corrupt": "Tier files found truncated or damaged: deleted, never loaded.",
    "foreign": "Tier files of another model, dtype or layout: ignored.",
}


def tier_families(stats: dict) -> Iterator:
    """The tiers under the pools (--enable-hierarchical-cache), per tier (host, file)."""
    if f"{TIER_STATS_PREFIX}lookups" not in stats:
        return
    yield CounterMetricFamily(
        "baton:hicache_lookups",
        "Admissions whose prefix went past the device cache and looked in the tiers.",
        value=float(stats[f"{TIER_STATS_PREFIX}lookups"]),
    )
    yield CounterMetricFamily(
        "baton:hicache_lookup_misses",
        "Tier lookups that found no block.",
        value=float(stats.get(f"{TIER_STATS_PREFIX}lookup_misses", 0)),
    )
    for counter, doc in _TIER_HELP.items():
        family = CounterMetricFamily(f"baton:hicache_{counter}", doc, labels=["tier"])
        for key, value in stats.items():
            tier, _, name = key.removeprefix(TIER_STATS_PREFIX).partition(":")
            if key.startswith(TIER_STATS_PREFIX) and name == counter:
                family.add_metric([tier], float(value))
        yield family
