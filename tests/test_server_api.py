"""/v1/completions and /v1/chat/completions against a live `baton serve`, via the openai client.

One server for the module (tiny random NemotronH, fp32); the offline `LLM` on the same model
directory is the reference for every greedy text.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from baton import LLM, SamplingParams
from baton.server.version import baton_version
from tests.server_process import start_server, tiny_model

MODEL_NAME = "tiny"
MAX_MODEL_LEN = 256
PROMPTS = ["Hello world", "The quick brown fox jumps"]
MESSAGES = [{"role": "user", "content": "Tom has 3 apples and buys 4 more."}]
GREEDY = {"temperature": 0, "max_tokens": 24}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    server = start_server(
        model_dir,
        tmp_path_factory.mktemp("logs"),
        "--served-model-name",
        MODEL_NAME,
        "--max-model-len",
        str(MAX_MODEL_LEN),
    )
    yield server
    assert server.stop() == 0, server.log()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), max_model_len=MAX_MODEL_LEN)


def chat_prompt_ids(llm: LLM, messages: list[dict]) -> list[int]:
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def streamed_completion(client, **kwargs) -> tuple[dict[int, str], dict[int, str], list]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    chunks = list(client.completions.create(stream=True, **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


def streamed_chat(client, **kwargs) -> tuple[dict[int, str], dict[int, str], list]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


# ---- text identity ---------------------------------------------------------------------------


def test_completion_text_is_the_same_streamed_unstreamed_and_offline(client, llm):
    offline = llm.generate(PROMPTS, SamplingParams(**GREEDY))
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, **GREEDY)
    texts, finish, _ = streamed_completion(client, model=MODEL_NAME, prompt=PROMPTS, **GREEDY)
    assert [choice.text for choice in response.choices] == [output.text for output in offline]
    assert texts == {index: output.text for index, output in enumerate(offline)}
    assert [choice.finish_reason for choice in response.choices] == [
        output.finish_reason for output in offline
    ]
    assert finish == {index: output.finish_reason for index, output in enumerate(offline)}
    assert all(output.text for output in offline)


def test_chat_text_is_the_same_streamed_unstreamed_and_offline(client, llm):
    (offline,) = llm.generate([chat_prompt_ids(llm, MESSAGES)], SamplingParams(**GREEDY))
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **GREEDY)
    texts, finish, chunks = streamed_chat(client, model=MODEL_NAME, messages=MESSAGES, **GREEDY)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == offline.text != ""
    assert texts == {0: offline.text}
    assert finish == {0: offline.finish_reason}
    assert chunks[0].choices[0].delta.role == "assistant"


def test_token_id_prompt_gives_the_same_text_as_its_string(client, llm):
    ids = llm.tokenizer.encode(PROMPTS[0])
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, **GREEDY)
    by_text = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text


# ---- usage -------------------------------------------------------------------------------------


def test_usage_counts_prompt_and_completion_tokens(client, llm):
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, **GREEDY)
    prompt_tokens = sum(len(llm.tokenizer.encode(prompt)) for prompt in PROMPTS)
    offline = llm.generate(PROMPTS, SamplingParams(**GREEDY))
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == sum(len(output.token_ids) for output in offline)
    assert response.usage.total_tokens == prompt_tokens + response.usage.completion_tokens
    assert response.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_usage_counts_the_templated_prompt(client, llm):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **GREEDY)
    assert response.usage.prompt_tokens == len(chat_prompt_ids(llm, MESSAGES))
    assert response.usage.completion_tokens == len(
        llm.generate([chat_prompt_ids(llm, MESSAGES)], SamplingParams(**GREEDY))[0].token_ids
    )


def unstreamed_and_chunks(client, endpoint: str, stream_options: dict) -> tuple[object, list]:
    """The same greedy request once unstreamed and once streamed with `stream_options`."""
    options = {"stream_options": stream_options, "model": MODEL_NAME, **GREEDY}
    if endpoint == "completions":
        unstreamed = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], **GREEDY)
        _, _, chunks = streamed_completion(client, prompt=PROMPTS[0], **options)
    else:
        unstreamed = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **GREEDY)
        _, _, chunks = streamed_chat(client, messages=MESSAGES, **options)
    return unstreamed, chunks


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_include_usage_adds_a_final_usage_chunk(client, endpoint):
    unstreamed, chunks = unstreamed_and_chunks(client, endpoint, {"include_usage": True})
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.model_dump() == unstreamed.usage.model_dump()
    assert all(chunk.usage is None for chunk in body)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_stats_put_the_running_usage_in_every_chunk(client, endpoint):
    """vLLM's stream_options.continuous_usage_stats: each chunk's completion_tokens is what was
    generated so far (non-decreasing, every chunk), the last one the unstreamed count."""
    unstreamed, chunks = unstreamed_and_chunks(
        client, endpoint, {"include_usage": True, "continuous_usage_stats": True}
    )
    assert all(chunk.usage is not None for chunk in chunks)
    prompt_tokens = {chunk.usage.prompt_tokens for chunk in chunks}
    assert prompt_tokens == {unstreamed.usage.prompt_tokens}
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == unstreamed.usage.completion_tokens
    assert len(set(counts)) > 2  # it moves while tokens stream, not only at the end
    assert chunks[-1].usage.model_dump() == unstreamed.usage.model_dump()


def test_without_include_usage_no_chunk_carries_usage(client):
    _, _, chunks = streamed_completion(client, model=MODEL_NAME, prompt=PROMPTS[0], **GREEDY)
    assert chunks and all(chunk.usage is None and chunk.choices for chunk in chunks)


# ---- n, seeds, stops -----------------------------------------------------------------------------


def test_n_samples_are_indexed_seeded_and_match_the_offline_fan_out(client, llm):
    sampling = {"temperature": 1.0, "max_tokens": 12, "seed": 1234, "n": 3}
    offline = llm.generate([PROMPTS[0]], SamplingParams(**sampling))
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], **sampling)
    texts, _, _ = streamed_completion(client, model=MODEL_NAME, prompt=PROMPTS[0], **sampling)
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    assert [choice.text for choice in response.choices] == [output.text for output in offline]
    assert texts == {index: output.text for index, output in enumerate(offline)}
    assert len({output.text for output in offline}) > 1, "three seeded samples should not all agree"
    assert response.usage.prompt_tokens == len(llm.tokenizer.encode(PROMPTS[0]))


def test_stop_string_ends_the_text_before_it(client, llm):
    (reference,) = llm.generate([PROMPTS[1]], SamplingParams(**GREEDY))
    stop = reference.text[6:9]
    expected = reference.text[: reference.text.index(stop)]
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], stop=[stop], **GREEDY)
    texts, finish, _ = streamed_completion(
        client, model=MODEL_NAME, prompt=PROMPTS[1], stop=stop, **GREEDY
    )
    assert response.choices[0].text == expected == texts[0]
    assert response.choices[0].finish_reason == "stop" == finish[0]


def test_include_stop_str_in_output_keeps_the_stop_string(client, llm):
    """vLLM's include_stop_str_in_output: the text runs through the stop string, streamed or
    not (it changes the output, so it must not be ignored as an unknown field)."""
    (reference,) = llm.generate([PROMPTS[1]], SamplingParams(**GREEDY))
    stop = reference.text[6:9]
    expected = reference.text[: reference.text.index(stop) + len(stop)]
    request = {
        "model": MODEL_NAME, "prompt": PROMPTS[1], "stop": [stop],
        "extra_body": {"include_stop_str_in_output": True}, **GREEDY,
    }  # fmt: skip
    response = client.completions.create(**request)
    texts, finish, _ = streamed_completion(client, **request)
    assert response.choices[0].text == expected == texts[0]
    assert response.choices[0].finish_reason == "stop" == finish[0]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, stop=[stop],
        extra_body={"include_stop_str_in_output": True}, **GREEDY,
    )  # fmt: skip
    (chat_reference,) = llm.generate([chat_prompt_ids(llm, MESSAGES)], SamplingParams(**GREEDY))
    if stop in chat_reference.text:
        at = chat_reference.text.index(stop) + len(stop)
        assert chat.choices[0].message.content == chat_reference.text[:at]


def _metric(server, name: str) -> float:
    with server.http() as http:
        for line in http.get("/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_stop_string_found_by_the_server_aborts_the_engine_request(server, client, llm):
    """Stop strings are matched where the text is made (the server); the engine, which would
    otherwise run to max_tokens, is told to stop."""
    long = {"temperature": 0, "max_tokens": 200, "extra_body": {"ignore_eos": True}}
    (reference,) = llm.generate(
        [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    )
    stop = reference.text[6:9]
    before = _metric(server, "baton:generation_tokens_total")
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], stop=[stop], **long)
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].text == reference.text[: reference.text.index(stop)]
    for _ in range(100):  # the engine reports its counters with its next message
        if _metric(server, "baton:num_requests_running") == 0:
            break
        time.sleep(0.05)
    generated = _metric(server, "baton:generation_tokens_total") - before
    assert response.usage.completion_tokens <= generated < 100


def test_stop_token_id_ends_generation_with_stop(client, llm):
    (reference,) = llm.generate([PROMPTS[1]], SamplingParams(**GREEDY))
    stop_token = reference.token_ids[4]
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], extra_body={"stop_token_ids": [stop_token]}, **GREEDY
    )
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == reference.token_ids.index(stop_token) + 1


def stop_reasons(response) -> list:
    """vLLM's `stop_reason` per choice (not in the openai client's types: an extra field);
    "absent" where the server left the key out."""
    return [choice.model_extra.get("stop_reason", "absent") for choice in response.choices]


def streamed_stop_reasons(chunks) -> dict[int, object]:
    """The stop_reason of each choice's finishing chunk."""
    return {
        choice.index: choice.model_extra.get("stop_reason", "absent")
        for chunk in chunks
        for choice in chunk.choices
        if choice.finish_reason
    }


