"""Start a real `baton serve` subprocess on a free 127.0.0.1 port, and stop it (server tests)."""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

BATON = Path(sys.executable).with_name("baton")  # the console script next to this interpreter
STARTUP_TIMEOUT_S = 120
# Every process _start launched: a fixture that fails half-way (its second server never became
# healthy) or a test run that ends early still stops them all when pytest exits.
_STARTED: list[ServerProcess] = []


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def children_of(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(child) for child in (task / "children").read_text().split()]
    return children


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie awaiting its parent's wait() counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


@dataclass
class ServerProcess:
    process: subprocess.Popen
    port: int
    log_path: Path
    api_key: str | None
    host: str = "127.0.0.1"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def engine_pid(self) -> int:
        (pid,) = children_of(self.process.pid)
        return pid

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=self.api_key or "none", max_retries=0, **options
        )

    def async_client(self, **options) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1", api_key=self.api_key or "none", max_retries=0, **options
        )

    def http(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, wait, and SIGKILL as a last resort; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(
    model_dir: str | Path,
    log_dir: Path,
    *flags: str,
    api_key: str | None = None,
    port: int | None = None,
) -> ServerProcess:
    return start_servers(model_dir, log_dir, [list(flags)], api_key=api_key, port=port)[0]


def start_servers(
    model_dir: str | Path,
    log_dir: Path,
    flag_lists: list[list[str]],
    api_key: str | None = None,
    port: int | None = None,
) -> list[ServerProcess]:
    """One `baton serve` per flag list, all loading at once; returned once all are healthy."""
    servers = []
    for flags in flag_lists:
        server_port = port or free_port()
        log_path = log_dir / f"baton-serve-{server_port}-{time.monotonic_ns()}.log"
        command = [str(BATON), "serve", "--model", str(model_dir), "--port", str(server_port)]
        command += [*flags, *(["--api-key", api_key] if api_key else [])]
        servers.append(launch(command, server_port, log_path, api_key))
    for server in servers:
        wait_ready(server)
    return servers


def start_router(
    log_dir: Path,
    prefill: list[str],
    decode: list[str],
    *flags: str,
    require_ready: bool = True,
    api_key: str | None = None,
) -> ServerProcess:
    server = launch_router(log_dir, prefill, decode, *flags, api_key=api_key)
    wait_ready(server, require_ready)
    return server


def launch_router(
    log_dir: Path, prefill: list[str], decode: list[str], *flags: str, api_key: str | None = None
) -> ServerProcess:
    """A `baton router` started, not waited for (`wait_ready`)."""
    port = free_port()
    log_path = log_dir / f"baton-router-{port}.log"
    command = [
        str(BATON),
        "router",
        "--prefill",
        ",".join(prefill),
        "--decode",
        ",".join(decode),
        "--port",
        str(port),
        *flags,
    ]
    if api_key:
        command += ["--api-key", api_key]
    return launch(command, port, log_path, api_key)


def launch(
    command: list[str],
    port: int,
    log_path: Path,
    api_key: str | None,
    env: dict[str, str] | None = None,
    host: str = "127.0.0.1",
    cwd: Path = Path(__file__).parents[1],
) -> ServerProcess:
    """A process started, not waited for (`wait_ready`); `host`: the address it listens on;
    `cwd`: where it starts (the repository root unless a test says otherwise)."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env)
    server = ServerProcess(
        process=process, port=port, log_path=log_path, api_key=api_key, host=host
    )
    _STARTED.append(server)
    return server


def wait_ready(server: ServerProcess, require_ready: bool = True) -> None:
    process = server.process
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"baton serve exited with {process.returncode}:\n{server.log()[-4000:]}"
            )
        try:
            status = httpx.get(f"{server.base_url}/health", timeout=1).status_code
            if status == 200 or (status == 503 and not require_ready):
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(
        f"baton serve did not become healthy in {STARTUP_TIMEOUT_S} s:\n{server.log()[-4000:]}"
    )


class Stack:
    """A `baton up` stack (router + prefill + decode workers) with its log."""

    def __init__(self, model_dir: Path, log_path: Path, *flags: str) -> None:
        self.port = free_port()
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if k != "BATON_DISAGG_SECRET"}
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                [str(BATON), "up", "--model", str(model_dir), "--port", str(self.port), *flags],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=Path(__file__).parents[1],
            )
        deadline = time.monotonic() + 180
        while "baton is up" not in self.log():
            assert self.process.poll() is None, self.log()[-3000:]
            assert time.monotonic() < deadline, self.log()[-3000:]
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def parts(self) -> dict[str, int]:
        """name -> pid for the three children and the two engines."""
        found = {}
        for pid in children_of(self.process.pid):
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"router" in command:
                found["router"] = pid
            else:
                role = command[command.index(b"--disaggregation-mode") + 1].decode()
                found[f"{role} worker"] = pid
                (found[f"{role} engine"],) = children_of(pid)
        return found

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(30)


@atexit.register
def stop_all() -> None:
    """Stop whatever a test started and did not stop (stop is a no-op on an exited process)."""
    while _STARTED:
        _STARTED.pop().stop(timeout=10)


def tiny_model(tmp_path_factory, **overrides) -> Path:
    from tests.tiny import save_tiny_model

    path = tmp_path_factory.mktemp("tiny-model")
    save_tiny_model(path, seed=0, **overrides)
    return path
