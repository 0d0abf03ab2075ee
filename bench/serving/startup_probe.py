"""What baton.bench.serving.startup measures on one server start: time to /health, request latencies, the RSS of
every process of the server, and where baton's seconds and megabytes went by its own log lines.

A server runs in a session of its own (stopped whole), with its output in a log file; every
figure comes from outside the server (wall clock, /proc) or from the lines it logs anyway.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import socket
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx

from baton.bench.serving.serve_side_by_side import share_autogroup_nice, stop

HEALTH_POLL_S = 0.02
SETTLE_S = 3.0  # RSS is read this long after /health answered (the "after load")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def process_tree(pid: int) -> list[int]:
    """`pid` and every descendant, parents first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop(0)
        tree.append(current)
        todo += sorted(children.get(current, []))
    return tree


@dataclass
class Server:
    """One started server: its process, port, log, and when it was started (wall clock)."""

    process: subprocess.Popen
    port: int
    log: Path
    started: float  # time.time() at Popen
    ready_s: float = 0.0  # seconds from Popen to the first 200 from /health
    notes: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss(self, names: tuple[str, ...]) -> dict[str, float]:
        """MB per process of the server's tree, named in tree order (extra ones numbered)."""
        pids = process_tree(self.process.pid)
        return {
            names[i] if i < len(names) else f"process {i}": round(rss_mb(pid), 1)
            for i, pid in enumerate(pids)
        }

    def cpu_s(self, names: tuple[str, ...]) -> dict[str, float]:
        """CPU seconds (user + system) each process of the server's tree has used so far: on
        a shared machine, what a start costs whatever the others run (wall time is not)."""
        pids = process_tree(self.process.pid)
        return {
            names[i] if i < len(names) else f"process {i}": round(cpu_seconds(pid), 2)
            for i, pid in enumerate(pids)
        }

    def stop(self) -> None:
        stop(self.process)


def start(command: list[str], port: int, log: Path, env: dict, timeout_s: float) -> Server:
    with open(log, "wb") as out:
        started = time.time()
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    share_autogroup_nice(process.pid)
    server = Server(process=process, port=port, log=log, started=started)
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{command[:3]} exited:\n{log.read_text()[-3000:]}")
            try:
                if client.get(f"{server.url}/health").status_code == 200:
                    server.ready_s = time.time() - started
                    return server
            except httpx.TransportError:
                pass
            time.sleep(HEALTH_POLL_S)
    server.stop()
    raise RuntimeError(f"{command[:3]} not healthy after {timeout_s:.0f} s")


def complete(url: str, body: dict, timeout_s: float = 600) -> float:
    """Seconds for one non-streamed completion (a new connection: llama-server closes them)."""
    began = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s)
    if response.status_code != 200:
        raise RuntimeError(f"completion failed ({response.status_code}): {response.text[:500]}")
    return time.perf_counter() - began


def fill(url: str, bodies: list[dict]) -> float:
    """Send every body at once (one thread each); seconds until the last answer."""
    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        list(pool.map(lambda body: complete(url, body), bodies))
    return time.perf_counter() - began


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\S+) \w+ (.*)$")
# (phase name, pattern of the line that ends it); numbers inside are captured
_MARKS = {
    "engine_spawned": r"engine process \d+ started",
    "engine_loading": r"loading .* \(",
    "model_loaded": r"model built in ([\d.]+) s, weights read in ([\d.]+) s, prepared in "
    r"([\d.]+) s: (\d+) MiB held",
    "pools": r"pools: (\d+) KV tokens, (\d+) state slots, (\d+) MiB reserved",
    "warmed_up": r"warm-up: \d+ forwards in ([\d.]+) s",
    "engine_ready": r"engine ready",
}


def baton_timeline(server: Server) -> dict[str, float]:
    """Where the seconds to /health went, from the log's timestamps and the numbers in its
    lines (seconds; MiB for the two memory figures)."""
    seen: dict[str, tuple[float, tuple[str, ...]]] = {}
    for line in server.log.read_text(errors="replace").splitlines():
        stamp = _STAMP.match(line)
        if stamp is None:
            continue
        when = datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for name, pattern in _MARKS.items():
            found = re.search(pattern, stamp[3])
            if found and name not in seen:
                seen[name] = (when - server.started, found.groups())
    if len(seen) < len(_MARKS):
        return {"missing log lines": float(len(_MARKS) - len(seen))}
    at = {name: when for name, (when, _) in seen.items()}
    build, weights, prepare, held = map(float, seen["model_loaded"][1])
    warm_up = float(seen["warmed_up"][1][0])
    loading = at["model_loaded"] - at["engine_loading"]
    return {
        "server imports, config check": at["engine_spawned"],
        "engine imports": at["engine_loading"] - at["engine_spawned"],
        "config and state spec": loading - build - weights - prepare,
        "model build": build,
        "weights read": weights,
        "CPU packing, matmul choice": prepare,
        "heap trim, tokenizer, pools": at["pools"] - at["model_loaded"],
        "scheduler, grammars, handover": at["warmed_up"] - warm_up - at["pools"],
        "warm-up forward": warm_up,
        "EngineReady to /health answered": server.ready_s - at["warmed_up"],
        "weights held MiB": held,
        "pools reserved MiB": float(seen["pools"][1][2]),
    }
