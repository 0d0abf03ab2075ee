"""The router's view of its workers: health probes, admission, and the router's own metrics.

Probes have a client of their own (their own connections), so request traffic can never starve
them: a probe that waited behind a saturated request pool would time out and declare a healthy
worker dead (issue 22: above 50 requests in flight the shared pool starved every probe).

    probe every PROBE_INTERVAL_S ──> 200 ─────────────────────> healthy (failures reset)
                                 ├─> refused connection / 503 ─> unhealthy at once
                                 └─> timeout / other error ────> one failure; FAILURES_TO_REMOVE
                                                                 in a row -> unhealthy

A refused connection (the process is gone) or a `/health` that answers 503 (its engine is dead) is
proof; a slow answer is only a hint, so it takes FAILURES_TO_REMOVE of them in a row. A worker is put
back as soon as one probe passes. Request traffic that finds a worker's port refused also takes it
out at once (`WorkerSet.lost`), so a killed worker is out before the next probe.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import Literal

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

logger = logging.getLogger("baton.router")

PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 2.0
FAILURES_TO_REMOVE = 3
RETRY_AFTER_S = 1  # what a 429 tells the client to wait


@dataclass
class Worker:
    url: str
    role: Literal["prefill", "decode"]
    healthy: bool = False
    transfer_addr: str | None = None  # prefill workers only, learnt from /disagg/info
    failed_probes: int = 0


class RouterMetrics:
    """`/metrics` of the router: requests by status, in flight, and worker health transitions."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "baton:router_requests",
            "Requests the router answered (every route but /health, /ping and /metrics), by"
            " HTTP status of its answer.",
            ["status"],
            registry=self.registry,
        )
        self.running = Gauge(
            "baton:router_requests_running",
            "Generation requests in flight through the router.",
            registry=self.registry,
        )
        self.transitions = Counter(
            "baton:router_worker_transitions",
            "Worker health changes seen by the router, by role and new state.",
            ["role", "state"],
            registry=self.registry,
        )
        self.healthy = Gauge(
            "baton:router_healthy_workers",
            "Workers the router currently sends requests to, by role.",
            ["role"],
            registry=self.registry,
        )
        for role in ("prefill", "decode"):
            self.healthy.labels(role=role).set(0)
            for state in ("healthy", "unhealthy"):
                self.transitions.labels(role=role, state=state)

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class WorkerSet:
    """The workers, their probes, and the admission limit on requests in flight."""

    prefill: list[Worker]
    decode: list[Worker]
    max_concurrent_requests: int
    probe_client: httpx.AsyncClient  # never used for request traffic
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    running: int = 0
    _turn: itertools.count = field(default_factory=itertools.count)

    def pick(self) -> tuple[Worker, Worker] | None:
        prefill = [w for w in self.prefill if w.healthy and w.transfer_addr]
        decode = [w for w in self.decode if w.healthy]
        if not prefill or not decode:
            return None
        turn = next(self._turn)
        return prefill[turn % len(prefill)], decode[turn % len(decode)]

    @property
    def ready(self) -> bool:
        return any(w.healthy and w.transfer_addr for w in self.prefill) and any(
            w.healthy for w in self.decode
        )

    # -- admission ---------------------------------------------------------------------------

    def try_admit(self) -> bool:
        """Take one of the `max_concurrent_requests` places, or False when all are taken."""
        if self.running >= self.max_concurrent_requests:
            return False
        self.running += 1
        self.metrics.running.set(self.running)
        return True

    def release(self) -> None:
        self.running -= 1
        self.metrics.running.set(self.running)

    # -- health ------------------------------------------------------------------------------

    def set_health(self, worker: Worker, healthy: bool, reason: str = "") -> None:
        if healthy:
            worker.failed_probes = 0
        else:
            worker.transfer_addr = None  # a restarted prefill worker may listen elsewhere
        if healthy != worker.healthy:
            worker.healthy = healthy
            state = "healthy" if healthy else "unhealthy"
            self.metrics.transitions.labels(role=worker.role, state=state).inc()
            self.metrics.healthy.labels(role=worker.role).set(
                sum(w.healthy for w in self._of_role(worker.role))
            )
            logger.info(
                "%s worker %s is %s%s",
                worker.role,
                worker.url,
                state,
                f" ({reason})" * bool(reason),
            )

    def lost(self, worker: Worker, error: Exception) -> None:
        """Request traffic found the worker gone (refused or dropped connection): out at once."""
        self.set_health(worker, False, f"request traffic: {describe(error)}")

    async def probe(self, worker: Worker) -> None:
        try:
            response = await self.probe_client.get(f"{worker.url}/health")
            if response.status_code != 200:
                self.set_health(worker, False, f"/health answered {response.status_code}")
                return
            if worker.role == "prefill" and worker.transfer_addr is None:
                info = await self.probe_client.get(f"{worker.url}/disagg/info")
                worker.transfer_addr = str(info.json()["transfer_addr"])
        except httpx.ConnectError as error:
            self.set_health(worker, False, f"connection refused: {describe(error)}")
            return
        except (httpx.HTTPError, KeyError, ValueError, TypeError) as error:
            worker.failed_probes += 1
            if worker.failed_probes >= FAILURES_TO_REMOVE:
                self.set_health(
                    worker, False, f"{worker.failed_probes} failed probes, last: {describe(error)}"
                )
            return
        self.set_health(worker, True)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in self.prefill + self.decode))

    async def probe_forever(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            await self.probe_all()

    def _of_role(self, role: str) -> list[Worker]:
        return self.prefill if role == "prefill" else self.decode


def describe(error: BaseException) -> str:
    """An exception as a person reads it: its text, or its type where the text is empty
    (httpx's timeouts and resets often carry none)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
