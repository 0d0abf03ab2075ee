"""Tool-call parsers: the model's answer text -> content + tool calls, by `--tool-call-parser`.

    text:  Let me check.\\n<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>
    parse: content "Let me check.\\n"   calls [f({"x": 1})]

Formats (vLLM's parser names):
  hermes, granite4   <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen3, Qwen3-Next,
                     Granite-4.0, Falcon-H1, the shipped model's template)
  nemotron_json      <TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL> (Nemotron
                     Nano 9B v2, as NVIDIA's vLLM plugin of that name)
  qwen3_coder        <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function>
                     </tool_call> (Nemotron 3, Qwen3.5, Qwen3-Coder); values typed by the
                     tool's JSON schema
and, not selectable, the bare JSON that a grammar forces for tool_choice "required" (an array
of {"name", "parameters"}) and for a named function (its arguments object), as vLLM does.

What the formats share (content around blocks, streaming) is server/parsers/blocks.py; the JSON
formats are server/parsers/json_calls.py, qwen3_coder server/parsers/xml_calls.py. A call to a
function the request's tools do not name is still a call (SGLang drops it; vLLM and OpenAI's
clients hand it back, so an agent can tell the model the tool does not exist).
"""

from __future__ import annotations

from baton.server.parsers.blocks import ToolCallParser
from baton.server.parsers.json_calls import TaggedJsonParser
from baton.server.parsers.xml_calls import Qwen3CoderParser

TOOL_CALL_PARSERS = ("hermes", "granite4", "qwen3_coder", "nemotron_json")


def make_tool_parser(name: str, tools: list[dict]) -> ToolCallParser:
    """A fresh parser (they cache per request) for `--tool-call-parser NAME`."""
    if name in ("hermes", "granite4"):
        return TaggedJsonParser("<tool_call>", "</tool_call>")
    if name == "nemotron_json":
        return TaggedJsonParser("<TOOLCALL>", "</TOOLCALL>")
    if name == "qwen3_coder":
        return Qwen3CoderParser(tools)
    raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_CALL_PARSERS)}")
