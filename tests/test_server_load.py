"""Many clients at once, and clients that give up: the server keeps up and frees everything."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_process import start_server, tiny_model

MODEL_NAME = "tiny"
POOL_GAUGES = ("kv_pages_used", "mamba_slots_used", "num_requests_running", "num_requests_waiting")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(
        tiny_model(tmp_path_factory),
        tmp_path_factory.mktemp("logs"),
        "--served-model-name",
        MODEL_NAME,
    )
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def engine_metrics(server) -> dict[str, float]:
    with server.http() as http:
        text = http.get("/metrics").text
    return {
        family.name.removeprefix("baton:"): family.samples[0].value
        for family in text_string_to_metric_families(text)
        if family.samples and not family.samples[0].labels
    }


def test_64_concurrent_streams_all_complete(server):
    async def stream_one(client: openai.AsyncOpenAI, index: int) -> tuple[str, str, int]:
        text, finish, usage = "", None, None
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=f"Request {index}: the quick brown fox",
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                finish = choice.finish_reason or finish
            usage = chunk.usage or usage
        return text, finish, usage.completion_tokens

    async def run_all():
        async with server.async_client(timeout=120) as client:
            return await asyncio.gather(*(stream_one(client, index) for index in range(64)))

    results = asyncio.run(run_all())
    assert len(results) == 64
    assert all(finish == "length" and tokens == 16 for _, finish, tokens in results)
    assert len({text for text, _, _ in results}) > 1  # different prompts, different answers


def test_abandoned_requests_are_aborted_and_free_the_pools(server):
    long_request = {
        "model": MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": 2000,
        "extra_body": {"ignore_eos": True},
    }
    probe = server.client().completions.create(
        model=MODEL_NAME, prompt=long_request["prompt"], max_tokens=1
    )
    before = engine_metrics(server)

    def admitted() -> float:
        delta = engine_metrics(server)["prompt_tokens"] - before["prompt_tokens"]
        return delta / probe.usage.prompt_tokens

    async def stream_forever(client: openai.AsyncOpenAI) -> None:
        async with await client.completions.create(stream=True, **long_request) as stream:
            async for _ in stream:
                pass

    async def run_all() -> None:
        # Abandon the requests once the engine has admitted all of them (not on a clock, which
        # a loaded machine can beat): cancelling the client tasks closes their connections.
        async with server.async_client(timeout=60) as client:
            tasks = [
                *(
                    asyncio.create_task(client.completions.create(**long_request))
                    for _ in range(25)
                ),
                *(asyncio.create_task(stream_forever(client)) for _ in range(25)),
            ]
            deadline = time.monotonic() + 30
            while await asyncio.to_thread(admitted) < 50:
                assert time.monotonic() < deadline, f"only {admitted()} of 50 requests admitted"
                assert not any(t.done() for t in tasks), "a 2000-token request finished early"
                await asyncio.sleep(0.05)
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(r, asyncio.CancelledError) for r in results), results

    asyncio.run(run_all())
    admitted_requests = admitted()

    started = time.monotonic()
    fresh = server.client(timeout=10).completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=8
    )
    assert time.monotonic() - started < 10
    assert fresh.choices[0].finish_reason in ("stop", "length")

    deadline = time.monotonic() + 10
    while any((after := engine_metrics(server))[gauge] for gauge in POOL_GAUGES):
        assert time.monotonic() < deadline, {gauge: after[gauge] for gauge in POOL_GAUGES}
        time.sleep(0.1)
    generated = after["generation_tokens"] - before["generation_tokens"]
    print(
        f"{admitted_requests:.0f} abandoned requests reached the engine; {generated:.0f} tokens generated in all"
    )
    assert generated < 50 * 2000 / 10, f"{generated} tokens: the abandoned requests ran on"


def huge_prompt_body(model: str | None, size: int = 4_000_000, **fields) -> bytes:
    """A completions body whose prompt is `size` characters of words (millions of tokens)."""
    words = ["apple", "banana", "cherry", "42", "question", "answer:", "the", "of", "pens", "7"]
    text = " ".join(words[(i * 7 + i // 3) % len(words)] for i in range(size // 6))
    named = {"model": model} if model else {}
    return json.dumps({**named, "prompt": text, "max_tokens": 4, **fields}).encode()


# A huge prompt the server must tokenize whole: one cut to its last tokens may be any length
# (a prompt that is not cut is refused as soon as its bytes prove it too long).
TOKENIZED_WHOLE = {"truncate_prompt_tokens": 64}


class HugeRequest(threading.Thread):
    """Sends one huge request; `sent` is set once its whole body is on the wire, `finished`
    once the answer came back (so other requests can be ordered against both)."""

    def __init__(self, url: str, body: bytes) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.sent, self.finished = threading.Event(), threading.Event()
        self.response: httpx.Response | None = None

    def chunks(self):
        for start in range(0, len(self.body), 1 << 20):
            yield self.body[start : start + (1 << 20)]
        self.sent.set()  # httpx asks for more only after writing the last chunk

    def run(self) -> None:
        try:
            self.response = httpx.post(
                self.url, content=self.chunks(), headers={"content-type": "application/json"},
                timeout=600,
            )  # fmt: skip
        finally:
            self.finished.set()


def test_a_huge_prompt_does_not_hold_up_health_or_other_clients(server):
    """Tokenizing millions of characters runs in a worker thread: while it runs, /health answers
    and another client's request completes (ordered against the huge one, not timed); and the
    tokenizer's peak goes back to the system afterwards (4 MB left the worker ~400 MB larger)."""
    body = huge_prompt_body(MODEL_NAME, **TOKENIZED_WHOLE)
    before = settled_rss_mb(server.process.pid)
    huge = HugeRequest(f"{server.base_url}/v1/completions", body)
    huge.start()
    assert huge.sent.wait(120)
    with server.http() as http:
        health = http.get("/health", timeout=600)
        health_before_huge = not huge.finished.is_set()
        other = http.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4},
            timeout=600,
        )  # fmt: skip
        other_before_huge = not huge.finished.is_set()
    huge.join(600)
    assert health.status_code == 200 and other.status_code == 200, other.text
    assert health_before_huge, "/health waited for the huge prompt's tokenization"
    assert other_before_huge, "another client's request waited for the huge prompt"
    assert huge.response is not None and huge.response.status_code == 200, huge.response
    assert huge.response.json()["usage"]["prompt_tokens"] == 64
    after = settled_rss_mb(server.process.pid)
    assert after - before < 50, f"RSS {before:.0f} -> {after:.0f} MB"


JSON = {"content-type": "application/json"}


def rss_mb(pid: int) -> float:
    status = open(f"/proc/{pid}/status").read()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def settled_rss_mb(pid: int) -> float:
    """RSS a moment after a request (what stays, not the peak)."""
    time.sleep(2)
    return rss_mb(pid)


def test_an_8_mb_prompt_is_refused_at_once_and_leaves_no_memory_behind(server):
    """Its bytes prove it cannot fit the context: refused before tokenizing (it used to take
    10-23 s of CPU and leave the worker ~1 GB larger for good)."""
    body = huge_prompt_body(MODEL_NAME, 8_300_000)
    with server.http() as http:
        before = settled_rss_mb(server.process.pid)
        started = time.monotonic()
        response = http.post("/v1/completions", content=body, headers=JSON)
        elapsed = time.monotonic() - started
    after = settled_rss_mb(server.process.pid)
    assert response.status_code == 400 and "exceeds max-model-len" in response.text
    assert elapsed < 1.0, f"refused after {elapsed:.2f} s"
    assert after - before < 50, f"RSS {before:.0f} -> {after:.0f} MB"