def test_stop_reason_names_the_stop_string_or_token_that_ended_a_completion(client, llm):
    """vLLM's field: the stop string or stop token id that ended the choice, null when it ran
    to max_tokens or stopped at EOS; in the unstreamed choice and the stream's finishing chunk."""
    (reference,) = llm.generate([PROMPTS[1]], SamplingParams(**GREEDY))
    stop, stop_token = reference.text[6:9], reference.token_ids[4]
    for extra, expected in (
        ({"stop": [stop]}, stop),
        ({"extra_body": {"stop_token_ids": [stop_token]}}, stop_token),
        ({}, None),
    ):
        request = {"model": MODEL_NAME, "prompt": PROMPTS[1], **GREEDY, **extra}
        response = client.completions.create(**request)
        _, _, chunks = streamed_completion(client, **request)
        assert stop_reasons(response) == [expected], extra
        assert streamed_stop_reasons(chunks) == {0: expected}, extra


def test_stop_reason_is_in_chat_choices_too(client, llm):
    (reference,) = llm.generate([chat_prompt_ids(llm, MESSAGES)], SamplingParams(**GREEDY))
    stop = reference.text[6:9]
    request = {"model": MODEL_NAME, "messages": MESSAGES, **GREEDY}
    for extra, expected in (({"stop": [stop]}, stop), ({}, None)):
        response = client.chat.completions.create(**request, **extra)
        _, _, chunks = streamed_chat(client, **request, **extra)
        assert response.choices[0].finish_reason == ("stop" if extra else reference.finish_reason)
        assert stop_reasons(response) == [expected], extra
        assert streamed_stop_reasons(chunks) == {0: expected}, extra


