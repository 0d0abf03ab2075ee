"""The nixl transfer backend across processes: `baton up --disaggregation-transfer-backend nixl`
serves as a colocated engine does with UCX over TCP and over shared memory on loopback, with
prefix caches on both workers; both report the backend on /disagg/info and count its transfers
on /metrics. A prefill worker killed while the decode worker reads from it fails that request
with a 503, and the decode worker's pages and slots come back.

Skipped only where NIXL is not installed (never under BATON_REQUIRE_NIXL: tests/test_disagg_nixl.py).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import pytest

from baton import LLM, SamplingParams
from tests.same_outputs import chosen
from tests.server_process import Stack, children_of, start_server
from tests.test_disagg_e2e import complete, gauge, pools_return_to_zero
from tests.test_disagg_nixl import needs_nixl

WORKER_FLAGS = ("--page-size", "4", "--mamba-track-interval", "16", "--chunked-prefill-size", "20")


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("base")[0]


@needs_nixl
@pytest.mark.parametrize(
    ("transports", "tp"),
    [("tcp,self", (1, 1)), ("sm,tcp,self", (1, 1)), ("tcp,self", (1, 2)), ("tcp,self", (2, 1))],
    ids=["tcp", "sm", "tcp-tp1to2", "tcp-tp2to1"],
)
def test_baton_up_over_nixl_serves_as_colocated(transports, tp, model_dir, tmp_path, monkeypatch):
    """A prompt twice (a prefix hit on the prefill worker; the decode worker reads only what it
    does not cache), a shared prefix, a first-token-only request: texts and logprobs as an
    in-process colocated engine gives them, at TP 1:1, 1:2 and 2:1 (each decode rank READs its
    slices from every prefill rank's pools, across the worker processes)."""
    monkeypatch.setenv("UCX_TLS", transports)
    whole = [(7 * i) % 300 + 3 for i in range(45)]
    greedy = dict(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    requests = [
        (whole, greedy),
        (whole, greedy),
        (whole[:32] + [5, 9, 11], greedy),
        (whole[:17], dict(max_tokens=1, temperature=0.0, logprobs=2)),
    ]
    reference = LLM(model_dir, page_size=4, enable_prefix_caching=False)
    stack = Stack(
        model_dir,
        tmp_path / "up.log",
        "--disaggregation-transfer-backend",
        "nixl",
        "--prefill-tp",
        str(tp[0]),
        "--decode-tp",
        str(tp[1]),
        "--",
        *WORKER_FLAGS,
    )
    try:
        for prompt, fields in requests:
            answer = httpx.post(
                f"http://127.0.0.1:{stack.port}/v1/completions",
                json={"prompt": prompt, **fields},
                timeout=60,
            )
            assert answer.status_code == 200, answer.text
            (expected,) = reference.generate([prompt], SamplingParams(**fields))
            (choice,) = answer.json()["choices"]
            assert choice["text"] == expected.text
            want = chosen(expected.token_ids, expected.logprobs)
            got = choice["logprobs"]["token_logprobs"]
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-4
        ports = re.search(r"prefill :(\d+) .* decode :(\d+)", stack.log())
        for port in ports.groups():
            worker = Worker(f"http://127.0.0.1:{port}")
            info = httpx.get(f"{worker.base_url}/disagg/info", timeout=10).json()
            assert info["transfer_backend"] == "nixl"
            moved = gauge(worker, "baton:disagg_backend_transfers_total", backend="nixl")
            assert moved == len(requests)
            assert gauge(worker, "baton:disagg_backend_transfer_bytes_total", backend="nixl") > 0
            assert pools_return_to_zero(worker) == [0, 0]
    finally:
        stack.stop()
    assert stack.process.returncode == 0, stack.log()[-3000:]


class Worker:
    """What tests/test_disagg_e2e.py's gauge helpers need of a server."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url


@needs_nixl
def test_prefill_killed_mid_read_fails_the_request_and_frees_the_decode_worker(
    model_dir, tmp_path, monkeypatch
):
    """The decode worker's READs never finish here (fault injection), so the prefill worker
    is killed with one in flight: the decode worker's dropped connection fails the room, its
    client gets a 503, the READ is cancelled and the pages and slot come back."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    nixl = ("--disaggregation-transfer-backend", "nixl", "--disagg-timeout", "30")
    prefill = start_server(
        model_dir, tmp_path, *WORKER_FLAGS, "--disaggregation-mode", "prefill", *nixl
    )
    monkeypatch.setenv("BATON_FAULT_STALL_READS", "1")
    decode = start_server(
        model_dir, tmp_path, *WORKER_FLAGS, "--disaggregation-mode", "decode", *nixl
    )
    monkeypatch.delenv("BATON_FAULT_STALL_READS")
    info = httpx.get(f"{prefill.base_url}/disagg/info", timeout=10).json()
    room = {"room": "mid-read", "prefill_addr": info["transfer_addr"]}
    result: dict = {}

    def send(worker, key: str) -> None:  # as the router does: the same request to both halves
        try:
            result[key] = complete(worker.base_url, list(range(3, 60)), baton_disagg=room)
        except httpx.TransportError as error:  # (the prefill worker, killed)
            result[key] = error

    try:
        threads = [
            threading.Thread(target=send, args=(worker, key))
            for worker, key in ((decode, "decode"), (prefill, "prefill"))
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while gauge(decode, "baton:disagg_rooms_transferring") < 1:  # the READ is in flight
            assert time.monotonic() < deadline, "the decode worker never started reading"
            time.sleep(0.1)
        assert gauge(decode, "baton:kv_pages_used") > 0
        for pid in [*children_of(prefill.process.pid), prefill.process.pid]:
            os.kill(pid, signal.SIGKILL)
        threads[0].join(30)
        response = result["decode"]
        assert response.status_code == 503, response.text
        assert "connection lost" in response.json()["error"]["message"]
        assert pools_return_to_zero(decode) == [0, 0]
        assert httpx.get(f"{decode.base_url}/health", timeout=10).status_code == 200
    finally:
        for part in (decode, prefill):
            part.stop()
