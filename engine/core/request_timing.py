"""Optional per-request timing inside the engine: what a request waited for, step by step.

Off by default (`EngineArgs.request_timing`, `baton serve --request-metrics`): a few clock reads
and dict lookups per request and step, and ~100 more numbers in every StepOutput's stats.
The definitions follow vLLM's `RequestStateStats` / `vllm:request_*_time_seconds`, so the two
servers' /metrics compare directly:

    add_request ──queue──> first scheduled ──prefill──> first token ──decode──> last token
                 (steps the engine ran meanwhile: queue_steps)

and, for the step that first scheduled the request, how many tokens it fed (`first_step_tokens`,
the request's own chunk included) and how many decode rows rode along (`first_step_decode_rows`).
Every step's token count is kept too (vLLM's `iteration_tokens_total`). Times are the engine's
own, from add_request, which the engine loop calls between steps: a request that reaches the
engine while a step runs has waited for that step before its queue time starts (vLLM reads its
input on a thread, so its queue time includes that wait), and the server path is in neither.
`queue_steps` 0 means the request ran in the very next step. A preempted request keeps its
first scheduling (vLLM does the same).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the server imports this module for the names; it never loads torch
    from baton.engine.executor.forward_metadata import ScheduledBatch

TIME_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.0, 10.0, 20.0)
COUNT_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

# histogram name -> its bucket upper bounds (the last bucket, +Inf, is implicit)
HISTOGRAMS: dict[str, tuple[float, ...]] = {
    "request_queue_time_seconds": TIME_BUCKETS_S,
    "request_prefill_time_seconds": TIME_BUCKETS_S,
    "request_decode_time_seconds": TIME_BUCKETS_S,
    "request_queue_steps": COUNT_BUCKETS,
    "request_first_step_tokens": COUNT_BUCKETS,
    "request_first_step_decode_rows": COUNT_BUCKETS,
    "iteration_tokens": COUNT_BUCKETS,
}
STATS_PREFIX = "timing:"  # stats keys: timing:<histogram>:le:<bound> | :sum | :count


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; +Inf last
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.total += value
        self.counts[bisect.bisect_left(self.bounds, value)] += 1


@dataclass
class _Times:
    added_s: float
    added_step: int
    first_scheduled_s: float | None = None
    first_token_s: float | None = None


class RequestTiming:
    """Fed by the engine at add_request, after schedule and per sampled token; read as a flat
    stats dict of cumulative Prometheus-style histograms."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.steps = 0
        self.histograms = {name: Histogram(bounds) for name, bounds in HISTOGRAMS.items()}
        self._times: dict[str, _Times] = {}

    def added(self, request_id: str) -> None:
        self._times[request_id] = _Times(added_s=self.clock(), added_step=self.steps)

    def scheduled(self, batch: ScheduledBatch) -> None:
        """Called once per step with the step's batch, before its forward."""
        now, h = self.clock(), self.histograms
        num_tokens = len(batch.input_ids)
        h["iteration_tokens"].observe(num_tokens)
        for request_id in batch.request_ids:
            times = self._times.get(request_id)
            if times is None or times.first_scheduled_s is not None:
                continue  # not added here (a disaggregated handover) or scheduled before
            times.first_scheduled_s = now
            h["request_queue_time_seconds"].observe(now - times.added_s)
            h["request_queue_steps"].observe(self.steps - times.added_step)
            h["request_first_step_tokens"].observe(num_tokens)
            h["request_first_step_decode_rows"].observe(batch.num_decode_seqs)
        self.steps += 1

    def sampled(self, request_id: str, finished: bool) -> None:
        times = self._times.get(request_id)
        if times is None:
            return
        now = self.clock()
        if times.first_token_s is None:
            times.first_token_s = now
            if times.first_scheduled_s is not None:
                self.histograms["request_prefill_time_seconds"].observe(
                    now - times.first_scheduled_s
                )
        if finished:
            self.histograms["request_decode_time_seconds"].observe(now - times.first_token_s)
            del self._times[request_id]

    def forget(self, request_id: str) -> None:
        """An aborted request: no decode time is recorded for it."""
        self._times.pop(request_id, None)

    def as_stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, hist in self.histograms.items():
            key = f"{STATS_PREFIX}{name}"
            cumulative = 0
            for bound, count in zip((*hist.bounds, float("inf")), hist.counts):
                cumulative += count
                out[f"{key}:le:{bound}"] = cumulative
            out[f"{key}:sum"] = hist.total
            out[f"{key}:count"] = cumulative
        return out
