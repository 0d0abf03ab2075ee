"""`baton bench serve` metrics: what one streamed request recorded, and the run's summary.

The definitions follow `vllm bench serve` (vllm/benchmarks/serve.py, `calculate_metrics`) and
SGLang's `bench_serving`, so figures are comparable with theirs:

* TTFT: from sending the request to the first streamed chunk that carries a choice.
* ITL: the gap between consecutive choice chunks, pooled over all requests (a chunk that holds
  several tokens is one gap, as in vLLM).
* TPOT: per request, (e2e latency - TTFT) / (output tokens - 1), for requests with more than
  one output token; then averaged over requests.
* E2EL: from sending the request to the end of its stream.
* Output tokens: the server's `usage.completion_tokens` (requested with
  `stream_options.include_usage`); a server that sends no usage falls back to the number of
  choice chunks.
* Goodput: completed requests that meet every given SLO (TTFT, TPOT, E2EL, in ms), per second.
* Throughputs divide by the run's duration (first send to last end); failed requests count in
  `failed` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True, kw_only=True, slots=True)
class RequestRecord:
    """What the client saw of one request; times in seconds from its own send."""

    success: bool
    error: str  # "" on success
    prompt_tokens: int  # the server's usage.prompt_tokens (the requested length if absent)
    output_tokens: int
    ttft: float  # 0.0 when no chunk arrived
    itl: tuple[float, ...]  # gaps between consecutive choice chunks
    latency: float  # e2e
    retried: bool  # sent again on a fresh connection: the first one failed before any answer

    @property
    def tpot(self) -> float:
        if self.output_tokens <= 1:
            return 0.0
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentile_label(p: float) -> str:
    """`p99`, `p99.9`: the key vLLM writes for a percentile."""
    return f"p{int(p) if float(p).is_integer() else p}"


def parse_percentiles(text: str) -> tuple[float, ...]:
    """`--metric-percentiles 50,90,99` -> (50.0, 90.0, 99.0); ValueError names a bad one."""
    values = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"--metric-percentiles: {item!r} is not a number") from None
        if not 0 < value < 100:
            raise ValueError(f"--metric-percentiles: {item!r} is not in (0, 100)")
        values.append(value)
    return tuple(values)


def _stats(name: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    """mean / median / std and the given percentiles of `values_s`, in milliseconds (0 when
    empty)."""
    values = np.asarray(values_s, dtype=np.float64) * 1000.0 if values_s else np.zeros(1)
    out = {
        f"mean_{name}_ms": float(values.mean()),
        f"median_{name}_ms": float(np.median(values)),
        f"std_{name}_ms": float(values.std()),
    }
    for p in percentiles:
        out[f"{percentile_label(p)}_{name}_ms"] = float(np.percentile(values, p))
    return out


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.latency}
    return all(values[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    slos_ms: dict[str, float],
    percentiles: tuple[float, ...] = PERCENTILES,
) -> dict[str, float | int]:
    """The run's summary (vLLM's key names). `slos_ms` maps ttft / tpot / e2el to a limit."""
    unknown = set(slos_ms) - set(SLO_METRICS)
    if unknown:
        raise ValueError(f"unknown SLO metric(s) {sorted(unknown)}; use {list(SLO_METRICS)}")
    done = [r for r in records if r.success]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    summary: dict[str, float | int] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(records) - len(done),
        "retried": sum(r.retried for r in records),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }
    if slos_ms:
        good = sum(meets_slos(r, slos_ms) for r in done)
        summary["request_goodput"] = good / duration_s
    summary.update(_stats("ttft", [r.ttft for r in done], percentiles))
    summary.update(_stats("tpot", [r.tpot for r in done if r.output_tokens > 1], percentiles))
    summary.update(_stats("itl", [gap for r in done for gap in r.itl], percentiles))
    summary.update(_stats("e2el", [r.latency for r in done], percentiles))
    summary["percentiles"] = list(percentiles)
    return summary


def format_summary(
    summary: dict[str, float | int], metrics: tuple[str, ...] = LATENCY_METRICS
) -> str:
    """The human-readable table, laid out like vLLM's, with the latency sections `metrics`."""
    lines = [
        "{:=^60}".format(" Serving Benchmark Result "),
        f"{'Successful requests:':<40}{summary['completed']:>20}",
        f"{'Failed requests:':<40}{summary['failed']:>20}",
        f"{'Retried on a fresh connection:':<40}{summary.get('retried', 0):>20}",
        f"{'Benchmark duration (s):':<40}{summary['duration']:>20.2f}",
        f"{'Total input tokens:':<40}{summary['total_input_tokens']:>20}",
        f"{'Total generated tokens:':<40}{summary['total_output_tokens']:>20}",
        f"{'Request throughput (req/s):':<40}{summary['request_throughput']:>20.2f}",
    ]
    if "request_goodput" in summary:
        lines.append(f"{'Request goodput (req/s):':<40}{summary['request_goodput']:>20.2f}")
    lines += [
        f"{'Output token throughput (tok/s):':<40}{summary['output_throughput']:>20.2f}",
        f"{'Total token throughput (tok/s):':<40}{summary['total_token_throughput']:>20.2f}",
    ]
    titles = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for name, title in titles.items():
        if name not in metrics:
            continue
        lines.append(f"{title:-^60}")
        upper = name.upper()
        lines.append(f"{f'Mean {upper} (ms):':<40}{summary[f'mean_{name}_ms']:>20.2f}")
        lines.append(f"{f'Median {upper} (ms):':<40}{summary[f'median_{name}_ms']:>20.2f}")
        for p in summary.get("percentiles", PERCENTILES):
            label = percentile_label(p)
            value = summary[f"{label}_{name}_ms"]
            lines.append(f"{f'{label.upper()} {upper} (ms):':<40}{value:>20.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)


# What the engine saw, from the server's /metrics: ours -> (baton's histogram, vLLM's or None).
# baton exposes these with `--request-metrics`; vLLM's V1 server always does (same definitions:
# queue = arrival in the engine -> first scheduled, prefill = -> first token, decode = -> last).
ENGINE_HISTOGRAMS: dict[str, tuple[str, str | None]] = {
    "queue_time_ms": ("baton:request_queue_time_seconds", "vllm:request_queue_time_seconds"),
    "prefill_time_ms": ("baton:request_prefill_time_seconds", "vllm:request_prefill_time_seconds"),
    "decode_time_ms": ("baton:request_decode_time_seconds", "vllm:request_decode_time_seconds"),
    "step_tokens": ("baton:iteration_tokens", "vllm:iteration_tokens_total"),
    "queue_steps": ("baton:request_queue_steps", None),
    "first_step_tokens": ("baton:request_first_step_tokens", None),
    "first_step_decode_rows": ("baton:request_first_step_decode_rows", None),
}


def histogram_totals(page: str) -> dict[str, tuple[float, float]]:
    """histogram name -> (count, sum) over all its label sets, from a Prometheus text page."""
    totals: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(page):
        if family.type != "histogram":
            continue
        for sample in family.samples:
            for suffix, index in (("_count", 0), ("_sum", 1)):
                if sample.name.endswith(suffix):
                    base = sample.name[: -len(suffix)]
                    totals.setdefault(base, [0.0, 0.0])[index] += sample.value
    return {name: (count, total) for name, (count, total) in totals.items()}


def engine_means(before: str, after: str) -> dict[str, float]:
    """Mean of each ENGINE_HISTOGRAMS entry over what was observed between two scrapes of
    /metrics (times in ms); entries the server does not expose are left out."""
    first, last = histogram_totals(before), histogram_totals(after)
    means = {}
    for key, names in ENGINE_HISTOGRAMS.items():
        for name in names:
            if name is None or name not in last:
                continue
            count0, sum0 = first.get(name, (0.0, 0.0))
            count1, sum1 = last[name]
            if count1 > count0:
                scale = 1000.0 if key.endswith("_ms") else 1.0
                means[key] = (sum1 - sum0) / (count1 - count0) * scale
    return means