def test_ignore_eos_and_penalties_are_accepted(client):
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[0],
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.2, "top_k": 5, "min_p": 0.05},
        **GREEDY,
    )
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == GREEDY["max_tokens"]


def test_logit_bias_moves_greedy_choices_as_the_offline_engine_does(client, llm):
    """+100 forces a token; -100 on each greedy token makes the engine take its runner-up, the
    second of the unbiased step's top-2 logprobs (an oracle from the raw distribution)."""
    params = {**GREEDY, "max_tokens": 6}
    (plain,) = llm.generate([PROMPTS[0]], SamplingParams(**params, logprobs=2))
    forced = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], logit_bias={"7": 100}, **params
    )
    (forced_offline,) = llm.generate([PROMPTS[0]], SamplingParams(**params, logit_bias={7: 100.0}))
    assert forced_offline.token_ids == [7] * 6
    assert forced.choices[0].text == llm.tokenizer.decode([7] * 6)
    first = plain.token_ids[0]
    runner_up = max((t for t in plain.logprobs[0] if t != first), key=plain.logprobs[0].get)
    banned = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[0],
        logit_bias={str(first): -100},
        logprobs=1,
        **{**params, "max_tokens": 1},
    )
    assert banned.choices[0].logprobs.tokens == [llm.tokenizer.decode([runner_up])]
    # logprobs stay those of the raw distribution, as in vLLM
    assert banned.choices[0].logprobs.token_logprobs[0] == pytest.approx(
        plain.logprobs[0][runner_up], abs=1e-5
    )


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({"x7": 1}, "logit_bias: key 'x7' is not a token id"),
        ({"-7": 1}, "logit_bias: key '-7' is not a token id"),
        ({"7": 100.5}, "logit_bias: 100.5 for token 7 is outside [-100, 100]"),
        ({"100000": 1}, "logit_bias: token id 100000 is outside the vocabulary"),
        ({"7": "high"}, "logit_bias.7: Input should be a valid number"),
    ],
)
def test_bad_logit_bias_is_a_400_naming_it(client, bias, message):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], logit_bias=bias, **GREEDY)
    assert message in caught.value.body["message"]
    assert caught.value.body["param"] == "logit_bias"


