"""`baton bench serve`: metrics computed exactly from known chunk timings, errors counted,
concurrency and arrivals honoured, and a short run against a real `baton serve`."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import threading
import time

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from baton.bench.serving.serve import (
    BenchConfig,
    BenchPrompt,
    arrival_gaps,
    run_benchmark,
    synthetic_prompts,
)
from baton.bench.serving.serve_metrics import RequestRecord, summarize
from tests.server_process import BATON, free_port, start_server, tiny_model

# -- a scripted OpenAI-compatible server ------------------------------------------------------

# prompt -> what the fake server streams: ("chunks", texts, completion_tokens) or an error.
SCRIPTS = {
    "five-tokens-in-three-chunks": ("chunks", ["a", "bc", "de"], 5),
    "one-token": ("chunks", ["z"], 1),
    "http-error": ("status", 503),
    "error-mid-stream": ("midstream", ["x"]),
    "garbage": ("garbage", ["y"]),
    "json-that-is-not-an-object": ("not-object", ["y"]),
    # where servers put the usage: on the last choice chunk, `null` on every chunk (vLLM without
    # continuous_usage_stats), cumulative on every chunk (with it), or malformed
    "usage-on-last-choice": ("usage-last", ["a", "b"], 4),
    "usage-null-then-final": ("usage-null", ["a", "b"], 6),
    "usage-on-every-chunk": ("usage-every", ["a", "b", "c"], 3),
    "usage-malformed": ("usage-bad", ["a", "b"], 0),
    "error-as-a-string": ("error-string", ["x"]),
}


def _sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def fake_openai_app(state: dict) -> FastAPI:
    app = FastAPI()
    state.setdefault("inflight", 0)
    state.setdefault("max_inflight", 0)
    state.setdefault("bodies", [])

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": []}  # serves, but names no model

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        state["bodies"].append(body)
        script = SCRIPTS.get(body["prompt"]) if isinstance(body["prompt"], str) else None
        if script is None:  # token-id prompts: a slow one-chunk answer (concurrency test)
            script = ("slow", ["t"], 1)
        if script[0] == "status":
            return JSONResponse({"error": {"message": "queue full", "code": 503}}, 503)

        async def stream():
            state["inflight"] += 1
            state["max_inflight"] = max(state["max_inflight"], state["inflight"])
            if script[0] == "slow":
                # Hold every request until a second one is in flight (or 5 s pass), so the
                # test sees the concurrency limit reached, never exceeded.
                for _ in range(500):
                    if state["inflight"] >= 2:
                        break
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.05)
            kind, texts = script[0], script[1]
            for i, text in enumerate(texts):
                chunk = {
                    "id": "c",
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": text, "finish_reason": None}],
                }
                if kind == "usage-null":
                    chunk["usage"] = None
                elif kind == "usage-every" or (kind == "usage-last" and i == len(texts) - 1):
                    chunk["usage"] = {
                        "prompt_tokens": 7,
                        "completion_tokens": i + 1 + script[2] - len(texts),
                    }
                yield _sse(chunk)
            state["inflight"] -= 1
            if kind in ("usage-last", "usage-every"):
                pass  # the usage came with the choices
            elif kind == "usage-bad":
                yield _sse(
                    {"choices": [], "usage": {"prompt_tokens": None, "completion_tokens": "2"}}
                )
            elif kind == "error-string":
                yield _sse({"error": "engine died"})
            elif kind == "midstream":
                yield _sse({"error": {"message": "engine died", "code": 503}})
            elif script[0] == "garbage":
                yield "data: {not json\xff\n\n"
            elif script[0] == "not-object":
                yield "data: [1, 2]\n\n"
            else:
                usage = {"prompt_tokens": 7, "completion_tokens": script[2], "total_tokens": 0}
                yield _sse({"id": "c", "object": "text_completion", "choices": [], "usage": usage})
            yield _sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture
def fake_server():
    state: dict = {}
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(fake_openai_app(state), host="127.0.0.1", port=port, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(10)


def _config(base_url: str, prompts: list[BenchPrompt], **overrides) -> BenchConfig:
    fields = dict(
        base_url=base_url,
        endpoint="/v1/completions",
        model="fake",
        prompts=prompts,
        request_rate=math.inf,
        burstiness=1.0,
        max_concurrency=1,
        ignore_eos=True,
        num_warmups=0,
        slos_ms={},
        percentiles=(50, 90, 99),
        api_key=None,
        seed=0,
        progress=False,
    )
    fields.update(overrides)
    return BenchConfig(**fields)


def _scripted_clock(times: list[float]):
    """A clock that returns `times` in order: the instants the script says each read happens."""
    readings = iter(times)
    return lambda: next(readings)


# Concurrency 1 makes the clock reads a fixed sequence: the run's start, then per request its
# send and each chunk with choices, then the run's end.
SCRIPTED_PROMPTS = [
    "five-tokens-in-three-chunks",  # send 10.0, chunks at 10.25, 10.5, 11.0
    "one-token",  # send 11.0, chunk at 11.5
    "http-error",  # send 11.5
    "error-mid-stream",  # send 11.5, chunk at 11.75, then an error event
]
SCRIPTED_TIMES = [10.0, 10.0, 10.25, 10.5, 11.0, 11.0, 11.5, 11.5, 11.5, 11.75, 12.0]


def _run_scripted(base_url: str, slos_ms: dict[str, float]) -> dict:
    prompts = [BenchPrompt(prompt=p, prompt_len=3, output_len=8) for p in SCRIPTED_PROMPTS]
    config = _config(base_url, prompts, slos_ms=slos_ms)
    return asyncio.run(run_benchmark(config, clock=_scripted_clock(SCRIPTED_TIMES)))


def test_metrics_from_known_chunk_timings_are_exact(fake_server):
    base_url, state = fake_server
    result = _run_scripted(base_url, {"ttft": 300.0})
    assert result["duration"] == 2.0
    assert (result["completed"], result["failed"]) == (2, 2)
    # Output tokens are the server's usage count, not the number of chunks (3 + 1).
    assert result["total_output_tokens"] == 5 + 1
    assert result["total_input_tokens"] == 7 + 7
    assert result["output_throughput"] == 3.0
    assert result["request_throughput"] == 1.0
    assert result["mean_ttft_ms"] == pytest.approx((250 + 500) / 2, abs=1e-9)
    # ITL pools the gaps between chunks: 10.25 -> 10.5 -> 11.0.
    assert result["mean_itl_ms"] == pytest.approx(375.0, abs=1e-9)
    assert result["p99_itl_ms"] == pytest.approx(250 + 0.99 * 250, abs=1e-9)
    # TPOT: (latency - ttft) / (tokens - 1) = (1.0 - 0.25) / 4; the 1-token request has none.
    assert result["mean_tpot_ms"] == pytest.approx(187.5, abs=1e-9)
    assert result["mean_e2el_ms"] == pytest.approx((1000 + 500) / 2, abs=1e-9)
    # TTFT <= 300 ms: only the first request is good.
    assert result["request_goodput"] == 0.5
    records = result["requests"]
    assert records[0]["itl"] == [0.25, 0.5]
    assert records[2]["error"].startswith("HTTP 503") and not records[2]["success"]
    assert "engine died" in records[3]["error"] and not records[3]["success"]
    body = state["bodies"][0]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 8


def test_goodput_counts_a_one_token_request_as_meeting_a_tpot_slo(fake_server):
    """As in vLLM, a request with one output token has TPOT 0 for its SLO check."""
    base_url, _ = fake_server
    assert _run_scripted(base_url, {"tpot": 100.0})["request_goodput"] == 0.5
    assert _run_scripted(base_url, {"tpot": 200.0, "e2el": 999.0})["request_goodput"] == 0.5
    assert _run_scripted(base_url, {"tpot": 200.0})["request_goodput"] == 1.0


def test_max_concurrency_is_reached_and_never_exceeded(fake_server):
    base_url, state = fake_server
    prompts = synthetic_prompts(
        num_prompts=6, input_len=4, output_len=2, range_ratio=0, kind="ids", vocab_size=50, seed=0
    )
    result = asyncio.run(run_benchmark(_config(base_url, prompts, max_concurrency=2)))
    assert result["completed"] == 6 and result["failed"] == 0
    assert state["max_inflight"] == 2


def test_warm_up_failure_is_reported_not_benchmarked(fake_server):
    base_url, state = fake_server
    prompts = [BenchPrompt(prompt="http-error", prompt_len=1, output_len=1)]
    with pytest.raises(RuntimeError, match="warm-up request failed: HTTP 503"):
        asyncio.run(run_benchmark(_config(base_url, prompts, num_warmups=1)))
    assert len(state["bodies"]) == 1


def test_sse_reader_joins_split_reads_and_takes_long_lines():
    """Payloads split across network reads, CRLF line ends, a line far over aiohttp's 64 KiB
    readline limit (a chunk with many logprobs), and a last line without its newline."""
    from baton.bench.serving.serve import _sse_data

    long_text = "x" * 200_000
    body = (
        b'data: {"a": 1}\r\n\r\n: a comment\n'
        + b'data: {"t": "'
        + long_text.encode()
        + b'"}\n\n'
        + b"data: [DONE]"
    )
    pieces = [body[i : i + 7] for i in range(0, 42, 7)] + [body[42:70_000], body[70_000:]]

    class Content:
        async def iter_any(self):
            for piece in pieces:
                yield piece

    class Response:
        content = Content()

    async def collect():
        return [data async for data in _sse_data(Response())]

    got = asyncio.run(collect())
    assert got == [b'{"a": 1}', b'{"t": "' + long_text.encode() + b'"}', b"[DONE]"]
    assert json.loads(got[1])["t"] == long_text


def test_a_stream_that_is_not_json_fails_its_request_not_the_run(fake_server):
    base_url, _ = fake_server
    names = ("garbage", "json-that-is-not-an-object", "one-token")
    prompts = [BenchPrompt(prompt=p, prompt_len=1, output_len=1) for p in names]
    result = asyncio.run(run_benchmark(_config(base_url, prompts)))
    assert (result["completed"], result["failed"]) == (1, 2)
    assert "JSONDecodeError" in result["requests"][0]["error"]
    assert "not an object: b'[1, 2]'" in result["requests"][1]["error"]
    assert result["requests"][2]["success"]


def test_usage_is_read_wherever_the_server_puts_it(fake_server):
    base_url, _ = fake_server
    names = [
        "usage-on-last-choice",
        "usage-null-then-final",
        "usage-on-every-chunk",
        "usage-malformed",
    ]
    prompts = [BenchPrompt(prompt=p, prompt_len=3, output_len=8) for p in names]
    result = asyncio.run(run_benchmark(_config(base_url, prompts)))
    records = result["requests"]
    assert all(r["success"] for r in records), [r["error"] for r in records]
    # the server's count where it gave one (4 tokens in 2 chunks; the final chunk's 6; the last
    # of the cumulative counts), the number of choice chunks where its usage is not a count
    assert [r["output_tokens"] for r in records] == [4, 6, 3, 2]
    assert [r["prompt_tokens"] for r in records] == [7, 7, 7, 3]


def test_an_error_event_that_is_a_bare_string_fails_its_request(fake_server):
    base_url, _ = fake_server
    prompts = [
        BenchPrompt(prompt=p, prompt_len=1, output_len=1)
        for p in ("error-as-a-string", "one-token")
    ]
    result = asyncio.run(run_benchmark(_config(base_url, prompts)))
    assert (result["completed"], result["failed"]) == (1, 1)
    assert result["requests"][0]["error"] == "stream error: engine died"


def test_a_server_that_is_not_there_fails_the_request_not_the_run():
    port = free_port()  # nothing listens
    prompts = [BenchPrompt(prompt="one-token", prompt_len=1, output_len=1)]
    result = asyncio.run(run_benchmark(_config(f"http://127.0.0.1:{port}", prompts)))
    assert (result["completed"], result["failed"]) == (0, 1)
    assert "Connect" in result["requests"][0]["error"]


def test_poisson_arrivals_have_the_requested_rate():
    gaps = np.array(arrival_gaps(20000, 4.0, seed=3))
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    assert arrival_gaps(5, math.inf, seed=0) == [0.0] * 5
    with pytest.raises(ValueError, match="request-rate"):
        arrival_gaps(5, 0.0, seed=0)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_arrivals_keep_the_rate_and_change_the_spread(burstiness):
    gaps = np.array(arrival_gaps(40000, 4.0, seed=3, burstiness=burstiness))
    assert gaps.mean() == pytest.approx(0.25, rel=0.04)
    # gamma with shape k: coefficient of variation 1 / sqrt(k)
    assert gaps.std() / gaps.mean() == pytest.approx(burstiness**-0.5, rel=0.05)
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="burstiness"):
            arrival_gaps(5, 4.0, seed=0, burstiness=bad)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"prompts": []}, "--num-prompts"),
        ({"max_concurrency": 0}, "--max-concurrency"),
        ({"num_warmups": -1}, "--num-warmups"),
        ({"request_rate": 0.0}, "--request-rate"),
        ({"burstiness": 0.0}, "--burstiness"),
    ],
)
def test_a_config_that_cannot_run_is_refused_by_name(overrides, message):
    fields = {"prompts": [BenchPrompt(prompt="one-token", prompt_len=1, output_len=1)], **overrides}
    with pytest.raises(ValueError, match=message):
        _config("http://127.0.0.1:1", **fields)


def test_cli_names_bad_settings_and_a_server_without_models(fake_server):
    base_url, _ = fake_server  # its /v1/models lists nothing
    for args, message in (
        (["--max-concurrency", "0", "--model", "m"], "--max-concurrency must be >= 1"),
        (["--num-prompts", "0", "--model", "m"], "--num-prompts must be >= 1"),
        ([], "did not list a model"),
        (["--model", "m", "--tokenizer", "/nonexistent"], "/nonexistent: not a directory"),
    ):
        result = subprocess.run(
            [str(BATON), "bench", "serve", "--base-url", base_url, "--no-progress", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 1, result.stderr
        assert message in result.stderr and "Traceback" not in result.stderr


def test_a_vllm_bench_serve_command_line_runs_as_it_is(fake_server, tmp_path):
    """vLLM's spellings (--backend, --dataset-name random, --random-*-len, --save-result with
    --result-dir / --result-filename) mean what they mean there."""
    base_url, state = fake_server
    result = subprocess.run(
        [
            str(BATON), "bench", "serve", "--backend", "vllm", "--host", "127.0.0.1",
            "--port", base_url.rsplit(":", 1)[1], "--percentile-metrics", "ttft,tpot",
            "--model", "m", "--dataset-name", "random", "--random-input-len", "6",
            "--random-output-len", "3", "--random-range-ratio", "0", "--num-prompts", "2",
            "--vocab-size", "50", "--save-result", "--result-dir", str(tmp_path / "out"),
            "--result-filename", "r.json", "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Time to First Token" in result.stdout and "Inter-token Latency" not in result.stdout
    saved = json.loads((tmp_path / "out" / "r.json").read_text())
    assert saved["config"]["base_url"] == base_url and "mean_itl_ms" in saved
    assert saved["completed"] == 2 and saved["config"]["endpoint"] == "/v1/completions"
    sent = [b for b in state["bodies"] if isinstance(b["prompt"], list)]
    assert {len(b["prompt"]) for b in sent} == {6} and {b["max_tokens"] for b in sent} == {3}
    refused = subprocess.run(
        [str(BATON), "bench", "serve", "--base-url", base_url, "--dataset-name", "sharegpt"],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "invalid choice: 'sharegpt'" in refused.stderr


def test_synthetic_prompt_lengths_stay_in_range():
    prompts = synthetic_prompts(
        num_prompts=200,
        input_len=100,
        output_len=10,
        range_ratio=0.5,
        kind="ids",
        vocab_size=9,
        seed=1,
    )
    lengths = [len(p.prompt) for p in prompts]
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(set(lengths)) > 20
    assert all(3 <= t < 9 for p in prompts for t in p.prompt)
    assert all(5 <= p.output_len <= 15 for p in prompts)
    words = synthetic_prompts(
        num_prompts=3, input_len=12, output_len=4, range_ratio=0, kind="text", vocab_size=0, seed=1
    )
    assert all(len(p.prompt.split()) == 12 for p in words)


def test_prompts_from_a_tokenizer_use_its_vocabulary_and_exact_token_counts(tmp_path):
    from transformers import AutoTokenizer

    from tests.tiny import save_tokenizer

    save_tokenizer(tmp_path, vocab_size=300)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    special = set(tokenizer.all_special_ids)
    assert special  # <s>, </s>, <pad>, ...: the ids to leave out
    common = dict(num_prompts=40, output_len=4, range_ratio=0.5, seed=3, tokenizer=tokenizer)
    ids = synthetic_prompts(input_len=30, kind="ids", vocab_size=None, **common)
    drawn = {t for p in ids for t in p.prompt}
    assert drawn <= set(range(len(tokenizer))) - special
    assert max(drawn) > len(tokenizer) * 0.8  # the whole vocabulary, not [3, 1000)
    assert all(p.prompt_len == len(p.prompt) for p in ids)
    texts = synthetic_prompts(input_len=30, kind="text", vocab_size=None, **common)
    counts = [len(tokenizer.encode(p.prompt, add_special_tokens=False)) for p in texts]
    assert counts == [p.prompt_len for p in texts]
    wanted = [
        p.prompt_len for p in synthetic_prompts(input_len=30, kind="ids", vocab_size=9, **common)
    ]
    # the drawn lengths, give or take the one token a cut inside a word can re-encode to
    assert all(abs(c - w) <= 1 for c, w in zip(counts, wanted)) and len(set(counts)) > 5
    explicit = synthetic_prompts(input_len=30, kind="ids", vocab_size=9, **common)
    assert {t for p in explicit for t in p.prompt} <= set(range(3, 9))  # --vocab-size wins
    with pytest.raises(ValueError, match="--vocab-size or --tokenizer"):
        synthetic_prompts(input_len=3, kind="ids", vocab_size=None, **{**common, "tokenizer": None})


@pytest.mark.parametrize(
    "listing",
    [
        {"data": []},
        {"data": "models"},
        {"data": [5, None, {"id": 7}, {"name": "m"}]},
        {"object": "list"},
        [1, 2],
        "not json at all",
    ],
)
def test_a_models_listing_without_a_model_name_is_named_not_a_traceback(
    listing, monkeypatch, tmp_path
):
    import httpx

    import baton.bench.cli

    def get(url, **kwargs):
        body = {"text": listing} if isinstance(listing, str) else {"json": listing}
        return httpx.Response(200, request=httpx.Request("GET", url), **body)

    monkeypatch.setattr(baton.bench.cli.httpx, "get", get)
    with pytest.raises(ValueError, match="did not list a model"):
        baton.bench.cli._served_models("http://127.0.0.1:1", None)
    # a hostile `root` is never taken for a tokenizer directory, nor another model's
    listed = [{"id": "m", "root": 123}, {"id": "m", "root": "a\x00b"}, {"id": "m", "root": ["x"]}]
    assert baton.bench.cli._default_tokenizer("m", listed) is None
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text("{}")
    assert baton.bench.cli._default_tokenizer("m", [{"id": "n", "root": str(other)}]) is None
    assert baton.bench.cli._default_tokenizer("m", [{"id": "m", "root": str(other)}]) == str(other)


@pytest.mark.parametrize(
    "given",
    [
        "http://127.0.0.1:8000",
        "http://127.0.0.1:8000/",
        "http://127.0.0.1:8000/v1",
        "127.0.0.1:8000",
    ],
)
def test_the_base_url_may_be_an_openai_clients(given):
    from baton.bench.cli import server_root

    assert server_root(given) == "http://127.0.0.1:8000"


def test_chosen_percentiles_are_computed_and_printed():
    from baton.bench.serving.serve_metrics import format_summary

    # TTFTs of 10 requests: 10, 20, ..., 100 ms.
    records = [
        RequestRecord(
            success=True, error="", prompt_tokens=1, output_tokens=2, ttft=t / 100, itl=(0.01,),
            latency=t / 100 + 0.01, retried=False,
        )
        for t in range(1, 11)
    ]  # fmt: skip
    summary = summarize(records, 1.0, {}, percentiles=(25, 99.9))
    assert summary["p25_ttft_ms"] == pytest.approx(32.5)  # numpy's linear interpolation
    assert summary["p99.9_ttft_ms"] == pytest.approx(99.91)
    assert "p99_ttft_ms" not in summary and summary["percentiles"] == [25, 99.9]
    table = format_summary(summary)
    assert "P25 TTFT (ms):" in table and "P99.9 E2EL (ms):" in table and "P99 " not in table


def test_unknown_slo_metric_is_refused():
    record = RequestRecord(
        success=True,
        error="",
        prompt_tokens=1,
        output_tokens=1,
        ttft=0.1,
        itl=(),
        latency=0.1,
        retried=False,
    )
    with pytest.raises(ValueError, match="unknown SLO"):
        summarize([record], 1.0, {"itl": 5.0})


@pytest.mark.parametrize(
    "args, message",
    [
        (["--goodput", "ttft"], "METRIC:MS"),
        (["--metric-percentiles", "50,x"], "'x' is not a number"),
        (["--metric-percentiles", "100"], "'100' is not in (0, 100)"),
        (["--percentile-metrics", "ttft,latency"], "unknown metric(s) ['latency']"),
    ],
)
def test_cli_rejects_malformed_options(args, message):
    result = subprocess.run(
        [str(BATON), "bench", "serve", "--base-url", "http://127.0.0.1:1", *args],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and message in result.stderr


def bench_serve(*args: str) -> subprocess.CompletedProcess:
    """`baton bench serve ARGS` as a newcomer runs it."""
    return subprocess.run(
        [str(BATON), "bench", "serve", *args], capture_output=True, text=True, timeout=300
    )


def test_short_run_against_a_real_baton_serve(tmp_path_factory, tmp_path):
    model = tiny_model(tmp_path_factory)
    server = start_server(model, tmp_path)
    try:
        out = tmp_path / "bench.json"
        # As an OpenAI client's base_url; no --vocab-size: the ids come from the tokenizer in
        # the directory that /v1/models names.
        result = bench_serve(
            "--base-url", server.base_url + "/v1", "--num-prompts", "4", "--input-len", "16",
            "--output-len", "8", "--ignore-eos", "--max-concurrency", "2",
            "--metric-percentiles", "50,95", "--goodput", "e2el:600000", "--no-progress",
            "--result-json", str(out),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "Serving Benchmark Result" in result.stdout
        summary = json.loads(out.read_text())
        # vLLM's openai-chat backend: the chat route, text prompts (it takes no token ids).
        chat_out = tmp_path / "chat.json"
        chat = bench_serve(
            "--backend", "openai-chat", "--base-url", server.base_url, "--num-prompts", "2",
            "--input-len", "12", "--output-len", "4", "--no-progress", "--result-json", str(chat_out),
        )  # fmt: skip
        assert chat.returncode == 0, chat.stderr
        chat_summary = json.loads(chat_out.read_text())
        # SGLang's bench_serving backend name: the native /generate route, token-id prompts.
        native_out = tmp_path / "native.json"
        native = bench_serve(
            "--backend", "sglang", "--base-url", server.base_url, "--num-prompts", "3",
            "--input-len", "12", "--output-len", "5", "--ignore-eos", "--no-progress",
            "--result-json", str(native_out),
        )  # fmt: skip
        assert native.returncode == 0, native.stderr
        native_summary = json.loads(native_out.read_text())
        # Ids the model does not have: the server's 400, and what to pass instead.
        refused = bench_serve(
            "--base-url", server.base_url, "--num-prompts", "2", "--vocab-size", "100000",
            "--no-progress",
        )  # fmt: skip
    finally:
        server.stop()
    assert refused.returncode == 1
    assert "outside the vocabulary" in refused.stderr and "--tokenizer DIR" in refused.stderr
    assert summary["config"]["tokenizer"] == str(model)
    assert chat_summary["completed"] == 2 and chat_summary["config"]["prompt_kind"] == "text"
    # every token counted from meta_info, one inter-token gap per later token
    assert native_summary["completed"] == 3 and native_summary["total_output_tokens"] == 15
    assert native_summary["total_input_tokens"] == 36
    assert native_summary["config"]["endpoint"] == "/generate"
    assert chat_summary["config"]["endpoint"] == "/v1/chat/completions"
    assert chat_summary["total_input_tokens"] > 2 * 12  # the chat template's tokens too
    assert summary["p95_ttft_ms"] >= summary["p50_ttft_ms"] > 0 and "P95 TTFT" in result.stdout
    assert summary["config"]["base_url"] == server.base_url
    assert (summary["completed"], summary["failed"]) == (4, 0)
    assert summary["total_input_tokens"] == 4 * 16
    assert summary["total_output_tokens"] == 4 * 8  # ignore_eos honoured, usage counted
    assert summary["request_goodput"] == summary["request_throughput"] > 0
    assert all(0 < r["ttft"] <= r["latency"] for r in summary["requests"])
    assert summary["config"]["model"] == str(model)


class ClosingAfterEachAnswer:
    """An HTTP/1.1 server like llama-server: every answer says keep-alive, but a connection
    that already carried one answer is closed when the next request arrives on it."""

    STREAM = (
        b'data: {"choices": [{"text": "a"}]}\n\n'
        b'data: {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}\n\n'
        b"data: [DONE]\n\n"
    )

    def __init__(self) -> None:
        self.port = free_port()
        self.answered = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
            if served:
                writer.close()
                return
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: keep-alive\r\n"
                + f"Content-Length: {len(self.STREAM)}\r\n\r\n".encode()
                + self.STREAM
            )
            await writer.drain()
            served += 1
            self.answered += 1

    async def run(self, body):
        server = await asyncio.start_server(self.handle, "127.0.0.1", self.port)
        async with server:
            return await body(f"http://127.0.0.1:{self.port}")


def test_a_request_on_a_connection_the_server_closed_is_retried_once_and_counted():
    """`baton bench serve` against llama-server lost requests (`Can not write request body`):
    a request that failed before any answer is sent again on a fresh connection, counted."""
    peer = ClosingAfterEachAnswer()
    prompts = [BenchPrompt(prompt=f"p{i}", prompt_len=1, output_len=1) for i in range(6)]
    result = asyncio.run(peer.run(lambda url: run_benchmark(_config(url, prompts))))
    assert (result["completed"], result["failed"]) == (6, 0), result["requests"]
    assert result["retried"] >= 2 and peer.answered == 6
    assert sum(r["retried"] for r in result["requests"]) == result["retried"]


def test_without_the_retry_such_a_request_fails_before_reaching_the_server():
    import aiohttp

    from baton.bench.serving.serve import send_request

    peer = ClosingAfterEachAnswer()
    prompt = BenchPrompt(prompt="p", prompt_len=1, output_len=1)

    async def twice(url):
        async with aiohttp.ClientSession() as session:
            config = _config(url, [prompt])
            first = await send_request(session, config, prompt, time.perf_counter, None)
            second = await send_request(session, config, prompt, time.perf_counter, None)
            return first, second

    first, second = asyncio.run(peer.run(twice))
    assert first.success and not second.success and not second.retried
    assert "Disconnected" in second.error and peer.answered == 1
