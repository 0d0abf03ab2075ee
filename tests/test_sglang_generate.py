"""SGLang's native POST /generate against a live `baton serve`: the same tokens as the offline
engine, SGLang's answer shape (one object or a list, meta_info, finish_reason), its streaming
(the whole text so far in every chunk), and refusals by name."""

from __future__ import annotations

import json

import httpx
import pytest

from baton import LLM, SamplingParams
from tests.server_process import start_server, tiny_model

MAX_MODEL_LEN = 256
PROMPTS = ["Hello world", "The quick brown fox jumps"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    server = start_server(
        model_dir, tmp_path_factory.mktemp("logs"), "--max-model-len", str(MAX_MODEL_LEN)
    )
    yield server
    assert server.stop() == 0, server.log()[-3000:]


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), max_model_len=MAX_MODEL_LEN)


def generate(server, **body) -> httpx.Response:
    return server.http().post("/generate", json=body)


def test_text_and_input_ids_give_the_offline_tokens(server, llm):
    sampling = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    (reference,) = llm.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    )
    answer = generate(server, text=PROMPTS[0], sampling_params=sampling).json()
    assert answer["text"] == reference.text and answer["output_ids"] == reference.token_ids
    meta = answer["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 10}
    assert meta["completion_tokens"] == 10
    assert meta["prompt_tokens"] == len(llm.tokenizer.encode(PROMPTS[0]))
    assert meta["id"] and meta["e2e_latency"] > 0 and meta["cached_tokens"] >= 0
    ids = llm.tokenizer.encode(PROMPTS[0])
    by_ids = generate(server, input_ids=ids, sampling_params=sampling).json()
    assert by_ids["output_ids"] == reference.token_ids


def test_a_batch_or_n_answers_a_list_prompt_major(server, llm):
    sampling = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    answers = generate(server, text=PROMPTS, sampling_params=sampling).json()
    references = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert [a["output_ids"] for a in answers] == [r.token_ids for r in references]
    as_list = generate(server, text=PROMPTS, sampling_params=[sampling, sampling]).json()
    assert [a["output_ids"] for a in as_list] == [r.token_ids for r in references]
    differing = generate(server, text=PROMPTS, sampling_params=[sampling, {**sampling, "top_k": 3}])
    assert differing.status_code == 400 and "all the same" in differing.json()["error"]["message"]
    short = generate(server, text=PROMPTS, sampling_params=[sampling])
    assert short.status_code == 400 and "one set per prompt (2)" in short.json()["error"]["message"]
    sampled = {"max_new_tokens": 4, "temperature": 1.0, "n": 3, "sampling_seed": 7}
    three = generate(server, text=PROMPTS[1], sampling_params=sampled).json()
    again = generate(server, text=PROMPTS[1], sampling_params=sampled).json()
    assert isinstance(three, list) and len(three) == 3
    # sampling_seed is the completions seed: sample i draws with seed + i, so a rerun repeats
    assert [a["output_ids"] for a in three] == [a["output_ids"] for a in again]
    (first,) = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=4, temperature=1.0, seed=7))
    assert three[0]["output_ids"] == first.token_ids


