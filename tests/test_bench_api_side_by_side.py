"""baton.bench.serving.api_side_by_side: its parsing and diffing on answers built by hand (a difference a
client would notice is reported, a null-only key is set aside), and the whole battery's
completions cases against one `baton serve` on both sides (every case the same)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from baton.bench.serving.api_battery import Case, cases
from baton.bench.serving.api_side_by_side import chunk_kind, collapse, diff, parse_sse, shape
from tests.server_process import start_server, tiny_model

ROOT = Path(__file__).resolve().parents[1]


def several_choices(case: Case) -> bool:
    """A stream of several choices (n > 1, or a list of prompts): its chunks interleave as the
    engine's steps fall, so two runs of it need not frame the same."""
    if not case.stream:  # (a stream's body is a dict)
        return False
    prompt = case.body.get("prompt")
    listed = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (list, str))
    return case.body.get("n") not in (None, 1) or listed


def test_parse_sse_reads_events_and_names_framing_problems():
    good = 'data: {"choices": []}\n\ndata: [DONE]\n\n'
    assert parse_sse(good) == ([{"choices": []}, "[DONE]"], [])
    events, problems = parse_sse('event: x\ndata: {"a": 1}\n\ndata: [DONE]')
    assert events == [{"a": 1}, "[DONE]"]
    assert problems == ["non-data line 'event: x'", "stream does not end with a blank line"]


def test_chunk_labels_and_their_runs():
    text = {"choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]}
    last = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": None}
    usage = {"choices": [], "usage": {"total_tokens": 3}}
    labels = [chunk_kind(e) for e in (text, text, last, usage, "[DONE]")]
    assert labels == ["0:text", "0:text", "0:text/length+usage:null", "no-choices+usage", "[DONE]"]
    assert collapse(labels) == [
        "0:text x2",
        "0:text/length+usage:null",
        "no-choices+usage",
        "[DONE]",
    ]
    assert chunk_kind({"error": {"code": 400}}) == "error(400)"


def test_diff_reports_what_a_client_sees_and_sets_null_only_keys_aside():
    a = shape({"object": "text_completion", "choices": [{"finish_reason": "stop", "text": "x"}],
               "usage": {"prompt_tokens": 3}, "service_tier": None})  # fmt: skip
    b = shape({"object": "text_completion", "choices": [{"finish_reason": "length", "text": 5}],
               "usage": {"prompt_tokens": 3}})  # fmt: skip
    extras: set[str] = set()
    lines = diff(a, b, extras=extras)
    assert any(line.startswith("choices.[*].finish_reason") for line in lines), lines
    assert any(line.startswith("choices.[*].text") for line in lines), lines
    assert not any("usage" in line or "service_tier" in line for line in lines), lines
    assert extras == {"service_tier only A"}
    assert diff(a, a) == []
    # token lists of any length share one shape; values a client acts on are kept
    assert shape({"tokens": [1, 2, 3]}) == {"tokens": {"[*]": "int", "len": 3}}
    assert shape({"finish_reason": "stop"}) == {"finish_reason": "stop"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = tiny_model(tmp_path_factory)
    logs = tmp_path_factory.mktemp("logs")
    server = start_server(model_dir, logs, "--served-model-name", "tiny", "--max-model-len", "256")
    yield server
    server.stop()


def test_one_server_on_both_sides_answers_every_completions_case_the_same(server, tmp_path):
    out = tmp_path / "observed.json"
    run = subprocess.run(
        [sys.executable, "-m", "baton.bench.serving.api_side_by_side", "--a", server.base_url,
         "--b", server.base_url, "--model", "tiny", "--only", "c.", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    verdicts = [line for line in run.stdout.splitlines() if line.startswith("== c.")]
    assert len(verdicts) > 100, run.stdout[-2000:]
    # streams of several choices interleave their chunks as the engine's steps fall
    differing = {v.split(":")[0][3:] for v in verdicts if not v.endswith(": same")}
    timing = {case.name for case in cases("tiny") if several_choices(case)}
    assert len(timing) >= 3 and differing <= timing, run.stdout[-3000:]
    observed = json.loads(out.read_text())
    # the battery reached the server: greedy text came back, and refusals were refusals
    assert observed["c.basic"]["a"]["status"] == 200
    assert observed["c.basic"]["a"]["texts"]["0"]
    assert {o["a"]["status"] for o in observed.values()} >= {200, 400}
