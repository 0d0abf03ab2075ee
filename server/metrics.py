"""Prometheus metrics under the `baton:` prefix, in a registry of the server's own.

Latencies and request counts are measured here, in the server; gauges and token counters come
from the engine's latest `EngineStats` snapshot (a custom collector reads it at scrape time).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from baton.disagg.rooms import BACKEND_KEYS, LATENCY_BUCKET_KEY
from baton.engine.core.request_timing import HISTOGRAMS, STATS_PREFIX
from baton.server.metrics_tiers import tier_families

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)

# EngineStats field -> (metric name, help, kind)
_ENGINE_METRICS = {
    "num_running": ("baton:num_requests_running", "Requests in the running batch.", "gauge"),
    "num_waiting": ("baton:num_requests_waiting", "Requests waiting to be scheduled.", "gauge"),
    "kv_pages_used": ("baton:kv_pages_used", "KV cache pages in use.", "gauge"),
    "kv_pages_total": ("baton:kv_pages_total", "KV cache pages in the pool.", "gauge"),
    "mamba_slots_used": ("baton:mamba_slots_used", "Mamba state slots in use.", "gauge"),
    "mamba_slots_total": ("baton:mamba_slots_total", "Mamba state slots in the pool.", "gauge"),
    "num_preemptions": ("baton:num_preemptions", "Requests preempted so far.", "counter"),
    "prompt_tokens_total": ("baton:prompt_tokens", "Prompt tokens processed.", "counter"),
    "generation_tokens_total": ("baton:generation_tokens", "Tokens generated.", "counter"),
    "spec_decode_num_drafts": (
        "baton:spec_decode_num_drafts",
        "Speculative verify rows run (a request's last token and its drafts, verified at once).",
        "counter",
    ),
    "spec_decode_num_draft_tokens": (
        "baton:spec_decode_num_draft_tokens",
        "Draft tokens verified.",
        "counter",
    ),
    "spec_decode_num_accepted_tokens": (
        "baton:spec_decode_num_accepted_tokens",
        "Draft tokens accepted.",
        "counter",
    ),
    "prefix_cache_blocks": (
        "baton:prefix_cache_blocks",
        "Cached prefix blocks (KV + Mamba checkpoint).",
        "gauge",
    ),
    "prefix_cache_query_tokens": (
        "baton:prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        "counter",
    ),
    "prefix_cache_hit_tokens": (
        "baton:prefix_cache_hits",
        "Prompt tokens served from the prefix cache.",
        "counter",
    ),
    "prefix_cache_evictions": (
        "baton:prefix_cache_evictions",
        "Prefix cache blocks evicted.",
        "counter",
    ),
    "disagg_transfer_bytes_total": (
        "baton:disagg_transfer_bytes",
        "Bytes of KV + state handed over.",
        "counter",
    ),
    "disagg_transfers_ok_total": (
        "baton:disagg_transfers",
        "Completed prefill -> decode handovers.",
        "counter",
    ),
    "disagg_transfers_failed_total": (
        "baton:disagg_transfers_failed",
        "Failed handovers (timeouts, drops, aborts).",
        "counter",
    ),
    "disagg_kv_chunks_total": (
        "baton:disagg_kv_chunks",
        "K/V page batches streamed per prefill chunk.",
        "counter",
    ),
    "disagg_rooms_bootstrapping": (
        "baton:disagg_rooms_bootstrapping",
        "Rooms waiting for their peer.",
        "gauge",
    ),
    "disagg_rooms_waiting_for_input": (
        "baton:disagg_rooms_waiting_for_input",
        "Rooms registered, waiting for the prefill.",
        "gauge",
    ),
    "disagg_rooms_transferring": (
        "baton:disagg_rooms_transferring",
        "Rooms whose state is on the wire.",
        "gauge",
    ),
    "disagg_messages_refused_total": (
        "baton:disagg_messages_refused",
        "Worker-to-worker messages refused: unauthenticated, malformed, or unusable (each logged;"
        " the room it named, if any, failed).",
        "counter",
    ),
    "zmq_messages_refused_total": (
        "baton:zmq_messages_refused",
        "Messages refused on the worker's ZMQ sockets before any protocol read them (too many"
        " parts, not a message of the channel, unauthenticated shards at a rank's transfer"
        " port); logged at most every 10 s per socket.",
        "counter",
    ),
    "disagg_holds_expired_total": (
        "baton:disagg_holds_expired",
        "Prefill side: handovers whose sends the decode worker never read within its transfer"
        " timeout (their pages and slot were given back).",
        "counter",
    ),
}


# engine/core/request_timing.py histogram -> help (metric name: baton:<histogram>)
_REQUEST_TIMING_HELP = {
    "request_queue_time_seconds": "Engine: time from a request's arrival to its first step.",
    "request_prefill_time_seconds": "Engine: time from a request's first step to its first token.",
    "request_decode_time_seconds": "Engine: time from a request's first token to its last.",
    "request_queue_steps": "Engine: steps run between a request's arrival and its first step.",
    "request_first_step_tokens": "Engine: tokens of the step that first scheduled a request.",
    "request_first_step_decode_rows": "Engine: decode rows in the step that first scheduled a "
    "request.",
    "iteration_tokens": "Engine: tokens per step.",
}


def _request_timing_families(stats: dict[str, int | float]) -> Iterator:
    """The engine's request timing histograms, when it keeps them (--request-metrics)."""
    for name in HISTOGRAMS:
        key = f"{STATS_PREFIX}{name}"
        if f"{key}:count" not in stats:
            continue
        marker = f"{key}:le:"
        buckets = sorted(
            (float(k[len(marker) :]), count) for k, count in stats.items() if k.startswith(marker)
        )
        yield HistogramMetricFamily(
            f"baton:{name}",
            _REQUEST_TIMING_HELP[name],
            buckets=[("+Inf" if le == float("inf") else str(le), n) for le, n in buckets],
            sum_value=stats[f"{key}:sum"],
        )