def test_stop_reasons_have_sglangs_shape(server, llm):
    (reference,) = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0))
    stop_token = reference.token_ids[3]
    answer = generate(
        server,
        text=PROMPTS[1],
        sampling_params={"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [stop_token]},
    ).json()
    cut = reference.token_ids.index(stop_token) + 1
    assert answer["output_ids"] == reference.token_ids[:cut]
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_token}
    stop_text = reference.text[len(reference.text) // 2 :][:3]
    if stop_text.strip():
        by_text = generate(
            server,
            text=PROMPTS[1],
            sampling_params={"max_new_tokens": 12, "temperature": 0, "stop": stop_text},
        ).json()
        assert by_text["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_text}
        assert stop_text not in by_text["text"]


def test_streaming_sends_the_whole_text_so_far(server, llm):
    sampling = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    (reference,) = llm.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )
    raw = generate(server, text=PROMPTS[0], sampling_params=sampling, stream=True).text
    events = [line.removeprefix("data: ") for line in raw.split("\n\n") if line.strip()]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    counts = [chunk["meta_info"]["completion_tokens"] for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 8 and len(chunks) > 2
    for chunk in chunks:  # each holds everything before it (SGLang's non-incremental stream)
        assert reference.text.startswith(chunk["text"])
        assert chunk["output_ids"] == reference.token_ids[: chunk["meta_info"]["completion_tokens"]]
    assert chunks[-1]["text"] == reference.text
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert all(chunk["meta_info"]["finish_reason"] is None for chunk in chunks[:-1])


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"text": "a", "input_ids": [5]}, "text", "exactly one of text and input_ids"),
        ({}, "text", "exactly one of text and input_ids"),
        ({"text": "a", "top_logprobs_num": 21}, "top_logprobs_num", "20"),
        ({"text": "a", "lora_path": "x"}, "lora_path", "lora_path"),
        (  # SGLang's constraints are vLLM's structured_outputs here (server/openai/structured.py)
            {"text": "a", "sampling_params": {"json_schema": "{"}},
            "structured_outputs",
            "not valid JSON",
        ),
        (
            {"text": "a", "sampling_params": {"max_new_tokens": 0}},
            "sampling_params",
            "max_new_tokens",
        ),
        ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p", "top_p"),
        (
            {"text": "a", "sampling_params": {"max_new_tokens": "8"}},
            "sampling_params",
            "valid integer",
        ),
        ({"input_ids": [5, 100000]}, "prompt", "outside the vocabulary"),
        (
            {"text": "a", "sampling_params": {"max_new_tokens": 10000}},
            "max_tokens",
            str(MAX_MODEL_LEN),
        ),
        (  # SGLang refuses prompt + max_new_tokens over the context (the OpenAI routes cut it)
            {"input_ids": [5] * 200, "sampling_params": {"max_new_tokens": 100}},
            "max_tokens",
            "300 tokens exceeds",
        ),
    ],
)
def test_bad_requests_are_400s_naming_the_field(server, body, param, needle):
    answer = generate(server, **body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and needle in error["message"], error


def test_return_logprob_gives_the_offline_engines_logprobs(server, llm):
    """output_token_logprobs [logprob, id, text] per generated token; from logprob_start_len on,
    input_token_logprobs (the first prompt token's logprob null), top alternatives when asked."""
    ids = llm.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(
        max_tokens=5, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2
    )
    (reference,) = llm.generate([ids], params)
    answer = generate(
        server,
        input_ids=ids,
        sampling_params={"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
        return_text_in_logprobs=True,
    ).json()
    meta = answer["meta_info"]
    outputs = meta["output_token_logprobs"]
    assert [token for _, token, _ in outputs] == reference.token_ids
    want = [entry[t] for entry, t in zip(reference.logprobs, reference.token_ids, strict=True)]
    assert [lp for lp, _, _ in outputs] == pytest.approx(want, abs=1e-5)
    assert [text for _, _, text in outputs] == [
        llm.tokenizer.decode([t]) for t in reference.token_ids
    ]
    inputs = meta["input_token_logprobs"]
    assert [token for _, token, _ in inputs] == ids and inputs[0][0] is None
    want_in = [reference.prompt_logprobs[i][ids[i]] for i in range(1, len(ids))]
    assert [lp for lp, _, _ in inputs[1:]] == pytest.approx(want_in, abs=1e-5)
    for top, entry in zip(meta["output_top_logprobs"], reference.logprobs, strict=True):
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:2]
        assert [t for _, t, _ in top] == [t for t, _ in best]
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(ids)
    # from a later start, and the output only (start -1, SGLang's default), without text
    later = generate(server, input_ids=ids, sampling_params={"max_new_tokens": 2, "temperature": 0}, return_logprob=True, logprob_start_len=2).json()  # fmt: skip
    assert [t for _, t, _ in later["meta_info"]["input_token_logprobs"]] == ids[2:]
    assert later["meta_info"]["input_token_logprobs"][0][0] == pytest.approx(want_in[1], abs=1e-5)
    plain = generate(server, input_ids=ids, sampling_params={"max_new_tokens": 2, "temperature": 0}, return_logprob=True).json()  # fmt: skip
    assert plain["meta_info"]["input_token_logprobs"] == []
    assert all(text is None for _, _, text in plain["meta_info"]["output_token_logprobs"])
    too_far = generate(server, input_ids=ids, return_logprob=True, logprob_start_len=len(ids))
    assert too_far.status_code == 400 and too_far.json()["error"]["param"] == "logprob_start_len"