UNSUPPORTED = [
    ("completions", "best_of", 2),
    ("completions", "suffix", " the end"),
    ("completions", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("completions", "tool_choice", "required"),
    ("chat", "functions", [{"name": "f", "parameters": {}}]),
    ("completions", "allowed_token_ids", [5, 6]),
    ("completions", "prompt_logprobs", 1),
    # vLLM's other fields that change the output (found side by side with vLLM 0.32)
    ("completions", "use_beam_search", True),
    ("completions", "length_penalty", 0.5),
    ("completions", "logprob_token_ids", [5]),
    ("completions", "prompt_embeds", "AAAA"),
    ("completions", "return_tokens_as_token_ids", True),
    ("completions", "return_token_offsets", True),
    ("completions", "thinking_token_budget", 10),
    ("completions", "repetition_detection", {"max_pattern_size": 4}),
    ("completions", "vllm_xargs", {"x": 1}),
    ("chat", "use_beam_search", True),
    ("chat", "echo", True),
    ("chat", "chat_template", "{{ messages }}"),
    ("chat", "documents", [{"text": "a"}]),
    ("chat", "mm_processor_kwargs", {"x": 1}),
]


@pytest.mark.parametrize(("endpoint", "field", "value"), UNSUPPORTED)
def test_fields_that_would_be_silently_ignored_are_refused_by_name(client, endpoint, field, value):
    """Unknown fields are ignored, but these change what a vLLM server would generate."""
    create = (
        client.completions.create if endpoint == "completions" else client.chat.completions.create
    )
    prompt = {"prompt": PROMPTS[0]} if endpoint == "completions" else {"messages": MESSAGES}
    with pytest.raises(openai.BadRequestError) as caught:
        create(model=MODEL_NAME, **prompt, extra_body={field: value}, **GREEDY)
    assert caught.value.body["param"] == field and field in caught.value.body["message"]


def test_chat_template_kwargs_are_taken_and_reserved_ones_refused(server, client):
    """The tiny template reads no variable: the same prompt; `tokenize` is the server's."""
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **GREEDY)
    extra = {"chat_template_kwargs": {"enable_thinking": False}}
    given = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, extra_body=extra, **GREEDY
    )
    assert given.choices[0].message.content == plain.choices[0].message.content
    tokens = server.http().post("/tokenize", json={"messages": MESSAGES, **extra}).json()
    assert tokens["count"] == plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            extra_body={"chat_template_kwargs": {"tokenize": True}},
            **GREEDY,
        )
    assert caught.value.body["param"] == "chat_template_kwargs"


def test_neutral_values_of_unsupported_fields_are_accepted(client, llm):
    (reference,) = llm.generate([PROMPTS[0]], SamplingParams(**GREEDY))
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], best_of=1, suffix="", **GREEDY
    )
    assert response.choices[0].text == reference.text
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        response_format={"type": "text"},
        tool_choice="none",
        **GREEDY,
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    neutral = {
        "use_beam_search": False, "length_penalty": 1.0, "return_tokens_as_token_ids": False,
        "echo": False, "documents": None, "chat_template": None,
    }  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, extra_body=neutral, **GREEDY
    )
    assert (
        chat.choices[0].message.content
        == client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **GREEDY)
        .choices[0]
        .message.content
    )