# disagg/rooms.py's per-backend keys -> (metric name, help)
_BACKEND_METRICS = dict(
    zip(
        BACKEND_KEYS,
        (
            ("baton:disagg_backend_transfer_bytes", "Bytes of KV + state handed over, by backend."),
            ("baton:disagg_backend_transfers", "Completed handovers, by transfer backend."),
            (
                "baton:disagg_backend_transfer_seconds",
                "Seconds the handed-over bytes were on the wire, by backend (nixl, decode side:"
                " each READ from its post to its completion).",
            ),
        ),
    )
)


def _backend_families(stats: dict) -> Iterator:
    """A disaggregated worker's transfer counts labelled by its transfer backend (zmq, nixl)."""
    for key, (name, doc) in _BACKEND_METRICS.items():
        family = CounterMetricFamily(name, doc, labels=["backend"])
        for stat, value in stats.items():
            if stat.startswith(key):
                family.add_metric([stat[len(key) :]], float(value))
        yield family


def _spec_decode_families(stats: dict) -> Iterator:
    """Speculative decoding's accepted drafts per draft position (vLLM's metric, label
    `position`) and the mean acceptance length derived from the counters: tokens a verify row
    appended on average, 1 + accepted / drafts (0 before any)."""
    per_pos = CounterMetricFamily(
        "baton:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted at each draft position.",
        labels=["position"],
    )
    for position, count in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos", ())):
        per_pos.add_metric([str(position)], float(count))
    yield per_pos
    drafts = stats.get("spec_decode_num_drafts", 0)
    accepted = stats.get("spec_decode_num_accepted_tokens", 0)
    yield GaugeMetricFamily(
        "baton:spec_decode_mean_acceptance_length",
        "Tokens a speculative verify row appends on average: 1 + accepted drafts / verify rows.",
        value=1.0 + accepted / drafts if drafts else 0.0,
    )


class EngineStatsCollector(Collector):
    """Exposes the engine's last reported stats; usage ratios are derived from used/total."""

    def __init__(self, read_stats: Callable[[], dict[str, int | float]]) -> None:
        self.read_stats = read_stats

    def collect(self) -> Iterator:
        stats = self.read_stats()
        for field, (name, doc, kind) in _ENGINE_METRICS.items():
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(name, doc, value=float(stats.get(field, 0)))
        # A disaggregated worker's handover latencies, as cumulative counts per bucket bound.
        buckets = sorted(
            (float(key[len(LATENCY_BUCKET_KEY) :]), count)
            for key, count in stats.items()
            if key.startswith(LATENCY_BUCKET_KEY)
        )
        if buckets:
            yield HistogramMetricFamily(
                "baton:disagg_transfer_latency_seconds",
                "Handover latency: decode side from register to installed, prefill side from"
                " state ready to its last message queued.",
                buckets=[("+Inf" if le == float("inf") else str(le), n) for le, n in buckets],
                sum_value=stats.get("disagg_transfer_latency_sum", 0.0),
            )
        yield from _backend_families(stats)
        yield from _request_timing_families(stats)
        checkpoints = CounterMetricFamily(
            "baton:mamba_checkpoints",
            "Mamba state checkpoints written for the prefix cache, by the kind of step that"
            " wrote them.",
            labels=["step"],
        )
        for step in ("extend", "decode", "mixed"):
            checkpoints.add_metric([step], float(stats.get(f"mamba_checkpoints_{step}", 0)))
        yield checkpoints
        yield from _spec_decode_families(stats)
        yield from tier_families(stats)
        queried = stats.get("prefix_cache_query_tokens", 0)
        yield GaugeMetricFamily(
            "baton:prefix_cache_hit_rate",
            "Fraction of looked-up prompt tokens served from the prefix cache.",
            value=stats.get("prefix_cache_hit_tokens", 0) / queried if queried else 0.0,
        )
        for pool, used, total in (
            ("kv", "kv_pages_used", "kv_pages_total"),
            ("mamba", "mamba_slots_used", "mamba_slots_total"),
        ):
            capacity = stats.get(total, 0)
            usage = stats.get(used, 0) / capacity if capacity else 0.0
            yield GaugeMetricFamily(
                f"baton:{pool}_usage_ratio", f"Fraction of the {pool} pool in use.", value=usage
            )


class ServerMetrics:
    def __init__(self, read_engine_stats: Callable[[], dict[str, int | float]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(read_engine_stats))
        self.time_to_first_token = Histogram(
            "baton:time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "baton:inter_token_latency_seconds",
            "Time between consecutive outputs of one request, per token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "baton:e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "baton:requests",
            "HTTP generation requests by endpoint and status code.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.finished = Counter(
            "baton:request_success",
            "Engine requests (one per choice) that finished, by finish reason.",
            ["finish_reason"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
