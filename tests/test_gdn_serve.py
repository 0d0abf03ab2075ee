"""The text part of a Qwen3.5 vision checkpoint over HTTP: `baton up` (two `baton serve`
workers, prefill and decode, behind the router) answers completions with the in-process engine's
text, chat takes text content parts, and an image content part is refused with a 400 that names
it."""

from __future__ import annotations

import httpx

from baton import LLM, SamplingParams
from tests.test_server_up import Stack

PROMPTS = [[5, 9, 11, 3, 7], list(range(3, 90))]
FLAGS = ("--page-size", "4", "--chunked-prefill-size", "32")


def in_process_texts(model_dir) -> list[str]:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return [o.text for o in LLM(model_dir, page_size=4).generate(PROMPTS, params)]


def check_served(base: str, expected: list[str]) -> None:
    for prompt, text in zip(PROMPTS, expected):
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == text
    text_part = {"type": "text", "text": "Once upon a time"}
    chat = {"messages": [{"role": "user", "content": [text_part]}], "max_tokens": 4}
    answer = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=120)
    assert answer.status_code == 200, answer.text
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}}
    chat["messages"][0]["content"].append(image)
    refused = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=120)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert "'image_url'" in error["message"] and error["param"] == "messages"


def test_baton_up_serves_the_text_part_of_a_vision_checkpoint(gdn_models, tmp_path):
    model_dir, _ = gdn_models("qwen3_5_vision")
    expected = in_process_texts(model_dir)
    stack = Stack(model_dir, tmp_path / "up.log", "--", *FLAGS)
    try:
        check_served(f"http://127.0.0.1:{stack.port}", expected)
    finally:
        stack.stop()
    assert stack.process.returncode == 0, stack.log()[-3000:]
