"""Per-request engine timing (engine/core/request_timing.py): queue / prefill / decode time, steps
waited and the first step's size, as vLLM's `vllm:request_*` histograms, on /metrics."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.engine.core.engine import Engine
from baton.engine.core.outputs import SampledTokens
from baton.engine.core.request_timing import STATS_PREFIX, RequestTiming
from baton.engine.core.sampling_params import SamplingParams
from tests.server_process import start_server, tiny_model
from tests.test_scheduler import make, req


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def hist(stats: dict, name: str) -> tuple[float, float]:
    """(count, sum) of one timing histogram in an engine stats dict."""
    key = f"{STATS_PREFIX}{name}"
    return stats[f"{key}:count"], stats[f"{key}:sum"]


def timed_step(sched, timing: RequestTiming, clock: FakeClock, start: float, end: float):
    """One fake step (tests/test_scheduler.py's) from `start` to `end`, reported to `timing`."""
    clock.now = start
    batch = sched.schedule()
    timing.scheduled(batch)
    clock.now = end
    for delta in sched.update_from_output(
        batch, {s: SampledTokens((7,), (None,)) for s in batch.logits_seqs}, {}, {}
    ):
        timing.sampled(delta.request_id, finished=delta.finished)
    return batch


def test_queue_prefill_decode_times_and_steps_waited_follow_the_schedule():
    clock = FakeClock()
    timing = RequestTiming(clock)
    sched, _ = make(budget=16, chunk=16, max_running=2)
    sched.add(req("a", 8, max_tokens=2))
    timing.added("a")  # t=0
    assert timed_step(sched, timing, clock, 1, 2).request_ids == ("a",)
    for rid in ("b", "c"):  # t=2, between steps (the engine loop adds requests there)
        sched.add(req(rid, 4, max_tokens=2))
        timing.added(rid)
    # c waits a step: two requests run at most
    assert timed_step(sched, timing, clock, 3, 4).request_ids == ("a", "b")
    assert timed_step(sched, timing, clock, 5, 6).request_ids == ("b", "c")
    stats = timing.as_stats()
    assert hist(stats, "request_queue_time_seconds") == (3, 1 + 1 + 3)
    assert hist(stats, "request_queue_steps") == (3, 0 + 0 + 1)
    assert hist(stats, "request_prefill_time_seconds") == (3, 1 + 1 + 1)
    assert hist(stats, "request_decode_time_seconds") == (2, 2 + 2)  # c has not finished
    assert hist(stats, "request_first_step_tokens") == (3, 8 + 5 + 5)
    assert hist(stats, "request_first_step_decode_rows") == (3, 0 + 1 + 1)
    assert hist(stats, "iteration_tokens") == (3, 8 + 5 + 5)
    # cumulative buckets, ending at the count
    assert stats[f"{STATS_PREFIX}request_queue_steps:le:0"] == 2
    assert stats[f"{STATS_PREFIX}request_queue_steps:le:1"] == 3
    assert stats[f"{STATS_PREFIX}request_queue_steps:le:inf"] == 3


def test_an_aborted_request_records_no_decode_time():
    timing = RequestTiming(FakeClock())
    timing.added("gone")
    timing.forget("gone")
    timing.sampled("gone", finished=True)  # a late delta for it changes nothing
    assert hist(timing.as_stats(), "request_decode_time_seconds") == (0, 0.0)


def test_engine_times_requests_only_when_asked(base_model):
    model_dir, _ = base_model
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    quiet = Engine(model_dir, max_total_tokens=2048, max_running_requests=4)
    assert quiet.timing_stats() == {}
    timed = Engine(model_dir, max_total_tokens=2048, max_running_requests=4, request_timing=True)
    for i in range(3):
        timed.add_request(f"r{i}", [5, 6, 7, 8 + i], params)
    while timed.has_unfinished_requests():
        timed.step()
    stats = timed.timing_stats()
    assert hist(stats, "request_decode_time_seconds")[0] == 3
    count, total = hist(stats, "request_prefill_time_seconds")
    assert count == 3 and total > 0
    assert hist(stats, "request_first_step_tokens") == (3, 3 * 12)  # one step took all three
    assert hist(stats, "iteration_tokens") == (3, 12 + 3 + 3)


@pytest.fixture(scope="module")
def timed_server(tmp_path_factory):
    server = start_server(
        tiny_model(tmp_path_factory),
        tmp_path_factory.mktemp("logs"),
        "--request-metrics",
        "--schedule-policy",
        "prefill-first",
    )
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def test_metrics_expose_request_timing_histograms(timed_server):
    client = timed_server.client()
    for _ in range(2):
        client.completions.create(
            model=client.models.list().data[0].id, prompt=[5, 6, 7], max_tokens=4
        )
    text = httpx.get(f"{timed_server.base_url}/metrics", timeout=10).text
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels or sample.labels.get("le") == "+Inf"
    }
    for name in ("queue_time_seconds", "prefill_time_seconds", "decode_time_seconds"):
        assert samples[f"baton:request_{name}_count"] == 2
    assert samples["baton:request_prefill_time_seconds_sum"] > 0
    assert samples["baton:request_first_step_tokens_sum"] == 2 * 3
