"""Structured-output request fields -> one StructuredOutputs (or a 400 naming the field).

    OpenAI   response_format: {"type": "json_object"} | {"type": "json_schema", "json_schema":
             {"name", "schema", "strict"}} | {"type": "structural_tag", ...}
    vLLM     structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object" |
             "structural_tag": ...}, and the older guided_json / guided_regex / guided_choice /
             guided_grammar (vLLM 0.32 ignores those silently; baton honours them)
    SGLang   /generate sampling_params json_schema / regex / ebnf / structural_tag (mapped onto
             structured_outputs by server/openai/validation.py:completion_from_generate)

`structured_outputs_of` runs where every generation request is checked without a model (the
workers and the router): the field's shape. `checked_structured` runs on a worker, in a thread,
before the request is admitted: the spec itself (a JSON schema lowered into what the grammar
engine enforces, or refused naming the keyword and its path; xgrammar parses the rest), so a bad
spec is a 400 before any compute, and the engine compiles the lowered spec.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections import OrderedDict
from typing import Any

from baton.engine.core.sampling_params import SamplingParams, StructuredKind, StructuredOutputs
from baton.engine.structured_output import check_structured_outputs
from baton.server.errors import APIError

# vLLM's StructuredOutputsParams: the constraint keys (exactly one) and the options baton takes.
_CONSTRAINT_KEYS: dict[str, StructuredKind] = {
    "json": "json",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
    "structural_tag": "structural_tag",
}
# option -> the values baton does anyway (it writes JSON on one line, never adds properties)
_OPTIONS: dict[str, tuple[Any, ...]] = {
    "disable_fallback": (True, False),  # one backend: there is nothing to fall back to
    "disable_any_whitespace": (True,),
    "disable_additional_properties": (True, False),
    "whitespace_pattern": (None,),
}
_GUIDED: dict[str, StructuredKind] = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_outputs_of(request: Any) -> StructuredOutputs | None:
    """The one constraint a generation request asks for (None: none); 400 for a malformed field
    or for two constraints at once."""
    found: list[tuple[str, StructuredOutputs]] = []
    response_format = getattr(request, "response_format", None)
    if response_format is not None:
        structured = _from_response_format(response_format)
        if structured is not None:
            found.append(("response_format", structured))
    if getattr(request, "structured_outputs", None) is not None:
        found.append(("structured_outputs", _from_vllm(request.structured_outputs)))
    for name, kind in _GUIDED.items():
        value = getattr(request, name, None)
        if value is not None:
            found.append((name, _spec(kind, value, name)))
    if len(found) > 1:
        raise APIError.bad_request(
            f"{found[0][0]} and {found[1][0]} both constrain the output: give one", found[1][0]
        )
    return found[0][1] if found else None


async def checked_structured(params: SamplingParams, param: str) -> SamplingParams:
    """`params` with its structured output checked and lowered (a worker thread: a large
    schema takes a while), or a 400 naming `param` (the field the spec came from)."""
    structured = params.structured_outputs
    if structured is None:
        return params
    try:
        checked = await asyncio.to_thread(_checked, structured)
    except ValueError as error:
        reason = str(error).removeprefix("structured_outputs: ")
        raise APIError.bad_request(f"{param}: {reason}", param.split(".")[0]) from None
    return dataclasses.replace(params, structured_outputs=checked)


def structured_source(request: Any) -> str:
    """The request field its structured output came from (a forced tool call's: `tools`)."""
    for name in ("response_format", "structured_outputs", *_GUIDED):
        if getattr(request, name, None) not in (None, {"type": "text"}):
            return name
    return "tools"


class _CheckedSpecs:
    """Specs that passed, with what the engine compiles for them (a client sends the same
    schema again and again), least recently used first, up to `limit` characters of spec in
    all; a failed check raises and is not remembered. Shared by the check threads."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._specs: OrderedDict[StructuredOutputs, StructuredOutputs] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def __call__(self, structured: StructuredOutputs) -> StructuredOutputs:
        with self._lock:
            if structured in self._specs:
                self._specs.move_to_end(structured)
                return self._specs[structured]
        checked = check_structured_outputs(structured)
        with self._lock:
            if structured not in self._specs:
                self._specs[structured] = checked
                self._chars += len(structured.spec) + len(checked.spec)
            while self._chars > self.limit and len(self._specs) > 1:
                key, value = self._specs.popitem(last=False)
                self._chars -= len(key.spec) + len(value.spec)
        return checked


_checked = _CheckedSpecs(limit=16 << 20)


def _from_response_format(value: Any) -> StructuredOutputs | None:
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise APIError.bad_request(
            "response_format must be an object with a `type` (text, json_object, json_schema, "
            "structural_tag)",
            param,
        )
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec("json_object", "", param)
    if kind == "json_schema":
        body = value.get("json_schema")
        if not isinstance(body, dict):
            raise APIError.bad_request("response_format.json_schema must be an object", param)
        if "schema" not in body:
            raise APIError.bad_request("response_format.json_schema.schema is required", param)
        strict = body.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise APIError.bad_request(
                "response_format.json_schema.strict must be a boolean", param
            )
        # strict or not, the schema is enforced (the grammar never writes what it forbids)
        return _spec("json", body["schema"], "response_format.json_schema.schema")
    if kind == "structural_tag":
        return _spec("structural_tag", value, param)
    raise APIError.bad_request(
        f"response_format.type must be text, json_object, json_schema or structural_tag, "
        f"got {kind!r}",
        param,
    )


def _from_vllm(value: Any) -> StructuredOutputs:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise APIError.bad_request("structured_outputs must be an object", param)
    given = [key for key in _CONSTRAINT_KEYS if value.get(key) not in (None, False)]
    if len(given) != 1:
        raise APIError.bad_request(
            "structured_outputs must give exactly one of "
            f"{', '.join(_CONSTRAINT_KEYS)}" + (f" (got {', '.join(given)})" if given else ""),
            param,
        )
    for key, option in value.items():
        if key in _CONSTRAINT_KEYS:
            continue
        if key not in _OPTIONS:
            raise APIError.bad_request(f"structured_outputs.{key} is not supported", param)
        if not any(option == ok and type(option) is type(ok) for ok in _OPTIONS[key]):
            raise APIError.bad_request(
                f"structured_outputs.{key} = {json.dumps(option)} is not supported (baton "
                "writes JSON on one line)",
                param,
            )
    key = given[0]
    if key == "json_object":
        if value[key] is not True:
            raise APIError.bad_request("structured_outputs.json_object must be true", param)
        return _spec("json_object", "", param)
    return _spec(_CONSTRAINT_KEYS[key], value[key], f"structured_outputs.{key}")


def _spec(kind: StructuredKind, value: Any, param: str) -> StructuredOutputs:
    """The field's value as the spec text of its kind (400 for the wrong JSON type)."""
    name = param.split(".")[0]
    if kind in ("json", "structural_tag"):
        if isinstance(value, (dict, bool)):
            value = json.dumps(value, ensure_ascii=False)
        elif not isinstance(value, str):
            raise APIError.bad_request(f"{param} must be a JSON object (or its text)", name)
    elif kind == "choice":
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise APIError.bad_request(f"{param} must be a list of strings", name)
        value = json.dumps(value, ensure_ascii=False)
    elif kind != "json_object" and not isinstance(value, str):
        raise APIError.bad_request(f"{param} must be a string", name)
    return StructuredOutputs(kind=kind, spec=value, after_token_ids=())