def test_add_special_tokens_is_the_tokenizers_as_in_vllm(server, client, llm):
    """completions add the tokenizer's special tokens unless told not to; chat does not (its
    template holds them) unless told to. The tiny tokenizer adds none, so a BOS-adding one is
    checked through /tokenize's count, which follows the same flag."""
    with_default = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=1)
    without = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=1, extra_body={"add_special_tokens": False}
    )
    expected = len(llm.tokenizer.encode(PROMPTS[0], add_special_tokens=False))
    assert without.usage.prompt_tokens == expected
    assert with_default.usage.prompt_tokens == len(llm.tokenizer.encode(PROMPTS[0]))
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=1, extra_body={"add_special_tokens": True}
    )
    assert chat.usage.prompt_tokens == len(
        llm.tokenizer.encode(
            llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        )
    )


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, llm):
    """vLLM's truncate_prompt_tokens: the last k tokens of the prompt (truncation_side "left",
    the default) or the first k ("right"); -1 keeps what the context can hold."""
    ids = llm.tokenizer.encode(PROMPTS[1])
    for side, kept in (("left", ids[-3:]), ("right", ids[:3])):
        (reference,) = llm.generate([kept], SamplingParams(**GREEDY))
        response = client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[1], **GREEDY,
            extra_body={"truncate_prompt_tokens": 3, "truncation_side": side},
        )  # fmt: skip
        assert response.usage.prompt_tokens == 3
        assert response.choices[0].text == reference.text
    echoed = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], echo=True, max_tokens=1,
        extra_body={"truncate_prompt_tokens": 3},
    )  # fmt: skip
    assert echoed.choices[0].text.startswith(llm.tokenizer.decode(ids[-3:]))  # what was kept
    assert not echoed.choices[0].text.startswith(PROMPTS[1])
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=1,
        extra_body={"truncate_prompt_tokens": 4},
    )  # fmt: skip
    assert chat.usage.prompt_tokens == 4
    long = client.completions.create(
        model=MODEL_NAME, prompt=[5] * (MAX_MODEL_LEN + 20), max_tokens=1,
        extra_body={"truncate_prompt_tokens": -1},
    )  # fmt: skip
    assert long.usage.prompt_tokens == MAX_MODEL_LEN - 1
    for bad in (MAX_MODEL_LEN + 1, 0, -2):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(
                model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=1,
                extra_body={"truncate_prompt_tokens": bad},
            )  # fmt: skip
        assert caught.value.body["param"] == "truncate_prompt_tokens", bad


# ---- echo ----------------------------------------------------------------------------------


def hf_prompt_logprobs(model_dir, ids: list[int]) -> list[float]:
    """transformers' log-probability of each prompt token after the ones before it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    chosen = logits[:-1].log_softmax(dim=-1).gather(1, torch.tensor(ids[1:])[:, None])
    return chosen[:, 0].tolist()


def test_echo_with_max_tokens_0_scores_the_prompt_as_transformers_does(client, llm, model_dir):
    """lm-evaluation-harness's loglikelihood requests (echo, logprobs, no new text): the prompt
    comes back with each token's logprob given the tokens before it, the first one null."""
    ids = llm.tokenizer.encode(PROMPTS[1])
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    (choice,) = response.choices
    assert choice.text == PROMPTS[1] and choice.finish_reason == "length"
    assert response.usage.completion_tokens == 0 and response.usage.prompt_tokens == len(ids)
    logprobs = choice.logprobs
    assert logprobs.tokens == [llm.tokenizer.decode([token]) for token in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx(
        hf_prompt_logprobs(model_dir, ids), abs=1e-4
    )
    for token, top in zip(logprobs.tokens[1:], logprobs.top_logprobs[1:], strict=True):
        assert token in top and 1 <= len(top) <= 2
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0


def test_echo_puts_the_prompt_before_the_completion_streamed_or_not(client, llm):
    ids = llm.tokenizer.encode(PROMPTS[0])
    (reference,) = llm.generate([ids], SamplingParams(**GREEDY, logprobs=0, prompt_logprobs=0))
    options = {"model": MODEL_NAME, "echo": True, "logprobs": 0, **GREEDY}
    whole = client.completions.create(prompt=ids, **options).choices[0]
    prompt_text = llm.tokenizer.decode(ids)
    assert whole.text == prompt_text + reference.text
    count = len(ids) + len(reference.token_ids)
    assert len(whole.logprobs.tokens) == len(whole.logprobs.token_logprobs) == count
    expected = [None] + [reference.prompt_logprobs[i][ids[i]] for i in range(1, len(ids))]
    expected += [entry[t] for entry, t in zip(reference.logprobs, reference.token_ids, strict=True)]
    assert whole.logprobs.token_logprobs[0] is None
    assert whole.logprobs.token_logprobs[1:] == pytest.approx(expected[1:], abs=1e-5)
    chunks = list(client.completions.create(prompt=ids, stream=True, **options))
    assert chunks[0].choices[0].text == prompt_text  # the prompt first, in a chunk of its own
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.text
    streamed = [lp for chunk in chunks for lp in chunk.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(expected[1:], abs=1e-5)


def test_echo_scoring_streams_one_chunk_and_n_repeats_the_prompt(client):
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS, echo=True, max_tokens=0, stream=True
        )
    )
    texts = sorted((chunk.choices[0].index, chunk.choices[0].text) for chunk in chunks)
    assert texts == [(0, PROMPTS[0]), (1, PROMPTS[1])]
    assert all(chunk.choices[0].finish_reason == "length" for chunk in chunks)
    both = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], echo=True, n=2, seed=1, max_tokens=3
    )
    assert all(choice.text.startswith(PROMPTS[0]) for choice in both.choices)


