"""Process lifecycle: a dead engine fails fast, a signal winds everything down, no orphans.

Each test kills what it starts, so each starts its own server.
"""

from __future__ import annotations

import glob
import os
import signal
import tempfile
import threading
import time

import httpx
import pytest

from tests.server_process import pid_alive, start_server, tiny_model

LONG_STREAM = {"prompt": "Once upon a time", "max_tokens": 3000, "stream": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory)


@pytest.fixture
def server(model_dir, tmp_path):
    server = start_server(model_dir, tmp_path)
    yield server
    server.stop()


def ipc_files(server) -> list[str]:
    """The server's ipc socket files (engine/runtime/ipc.py's channel), /tmp/baton-<server pid>-*."""
    return glob.glob(os.path.join(tempfile.gettempdir(), f"baton-{server.process.pid}-*"))


def wait_until(condition, timeout: float, what: str) -> float:
    """Seconds until `condition()` held; fails after `timeout`."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"{what} did not happen within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - started


class StreamReader(threading.Thread):
    """Reads one SSE stream in the background until it ends; remembers its last events."""

    def __init__(self, server) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.events: list[str] = []
        self.first_event = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream(
                "POST", f"{self.server.base_url}/v1/completions", json=LONG_STREAM, timeout=60
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
                        self.first_event.set()
        except httpx.HTTPError as error:
            self.events.append(f"transport error: {error!r}")
        self.first_event.set()


def test_killed_engine_fails_in_flight_requests_then_the_server_exits_non_zero(server):
    """A live port in front of a dead engine would answer 503 forever; exiting non-zero lets a
    supervisor (docker, systemd, Kubernetes, `baton up`) restart the pair."""
    reader = StreamReader(server)
    reader.start()
    assert reader.first_event.wait(30)
    os.kill(server.engine_pid, signal.SIGKILL)

    reader.join(10)
    assert not reader.is_alive(), "the in-flight stream hung after the engine died"
    assert reader.events[-1] == "[DONE]" and "engine unavailable" in reader.events[-2]
    assert "exited with code -9" in reader.events[-2], reader.events[-2]

    server.process.wait(20)
    assert server.process.returncode == 3, server.log()[-3000:]  # ENGINE_DIED_EXIT_CODE
    assert "engine process exited with code -9" in server.log()
    assert "supervisor can restart" in server.log()
    with pytest.raises(httpx.TransportError):  # the port is closed, not answering 503
        httpx.get(f"{server.base_url}/health", timeout=5)
    assert ipc_files(server) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_aborts_in_flight_requests_and_stops_both_processes(server, sig):
    engine_pid = server.engine_pid
    reader = StreamReader(server)
    reader.start()
    assert reader.first_event.wait(30)
    server.process.send_signal(sig)
    server.process.wait(20)
    assert server.process.returncode == 0, server.log()[-3000:]
    wait_until(lambda: not pid_alive(engine_pid), 5, "the engine process exiting")
    reader.join(5)
    assert not reader.is_alive()
    assert reader.events[-1] == "[DONE]", reader.events[-3:]
    assert "server is shutting down" in reader.events[-2]


def test_engine_exits_when_the_server_is_killed_outright(server):
    """...and removes the ipc socket files the server could not (they were left in /tmp)."""
    engine_pid = server.engine_pid
    assert len(ipc_files(server)) == 2
    server.process.kill()
    server.process.wait(10)
    wait_until(lambda: not pid_alive(engine_pid), 5, "the orphaned engine process exiting")
    assert ipc_files(server) == [], server.log()[-3000:]
