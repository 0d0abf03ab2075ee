"""Many clients at once, and clients that give up: the server keeps up and frees everything."""

from __future__ import annotations

import asyncio
import time

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
    before = engine_metrics(server)

    async def abandon_unstreamed(client: openai.AsyncOpenAI) -> None:
        with pytest.raises(openai.APITimeoutError):
            await client.completions.create(**long_request)

    async def abandon_streamed(client: openai.AsyncOpenAI) -> None:
        # A stream keeps delivering chunks, so no read timeout fires: give up on the clock instead.
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                async with await client.completions.create(stream=True, **long_request) as stream:
                    async for _ in stream:
                        pass

    async def run_all() -> None:
        async with server.async_client(timeout=0.2) as client:
            await asyncio.gather(
                *(abandon_unstreamed(client) for _ in range(25)),
                *(abandon_streamed(client) for _ in range(25)),
            )

    asyncio.run(run_all())
    probe = server.client().completions.create(
        model=MODEL_NAME, prompt=long_request["prompt"], max_tokens=1
    )
    admitted = (
        engine_metrics(server)["prompt_tokens"] - before["prompt_tokens"]
    ) / probe.usage.prompt_tokens - 1
    assert admitted >= 25, f"only {admitted} of the abandoned requests reached the engine"

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
        f"{admitted:.0f} abandoned requests reached the engine; {generated:.0f} tokens generated in all"
    )
    assert generated < 50 * 2000 / 10, f"{generated} tokens: the abandoned requests ran on"
