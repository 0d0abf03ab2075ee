"""`baton serve --model DIR` answers /v1/completions for one model of each family with the
text the in-process engine gives; one disaggregated HTTP stack (prefill + decode workers
behind the router) for a family with rotary attention and MoE gives the colocated tokens."""

from __future__ import annotations

import httpx
import pytest

from baton import LLM, SamplingParams
from tests.families import FAMILY_CONFIGS
from tests.server_process import start_router, start_server

ONE_PER_FAMILY = list({FAMILY_CONFIGS[n][1]: n for n in reversed(list(FAMILY_CONFIGS))}.values())
PROMPTS = [[5, 9, 11, 3, 7], list(range(3, 60))]
FLAGS = ("--page-size", "4", "--chunked-prefill-size", "32", "--max-num-batched-tokens", "64")


def in_process_texts(model_dir) -> list[str]:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return [o.text for o in LLM(model_dir, page_size=4).generate(PROMPTS, params)]


def expected_and_served(base_url: str, model_dir) -> tuple[list[str], list[str]]:
    """Greedy texts from the in-process engine and from /v1/completions (same detokenizer)."""
    got = []
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        got.append(choice["text"])
    return in_process_texts(model_dir), got


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("family-serve-logs")


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_baton_serve_answers_completions(family_models, logs, name):
    model_dir, _ = family_models(name)
    server = start_server(model_dir, logs, *FLAGS)
    try:
        expected, got = expected_and_served(server.base_url, model_dir)
        assert got == expected
        models = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()
        assert models["data"][0]["id"]
    finally:
        assert server.stop() == 0


def test_disaggregated_http_stack_matches_colocated(family_models, logs):
    model_dir, _ = family_models("granite_moe")
    disagg = ("--disagg-timeout", "60")
    prefill = start_server(model_dir, logs, *FLAGS, "--disaggregation-mode", "prefill", *disagg)
    decode = start_server(model_dir, logs, *FLAGS, "--disaggregation-mode", "decode", *disagg)
    router = start_router(logs, [prefill.base_url], [decode.base_url])
    try:
        expected, got = expected_and_served(router.base_url, model_dir)
        assert got == expected
    finally:
        for part in (router, decode, prefill):
            part.stop()
