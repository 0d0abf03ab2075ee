"""What a worker says of itself on `/disagg/info`: its role, where decode engines register
with it (prefill), and its prefix cache's geometry (what cache_aware matches prompts in)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["prefill", "decode"]


@dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    """A worker's `/disagg/info`."""

    role: Role
    transfer_addr: str | None  # prefill workers: where decode engines register
    page_size: int
    track_interval: int  # tokens between Mamba checkpoints of its prefix cache (0: none)

    @classmethod
    def from_json(cls, payload: dict) -> WorkerInfo:
        """Raises KeyError, TypeError or ValueError for an answer that is not a worker's."""
        role = payload["role"]
        if role not in ("prefill", "decode"):
            raise ValueError(f"role {role!r} is neither prefill nor decode")
        page_size, track_interval = int(payload["page_size"]), int(payload["track_interval"])
        if page_size < 1 or track_interval < 0 or track_interval % page_size:
            raise ValueError(
                f"track interval {track_interval} is not a multiple of page size {page_size}"
            )
        transfer_addr = payload.get("transfer_addr")
        return cls(
            role=role,
            transfer_addr=str(transfer_addr) if transfer_addr else None,
            page_size=page_size,
            track_interval=track_interval,
        )
