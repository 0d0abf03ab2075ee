"""The tier flags of `baton serve` (and `baton up`, for both workers): SGLang's HiCache names, with
vLLM's --kv-offloading-size accepted for --hicache-size (alone, it turns the tiers on, as in
vLLM). Checked by engine/cache/tier_config.py, the engine's own check."""

from __future__ import annotations

import argparse
from typing import Any

from baton.engine.cache.tier_config import DEFAULT_STORAGE_GIB, STORAGE_BACKENDS, tier_config

TIER_FIELDS = (
    "enable_hierarchical_cache",
    "hicache_size",
    "kv_offloading_size",
    "hicache_storage_backend",
    "hicache_storage_dir",
    "hicache_storage_size",
)


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    tiers = parser.add_argument_group(
        "tiers under the pools",
        "evicted prefix blocks (KV pages + state checkpoints) kept in host memory and/or files, "
        "found again by later requests and by a restarted server (README: Tiers)",
    )
    tiers.add_argument(
        "--enable-hierarchical-cache",
        action="store_true",
        help="keep evicted prefix blocks in the tiers below (needs --hicache-size and/or "
        "--hicache-storage-backend file)",
    )
    tiers.add_argument(
        "--hicache-size",
        type=float,
        metavar="GIB",
        help="host-memory tier: GiB of evicted blocks kept in this process's memory (LRU)",
    )
    tiers.add_argument(
        "--kv-offloading-size",
        type=float,
        metavar="GIB",
        help="vLLM's name for --hicache-size; alone, it turns the tiers on",
    )
    tiers.add_argument(
        "--hicache-storage-backend",
        choices=STORAGE_BACKENDS,
        help="storage tier: file (one checksummed file per block in --hicache-storage-dir)",
    )
    tiers.add_argument(
        "--hicache-storage-dir",
        metavar="DIR",
        help="the file tier's directory; servers of one model may share it, and a restarted "
        "server finds its files again",
    )
    tiers.add_argument(
        "--hicache-storage-size",
        type=float,
        metavar="GIB",
        help=f"GiB the file tier's directory may hold, for every server on it; the least "
        f"recently used files go first (default: {DEFAULT_STORAGE_GIB:g})",
    )


def resolved(values: dict[str, Any]) -> dict[str, Any]:
    """The EngineArgs tier settings from the flags' values (ValueError naming a bad flag)."""
    host = values["hicache_size"]
    offload = values["kv_offloading_size"]
    if offload is not None and host is not None and offload != host:
        raise ValueError(
            f"--kv-offloading-size {offload} and --hicache-size {host} disagree (one flag, two names)"
        )
    args = {
        "enable_hierarchical_cache": values["enable_hierarchical_cache"] or offload is not None,
        "hicache_size": host if host is not None else offload,
        "hicache_storage_backend": values["hicache_storage_backend"],
        "hicache_storage_dir": values["hicache_storage_dir"],
        "hicache_storage_size": values["hicache_storage_size"],
    }
    return args


def check(values: dict[str, Any], prefix_caching: bool, tensor_parallel_size: int) -> None:
    args = resolved(values)
    tier_config(
        enable=args["enable_hierarchical_cache"],
        host_gib=args["hicache_size"],
        backend=args["hicache_storage_backend"],
        storage_dir=args["hicache_storage_dir"],
        storage_gib=args["hicache_storage_size"],
        prefix_caching=prefix_caching,
        tensor_parallel_size=tensor_parallel_size,
    )


def worker_flags(values: dict[str, Any]) -> list[str]:
    """The flags again, for a worker `baton up` starts."""
    flags = []
    for name in TIER_FIELDS:
        value = values[name]
        if value is True:
            flags.append("--" + name.replace("_", "-"))
        elif value not in (None, False):
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags
