"""The seed bug end to end, on the shipped trained model (assets/).

Multi-turn GSM8K conversations run side by side; each turn's prompt is the previous prompt, its
completion (token for token) and the next question, so a turn's prefix-cache hit reaches into
the previous turn's completion: it resumes from a Mamba checkpoint written in a decode step (or
a mixed one, while another conversation's prompt was prefilling). Through a colocated server and
a prefill/decode pair, cache on (track interval 64, the shortest the shipped model allows) must
answer exactly as a server with the cache off: same tokens, logprobs within 1e-4 (fp32).

The last test puts the seed bug back in a colocated server (its engine process skips the
checkpoint copies of decode and mixed steps while the scheduler still registers them) and shows
that the same comparison then fails. The prefill/decode pair cannot fail that way: its decode
worker's checkpoints only spare K/V pages on the wire, the Mamba state always comes from the
prefill worker, which runs extend steps only.

Nothing here depends on what the model writes (it is retrained from time to time): answers are
compared between runs, never against fixed text.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.bench.accuracy.gsm8k import few_shot_prefix, format_example
from baton.bench.accuracy.gsm8k_data import HELDOUT_PATH, NUM_FEW_SHOT_ROWS, read_jsonl
from baton.server.tokenizer import Tokenizer
from tests.server_process import start_router, start_server

ASSETS = Path(__file__).parents[1] / "assets"
INTERVAL = 64
CHAINS = 4
TURNS = 3
# > INTERVAL, so every completion crosses a checkpoint boundary while it decodes; ignore_eos keeps
# the length fixed whatever the model writes.
MAX_TOKENS = INTERVAL + 8
LOGPROB_TOLERANCE = 1e-4
# Small prefill chunks: one conversation decodes while another's prompt is still prefilling, so
# steps are mixed; the 4 conversations share the 5-shot prefix, so prompts hit each other too.
ENGINE_FLAGS = ("--chunked-prefill-size", "64", "--max-num-batched-tokens", "128")
CACHE_ON = (*ENGINE_FLAGS, "--mamba-track-interval", str(INTERVAL))

# Imported by every Python process started with it on PYTHONPATH: the engine process of the
# server under test gets the seed bug back (decode and mixed steps write no checkpoint, while
# the scheduler registers the blocks as if they had).
SEED_BUG = """
import os
if os.environ.get("BATON_TEST_SEED_BUG") == "1":
    from baton.engine.models import nemotron_h

    _checkpoint = nemotron_h.Mamba2Mixer.checkpoint

    def checkpoint(self, md, *args):
        if md.forward.batch.mode in ("decode", "mixed"):
            return
        _checkpoint(self, md, *args)

    nemotron_h.Mamba2Mixer.checkpoint = checkpoint
