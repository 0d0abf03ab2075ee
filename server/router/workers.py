"""The router's view of its workers: membership, health probes, load, circuits and the picks.

Probes have a client of their own (their own connections), so request traffic can never starve
them: a probe that waited behind a saturated request pool would time out and declare a healthy
worker dead (issue 22: above 50 requests in flight the shared pool starved every probe).

    probe every PROBE_INTERVAL_S ──> 200 ─────────────────────> healthy (failures reset)
                                 ├─> refused connection / 503 ─> unhealthy at once
                                 └─> timeout / other error ────> one failure; FAILURES_TO_REMOVE
                                                                 in a row -> unhealthy

A refused connection (the process is gone) or a `/health` that answers 503 (its engine is dead) is
proof; a slow answer is only a hint, so it takes FAILURES_TO_REMOVE of them in a row. A worker is put
back as soon as one probe passes and its `/disagg/info` (role, transfer address, page size, track
interval) is read. Request traffic that finds a worker's port refused also takes it out at once
(`WorkerSet.lost`), so a killed worker is out before the next probe.

Membership changes while serving (admin routes, Kubernetes discovery): a new worker is probed at
once and picked as soon as it is healthy; a removed one drains: no new requests, the ones in
flight finish, then it is dropped. Workers are named by their canonical URL (router/urls.py), so
one worker written two ways is one worker.

Every answer a probe reads is bounded (router/answers.py) and checked (router/info.py); nothing a
worker sends or fails to send ends the probe loop: what a probe cannot use is a failed probe,
and a round that fails for a reason nobody foresaw is logged and the next round runs. A worker
whose model is not the other workers' is refused; with cache_aware, a worker is usable once the
router has its model's tokenizer (router/model.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from baton.server.router.answers import HEALTH_BODY_BYTES, get
from baton.server.router.circuit import Circuit, CircuitSettings
from baton.server.router.info import ModelIdentity, Role, WorkerInfo, read_info
from baton.server.router.metrics import RouterMetrics
from baton.server.router.model import RouterTokenizer, model_conflict
from baton.server.router.policies import Policy
from baton.server.router.policies.base import Choice
from baton.server.tokenizer import Tokenizer

logger = logging.getLogger("baton.router")

PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 2.0
FAILURES_TO_REMOVE = 3
RETRY_AFTER_S = 1  # what a 429 tells the client to wait


@dataclass(eq=False)
class Worker:
    url: str
    role: Role
    circuit: Circuit
    healthy: bool = False
    info: WorkerInfo | None = None  # read once healthy; dropped when it goes away
    failed_probes: int = 0
    in_flight: int = 0  # the router's requests on it now
    draining: bool = False  # removed: no new requests; dropped once in_flight reaches 0
    refused: str | None = None  # why its last /disagg/info was not accepted (another model)

    @property
    def transfer_addr(self) -> str | None:
        return self.info.transfer_addr if self.info is not None else None

    @property
    def transfer_addr_token(self) -> str | None:
        return self.info.transfer_addr_token if self.info is not None else None

    @property
    def load(self) -> int:
        return self.in_flight

    @property
    def track_interval(self) -> int:
        return self.info.track_interval if self.info is not None else 0

    @property
    def usable(self) -> bool:
        """Healthy, known, not draining, and (a prefill worker) with a transfer address."""
        return (
            self.healthy
            and self.info is not None
            and not self.draining
            and (self.role == "decode" or self.transfer_addr is not None)
        )


@dataclass
class WorkerSet:
    """The workers, their probes, the policies that pick them, and the admission limit."""

    max_concurrent_requests: int
    probe_client: httpx.AsyncClient  # never used for request traffic
    policies: dict[str, Policy]  # role -> its policy
    circuit: CircuitSettings
    tokenizer_override: Tokenizer | None = None  # --tokenizer, when some policy reads tokens
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    prefill: list[Worker] = field(default_factory=list)
    decode: list[Worker] = field(default_factory=list)
    running: int = 0

    def __post_init__(self) -> None:
        self.tokenizer = RouterTokenizer(self.needs_tokens, self.tokenizer_override)

    # -- membership --------------------------------------------------------------------------

    def find(self, url: str) -> Worker | None:
        return next((w for w in self.prefill + self.decode if w.url == url), None)

    def add(self, url: str, role: Role) -> Worker:
        """A worker to route to once a probe finds it healthy (at once if it is: `probe` it).
        `url` is canonical (router/urls.py)."""
        worker = self.find(url)
        if worker is not None and worker.role == role:
            worker.draining = False  # added back while it drained: keep it
            return worker
        if worker is not None:
            raise ValueError(f"{url} is already a {worker.role} worker")
        worker = Worker(url=url, role=role, circuit=Circuit(self.circuit))
        self._of_role(role).append(worker)
        self.metrics.add_worker(role, url, self.policies[role].name)
        logger.info("%s worker %s added", role, url)
        return worker

    def remove(self, url: str) -> Worker | None:
        """Drain the worker: no new requests; dropped once its requests in flight finish."""
        worker = self.find(url)
        if worker is None:
            return None
        worker.draining = True
        logger.info("%s worker %s drains (%d in flight)", worker.role, url, worker.in_flight)
        self._drop_if_drained(worker)
        self._count_healthy(worker.role)
        return worker

    def _drop_if_drained(self, worker: Worker) -> None:
        if worker.draining and worker.in_flight == 0 and worker in self._of_role(worker.role):
            self._of_role(worker.role).remove(worker)
            self.policies[worker.role].forget(worker)
            self.metrics.remove_worker(worker.role, worker.url, self.policies[worker.role].name)
            logger.info("%s worker %s removed", worker.role, worker.url)

    # -- picks -------------------------------------------------------------------------------

    def usable(self, role: Role) -> list[Worker]:
        return [w for w in self._of_role(role) if w.usable]

    @property
    def needs_tokens(self) -> bool:
        return any(policy.needs_tokens for policy in self.policies.values())

    def pick_pair(
        self, prompt: Sequence[int] | None, avoid: frozenset[str] = frozenset()
    ) -> tuple[Worker, Worker] | None:
        """A prefill and a decode worker for a request, each by its role's policy, among the
        usable workers whose circuit lets a request through and that have not failed this one
        (`avoid`); failing that, among those whose circuit is closed, then all usable ones: a
        circuit or a failure moves a request elsewhere, never refuses one a worker might serve."""
        prefill = self._pick("prefill", prompt, avoid)
        decode = self._pick("decode", prompt, avoid)
        if prefill is None or decode is None:
            return None
        return prefill, decode

    def _pick(self, role: Role, prompt: Sequence[int] | None, avoid: frozenset[str]):
        usable = self.usable(role)
        closed = [w for w in usable if w.circuit.allows()]
        fresh = [w for w in closed if w.url not in avoid]
        candidates = fresh or closed or [w for w in usable if w.url not in avoid] or usable
        if not candidates:
            return None
        policy = self.policies[role]
        choice: Choice = policy.pick(candidates, prompt)
        worker = choice.worker
        assert isinstance(worker, Worker)
        self.metrics.worker_requests.labels(role=role, worker=worker.url, policy=policy.name).inc()
        if choice.cached_tokens:
            self.metrics.cache_hits.labels(role=role, worker=worker.url).inc()
            self.metrics.cache_hit_tokens.labels(role=role, worker=worker.url).inc(
                choice.cached_tokens
            )
        return worker

    def least_loaded_decode(self) -> Worker | None:
        """For requests about the model (/v1/models, /tokenize): nothing is generated."""
        return min(self.usable("decode"), key=lambda w: w.load, default=None)

    @property
    def ready(self) -> bool:
        return any(w.usable for w in self.prefill) and any(w.usable for w in self.decode)

    # -- load and circuits --------------------------------------------------------------------

    def begin(self, worker: Worker) -> None:
        worker.in_flight += 1
        worker.circuit.started()
        self.metrics.worker_running.labels(role=worker.role, worker=worker.url).set(
            worker.in_flight
        )

    def end(self, worker: Worker) -> None:
        worker.in_flight -= 1
        worker.circuit.ended()
        if worker in self._of_role(worker.role):
            self.metrics.worker_running.labels(role=worker.role, worker=worker.url).set(
                worker.in_flight
            )
        self._drop_if_drained(worker)

    def succeeded(self, worker: Worker) -> None:
        if worker.circuit.opened_at is not None:
            logger.info("%s worker %s: circuit closed", worker.role, worker.url)
        worker.circuit.succeeded()
        self._count_circuits(worker)

    def failed(self, worker: Worker, reason: str) -> None:
        """The worker failed a request (its fault, not the client's): count it on its circuit."""
        if worker.circuit.failed():
            logger.warning(
                "%s worker %s: circuit open for %.0f s after %d failures in a row (last: %s)",
                worker.role,
                worker.url,
                worker.circuit.settings.open_s,
                worker.circuit.failures,
                reason,
            )
        self._count_circuits(worker)

    def retried(self, worker: Worker) -> None:
        """A request the worker failed is tried again elsewhere."""
        if worker in self._of_role(worker.role):
            self.metrics.retries.labels(role=worker.role, worker=worker.url).inc()

    def _count_circuits(self, worker: Worker) -> None:
        if worker not in self._of_role(worker.role):
            return
        is_open = worker.circuit.opened_at is not None
        self.metrics.circuit_open.labels(role=worker.role, worker=worker.url).set(int(is_open))
        self.metrics.open_circuits.labels(role=worker.role).set(
            sum(w.circuit.opened_at is not None for w in self._of_role(worker.role))
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
        elif worker.info is not None:
            # a restarted worker may listen elsewhere, and has an empty cache
            worker.info = None
            self.policies[worker.role].forget(worker)
        if healthy != worker.healthy:
            worker.healthy = healthy
            state = "healthy" if healthy else "unhealthy"
            self.metrics.transitions.labels(role=worker.role, state=state).inc()
            self._count_healthy(worker.role)
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
            health = await get(
                self.probe_client, f"{worker.url}/health", HEALTH_BODY_BYTES, "/health"
            )
            if health.status != 200:
                self.set_health(worker, False, f"/health answered {health.status}")
                return
            if worker.info is None:
                info = await read_info(self.probe_client, worker.url)
                if info.role != worker.role:
                    self.set_health(worker, False, f"/disagg/info says it is a {info.role} worker")
                    return
                if not self._accept_model(worker, info):
                    return
                worker.info = info
            model = worker.info.model
            if not self.tokenizer.has(model):
                # out of rotation until the router can match its prompts: waited for a probe's
                # time here, then the next probe looks again (and tries again if this failed)
                learning = self.tokenizer.learn(worker.url, model, self.probe_client)
                await asyncio.wait({learning}, timeout=PROBE_TIMEOUT_S)
                if not self.tokenizer.has(model) or worker.info is None:
                    return
        except httpx.ConnectError as error:
            self.set_health(worker, False, f"connection refused: {describe(error)}")
            return
        except Exception as error:  # an answer it cannot use (BadAnswer, WorkerInfo's refusals)
            if not isinstance(error, (httpx.HTTPError, ValueError)):  # nobody foresaw it
                logger.exception("probing %s worker %s failed", worker.role, worker.url)
            worker.failed_probes += 1
            if worker.failed_probes >= FAILURES_TO_REMOVE:
                self.set_health(
                    worker, False, f"{worker.failed_probes} failed probes, last: {describe(error)}"
                )
            return
        self.set_health(worker, True)

    def _accept_model(self, worker: Worker, info: WorkerInfo) -> bool:
        """Whether the worker serves the model of the router's other workers; a refusal is
        logged once and shown in GET /workers."""
        refusal = self.model_refusal(worker.url, info.model)
        if refusal is not None and refusal != worker.refused:
            logger.warning("%s worker refused: %s", worker.role, refusal)
        worker.refused = refusal
        if refusal is not None:
            self.set_health(worker, False, "another model")
        return refusal is None

    def model_refusal(self, url: str, model: ModelIdentity) -> str | None:
        """Why the worker at `url` cannot serve `model` beside the router's other workers (those
        not draining whose /disagg/info was read), or None."""
        others = [
            (other.url, other.info.model)
            for other in self.prefill + self.decode
            if other.url != url and other.info is not None and not other.draining
        ]
        return model_conflict(url, model, others)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in self.prefill + self.decode))

    async def probe_forever(self) -> None:
        """Probe every worker each PROBE_INTERVAL_S, for as long as the router runs: a round
        that fails for a reason `probe` did not foresee is logged, and the next one runs."""
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            try:
                await self.probe_all()
            except Exception:
                logger.exception("a round of health probes failed; probing goes on")

    def _count_healthy(self, role: Role) -> None:
        self.metrics.healthy.labels(role=role).set(
            sum(w.healthy and not w.draining for w in self._of_role(role))
        )

    def _of_role(self, role: str) -> list[Worker]:
        return self.prefill if role == "prefill" else self.decode


def describe(error: BaseException) -> str:
    """An exception as a person reads it: its text, or its type where the text is empty
    (httpx's timeouts and resets often carry none)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