def test_max_tokens_0_needs_echo(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=0)
    assert caught.value.body["param"] == "max_tokens"
    assert "0 only with echo" in caught.value.body["message"]


# ---- logprobs ----------------------------------------------------------------------------------


def test_completion_logprobs_have_the_openai_shape_and_offline_values(client, llm):
    (reference,) = llm.generate([PROMPTS[0]], SamplingParams(**GREEDY, logprobs=2))
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], logprobs=2, **GREEDY)
    logprobs = response.choices[0].logprobs
    count = len(reference.token_ids)
    assert (
        len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == count
    )
    assert logprobs.tokens == [llm.tokenizer.decode([token]) for token in reference.token_ids]
    expected = [
        entry[token] for entry, token in zip(reference.logprobs, reference.token_ids, strict=True)
    ]
    assert logprobs.token_logprobs == pytest.approx(expected, abs=1e-5)
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_logprobs_list_tokens_bytes_and_top_alternatives(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    joined = b"".join(bytes(entry.bytes) for entry in content).decode("utf-8", errors="replace")
    assert joined == response.choices[0].message.content


# ---- the other endpoints -----------------------------------------------------------------------


# ---- return_token_ids (vLLM's) -----------------------------------------------------------------


def test_return_token_ids_gives_prompt_and_output_ids_as_vllm_does(client, llm):
    """Completions: each choice carries prompt_token_ids and token_ids; streamed, the first
    chunk of a choice carries its prompt's ids and every chunk its new ids (RL clients rebuild
    the exact sequence from them)."""
    offline = llm.generate(PROMPTS, SamplingParams(**GREEDY))
    request = {"model": MODEL_NAME, "prompt": PROMPTS, "extra_body": {"return_token_ids": True}}
    response = client.completions.create(**request, **GREEDY)
    for choice, output in zip(response.choices, offline, strict=True):
        assert choice.model_extra["prompt_token_ids"] == llm.tokenizer.encode(PROMPTS[choice.index])
        assert choice.model_extra["token_ids"] == output.token_ids
    streamed: dict[int, list[int]] = {0: [], 1: []}
    prompt_ids: dict[int, list] = {0: [], 1: []}
    for chunk in client.completions.create(stream=True, **request, **GREEDY):
        for choice in chunk.choices:
            streamed[choice.index] += choice.model_extra["token_ids"]
            prompt_ids[choice.index].append(choice.model_extra["prompt_token_ids"])
    assert streamed == {index: output.token_ids for index, output in enumerate(offline)}
    for index, given in prompt_ids.items():
        assert given[0] == llm.tokenizer.encode(PROMPTS[index])
        assert all(ids is None for ids in given[1:])


def test_chat_return_token_ids_puts_the_prompt_ids_on_the_response(client, llm):
    prompt = chat_prompt_ids(llm, MESSAGES)
    (reference,) = llm.generate([prompt], SamplingParams(**GREEDY))
    request = {"model": MODEL_NAME, "messages": MESSAGES, "extra_body": {"return_token_ids": True}}
    response = client.chat.completions.create(**request, **GREEDY)
    assert response.model_extra["prompt_token_ids"] == prompt
    assert response.choices[0].model_extra["token_ids"] == reference.token_ids
    chunks = list(client.chat.completions.create(stream=True, **request, **GREEDY))
    assert chunks[0].model_extra["prompt_token_ids"] == prompt
    streamed = [
        token
        for chunk in chunks[1:]
        for choice in chunk.choices
        for token in choice.model_extra["token_ids"]
    ]
    assert streamed == reference.token_ids


# ---- chat messages as vLLM renders them -------------------------------------------------------


def tokenize_messages(server, messages: list[dict], **options) -> httpx.Response:
    with server.http() as http:
        return http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages, **options})


