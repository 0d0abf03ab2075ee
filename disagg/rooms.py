"""Settings, fault injection, counters and compatibility facts shared by both worker roles."""

from __future__ import annotations

import bisect
import ipaddress
import os
import random
import time
from dataclasses import dataclass, field
from typing import Literal

from baton.engine.core.sampling_params import SamplingParams

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
    max_rooms_per_peer: int  # prefill side: rooms one decode worker may hold open at once
    # How the state's bytes move (both workers must agree): "zmq" pushes them as frames on the
    # control channel, "nixl" has the decode side READ them from the prefill side's pools
    # (disagg/nixl_transfer.py).
    transfer_backend: str


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultInjection:
    """Read from the environment so tests can prove the failure paths."""

    drop_probability: float
    delay_ms: int
    # nixl backend, decode side: posted READs are never seen to finish (a read stuck on the
    # wire), so that the deadline and peer-loss paths can be proven mid-read
    stall_reads: bool

    @classmethod
    def from_env(cls) -> FaultInjection:
        return cls(
            drop_probability=float(os.environ.get("BATON_FAULT_DROP_TRANSFER", "0") or 0),
            delay_ms=int(os.environ.get("BATON_FAULT_DELAY_TRANSFER_MS", "0") or 0),
            stall_reads=os.environ.get("BATON_FAULT_STALL_READS", "") not in ("", "0"),
        )

    def should_drop(self, rng: random.Random) -> bool:
        return self.drop_probability > 0 and rng.random() < self.drop_probability


# Upper bounds (seconds) of the transfer latency histogram's buckets; the last is +Inf.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKET_KEY = "disagg_transfer_latency_le_"  # + the bound, in the stats dict
# Per transfer backend, in the stats dict: key + backend ("disagg_backend_bytes_total:nixl")
BACKEND_KEYS = (
    "disagg_backend_bytes_total:",
    "disagg_backend_transfers_total:",
    "disagg_backend_transfer_seconds_sum:",
)


@dataclass
class TransferCounters:
    """Exported on /metrics by the server (`baton:disagg_*`)."""

    backend: str = "zmq"  # the worker's transfer backend: its counts are reported under it too
    bytes_total: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0
    kv_chunks: int = 0  # K/V page batches streamed ahead of the final state
    holds_expired: int = 0  # prefill side: sends a decode engine never read, given up on
    messages_refused: int = 0  # peer messages that did not parse or could not be used
    # Decode side: register -> installed. Prefill side: state ready (prefill done and decode
    # side registered) -> its last message handed to ZMQ.
    latency_sum_s: float = 0.0
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    # Time the bytes were on the wire: nixl, decode side, a READ's post to its completion (the
    # latency above adds the prefill and the waits on either side)
    transfer_seconds_sum: float = 0.0

    def observe_latency(self, seconds: float) -> None:
        self.latency_sum_s += seconds
        self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def as_dict(self, rooms_by_state: dict[str, int]) -> dict[str, float | int]:
        out: dict[str, float | int] = {
            "disagg_transfer_bytes_total": self.bytes_total,
            "disagg_transfers_ok_total": self.transfers_ok,
            "disagg_transfers_failed_total": self.transfers_failed,
            "disagg_kv_chunks_total": self.kv_chunks,
            "disagg_holds_expired_total": self.holds_expired,
            "disagg_messages_refused_total": self.messages_refused,
            "disagg_transfer_latency_sum": self.latency_sum_s,
        }
        for key, value in zip(
            BACKEND_KEYS, (self.bytes_total, self.transfers_ok, self.transfer_seconds_sum)
        ):
            out[f"{key}{self.backend}"] = value
        cumulative = 0
        for bound, count in zip((*LATENCY_BUCKETS, float("inf")), self.latency_counts):
            cumulative += count
            out[f"{LATENCY_BUCKET_KEY}{bound}"] = cumulative
        for state in ("bootstrapping", "waiting_for_input", "transferring"):
            out[f"disagg_rooms_{state}"] = rooms_by_state.get(state, 0)
        return out


@dataclass
class DecodeRoom:
    room: str
    request_id: str
    peer: str  # prefill transfer address
    registered: float
    state: RoomState = "waiting_for_input"
    slot_units: int = 0  # slot units installed ahead of the StateTransfer (SlotChunk)
    # (first-token state, prefill TP size, when it came) of a StateTransfer whose shards the
    # ranks still await
    sharded: tuple | None = None


@dataclass
class QueuedRoom:
    """A room whose pages and slot do not fit in the pools yet: it registers (oldest first) once
    they do, like a request waiting in a colocated engine's queue, or fails after the bootstrap
    timeout (the prefill side gives up on an unregistered room after the same time)."""

    room: str
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    peer: str  # prefill transfer address
    queued: float


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a port on this machine (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def now() -> float:
    return time.monotonic()
