"""`baton serve --tp 2`: the same greedy text as the offline TP=1 engine; a rank that dies or
hangs mid-request fails the request with an error naming it within 10 s, /health stops
answering 200, and the server exits instead of hanging. Each test kills what it starts."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from baton.engine.core.llm import LLM
from baton.engine.core.sampling_params import SamplingParams
from tests.server_process import children_of, pid_alive, start_server, tiny_model
from tests.test_server_lifecycle import StreamReader, wait_until


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory, n_groups=1, num_key_value_heads=1)


def _rank_pids(server) -> list[int]:
    """The engine process's children: ranks 1..N-1."""
    return children_of(server.engine_pid)


def test_tp2_server_answers_like_the_offline_tp1_engine(model_dir, tmp_path):
    expected = LLM(model_dir).generate(
        "Once upon a time", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    )[0]
    server = start_server(model_dir, tmp_path, "--tp", "2")
    try:
        assert len(_rank_pids(server)) == 1
        with server.http() as http:
            body = {
                "prompt": "Once upon a time",
                "max_tokens": 16,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            answer = http.post("/v1/completions", json=body).json()
        assert answer["choices"][0]["text"] == expected.text
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_dead_or_hung_rank_fails_the_request_and_the_server_exits(model_dir, tmp_path, how):
    server = start_server(model_dir, tmp_path, "--tp", "2", "--tp-timeout", "3")
    (rank_pid,) = _rank_pids(server)
    try:
        reader = StreamReader(server)
        reader.start()
        assert reader.first_event.wait(30)
        started = time.monotonic()
        os.kill(rank_pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        reader.join(10)
        assert not reader.is_alive(), "the in-flight stream hung after the rank failed"
        assert time.monotonic() - started <= 10
        assert reader.events[-1] == "[DONE]", reader.events[-3:]
        assert "tensor-parallel rank" in reader.events[-2], reader.events[-2]
        if how == "killed":
            assert "rank 1 (pid" in reader.events[-2] and "code -9" in reader.events[-2]
        with pytest.raises(AssertionError):  # never healthy again: 503, then the port closes
            wait_until(_healthy(server), 1, "healthy")
        server.process.wait(20)
        assert server.process.returncode == 3, server.log()[-3000:]  # ENGINE_DIED_EXIT_CODE
        wait_until(lambda: not pid_alive(rank_pid), 10, "the rank exiting")
    finally:
        if pid_alive(rank_pid):
            os.kill(rank_pid, signal.SIGKILL)
        server.stop()


def _healthy(server):
    def check() -> bool:
        try:
            return httpx.get(f"{server.base_url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    return check


def test_tp_flags_reach_the_engine_and_bad_values_are_refused(model_dir):
    from baton.server.args import ServerArgs
    from baton.server.cli import build_parser

    ns = build_parser().parse_args(
        ["serve", "--model", str(model_dir), "--tp", "2", "--tp-timeout", "5"]
    )
    assert (ns.tensor_parallel_size, ns.tp_timeout) == (2, 5.0)
    args = ServerArgs(model=str(model_dir), tensor_parallel_size=2, tp_timeout=5.0)
    assert args.engine_args()["tensor_parallel_size"] == 2
    assert args.engine_args()["tp_timeout"] == 5.0
    with pytest.raises(ValueError, match="--tensor-parallel-size must be >= 1, got 0"):
        ServerArgs(model=str(model_dir), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="--tp-timeout must be > 0"):
        ServerArgs(model=str(model_dir), tp_timeout=0.0)
    # A disaggregated worker may run TP > 1 (the handover goes rank to rank: test_disagg_tp.py).
    decode = ServerArgs(model=str(model_dir), tensor_parallel_size=2, disaggregation_mode="decode")
    assert decode.engine_args()["tensor_parallel_size"] == 2
    assert decode.disagg_options()["role"] == "decode"
