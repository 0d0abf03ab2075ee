"""The server's own costs between the HTTP request and the engine: a token-id prompt skips the
tokenizer thread (issue 21: TTFT side by side with vLLM's server)."""

from __future__ import annotations

import asyncio

import pytest
from starlette.testclient import TestClient

from baton.engine.core.outputs import RequestDelta
from baton.engine.runtime.ipc import EngineReady
from baton.server.app import build_app
from baton.server.args import ServerArgs
from baton.server.metrics import ServerMetrics
from baton.server.openai import completions
from baton.server.openai.generation import ServerState
from baton.server.tokenizer import Tokenizer
from tests.tiny import save_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tokenizer and a config.json (ServerArgs checks it is there; nothing reads it here)."""
    path = tmp_path_factory.mktemp("model")
    save_tokenizer(path, 64)
    (path / "config.json").write_text("{}")
    return path


class _OneTokenClient:
    """An EngineClient stand-in: every request gets token 5 and finishes."""

    alive = True
    unavailable_reason = None
    stats: dict = {}
    adapters: dict = {}  # LoRA adapters served (none)
    ready = EngineReady(
        vocab_size=1024,
        max_model_len=512,
        transfer_addr="",
        rank_transfer_addrs=[],
        page_size=16,
        track_interval=512,
    )

    def num_waiting(self) -> int:
        return 0

    async def generate(self, requests, tokenizer):
        for index, request in enumerate(requests):
            yield index, RequestDelta(
                request_id=request.request_id, new_token_ids=[5], new_text="w5",
                new_logprobs=None, prompt_logprobs=None, finished=True, finish_reason="length",
                stop_reason=None, num_prompt_tokens=len(request.prompt_token_ids),
                num_cached_tokens=0,
            )  # fmt: skip


@pytest.fixture(scope="module")
def app_client(model_dir):
    state = ServerState(
        args=ServerArgs(model=str(model_dir)),
        client=_OneTokenClient(),
        tokenizer=Tokenizer(str(model_dir)),
        metrics=ServerMetrics(lambda: {}),
    )
    with TestClient(build_app(state)) as client:
        yield client


def _count_thread_hops(monkeypatch) -> list:
    hops = []
    real = asyncio.to_thread

    async def counting_to_thread(func, *args, **kwargs):
        hops.append(func)
        return await real(func, *args, **kwargs)

    monkeypatch.setattr(completions.asyncio, "to_thread", counting_to_thread)
    return hops


@pytest.mark.parametrize(("prompt", "num_prompts"), [([7, 8, 9], 1), ([[7, 8], [9]], 2)])
def test_token_id_prompts_skip_the_tokenizer_thread(app_client, monkeypatch, prompt, num_prompts):
    hops = _count_thread_hops(monkeypatch)
    answer = app_client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    assert [c["text"] for c in answer.json()["choices"]] == ["w5"] * num_prompts
    assert answer.json()["usage"]["prompt_tokens"] == 3
    assert hops == []


@pytest.mark.parametrize("prompt", ["w7 w8", ["w7", "w8 w9"]])
def test_text_prompts_are_still_tokenized_off_the_event_loop(app_client, monkeypatch, prompt):
    hops = _count_thread_hops(monkeypatch)
    answer = app_client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    assert hops == [completions.tokenize_prompts]
