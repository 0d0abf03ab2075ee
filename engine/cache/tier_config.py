"""The tier flags (SGLang's names; vLLM's --kv-offloading-size is --hicache-size) and their checks,
shared by EngineArgs, the offline LLM and the CLI so that every entry point refuses the same
things with the same words."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
DEFAULT_STORAGE_GIB = 10.0  # --hicache-storage-size when a directory is given without one
STORAGE_BACKENDS = ("file",)


@dataclass(frozen=True, kw_only=True, slots=True)
class TierConfig:
    host_bytes: int | None  # the host-memory tier's bound; None: no host tier
    storage_dir: str | None  # the file tier's directory; None: no file tier
    storage_bytes: int  # the file tier's bound


def tier_config(
    *,
    enable: bool,
    host_gib: float | None,
    backend: str | None,
    storage_dir: str | None,
    storage_gib: float | None,
    prefix_caching: bool,
    tensor_parallel_size: int,
) -> TierConfig | None:
    """What the flags ask for (None: no tiers), or ValueError naming the flag at fault."""
    for flag, value in (("--hicache-size", host_gib), ("--hicache-storage-size", storage_gib)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be > 0 (GiB, fractions allowed), got {value}")
    if backend is not None and backend not in STORAGE_BACKENDS:
        raise ValueError(
            f"--hicache-storage-backend must be one of {', '.join(STORAGE_BACKENDS)}, got {backend!r}"
        )
    if not enable:
        given = [
            flag
            for flag, value in (
                ("--hicache-size", host_gib),
                ("--hicache-storage-backend", backend),
                ("--hicache-storage-dir", storage_dir),
                ("--hicache-storage-size", storage_gib),
            )
            if value is not None
        ]
        if given:
            raise ValueError(f"{given[0]} needs --enable-hierarchical-cache")
        return None
    if backend is not None and not storage_dir:
        raise ValueError("--hicache-storage-backend file needs --hicache-storage-dir DIR")
    if storage_dir and backend is None:
        raise ValueError("--hicache-storage-dir needs --hicache-storage-backend file")
    if storage_gib is not None and backend is None:
        raise ValueError("--hicache-storage-size needs --hicache-storage-backend file")
    if host_gib is None and backend is None:
        raise ValueError(
            "--enable-hierarchical-cache needs a tier: --hicache-size GiB (host memory) and/or "
            "--hicache-storage-backend file --hicache-storage-dir DIR"
        )
    if not prefix_caching:
        raise ValueError(
            "--enable-hierarchical-cache needs prefix caching (drop --no-prefix-cache)"
        )
    if tensor_parallel_size > 1:
        raise ValueError(
            "--enable-hierarchical-cache is not supported with --tensor-parallel-size > 1 yet "
            "(each rank would store its own shard of every block)"
        )
    return TierConfig(
        host_bytes=int(host_gib * GIB) if host_gib is not None else None,
        storage_dir=storage_dir,
        storage_bytes=int((storage_gib or DEFAULT_STORAGE_GIB) * GIB),
    )
