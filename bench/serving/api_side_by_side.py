"""What a client sees from two OpenAI-compatible servers on the same model, request by request.

    python -m baton.bench.serving.api_side_by_side --a http://127.0.0.1:8021 --b http://127.0.0.1:8011 \
        --model model [--only PREFIX] [--json out.json]

Sends one battery of requests (bench/serving/api_battery.py, bench/serving/api_battery_structured.py and bench/serving/api_battery_tools.py: valid
ones, malformed ones, every route a vLLM user relies on) to both servers with raw httpx and prints, per request, where the two
answers differ in *shape*: status code, error type / code / param, response keys and value types, `object`,
`finish_reason`, `stop_reason`, usage counts, logprobs structure, and for streams the SSE
framing (the chunk sequence with its roles, finish reasons and usage, and `data: [DONE]`).
Generated text is compared only for greedy requests, where both engines should agree. Used
for the record in bench/results/*/api/vllm_side_by_side.md; the server under test is `--a`.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import httpx

from baton.bench.serving.api_battery import Case, cases, client_calls
from baton.bench.serving.api_battery_structured import structured_cases, structured_client_calls
from baton.bench.serving.api_battery_tools import (
    tool_and_reasoning_cases,
    tool_and_reasoning_client_calls,
)

# keys whose values (not only types) a client acts on
VALUE_KEYS = {
    "object", "finish_reason", "stop_reason", "role", "type", "code", "param", "index",
    "prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens", "status",
}  # fmt: skip


def parse_sse(text: str) -> tuple[list[Any], list[str]]:
    """(events, framing problems): every `data:` payload parsed, [DONE] kept as the string."""
    events, problems = [], []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        for line in block.split("\n"):
            if not line.startswith("data: "):
                problems.append(f"non-data line {line[:40]!r}")
                continue
            payload = line[len("data: ") :]
            events.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
    if not text.endswith("\n\n"):
        problems.append("stream does not end with a blank line")
    return events, problems


def shape(value: Any, key: str = "") -> Any:
    """Types for every value, the value itself where a client acts on it (VALUE_KEYS)."""
    if isinstance(value, dict):
        return {k: shape(v, k) for k, v in sorted(value.items())}
    if isinstance(value, list):
        if not value:
            return []
        # one element's shape stands for all when they agree (token lists); else every one
        shapes = [shape(item, key) for item in value]
        if all(s == shapes[0] for s in shapes) and key not in VALUE_KEYS:
            return {"[*]": shapes[0], "len": len(value)}
        return {f"[{i}]": s for i, s in enumerate(shapes)}
    if key in VALUE_KEYS:
        return value
    return type(value).__name__


def chunk_kind(event: Any) -> str:
    """One SSE event as a short label: what its choices carry, and usage."""
    if event == "[DONE]":
        return "[DONE]"
    if "error" in event:
        return f"error({event['error'].get('code')})"
    parts = []
    for choice in event.get("choices", []):
        delta = choice.get("delta")
        fields = (
            sorted(delta) if isinstance(delta, dict) else (["text"] if "text" in choice else [])
        )
        if choice.get("logprobs") is not None:
            fields.append("logprobs")
        finish = choice.get("finish_reason")
        parts.append(f"{choice.get('index')}:{'+'.join(fields)}" + (f"/{finish}" if finish else ""))
    label = ",".join(parts) or "no-choices"
    if event.get("usage") is not None:
        label += "+usage"
    elif "usage" in event:
        label += "+usage:null"
    return label


def collapse(labels: list[str]) -> list[str]:
    out: list[str] = []
    for label in labels:
        if out and out[-1].split(" x")[0] == label:
            head, _, count = out[-1].partition(" x")
            out[-1] = f"{head} x{int(count or 1) + 1}"
        else:
            out.append(label)
    return out


def observe(client: httpx.Client, case: Case) -> dict:
    """Everything about the answer that a client could notice, normalised for diffing."""
    kwargs: dict[str, Any] = {}
    if isinstance(case.body, bytes):
        kwargs = {"content": case.body, "headers": {"Content-Type": "application/json"}}
    elif case.body is not None:
        kwargs = {"json": case.body}
    response = client.request(case.method, case.path, **kwargs)
    seen: dict[str, Any] = {"status": response.status_code}
    content_type = response.headers.get("content-type", "").split(";")[0]
    seen["content_type"] = content_type
    if content_type == "text/event-stream":
        events, problems = parse_sse(response.text)
        seen["framing"] = problems
        seen["chunks"] = collapse([chunk_kind(event) for event in events])
        objects = [e for e in events if isinstance(e, dict)]
        # the first chunk, the first one that finishes a choice, and the usage-only one
        with_choices = [e for e in objects if e.get("choices")]
        finishing = [e for e in with_choices if e["choices"][0].get("finish_reason")]
        usage_only = [e for e in objects if "choices" in e and not e["choices"]]
        for label, group in (("first", with_choices), ("finish", finishing), ("usage", usage_only)):
            if group:
                seen[f"{label}_chunk"] = shape(group[0])
        ids = {e.get("id") for e in objects}
        seen["one_id"] = len(ids) == 1
        if case.greedy:
            texts: dict[int, str] = {}
            for e in objects:
                for choice in e.get("choices", []):
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    texts[choice["index"]] = texts.get(choice["index"], "") + piece
            seen["texts"] = texts
        return seen
    try:
        body = response.json()
    except ValueError:
        seen["body_text"] = response.text[:200]
        return seen
    seen["shape"] = shape(body)
    if isinstance(body, dict) and isinstance(body.get("id"), str):
        seen["id_prefix"] = body["id"].split("-")[0]
    if case.greedy and isinstance(body, dict):
        seen["texts"] = {
            choice.get("index"): choice.get("text", (choice.get("message") or {}).get("content"))
            for choice in body.get("choices", [])
        }
    if isinstance(body, dict) and "error" in body and isinstance(body["error"], dict):
        seen["error_message"] = body["error"].get("message")
    return seen


def diff(a: Any, b: Any, path: str = "", extras: set[str] | None = None) -> list[str]:
    """`extras` collects keys only one side has and sets to null (vLLM's kv_transfer_params…),
    which a client cannot tell from absent; they are listed once rather than per request."""
    if isinstance(a, dict) and isinstance(b, dict):
        lines = []
        for key in sorted(set(a) | set(b), key=str):
            where = f"{path}.{key}" if path else str(key)
            lone = a.get(key, b.get(key))
            if (key not in a or key not in b) and lone == "NoneType" and extras is not None:
                general = re.sub(r"\[\d+\]", "[i]", where)
                extras.add(f"{general} only {'B' if key not in a else 'A'}")
                continue
            if key not in a:
                lines.append(f"{where}: only B ({json.dumps(b[key])[:120]})")
            elif key not in b:
                lines.append(f"{where}: only A ({json.dumps(a[key])[:120]})")
            else:
                lines += diff(a[key], b[key], where, extras)
        return lines
    if a != b:
        return [f"{path}: A {json.dumps(a)[:300]} | B {json.dumps(b)[:300]}"]
    return []


def client_observe(base_url: str, call) -> Any:
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=300)
    try:
        result = call(client)
    except (openai.APIError, openai.LengthFinishReasonError) as error:  # (parse() raises both)
        return {"raised": type(error).__name__, "status": getattr(error, "status_code", None)}
    items = result if isinstance(result, list) else [result]
    if hasattr(result, "data"):
        items = list(result.data)
    picked = {"first": items[0], "last": items[-1]} if items else {}
    if len(items) > 2:
        picked["before_last"] = items[-2]
    return {name: shape(item.model_dump()) for name, item in picked.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", required=True, help="the server under test (baton)")
    parser.add_argument("--b", required=True, help="the reference server (vLLM)")
    parser.add_argument("--model", required=True, help="the served model name on both")
    parser.add_argument("--only", default="", help="run the cases whose name starts with this")
    parser.add_argument(
        "--ignore", default="", help="leave out difference lines matching this regex (known ones)"
    )
    parser.add_argument("--json", help="write every observation here")
    parser.add_argument(
        "--client", action="store_true", help="also send a few through the official openai client"
    )
    args = parser.parse_args()
    observations = {}
    extras: set[str] = set()
    with (
        httpx.Client(base_url=args.a, timeout=300) as a,
        httpx.Client(base_url=args.b, timeout=300) as b,
    ):
        for case in (
            cases(args.model) + structured_cases(args.model) + tool_and_reasoning_cases(args.model)
        ):
            if not case.name.startswith(args.only):
                continue
            seen_a, seen_b = observe(a, case), observe(b, case)
            observations[case.name] = {"a": seen_a, "b": seen_b}
            compared_a = {k: v for k, v in seen_a.items() if k != "error_message"}
            compared_b = {k: v for k, v in seen_b.items() if k != "error_message"}
            lines = diff(compared_a, compared_b, extras=extras)
            if args.ignore:
                lines = [line for line in lines if not re.search(args.ignore, line)]
            print(f"== {case.name}: {'same' if not lines else 'DIFFERS'}")
            for line in lines:
                print(f"   {line}")
            if "error_message" in seen_a or "error_message" in seen_b:
                print(f"   A says: {seen_a.get('error_message')!r}")
                print(f"   B says: {seen_b.get('error_message')!r}")
    if args.client:
        for name, call in (
            client_calls(args.model)
            + structured_client_calls(args.model)
            + tool_and_reasoning_client_calls(args.model)
        ):
            if not name.startswith(args.only.removeprefix("client.")):
                continue
            seen_a, seen_b = client_observe(args.a, call), client_observe(args.b, call)
            lines = diff({"r": seen_a}, {"r": seen_b}, extras=extras)
            if args.ignore:
                lines = [line for line in lines if not re.search(args.ignore, line)]
            print(f"== client.{name}: {'same' if not lines else 'DIFFERS'}")
            for line in lines:
                print(f"   {line}")
    print("== null-valued keys only one side sends (not diffed above):")
    for line in sorted(extras):
        print(f"   {line}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(observations, out, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
