"""Soak a `baton up` stack: mixed valid and invalid traffic, kills of either worker, a summary.

    python -m baton.bench.serving.soak [--duration 600] [--kill-every 60] [--clients 6] [--output soak.json]

Starts `baton up` on 127.0.0.1 (the shipped model unless --model), sends valid requests
(completions, chat, streams, clients that give up early) and invalid ones (lone surrogates,
strings for ints, NaN, deep JSON, unknown roles, bodies over the size limit, prompts over the
context, malformed `baton_disagg` straight to a worker…) from several threads, and every
--kill-every seconds SIGKILLs one part: a prefill or decode worker, or one of their engines.
`baton up` must then stop the stack and exit 1 naming that part; this script is its supervisor
and starts it again. Before each kill and at the end, with traffic paused, the workers' KV pages
and Mamba slots in use must fall back to zero.

The summary counts what must stay zero: engine deaths caused by input (the stack died when
nothing was killed), leaked pages or slots, and 5xx answers caused by input (any 5xx to an
invalid request, or to a valid one outside a kill-and-restart window).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from baton.server.up import DEFAULT_MODEL, free_port

VICTIMS = ("prefill worker", "decode worker", "prefill engine", "decode engine")
LONE = '"\\ud800"'  # a lone UTF-16 surrogate as JSON text


def valid_cases() -> list[tuple[str, str, dict]]:
    """(name, path, body); every one must succeed (200) whenever the stack is up."""
    question = "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:"
    return [
        ("text", "/v1/completions", {"prompt": question, "max_tokens": 24, "temperature": 0}),
        ("ids", "/v1/completions", {"prompt": list(range(5, 60)), "max_tokens": 8}),
        ("sampled", "/v1/completions", {"prompt": question, "max_tokens": 16, "seed": 3}),
        ("stream", "/v1/completions", {"prompt": question, "max_tokens": 16, "stream": True}),
        (
            "chat-stream",
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 8,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ),
        (
            "chat",
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "system", "content": "Be brief"},
                    {"role": "user", "content": "2+2?"},
                ],
                "max_tokens": 8,
            },
        ),  # fmt: skip
    ]


def invalid_cases() -> list[tuple[str, str, bytes]]:
    """(name, path, raw body); each must get a 4xx, never a 5xx."""
    raw = [
        ("surrogate-prompt", "/v1/completions", f'{{"prompt": {LONE}}}'),
        (
            "surrogate-stop",
            "/v1/chat/completions",
            f'{{"messages": [{{"role": "user", "content": "x"}}], "stream": true, "stop": [{LONE}]}}',
        ),  # fmt: skip
        ("surrogate-model", "/v1/completions", f'{{"prompt": "x", "model": {LONE}}}'),
        ("string-int", "/v1/completions", '{"prompt": "x", "max_tokens": "16"}'),
        ("bool-int", "/v1/completions", '{"prompt": "x", "max_tokens": true}'),
        ("nan", "/v1/completions", '{"prompt": "x", "temperature": NaN}'),
        ("inf", "/v1/completions", '{"prompt": "x", "top_p": 1e400}'),
        ("role", "/v1/chat/completions", '{"messages": [{"role": "wizard", "content": "x"}]}'),
        (
            "stream-options",
            "/v1/completions",
            '{"prompt": "x", "stream": true, "stream_options": 5}',
        ),
        ("too-long", "/v1/completions", json.dumps({"prompt": [5] * 5000})),
        ("vocab", "/v1/completions", '{"prompt": [5, 99999999]}'),
        ("negative", "/v1/completions", '{"prompt": "x", "max_tokens": -1}'),
        ("model", "/v1/completions", '{"prompt": "x", "model": "gpt-17"}'),
        ("not-json", "/v1/completions", "{prompt: x"),
        ("deep", "/v1/completions", '{"prompt": "x", "x": ' + "[" * 50_000 + "]" * 50_000 + "}"),
    ]
    cases = [(name, path, body.encode()) for name, path, body in raw]
    cases.append(("too-big", "/v1/completions", b'{"prompt": "' + b"a" * 9_000_000 + b'"}'))
    return cases


def worker_cases() -> list[tuple[str, str, str, bytes]]:
    """(name, worker, path, raw body) sent straight to a worker: what only the router should
    send, malformed. Each must get a 4xx and leave the engine running."""
    bodies = [
        (
            "bad-address",
            "decode",
            {
                "prompt": [5, 6],
                "max_tokens": 2,
                "baton_disagg": {"room": "r", "prefill_addr": "not-a-zmq-endpoint"},
            },
        ),  # fmt: skip
        (
            "long-room",
            "prefill",
            {"prompt": [5, 6], "max_tokens": 2, "baton_disagg": {"room": "x" * 200}},
        ),  # fmt: skip
        (
            "room-type",
            "decode",
            {"prompt": [5, 6], "baton_disagg": {"room": ["r"], "prefill_addr": 5}},
        ),  # fmt: skip
    ]
    cases = [(name, role, "/v1/completions", json.dumps(b).encode()) for name, role, b in bodies]
    cases.append(("surrogate-room", "prefill", "/v1/completions", f'{{"prompt": [5], "baton_disagg": {{"room": {LONE}}}}}'.encode()))  # fmt: skip
    return cases


class Stack:
    """One `baton up` process and the pids of its parts."""

    def __init__(self, model: str, port: int, log_dir: Path, index: int) -> None:
        self.port = port
        self.log_path = log_dir / f"up-{index}.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "baton.server.cli",
                    "up",
                    "--model",
                    model,
                    "--port",
                    str(port),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 300
        while "baton is up" not in self.log():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"baton up did not start:\n{self.log()[-3000:]}")
            time.sleep(0.2)
        self.parts = self._parts()
        found = re.search(r"prefill :(\d+) -> decode :(\d+)", self.log())
        assert found is not None
        self.worker_urls = {
            "prefill": f"http://127.0.0.1:{found.group(1)}",
            "decode": f"http://127.0.0.1:{found.group(2)}",
        }

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _parts(self) -> dict[str, int]:
        parts = {}
        for pid in _children(self.process.pid):
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"--disaggregation-mode" in command:
                role = command[command.index(b"--disaggregation-mode") + 1].decode()
                parts[f"{role} worker"] = pid
                parts[f"{role} engine"] = _children(pid)[0]
        return parts

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(60)


def _children(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(child) for child in (task / "children").read_text().split()]
    return children


def pools_in_use(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("baton:kv_pages_used", "baton:mamba_slots_used"):
            values[name] = float(value)
    return values["baton:kv_pages_used"], values["baton:mamba_slots_used"]


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.counts: Counter = Counter()
        self.problems: list[str] = []
        self.lock = threading.Lock()
        self.traffic_on = threading.Event()
        self.outage = threading.Event()  # set from a kill until the restarted stack is healthy
        self.epoch = 0  # kills so far: a request that saw it change overlapped a kill
        self.in_flight = 0
        self.stack: Stack | None = None

    def note(self, key: str, problem: str | None = None) -> None:
        with self.lock:
            self.counts[key] += 1
            if problem is not None and len(self.problems) < 50:
                self.problems.append(problem)

    def client_loop(self, stop: threading.Event, seed: int) -> None:
        rng = random.Random(seed)
        valid, invalid, direct = valid_cases(), invalid_cases(), worker_cases()
        while not stop.is_set():
            if not self.traffic_on.wait(0.2):
                continue
            stack = self.stack
            assert stack is not None
            with self.lock:
                self.in_flight += 1
            try:
                roll = rng.random()
                if roll < 0.5 or (roll >= 0.9 and not self.args.worker_cases):
                    self.send_valid(stack, rng.choice(valid), give_up=rng.random() < 0.15)
                elif roll < 0.9:
                    self.send_invalid(f"http://127.0.0.1:{stack.port}", rng.choice(invalid))
                else:
                    name, role, path, raw = rng.choice(direct)
                    self.send_invalid(stack.worker_urls[role], (name, path, raw), direct=True)
            finally:
                with self.lock:
                    self.in_flight -= 1

    def send_valid(self, stack: Stack, case, give_up: bool) -> None:
        name, path, body = case
        url = f"http://127.0.0.1:{stack.port}{path}"
        outage, epoch = self.outage.is_set(), self.epoch
        try:
            timeout = 0.3 if give_up else 120
            response = httpx.post(url, json=body, timeout=timeout)
            text = response.text
        except httpx.TimeoutException:
            self.note("valid: gave up" if give_up else "valid: timeout", None if give_up else name)
            return
        except httpx.TransportError as error:
            self.transport_error("valid", name, error, outage, epoch)
            return
        during = outage or self.outage.is_set() or epoch != self.epoch
        if response.status_code == 200 and '"error"' not in text:
            self.note("valid: ok")
        elif during:
            self.note("valid: failed during a kill")
        elif response.status_code >= 500 or '"error"' in text:
            self.note("valid: 5xx outside a kill", f"{name}: {response.status_code} {text[:300]}")
        else:
            self.note("valid: refused", f"{name}: {response.status_code} {text[:300]}")

    def transport_error(self, kind: str, name: str, error, outage: bool, epoch: int) -> None:
        """A dropped or refused connection: expected while a killed stack restarts (then back
        off a little instead of spinning on a closed port), a failure at any other time."""
        if outage or self.outage.is_set() or epoch != self.epoch:
            self.note(f"{kind}: transport error during a kill")
            time.sleep(0.2)
        else:
            self.note("dropped connections outside a kill", f"{kind} {name}: {error!r}")

    def send_invalid(self, base_url: str, case, direct: bool = False) -> None:
        name, path, raw = case
        kind = "invalid (to a worker)" if direct else "invalid"
        outage, epoch = self.outage.is_set(), self.epoch
        try:
            response = httpx.post(
                f"{base_url}{path}", content=raw, timeout=120,
                headers={"content-type": "application/json"},
            )  # fmt: skip
        except httpx.TransportError as error:
            self.transport_error(kind, name, error, outage, epoch)
            return
        during = outage or self.outage.is_set() or epoch != self.epoch
        if 400 <= response.status_code < 500:
            self.note(f"{kind}: 4xx")
        elif response.status_code < 400:
            self.note(f"{kind}: accepted", f"{name}: {response.status_code} {response.text[:200]}")
        elif response.status_code >= 500 and not during:
            self.note(
                "5xx caused by input", f"{name}: {response.status_code} {response.text[:300]}"
            )
        else:
            self.note(f"{kind}: {response.status_code} during a kill")

    def quiesce_and_check_pools(self) -> None:
        """Pause traffic, let what is in flight end, then pages and slots must come back to 0."""
        self.traffic_on.clear()
        deadline = time.monotonic() + 150
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.1)
        assert self.stack is not None
        for role, url in self.stack.worker_urls.items():
            deadline = time.monotonic() + 15
            while (used := pools_in_use(url)) != (0, 0) and time.monotonic() < deadline:
                time.sleep(0.2)
            self.note("pool checks")
            if used != (0, 0):
                self.note("leaked pages/slots", f"{role}: kv pages, mamba slots in use {used}")

    def run(self) -> dict:
        args = self.args
        log_dir = Path(args.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        port = args.port or free_port()
        env_secret = os.environ.pop("BATON_DISAGG_SECRET", None)  # let `baton up` make one
        self.stack = Stack(args.model, port, log_dir, 0)
        stop = threading.Event()
        threads = [
            threading.Thread(target=self.client_loop, args=(stop, args.seed + i), daemon=True)
            for i in range(args.clients)
        ]
        for thread in threads:
            thread.start()
        started = time.monotonic()
        next_kill = started + args.kill_every
        restarts = 0
        self.traffic_on.set()
        try:
            while time.monotonic() - started < args.duration:
                time.sleep(0.5)
                if self.stack.process.poll() is not None:  # nobody killed anything
                    self.note("engine deaths caused by input", self.stack.log()[-2000:])
                    restarts = self.restart(log_dir, port, restarts)
                    continue
                if time.monotonic() >= next_kill:
                    self.quiesce_and_check_pools()
                    restarts = self.kill_and_restart(log_dir, port, restarts)
                    next_kill = time.monotonic() + args.kill_every
                    self.traffic_on.set()
            self.quiesce_and_check_pools()
        finally:
            stop.set()
            self.traffic_on.set()
            for thread in threads:
                thread.join(150)
            self.stack.stop()
            if env_secret is not None:
                os.environ["BATON_DISAGG_SECRET"] = env_secret
        summary = {
            "seconds": round(time.monotonic() - started),
            "engine_deaths_caused_by_input": self.counts["engine deaths caused by input"],
            "leaked_pages_or_slots": self.counts["leaked pages/slots"],
            "5xx_caused_by_input": self.counts["5xx caused by input"]
            + self.counts["valid: 5xx outside a kill"],
            "kills": self.counts["kills"],
            "valid_requests_refused": self.counts["valid: refused"],
            "dropped_connections_outside_a_kill": self.counts["dropped connections outside a kill"],
            "counts": dict(sorted(self.counts.items())),
            "problems": self.problems,
        }
        return summary

    def kill_and_restart(self, log_dir: Path, port: int, restarts: int) -> int:
        assert self.stack is not None
        victim = self.rng.choice(VICTIMS)
        self.outage.set()
        self.epoch += 1
        self.traffic_on.set()  # traffic runs on through the kill
        os.kill(self.stack.parts[victim], signal.SIGKILL)
        self.note("kills")
        try:
            code = self.stack.process.wait(60)
        except subprocess.TimeoutExpired:
            code = None
        named = f"the {victim} (pid {self.stack.parts[victim]}" in self.stack.log()
        if code != 1 or not named:
            self.note("stack did not stop as expected", f"{victim}: exit {code}, named {named}")
        self.traffic_on.clear()
        return self.restart(log_dir, port, restarts)

    def restart(self, log_dir: Path, port: int, restarts: int) -> int:
        assert self.stack is not None
        self.outage.set()
        self.stack.stop()
        restarts += 1
        self.stack = Stack(self.args.model, port, log_dir, restarts)
        self.outage.clear()
        self.traffic_on.set()
        return restarts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds (default: 600)")
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds between kills")
    parser.add_argument("--clients", type=int, default=6, help="client threads")
    parser.add_argument("--port", type=int, default=0, help="router port (default: a free one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-worker-cases",
        dest="worker_cases",
        action="store_false",
        help="send nothing straight to the workers (malformed `baton_disagg` fields)",
    )
    parser.add_argument("--log-dir", default="/tmp/baton-soak", help="where `baton up` logs go")
    parser.add_argument("--output", help="write the summary here as JSON")
    args = parser.parse_args(argv)
    summary = Soak(args).run()
    print(json.dumps(summary, indent=2))
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=2))
    bad = (
        summary["dropped_connections_outside_a_kill"]
        + summary["valid_requests_refused"]
        + summary["engine_deaths_caused_by_input"]
        + summary["leaked_pages_or_slots"]
        + summary["5xx_caused_by_input"]
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