"""


@dataclass(frozen=True)
class Answer:
    prompt_len: int
    token_ids: list[int]
    logprobs: list[float]
    cached_tokens: int


def conversations() -> list[list[str]]:
    """CHAINS conversations of TURNS questions each, from the held-out file (after its shots)."""
    rows = read_jsonl(HELDOUT_PATH)
    questions = [row["question"] for row in rows[NUM_FEW_SHOT_ROWS:]]
    return [questions[c * TURNS : (c + 1) * TURNS] for c in range(CHAINS)]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(str(ASSETS))


@pytest.fixture(scope="module")
def token_ids_of_text(tokenizer):
    """The server reports each generated token by its text; every text names one id here."""
    ids: dict[str, int] = {}
    for i in range(len(tokenizer.hf)):
        ids.setdefault(tokenizer.token_text(i), i)
    return ids


def run_conversations(base_url: str, tokenizer, token_ids_of_text) -> dict[tuple[int, int], Answer]:
    shots = few_shot_prefix(read_jsonl(HELDOUT_PATH)[:NUM_FEW_SHOT_ROWS])

    def chain(c: int, questions: list[str]) -> dict[tuple[int, int], Answer]:
        answers, prompt = {}, tokenizer.encode(shots + format_example(questions[0]))
        completion: list[int] = []
        for turn, question in enumerate(questions):
            if turn:
                follow_up = "\n\n" + format_example(question)
                prompt = prompt + completion + tokenizer.encode(follow_up, add_special_tokens=False)
            body = {
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 1,
            }
            response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=300)
            assert response.status_code == 200, response.text
            choice, usage = response.json()["choices"][0], response.json()["usage"]
            tokens = choice["logprobs"]["tokens"]
            ambiguous = [t for t in tokens if t not in token_ids_of_text]
            assert not ambiguous, f"token texts with no single id: {ambiguous}"
            completion = [token_ids_of_text[t] for t in tokens]
            assert len(completion) == MAX_TOKENS
            answers[c, turn] = Answer(
                prompt_len=len(prompt),
                token_ids=completion,
                logprobs=choice["logprobs"]["token_logprobs"],
                cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
            )
        return answers

    with concurrent.futures.ThreadPoolExecutor(CHAINS) as pool:
        futures = [pool.submit(chain, c, qs) for c, qs in enumerate(conversations())]
        return {key: a for f in futures for key, a in f.result().items()}


def assert_same_answers(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key in sorted(expected):
        mine, theirs = got[key], expected[key]
        assert mine.token_ids == theirs.token_ids, f"conversation {key[0]} turn {key[1]}: tokens"
        worst = max(abs(a - b) for a, b in zip(mine.logprobs, theirs.logprobs))
        assert worst <= LOGPROB_TOLERANCE, (
            f"conversation {key[0]} turn {key[1]}: logprobs differ by {worst:.3g}"
        )


def hits_past_the_previous_prompt(answers: dict) -> list[tuple[int, int]]:
    """Turns whose cache hit reached beyond the blocks of the previous turn's prompt, i.e. into
    its completion: a checkpoint written while decoding."""
    reached = []
    for (c, turn), answer in answers.items():
        if turn:
            before = answers[c, turn - 1].prompt_len // INTERVAL * INTERVAL
            if answer.cached_tokens > before:
                reached.append((c, turn))
    return reached


def metric(server, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    raise KeyError(name)


def checkpoints(server, step: str) -> float:
    return metric(server, "baton:mamba_checkpoints_total", step=step)


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("seed-regression-logs")


@pytest.fixture(scope="module")
def cache_off(logs, tokenizer, token_ids_of_text) -> dict:
    server = start_server(ASSETS, logs, *ENGINE_FLAGS, "--no-prefix-cache")
    try:
        answers = run_conversations(server.base_url, tokenizer, token_ids_of_text)
        assert metric(server, "baton:prefix_cache_hits_total") == 0
    finally:
        server.stop()
    assert all(not math.isnan(lp) for a in answers.values() for lp in a.logprobs)
    return answers


def test_colocated_hits_on_decode_and_mixed_checkpoints_and_matches_cache_off(
    logs, tokenizer, token_ids_of_text, cache_off
):
    server = start_server(ASSETS, logs, *CACHE_ON)
    try:
        answers = run_conversations(server.base_url, tokenizer, token_ids_of_text)
        assert checkpoints(server, "decode") > 0
        assert checkpoints(server, "mixed") > 0
        assert metric(server, "baton:prefix_cache_hits_total") > 0
    finally:
        server.stop()
    assert len(hits_past_the_previous_prompt(answers)) == CHAINS * (TURNS - 1)
    assert_same_answers(answers, cache_off)


def test_disaggregated_pair_hits_on_both_sides_and_matches_cache_off(
    logs, tokenizer, token_ids_of_text, cache_off
):
    prefill = start_server(ASSETS, logs, *CACHE_ON, "--disaggregation-mode", "prefill")
    decode = start_server(ASSETS, logs, *CACHE_ON, "--disaggregation-mode", "decode")
    router = start_router(logs, [prefill.base_url], [decode.base_url])
    try:
        answers = run_conversations(router.base_url, tokenizer, token_ids_of_text)
        assert checkpoints(decode, "decode") > 0
        assert metric(prefill, "baton:prefix_cache_hits_total") > 0
        assert metric(decode, "baton:prefix_cache_hits_total") > 0
    finally:
        for part in (router, decode, prefill):
            part.stop()
    # The usage the router relays is the decode worker's: its hits reach into the completions
    # it decoded itself.
    assert len(hits_past_the_previous_prompt(answers)) == CHAINS * (TURNS - 1)
    assert_same_answers(answers, cache_off)


def test_the_regression_fails_with_the_seed_bug_put_back(
    logs, tokenizer, token_ids_of_text, cache_off, tmp_path, monkeypatch
):
    (tmp_path / "sitecustomize.py").write_text(SEED_BUG)
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{path}" if path else str(tmp_path))
    monkeypatch.setenv("BATON_TEST_SEED_BUG", "1")
    server = start_server(ASSETS, logs, *CACHE_ON)
    try:
        answers = run_conversations(server.base_url, tokenizer, token_ids_of_text)
        # The scheduler still counts (and registers) the checkpoints the forward skipped.
        assert checkpoints(server, "decode") > 0
    finally:
        server.stop()
    assert hits_past_the_previous_prompt(answers)
    with pytest.raises(AssertionError, match="conversation") as failure:
        assert_same_answers(answers, cache_off)
    print(f"with the seed bug put back: {failure.value}")
