"""`baton up`: a random worker secret by default, secrets only in environments, and a stack that stops as a whole, exit code 1,
naming the part, when any of its processes dies (engines included)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from baton.engine.core.llm import LLM
from baton.engine.core.sampling_params import SamplingParams
from baton.engine.runtime.cpu_threads import cores_per_engine
from tests.server_process import BATON, Stack, children_of, free_port, pid_alive, tiny_model
from tests.tiny import load_json, save_tiny_model, save_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory)


def environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if b"=" in entry)


def test_up_hands_its_secrets_to_every_part_in_the_environment_never_argv(model_dir, tmp_path):
    """A random worker secret for both workers, and the API key (from --api-key-file) for all
    three, in their environments: no process of the stack shows either in /proc/*/cmdline."""
    key = "up-api-key-4f1c"
    (tmp_path / "key").write_text(key + "\n")
    stack = Stack(model_dir, tmp_path / "up.log", "--api-key-file", str(tmp_path / "key"))
    try:
        parts = stack.parts()
        secrets_seen = {
            name: environ(parts[name]).get("BATON_DISAGG_SECRET")
            for name in ("prefill worker", "decode worker", "router")
        }
        secret = secrets_seen["prefill worker"]
        assert secret and re.fullmatch(r"[0-9a-f]{64}", secret), secrets_seen
        assert secrets_seen["decode worker"] == secret and secrets_seen["router"] is None
        for name in ("prefill worker", "decode worker", "router"):
            assert environ(parts[name]).get("BATON_API_KEY") == key, name
        for name, pid in parts.items():  # never on a command line
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert secret.encode() not in command and key.encode() not in command, name
        # Two engines on one machine: each runs on its half of the cores (engine/runtime/cpu_threads.py).
        share = str(cores_per_engine(2))
        for name in ("prefill engine", "decode engine"):
            assert environ(parts[name]).get("OMP_NUM_THREADS") == os.environ.get(
                "OMP_NUM_THREADS", share
            ), name
        body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
        url = f"http://127.0.0.1:{stack.port}/v1/completions"
        assert httpx.post(url, json=body, timeout=60).status_code == 401
        keyed = {"Authorization": f"Bearer {key}"}
        assert httpx.post(url, json=body, headers=keyed, timeout=60).status_code == 200
    finally:
        stack.stop()
    assert stack.process.returncode == 0, stack.log()[-3000:]


@pytest.mark.parametrize("victim", ["decode engine", "prefill engine", "prefill worker"])
def test_up_stops_the_whole_stack_and_names_the_part_that_died(model_dir, tmp_path, victim):
    stack = Stack(model_dir, tmp_path / "up.log")
    try:
        parts = stack.parts()
        os.kill(parts[victim], signal.SIGKILL)
        stack.process.wait(60)
    finally:
        stack.stop()
    assert stack.process.returncode == 1, stack.log()[-3000:]
    assert f"the {victim} (pid {parts[victim]}" in stack.log(), stack.log()[-3000:]
    assert "stopping the stack" in stack.log()
    deadline = time.monotonic() + 10
    while any(pid_alive(pid) for pid in parts.values()):
        assert time.monotonic() < deadline, {n: pid_alive(p) for n, p in parts.items()}
        time.sleep(0.1)


def test_up_with_different_tp_sizes_serves_the_tp1_answer(model_dir, tmp_path):
    """`--tp 2 --decode-tp 1`: a TP=2 prefill worker (n_groups and KV heads split across its
    ranks) hands over to a TP=1 decode worker, rank by rank; each of the three ranks runs on its
    share of the cores, and the answer is the offline TP=1 engine's."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = LLM(model_dir).generate("Once upon a time", params)[0]
    stack = Stack(model_dir, tmp_path / "up.log", "--tp", "2", "--decode-tp", "1")
    try:
        parts = stack.parts()
        (rank1,) = children_of(parts["prefill engine"])
        assert children_of(parts["decode engine"]) == []
        threads = {n: environ(parts[n])["OMP_NUM_THREADS"] for n in parts if "engine" in n}
        if "OMP_NUM_THREADS" not in os.environ:  # (a user's own setting wins)
            share = cores_per_engine(3)
            assert threads == {"prefill engine": str(2 * share), "decode engine": str(share)}
        # each prefill rank: half its engine's threads
        assert environ(rank1)["OMP_NUM_THREADS"] == str(max(1, int(threads["prefill engine"]) // 2))
        prefill_port, decode_port = re.search(
            r"prefill :(\d+) \(TP=2\) -> decode :(\d+) \(TP=1\)", stack.log()
        ).groups()
        info = {
            role: httpx.get(f"http://127.0.0.1:{port}/disagg/info", timeout=10).json()
            for role, port in (("prefill", prefill_port), ("decode", decode_port))
        }
        assert len(info["prefill"]["rank_transfer_addrs"]) == 2
        (decode_rank,) = info["decode"]["rank_transfer_addrs"]
        assert decode_rank.startswith("tcp://127.0.0.1:"), info
        body = {"prompt": "Once upon a time", **params_body(params)}
        url = f"http://127.0.0.1:{stack.port}/v1/completions"
        answer = httpx.post(url, json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == expected.text
    finally:
        stack.stop()
    assert stack.process.returncode == 0, stack.log()[-3000:]


def params_body(params: SamplingParams) -> dict:
    return {"max_tokens": params.max_tokens, "temperature": 0.0, "ignore_eos": True}


def test_up_forwards_tokenizer_to_both_workers(tmp_path):
    """A model directory without a tokenizer: named at once without --tokenizer; served with it."""
    model, elsewhere = tmp_path / "model", tmp_path / "tokenizer"
    save_tiny_model(model, tokenizer=False)
    save_tokenizer(elsewhere, load_json(model / "config.json")["vocab_size"])
    refused = subprocess.run(
        [str(BATON), "up", "--model", str(model), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert refused.returncode != 0
    assert f"--model {model}: no tokenizer there" in refused.stderr + refused.stdout
    stack = Stack(model, tmp_path / "up.log", "--tokenizer", str(elsewhere))
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
        url = f"http://127.0.0.1:{stack.port}/v1/completions"
        answer = httpx.post(url, json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        expected = AutoTokenizer.from_pretrained(str(elsewhere)).encode("Once upon a time")
        assert answer.json()["usage"]["prompt_tokens"] == len(expected)
    finally:
        stack.stop()
    assert stack.process.returncode == 0, stack.log()[-3000:]


def test_up_on_the_shipped_model_prints_nothing_a_newcomer_would_take_for_an_error(tmp_path):
    """What `make serve` shows (`baton up --model assets`), through one answered request: no
    warning, error or "not found" line (the server processes hold no torch on purpose, and
    transformers' notice of it is not shown)."""
    assets = Path(__file__).parents[1] / "assets"
    stack = Stack(assets, tmp_path / "up.log")
    try:
        body = {"prompt": "Question: 2 pens cost $4. How much is one?\nAnswer:", "max_tokens": 8}
        url = f"http://127.0.0.1:{stack.port}/v1/completions"
        assert httpx.post(url, json=body, timeout=60).status_code == 200
    finally:
        stack.stop()
    assert stack.process.returncode == 0, stack.log()[-3000:]
    alarming = re.compile(r"warn|error|not found|traceback|deprecat|fail", re.IGNORECASE)
    assert [line for line in stack.log().splitlines() if alarming.search(line)] == []
