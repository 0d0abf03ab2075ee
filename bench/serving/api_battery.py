"""The requests `baton.bench.serving.api_side_by_side` sends to both servers: one battery of valid and
malformed requests over every route a vLLM user relies on (`cases`), and the same kinds of
request through the official `openai` client (`client_calls`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QUESTION = "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:"
MESSAGES = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many?"}]


@dataclass
class Case:
    name: str
    path: str
    body: Any = None  # dict -> JSON; bytes -> sent as they are
    method: str = "POST"
    greedy: bool = False  # compare text too

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and self.body.get("stream") is True


def cases(model: str) -> list[Case]:
    c = "/v1/completions"
    ch = "/v1/chat/completions"
    g = {"model": model, "temperature": 0, "max_tokens": 12}
    cmp = {**g, "prompt": QUESTION}
    chat = {**g, "messages": MESSAGES}
    out = [
        # ---- completions: valid
        Case("c.basic", c, cmp, greedy=True),
        Case("c.no_model", c, {k: v for k, v in cmp.items() if k != "model"}, greedy=True),
        Case(
            "c.max_tokens_absent",
            c,
            {"model": model, "prompt": QUESTION, "temperature": 0},
            greedy=True,
        ),
        Case("c.max_tokens_null", c, {**cmp, "max_tokens": None}, greedy=True),
        Case("c.n2", c, {**cmp, "n": 2, "temperature": 1, "seed": 1}),
        Case("c.n2.stream", c, {**cmp, "n": 2, "temperature": 1, "seed": 1, "stream": True}),
        Case("c.seed", c, {**cmp, "temperature": 0.8, "seed": 7}),
        Case("c.stop", c, {**cmp, "max_tokens": 40, "stop": ["\n"]}, greedy=True),
        Case("c.stop_spanning", c, {**cmp, "max_tokens": 40, "stop": ["25 ="]}, greedy=True),
        Case(
            "c.stop_include",
            c,
            {**cmp, "max_tokens": 40, "stop": ["25 ="], "include_stop_str_in_output": True},
            greedy=True,
        ),
        Case(
            "c.stop_token_ids", c, {**cmp, "max_tokens": 40, "stop_token_ids": [268]}, greedy=True
        ),
        Case(
            "c.stop.stream",
            c,
            {**cmp, "max_tokens": 40, "stop": ["25 ="], "stream": True},
            greedy=True,
        ),
        Case("c.ignore_eos", c, {**cmp, "max_tokens": 60, "ignore_eos": True}, greedy=True),
        Case("c.eos", c, {**cmp, "max_tokens": 200}, greedy=True),
        Case("c.logprobs0", c, {**cmp, "logprobs": 0}, greedy=True),
        Case("c.logprobs5", c, {**cmp, "logprobs": 5}, greedy=True),
        Case("c.logprobs20", c, {**cmp, "logprobs": 20}, greedy=True),
        Case("c.logprobs21", c, {**cmp, "logprobs": 21}),
        Case("c.logprobs5.stream", c, {**cmp, "logprobs": 5, "stream": True}, greedy=True),
        Case("c.echo", c, {**cmp, "echo": True}, greedy=True),
        Case("c.echo_logprobs", c, {**cmp, "echo": True, "logprobs": 2}, greedy=True),
        Case("c.echo_max0", c, {**cmp, "echo": True, "logprobs": 1, "max_tokens": 0}),
        Case("c.token_ids", c, {**g, "prompt": [40, 41, 42, 43]}, greedy=True),
        Case("c.list_of_text", c, {**g, "prompt": [QUESTION, "Question: hi"]}, greedy=True),
        Case("c.list_of_ids", c, {**g, "prompt": [[40, 41, 42], [50, 51]]}, greedy=True),
        Case(
            "c.list_of_ids.stream",
            c,
            {**g, "prompt": [[40, 41, 42], [50, 51]], "stream": True},
            greedy=True,
        ),
        Case("c.stream", c, {**cmp, "stream": True}, greedy=True),
        Case(
            "c.stream.usage",
            c,
            {**cmp, "stream": True, "stream_options": {"include_usage": True}},
            greedy=True,
        ),
        Case(
            "c.stream.usage_false",
            c,
            {**cmp, "stream": True, "stream_options": {"include_usage": False}},
            greedy=True,
        ),
        Case(
            "c.stream.continuous",
            c,
            {
                **cmp,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
            greedy=True,
        ),
        Case("c.stream_options_no_stream", c, {**cmp, "stream_options": {"include_usage": True}}),
        Case(
            "c.unicode",
            c,
            {**g, "prompt": "Question: 🍎 café 日本語 — how many?\nAnswer:"},
            greedy=True,
        ),
        Case("c.top_p_small", c, {**cmp, "temperature": 1, "top_p": 1e-9, "seed": 1}),
        Case("c.top_k1", c, {**cmp, "temperature": 1, "top_k": 1}),
        Case("c.top_k0", c, {**cmp, "top_k": 0}),
        Case("c.top_k-1", c, {**cmp, "top_k": -1}),
        Case("c.min_p1", c, {**cmp, "temperature": 1, "min_p": 1.0}),
        Case("c.temp_high", c, {**cmp, "temperature": 2.0, "seed": 3}),
        Case(
            "c.penalties",
            c,
            {**cmp, "presence_penalty": 1, "frequency_penalty": 1, "repetition_penalty": 1.2},
        ),
        Case("c.logit_bias", c, {**cmp, "logit_bias": {"13": 100}}),
        Case("c.min_tokens", c, {**cmp, "min_tokens": 5, "max_tokens": 8}),
        Case("c.user", c, {**cmp, "user": "someone"}),
        Case("c.best_of_n", c, {**cmp, "best_of": 1}),
        Case(
            "c.stop_include.stream",
            c,
            {
                **cmp,
                "max_tokens": 40,
                "stop": ["25 ="],
                "include_stop_str_in_output": True,
                "stream": True,
            },
            greedy=True,
        ),
        Case(
            "c.stop_token_ids.stream",
            c,
            {**cmp, "max_tokens": 40, "stop_token_ids": [268], "stream": True},
            greedy=True,
        ),
        Case("c.max_clamped", c, {**cmp, "max_tokens": 2040, "ignore_eos": True}, greedy=True),
        Case("c.truncate_prompt_tokens", c, {**cmp, "truncate_prompt_tokens": 5}, greedy=True),
        Case(
            "c.truncate_right",
            c,
            {**cmp, "truncate_prompt_tokens": 5, "truncation_side": "right"},
            greedy=True,
        ),
        Case("c.truncate_too_big", c, {**cmp, "truncate_prompt_tokens": 5000}),
        Case("c.add_special_tokens_false", c, {**cmp, "add_special_tokens": False}, greedy=True),
        Case("c.return_token_ids", c, {**cmp, "return_token_ids": True}),
        Case("c.use_beam_search", c, {**cmp, "use_beam_search": True}),
        # ---- completions: refused
        Case("c.bad_model", c, {**cmp, "model": "nope"}),
        Case("c.empty_prompt", c, {**cmp, "prompt": ""}),
        Case("c.empty_list", c, {**cmp, "prompt": []}),
        Case("c.empty_ids_in_list", c, {**cmp, "prompt": [[]]}),
        Case("c.prompt_missing", c, {"model": model}),
        Case("c.prompt_too_long", c, {**g, "prompt": [40] * 3000}),
        Case("c.prompt_fills_ctx", c, {**g, "prompt": [40] * 2048}),
        Case("c.max_over_ctx", c, {**cmp, "max_tokens": 5000}),
        Case("c.max0", c, {**cmp, "max_tokens": 0}),
        Case("c.max_neg", c, {**cmp, "max_tokens": -1}),
        Case("c.max_huge", c, {**cmp, "max_tokens": 10**20}),
        Case("c.max_str", c, {**cmp, "max_tokens": "16"}),
        Case("c.max_float", c, {**cmp, "max_tokens": 16.0}),
        Case("c.max_float_frac", c, {**cmp, "max_tokens": 16.5}),
        Case("c.max_bool", c, {**cmp, "max_tokens": True}),
        Case("c.n0", c, {**cmp, "n": 0}),
        Case("c.n_neg", c, {**cmp, "n": -1}),
        Case("c.n_huge", c, {**cmp, "n": 10**10}),
        Case("c.n_str", c, {**cmp, "n": "2"}),
        Case("c.temp_neg", c, {**cmp, "temperature": -1}),
        Case("c.temp_str", c, {**cmp, "temperature": "0"}),
        Case("c.temp_huge", c, {**cmp, "temperature": 1e308}),
        Case("c.top_p0", c, {**cmp, "top_p": 0}),
        Case("c.top_p_gt1", c, {**cmp, "top_p": 1.5}),
        Case("c.top_k-2", c, {**cmp, "top_k": -2}),
        Case("c.top_k_float", c, {**cmp, "top_k": 1.5}),
        Case("c.min_p_gt1", c, {**cmp, "min_p": 1.5}),
        Case("c.min_p_neg", c, {**cmp, "min_p": -0.1}),
        Case("c.presence_big", c, {**cmp, "presence_penalty": 3}),
        Case("c.repetition0", c, {**cmp, "repetition_penalty": 0}),
        Case("c.seed_neg", c, {**cmp, "seed": -1}),
        Case("c.seed_huge", c, {**cmp, "seed": 2**70}),
        Case("c.seed_str", c, {**cmp, "seed": "1"}),
        Case("c.logprobs_neg", c, {**cmp, "logprobs": -1}),
        Case("c.logprobs_huge", c, {**cmp, "logprobs": 10**6}),
        Case("c.logprobs_bool", c, {**cmp, "logprobs": True}),
        Case("c.stop_int", c, {**cmp, "stop": 5}),
        Case("c.stop_list_int", c, {**cmp, "stop": [5]}),
        Case("c.stop_empty_str", c, {**cmp, "stop": ""}),
        Case("c.stop_token_ids_neg", c, {**cmp, "stop_token_ids": [-1]}),
        Case("c.stop_token_ids_oov", c, {**cmp, "stop_token_ids": [10**6]}),
        Case("c.prompt_int", c, {**cmp, "prompt": 5}),
        Case("c.prompt_float_list", c, {**cmp, "prompt": [1.5]}),
        Case("c.prompt_mixed_list", c, {**cmp, "prompt": ["a", 1]}),
        Case("c.prompt_oov", c, {**cmp, "prompt": [10**6]}),
        Case("c.prompt_neg_id", c, {**cmp, "prompt": [-1]}),
        Case("c.prompt_null", c, {**cmp, "prompt": None}),
        Case("c.echo_str", c, {**cmp, "echo": "yes"}),
        Case("c.stream_str", c, {**cmp, "stream": "true"}),
        Case(
            "c.stream_options_bad",
            c,
            {**cmp, "stream": True, "stream_options": {"include_usage": "yes"}},
        ),
        Case("c.logit_bias_bad_key", c, {**cmp, "logit_bias": {"abc": 1}}),
        Case("c.logit_bias_oov", c, {**cmp, "logit_bias": {"1000000": 1}}),
        Case("c.min_tokens_over_max", c, {**cmp, "min_tokens": 20, "max_tokens": 8}),
        Case("c.best_of2", c, {**cmp, "best_of": 2}),
        Case("c.suffix", c, {**cmp, "suffix": "x"}),
        Case("c.response_format_json", c, {**cmp, "response_format": {"type": "json_object"}}),
        Case(
            "c.lone_surrogate",
            c,
            b'{"model": "' + model.encode() + b'", "prompt": "\\ud800", "max_tokens": 2}',
        ),
        Case("c.invalid_json", c, b'{"model": "x", "prompt": '),
        Case("c.json_array", c, b"[1, 2]"),
        Case("c.empty_body", c, b""),
        Case(
            "c.nan", c, b'{"model": "' + model.encode() + b'", "prompt": "a", "temperature": NaN}'
        ),
        Case(
            "c.big_number",
            c,
            b'{"model": "' + model.encode() + b'", "prompt": "a", "temperature": 1e400}',
        ),
        Case("c.get", c, None, method="GET"),
        # ---- chat: valid
        Case("ch.basic", ch, chat, greedy=True),
        Case(
            "ch.no_max_tokens",
            ch,
            {"model": model, "messages": MESSAGES, "temperature": 0},
            greedy=True,
        ),
        Case(
            "ch.max_completion_tokens",
            ch,
            {**{k: v for k, v in chat.items() if k != "max_tokens"}, "max_completion_tokens": 5},
            greedy=True,
        ),
        Case(
            "ch.turns",
            ch,
            {
                **chat,
                "messages": [
                    {"role": "system", "content": "You solve word problems."},
                    {"role": "user", "content": "Question: Ann has 2 pens. She buys 3. How many?"},
                    {"role": "assistant", "content": "2 + 3 = 5.\n#### 5"},
                    {"role": "user", "content": "Question: Bob has 5 cups and breaks 1. How many?"},
                ],
            },
            greedy=True,
        ),
        Case(
            "ch.developer",
            ch,
            {**chat, "messages": [{"role": "developer", "content": "Be brief."}, *MESSAGES]},
            greedy=True,
        ),
        Case("ch.name", ch, {**chat, "messages": [{**MESSAGES[0], "name": "tom"}]}, greedy=True),
        Case(
            "ch.prefill",
            ch,
            {
                **chat,
                "messages": [*MESSAGES, {"role": "assistant", "content": "He has"}],
                "add_generation_prompt": False,
                "continue_final_message": True,
            },
            greedy=True,
        ),
        Case("ch.no_gen_prompt", ch, {**chat, "add_generation_prompt": False}, greedy=True),
        Case(
            "ch.content_parts",
            ch,
            {
                **chat,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "Tom has 3 apples"},
                            {"type": "text", "text": " and buys 4 more."},
                        ],
                    }
                ],
            },
            greedy=True,
        ),
        Case(
            "ch.content_null_assistant",
            ch,
            {**chat, "messages": [*MESSAGES, {"role": "assistant", "content": None}, *MESSAGES]},
        ),
        Case(
            "ch.unicode",
            ch,
            {**chat, "messages": [{"role": "user", "content": "🍎🍎🍎 + 🍏 = ?"}]},
            greedy=True,
        ),
        Case("ch.n2", ch, {**chat, "n": 2, "temperature": 1, "seed": 1}),
        Case("ch.n2.stream", ch, {**chat, "n": 2, "temperature": 1, "seed": 1, "stream": True}),
        Case("ch.stop", ch, {**chat, "max_tokens": 40, "stop": ["27 ="]}, greedy=True),
        Case(
            "ch.stop_token_ids",
            ch,
            {**chat, "max_tokens": 40, "stop_token_ids": [268]},
            greedy=True,
        ),
        Case("ch.eos", ch, {**chat, "max_tokens": 300}, greedy=True),
        Case("ch.logprobs", ch, {**chat, "logprobs": True}, greedy=True),
        Case("ch.top_logprobs0", ch, {**chat, "logprobs": True, "top_logprobs": 0}, greedy=True),
        Case("ch.top_logprobs5", ch, {**chat, "logprobs": True, "top_logprobs": 5}, greedy=True),
        Case("ch.top_logprobs20", ch, {**chat, "logprobs": True, "top_logprobs": 20}, greedy=True),
        Case(
            "ch.top_logprobs5.stream",
            ch,
            {**chat, "logprobs": True, "top_logprobs": 5, "stream": True},
            greedy=True,
        ),
        Case(
            "ch.logprobs_false_top0",
            ch,
            {**chat, "logprobs": False, "top_logprobs": 0},
            greedy=True,
        ),
        Case("ch.stream", ch, {**chat, "stream": True}, greedy=True),
        Case(
            "ch.stream.usage",
            ch,
            {**chat, "stream": True, "stream_options": {"include_usage": True}},
            greedy=True,
        ),
        Case(
            "ch.stream.continuous",
            ch,
            {
                **chat,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
            greedy=True,
        ),
        Case(
            "ch.chat_template_kwargs",
            ch,
            {**chat, "chat_template_kwargs": {"enable_thinking": False}},
            greedy=True,
        ),
        Case("ch.tool_choice_none", ch, {**chat, "tool_choice": "none"}, greedy=True),
        Case(
            "ch.response_format_text",
            ch,
            {**chat, "response_format": {"type": "text"}},
            greedy=True,
        ),
        Case(
            "ch.stop.stream",
            ch,
            {**chat, "max_tokens": 40, "stop": ["27 ="], "stream": True},
            greedy=True,
        ),
        Case(
            "ch.stop_include",
            ch,
            {**chat, "max_tokens": 40, "stop": ["27 ="], "include_stop_str_in_output": True},
            greedy=True,
        ),
        Case("ch.max_clamped", ch, {**chat, "max_tokens": 2040, "ignore_eos": True}, greedy=True),
        Case("ch.reasoning_effort", ch, {**chat, "reasoning_effort": "none"}, greedy=True),
        Case("ch.truncate_prompt_tokens", ch, {**chat, "truncate_prompt_tokens": 6}, greedy=True),
        Case(
            "ch.prefill_and_gen_prompt",
            ch,
            {
                **chat,
                "messages": [*MESSAGES, {"role": "assistant", "content": "He has"}],
                "continue_final_message": True,
            },
        ),
        Case(
            "ch.developer_merged",
            ch,
            {
                **chat,
                "messages": [
                    *MESSAGES,
                    {"role": "developer", "content": "Be brief."},
                    {"role": "system", "content": "Use numbers."},
                ],
            },
            greedy=True,
        ),
        # ---- chat: refused
        Case("ch.bad_model", ch, {**chat, "model": "nope"}),
        Case("ch.empty_messages", ch, {**chat, "messages": []}),
        Case("ch.missing_messages", ch, {"model": model}),
        Case("ch.unknown_role", ch, {**chat, "messages": [{"role": "robot", "content": "hi"}]}),
        Case("ch.missing_role", ch, {**chat, "messages": [{"content": "hi"}]}),
        Case("ch.content_int", ch, {**chat, "messages": [{"role": "user", "content": 5}]}),
        Case("ch.content_dict", ch, {**chat, "messages": [{"role": "user", "content": {"a": 1}}]}),
        Case(
            "ch.content_image",
            ch,
            {
                **chat,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,AAAA"},
                            }
                        ],
                    }
                ],
            },
        ),
        Case(
            "ch.content_part_no_type",
            ch,
            {**chat, "messages": [{"role": "user", "content": [{"text": "hi"}]}]},
        ),
        Case("ch.messages_str", ch, {**chat, "messages": "hi"}),
        Case("ch.max_over_ctx", ch, {**chat, "max_tokens": 5000}),
        Case("ch.max0", ch, {**chat, "max_tokens": 0}),
        Case("ch.max_neg", ch, {**chat, "max_tokens": -1}),
        Case("ch.top_logprobs21", ch, {**chat, "logprobs": True, "top_logprobs": 21}),
        Case("ch.top_logprobs_neg", ch, {**chat, "logprobs": True, "top_logprobs": -1}),
        Case("ch.top_logprobs_no_logprobs", ch, {**chat, "top_logprobs": 3}),
        Case("ch.logprobs_int", ch, {**chat, "logprobs": 5}),
        Case("ch.n0", ch, {**chat, "n": 0}),
        Case("ch.temp_neg", ch, {**chat, "temperature": -1}),
        Case(
            "ch.tools",
            ch,
            {**chat, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        ),
        Case("ch.response_format_json", ch, {**chat, "response_format": {"type": "json_object"}}),
        Case(
            "ch.prompt_too_long",
            ch,
            {**chat, "messages": [{"role": "user", "content": "7 " * 3000}]},
        ),
        Case("ch.invalid_json", ch, b'{"messages": [}'),
        Case(
            "ch.lone_surrogate",
            ch,
            b'{"model": "'
            + model.encode()
            + b'", "messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}',
        ),
        # ---- refusals of streamed requests: an error body before any SSE, as unstreamed
        Case("c.stream.bad_model", c, {**cmp, "model": "nope", "stream": True}),
        Case("c.stream.prompt_too_long", c, {**g, "prompt": [40] * 3000, "stream": True}),
        Case("c.stream.max_neg", c, {**cmp, "max_tokens": -1, "stream": True}),
        Case(
            "ch.stream.bad_role",
            ch,
            {**chat, "messages": [{"role": "x", "content": "a"}], "stream": True},
        ),
        Case(
            "ch.stream.n2.usage",
            ch,
            {**chat, "n": 2, "stream": True, "stream_options": {"include_usage": True}},
            greedy=True,
        ),
        Case(
            "c.stream.n2.usage",
            c,
            {**cmp, "n": 2, "stream": True, "stream_options": {"include_usage": True}},
            greedy=True,
        ),
        # ---- other routes
        Case("models", "/v1/models", method="GET"),
        Case("models.retrieve", f"/v1/models/{model}", method="GET"),
        Case("models.retrieve_missing", "/v1/models/nope", method="GET"),
        Case("health", "/health", method="GET"),
        Case("version", "/version", method="GET"),
        Case("ping", "/ping", method="GET"),
        Case("not_found", "/v1/nothing", method="GET"),
        Case("tokenize.prompt", "/tokenize", {"model": model, "prompt": "Hello 🍎 world"}),
        Case("tokenize.no_model", "/tokenize", {"prompt": "Hello world"}),
        Case(
            "tokenize.no_special",
            "/tokenize",
            {"prompt": "Hello world", "add_special_tokens": False},
        ),
        Case("tokenize.messages", "/tokenize", {"model": model, "messages": MESSAGES}),
        Case(
            "tokenize.return_token_strs",
            "/tokenize",
            {"model": model, "prompt": "Hello", "return_token_strs": True},
        ),
        Case("tokenize.bad_model", "/tokenize", {"model": "nope", "prompt": "a"}),
        Case("tokenize.neither", "/tokenize", {"model": model}),
        Case("tokenize.prompt_int", "/tokenize", {"model": model, "prompt": 5}),
        Case("detokenize", "/detokenize", {"model": model, "tokens": [40, 41, 42]}),
        Case("detokenize.oov", "/detokenize", {"model": model, "tokens": [10**6]}),
        Case("detokenize.neg", "/detokenize", {"model": model, "tokens": [-1]}),
        Case("detokenize.missing", "/detokenize", {"model": model}),
    ]
    return out


def client_calls(model: str) -> list[tuple[str, Any]]:
    """The same kind of requests through the official `openai` client: what its types parse,
    and which exception class a refusal becomes."""
    cmp = {"model": model, "prompt": QUESTION, "max_tokens": 8, "temperature": 0}
    chat = {"model": model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    usage = {"stream_options": {"include_usage": True}}
    return [
        ("completions", lambda c: c.completions.create(**cmp)),
        ("completions.logprobs_echo", lambda c: c.completions.create(**cmp, logprobs=2, echo=True)),
        ("completions.n2", lambda c: c.completions.create(**cmp | {"temperature": 1, "n": 2})),
        ("completions.stream", lambda c: list(c.completions.create(**cmp, stream=True, **usage))),
        ("chat", lambda c: c.chat.completions.create(**chat)),
        (
            "chat.logprobs",
            lambda c: c.chat.completions.create(**chat, logprobs=True, top_logprobs=3),
        ),
        ("chat.stream", lambda c: list(c.chat.completions.create(**chat, stream=True, **usage))),
        ("models.list", lambda c: c.models.list()),
        ("error.model", lambda c: c.completions.create(**cmp | {"model": "nope"})),
        ("error.context", lambda c: c.completions.create(**cmp | {"prompt": [40] * 3000})),
        (
            "error.stream",
            lambda c: list(c.completions.create(**cmp | {"max_tokens": -1}, stream=True)),
        ),
    ]
