"""baton.bench.serving.serve_side_by_side reads what the engine saw from /metrics (baton's request timing
histograms and vLLM's, differenced between two scrapes); the server's scheduling defaults."""

from __future__ import annotations

import pytest

from baton.bench.serving.serve_metrics import engine_means, histogram_totals
from baton.bench.serving.serve_side_by_side import server_commands
from baton.engine.core.engine import Engine
from baton.engine.core.request_timing import RequestTiming
from baton.server.args import ServerArgs
from baton.server.metrics import ServerMetrics

VLLM_PAGE = """\
# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{{engine="0",le="0.3",model_name="m"}} {n}.0
vllm:request_queue_time_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {n}.0
vllm:request_queue_time_seconds_count{{engine="0",model_name="m"}} {n}.0
vllm:request_queue_time_seconds_sum{{engine="0",model_name="m"}} {queue}
# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{{engine="0",le="+Inf",model_name="m"}} {steps}.0
vllm:iteration_tokens_total_count{{engine="0",model_name="m"}} {steps}.0
vllm:iteration_tokens_total_sum{{engine="0",model_name="m"}} {tokens}
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",model_name="m"}} 0.0
"""


def test_vllm_histograms_are_differenced_between_scrapes():
    before = VLLM_PAGE.format(n=2, queue=0.5, steps=10, tokens=300)
    after = VLLM_PAGE.format(n=6, queue=1.3, steps=30, tokens=1300)
    assert histogram_totals(after)["vllm:request_queue_time_seconds"] == (6.0, 1.3)
    means = engine_means(before, after)
    assert means["queue_time_ms"] == pytest.approx(800.0 / 4)
    assert means["step_tokens"] == pytest.approx(1000 / 20)
    assert "prefill_time_ms" not in means  # not on the page: left out, not zero


def test_baton_request_timing_reaches_the_benchmark_through_metrics():
    clock = iter([0.0, 0.25, 0.75, 1.0]).__next__
    timing = RequestTiming(clock)
    stats: dict = {}
    metrics = ServerMetrics(lambda: stats)
    before = metrics.render().decode()
    timing.added("r")  # 0.0
    timing.scheduled(_batch_of("r", tokens=9, decode_rows=2))  # 0.25
    timing.sampled("r", finished=False)  # 0.75
    timing.sampled("r", finished=True)  # 1.0
    stats.update(timing.as_stats())
    means = engine_means(before, metrics.render().decode())
    assert means["queue_time_ms"] == pytest.approx(250.0)
    assert means["prefill_time_ms"] == pytest.approx(500.0)
    assert means["decode_time_ms"] == pytest.approx(250.0)
    assert means["first_step_tokens"] == 9 and means["first_step_decode_rows"] == 2
    assert means["queue_steps"] == 0 and means["step_tokens"] == 9


def test_side_by_side_turns_on_baton_request_metrics_and_forwards_flags():
    flags = ("--schedule-policy", "prefill-first")
    serve = server_commands("baton", "/m", "bfloat16", 9000, None, flags)
    assert "--request-metrics" in serve and serve[-2:] == list(flags)
    pd = server_commands("baton-pd", "/m", "bfloat16", 9000, None, flags)
    assert pd[-2:] == list(flags) and pd.index("--") < pd.index("--schedule-policy")


def _batch_of(request_id: str, tokens: int, decode_rows: int):
    """A ScheduledBatch-shaped stand-in: RequestTiming reads only these three fields."""

    class Batch:
        request_ids = (request_id,)
        input_ids = tuple(range(tokens))
        num_decode_seqs = decode_rows

    return Batch()


def test_a_server_schedules_mixed_unless_told_otherwise(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert ServerArgs(model=str(tmp_path)).engine_args()["schedule_policy"] == "mixed"
    first = ServerArgs(model=str(tmp_path), schedule_policy="prefill-first", max_prefill_tokens=256)
    assert first.engine_args()["schedule_policy"] == "prefill-first"
    assert first.engine_args()["max_prefill_tokens"] == 256
    with pytest.raises(ValueError, match="--schedule-policy"):
        ServerArgs(model=str(tmp_path), schedule_policy="fastest")


def test_cpu_prefill_first_steps_default_to_512_tokens(base_model):
    model_dir, _ = base_model
    engine = Engine(model_dir, max_total_tokens=1024, max_running_requests=2)
    assert engine.scheduler.config.max_prefill_tokens == 512
    small = Engine(model_dir, max_total_tokens=1024, max_num_batched_tokens=256)
    assert small.scheduler.config.max_prefill_tokens == 256  # never above the step budget
