"""`baton up`: a prefill worker, a decode worker and a router on 127.0.0.1, in one command.

Each part is a child process (`baton serve --disaggregation-mode …`, `baton router`); the command
waits until the router reports a healthy pair, prints where to send requests, and stays in the
foreground. Ctrl-C or SIGTERM stops all three; if any child dies, the others are stopped too.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from server.router import DEFAULT_MAX_CONCURRENT_REQUESTS

DEFAULT_MODEL = str(Path(__file__).resolve().parent.parent / "assets")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def add_up_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "up",
        help="start a prefill worker, a decode worker and a router on 127.0.0.1",
        description="Start the whole disaggregated stack locally and print where to send requests.",
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="model directory (default: the model shipped in assets/)",
    )
    parser.add_argument("--port", type=int, default=8000, help="router port (default: 8000)")
    parser.add_argument(
        "--prefill-port",
        type=int,
        default=0,
        help="prefill worker HTTP port (default: a free port)",
    )
    parser.add_argument(
        "--decode-port", type=int, default=0, help="decode worker HTTP port (default: a free port)"
    )
    parser.add_argument(
        "--disagg-port", type=int, default=0, help="prefill transfer port (default: a free port)"
    )
    parser.add_argument("--served-model-name", help="name clients pass as `model`")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds to wait for a healthy stack"
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=DEFAULT_MAX_CONCURRENT_REQUESTS,
        help="the router's limit on generation requests in flight; past it, 429 with Retry-After "
        f"(default: {DEFAULT_MAX_CONCURRENT_REQUESTS})",
    )
    parser.add_argument(
        "worker_args", nargs="*", help="extra `baton serve` flags for both workers (after --)"
    )
    parser.set_defaults(handler=run_up)


def run_up(ns) -> int:
    if not Path(ns.model, "config.json").is_file():
        print(
            f"baton up: --model {ns.model}: no config.json there (expected a Hugging Face model directory)",
            file=sys.stderr,
        )
        return 2
    prefill_port, decode_port = ns.prefill_port or free_port(), ns.decode_port or free_port()
    disagg_port = ns.disagg_port or free_port()
    common = [
        "--model",
        ns.model,
        "--host",
        "127.0.0.1",
        "--dtype",
        ns.dtype,
        "--device",
        ns.device,
    ]
    if ns.served_model_name:
        common += ["--served-model-name", ns.served_model_name]
    baton = [sys.executable, "-m", "server.cli"]
    commands = {
        "prefill": baton
        + [
            "serve",
            *common,
            "--port",
            str(prefill_port),
            "--disaggregation-mode",
            "prefill",
            "--disagg-port",
            str(disagg_port),
            *ns.worker_args,
        ],
        "decode": baton
        + [
            "serve",
            *common,
            "--port",
            str(decode_port),
            "--disaggregation-mode",
            "decode",
            *ns.worker_args,
        ],
        "router": baton
        + [
            "router",
            "--prefill",
            f"http://127.0.0.1:{prefill_port}",
            "--decode",
            f"http://127.0.0.1:{decode_port}",
            "--port",
            str(ns.port),
            "--max-concurrent-requests",
            str(ns.max_concurrent_requests),
        ],
    }
    children = {name: subprocess.Popen(cmd) for name, cmd in commands.items()}
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    url = f"http://127.0.0.1:{ns.port}"
    try:
        if not _wait_healthy(url, children, ns.startup_timeout, lambda: stopping):
            return 1
        name = ns.served_model_name or ns.model
        print(
            f"\nbaton is up: prefill :{prefill_port} -> decode :{decode_port} (transfer :{disagg_port}), router {url}\n"
            f"  curl {url}/v1/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{name}", "prompt": "Question: A pen costs $12. Anna buys 4 pens and pays with $60. How much change does she get?\\nAnswer:", "max_tokens": 48, "temperature": 0, "stop": ["Question"]}}\'\n'
            f"  OpenAI clients: base_url={url}/v1   (Ctrl-C stops everything)",
            flush=True,
        )
        while not stopping:
            dead = [n for n, p in children.items() if p.poll() is not None]
            if dead:
                print(
                    f"baton up: the {dead[0]} process exited; stopping the stack", file=sys.stderr
                )
                return 1
            time.sleep(0.5)
        return 0
    finally:
        _stop_all(children)


def _wait_healthy(url: str, children, timeout: float, stopping) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline and not stopping():
        for name, process in children.items():
            if process.poll() is not None:
                print(f"baton up: the {name} process exited during startup", file=sys.stderr)
                return False
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    if not stopping():
        print(f"baton up: the stack was not healthy within {timeout:.0f} s", file=sys.stderr)
    return False


def _stop_all(children) -> None:
    for process in children.values():
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.time() + 20
    for process in children.values():
        try:
            process.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
