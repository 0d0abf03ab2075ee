"""Settings, fault injection, counters and compatibility facts shared by both worker roles."""

from __future__ import annotations

import hashlib
import os
import random
import time
from dataclasses import dataclass
from typing import Literal

from disagg.protocol import Compat, dtype_name

Role = Literal["prefill", "decode"]
RoomState = Literal["bootstrapping", "waiting_for_input", "transferring", "success", "failed"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DisaggConfig:
    role: Role
    host: str  # where the prefill worker's transfer socket binds / is advertised
    port: int  # prefill worker's transfer port (0: pick a free one)
    secret: bytes | None  # HMAC key authenticating worker-to-worker messages
    bootstrap_timeout_s: float  # a room must be registered and prefilled within this
    transfer_timeout_s: float  # decode side: state must arrive within this after registering
    heartbeat_interval_s: float  # decode -> prefill heartbeats for pending rooms
    lease_timeout_s: (
        float  # no heartbeat (prefill side) / no ack (decode side) for this long: peer lost
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultInjection:
    """Read from the environment so tests can prove the failure paths."""

    drop_probability: float
    delay_ms: int

    @classmethod
    def from_env(cls) -> FaultInjection:
        return cls(
            drop_probability=float(os.environ.get("BATON_FAULT_DROP_TRANSFER", "0") or 0),
            delay_ms=int(os.environ.get("BATON_FAULT_DELAY_TRANSFER_MS", "0") or 0),
        )

    def should_drop(self, rng: random.Random) -> bool:
        return self.drop_probability > 0 and rng.random() < self.drop_probability


@dataclass
class TransferCounters:
    """Exported on /metrics by the server (`baton:disagg_*`)."""

    bytes_total: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0
    kv_chunks: int = 0  # K/V page batches streamed ahead of the final state
    latency_sum_s: float = 0.0  # register -> install, decode side
    latency_count: int = 0

    def observe_latency(self, seconds: float) -> None:
        self.latency_sum_s += seconds
        self.latency_count += 1

    def as_dict(self, rooms_by_state: dict[str, int]) -> dict[str, float | int]:
        out: dict[str, float | int] = {
            "disagg_transfer_bytes_total": self.bytes_total,
            "disagg_transfers_ok_total": self.transfers_ok,
            "disagg_transfers_failed_total": self.transfers_failed,
            "disagg_kv_chunks_total": self.kv_chunks,
            "disagg_transfer_latency_sum": self.latency_sum_s,
            "disagg_transfer_latency_count": self.latency_count,
        }
        for state in ("bootstrapping", "waiting_for_input", "transferring"):
            out[f"disagg_rooms_{state}"] = rooms_by_state.get(state, 0)
        return out


def now() -> float:
    return time.monotonic()


def compat_of(engine) -> Compat:
    """The facts both engines must share, read from a live Engine."""
    config, cache = engine.model_config, engine.cache
    k = cache.k[0] if cache.k else None
    return Compat(
        model=hashlib.sha256(repr(config).encode()).hexdigest()[:16],
        dtype=dtype_name(engine.dtype),
        page_size=cache.page_size,
        kv_page_shape=[
            len(cache.k),
            cache.page_size,
            *(list(k.shape[1:]) if k is not None else [0, 0]),
        ],
        conv_shape=[cache.conv.shape[0], *cache.conv.shape[2:]],
        ssm_shape=[cache.ssm.shape[0], *cache.ssm.shape[2:]],
        ssm_dtype=dtype_name(cache.ssm.dtype),
    )