def templated(llm: LLM, messages: list[dict], **options) -> list[int]:
    options = {"add_generation_prompt": True, **options}
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, **options)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def test_developer_messages_reach_a_template_without_that_role_as_one_system_message(server, llm):
    """vLLM: a template that never names "developer" gets developer messages as system ones,
    merged with the other system messages into one first message (templates that want the
    system message first would otherwise fail or drop it)."""
    given = [
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": "Use numbers."},
    ]
    expected = [{"role": "system", "content": "Be brief.\n\nUse numbers."}, given[0]]
    assert tokenize_messages(server, given).json()["tokens"] == templated(llm, expected)


def test_text_parts_of_a_message_are_joined_with_newlines_as_vllm_does(server, client, llm):
    parts = [{"type": "text", "text": "Tom has 3 apples"}, {"type": "text", "text": "and 4 pears."}]
    joined = [{"role": "user", "content": "Tom has 3 apples\nand 4 pears."}]
    assert tokenize_messages(server, [{"role": "user", "content": parts}]).json()["tokens"] == (
        templated(llm, joined)
    )
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": parts}], max_tokens=1
    )
    assert answer.usage.prompt_tokens == len(templated(llm, joined))


def test_continue_final_message_extends_the_assistants_last_message(server, client, llm):
    """vLLM's continue_final_message (assistant prefill): the prompt ends inside the final
    message, with nothing the template would close it with, and generation continues it."""
    messages = [*MESSAGES, {"role": "assistant", "content": "He has"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    prompt = templated(llm, messages, **options)
    assert llm.tokenizer.decode(prompt).endswith("He has")
    assert tokenize_messages(server, messages, **options).json()["tokens"] == prompt
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, extra_body=options, **GREEDY
    )
    (reference,) = llm.generate([prompt], SamplingParams(**GREEDY))
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.choices[0].message.content == reference.text
    with pytest.raises(openai.BadRequestError) as caught:  # vLLM refuses the pair too
        client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=2,
            extra_body={"continue_final_message": True},
        )  # fmt: skip
    assert caught.value.body["param"] == "continue_final_message"


def test_models_retrieve_and_version(server, client):
    """OpenAI's `models.retrieve`; another id is 404 model_not_found; /version as vLLM has it."""
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("org/other-model")
    assert caught.value.body["code"] == "model_not_found"
    version = server.http().get("/version")
    assert version.status_code == 200 and version.json()["version"] == baton_version() != ""


def test_models_lists_the_served_name(client):
    assert [model.id for model in client.models.list().data] == [MODEL_NAME]


def test_tokenize_and_detokenize_round_trip(server, llm):
    with server.http() as http:
        tokens = http.post("/tokenize", json={"prompt": PROMPTS[1]}).json()
        assert tokens["tokens"] == llm.tokenizer.encode(PROMPTS[1])
        assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
        chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
        assert chat["tokens"] == chat_prompt_ids(llm, MESSAGES)
        assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {
            "prompt": PROMPTS[1]
        }


def test_tokenize_returns_token_strs_when_asked_as_vllm_does(server, llm):
    with server.http() as http:
        plain = http.post("/tokenize", json={"prompt": PROMPTS[1]}).json()
        named = http.post("/tokenize", json={"prompt": PROMPTS[1], "return_token_strs": True})
    assert plain["token_strs"] is None
    assert named.json()["token_strs"] == llm.tokenizer.convert_ids_to_tokens(plain["tokens"])


def test_health_is_ok(server):
    with server.http() as http:
        response = http.get("/health")
        pings = [http.get("/ping"), http.post("/ping")]  # vLLM's (SageMaker's) liveness route
    assert response.status_code == 200 and response.json() == {"status": "ok"}
    assert [ping.status_code for ping in pings] == [200, 200]
