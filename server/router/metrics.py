"""`/metrics` of the router: its answers, its workers' health, and per worker and policy the
requests it routed, cache-aware hits, retries and open circuits."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

ROLES = ("prefill", "decode")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "baton:router_requests",
            "Generation requests the router answered, by HTTP status of its answer.",
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
        self.worker_requests = Counter(
            "baton:router_worker_requests",
            "Requests (each try of one) sent to a worker, by role, worker and the policy that "
            "picked it.",
            ["role", "worker", "policy"],
            registry=self.registry,
        )
        self.worker_running = Gauge(
            "baton:router_worker_requests_running",
            "The router's requests in flight on a worker: the load its policies see.",
            ["role", "worker"],
            registry=self.registry,
        )
        self.cache_hits = Counter(
            "baton:router_cache_aware_hits",
            "Requests cache_aware sent to a worker that it believes holds a usable prefix "
            "(whole Mamba checkpoint blocks) of the prompt.",
            ["role", "worker"],
            registry=self.registry,
        )
        self.cache_hit_tokens = Counter(
            "baton:router_cache_aware_hit_tokens",
            "Prompt tokens cache_aware expected the chosen worker to reuse.",
            ["role", "worker"],
            registry=self.registry,
        )
        self.retries = Counter(
            "baton:router_retries",
            "Requests tried again on another pair after this worker failed them before any "
            "byte reached the client (refused, reset, 503, a failed handover).",
            ["role", "worker"],
            registry=self.registry,
        )
        self.circuit_open = Gauge(
            "baton:router_circuit_open",
            "1 while a worker's circuit is open or half-open (it failed requests in a row).",
            ["role", "worker"],
            registry=self.registry,
        )
        self.open_circuits = Gauge(
            "baton:router_open_circuits",
            "Workers whose circuit is open or half-open, by role.",
            ["role"],
            registry=self.registry,
        )
        for role in ROLES:
            self.healthy.labels(role=role).set(0)
            self.open_circuits.labels(role=role).set(0)
            for state in ("healthy", "unhealthy"):
                self.transitions.labels(role=role, state=state)

    def add_worker(self, role: str, url: str, policy: str) -> None:
        """Every per-worker series at zero from the start, so a rate over it is defined."""
        self.worker_requests.labels(role=role, worker=url, policy=policy)
        for metric in (self.worker_running, self.cache_hits, self.cache_hit_tokens, self.retries):
            metric.labels(role=role, worker=url)
        self.circuit_open.labels(role=role, worker=url).set(0)

    def remove_worker(self, role: str, url: str, policy: str) -> None:
        self.worker_requests.remove(role, url, policy)
        for metric in (
            self.worker_running,
            self.cache_hits,
            self.cache_hit_tokens,
            self.retries,
            self.circuit_open,
        ):
            metric.remove(role, url)

    def render(self) -> bytes:
        return generate_latest(self.registry)
