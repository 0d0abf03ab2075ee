"""`make gsm8k`: serve the shipped model, run `baton eval gsm8k` on the held-out file, stop.

    python -m baton.bench.accuracy.run_gsm8k [--model assets] [--speculative-config JSON] [--dtype bfloat16]
        [--quantization fp8]
        [EVAL FLAGS, e.g. --num-questions 50 --output r.json]

Starts the disaggregated stack (`baton up`: prefill + decode + router) on a free 127.0.0.1 port, waits for /health, runs the
eval against it (flags it does not know are passed on to `baton eval gsm8k`), prints the
accuracy and stops the server. Exits with the eval's status. `--speculative-config` is handed to
`baton up` (both workers speculate), so the answers with and without speculation can be compared.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from baton.bench.accuracy.gsm8k_data import HELDOUT_PATH
from baton.server.up import free_port

ROOT = Path(__file__).resolve().parents[2]
BATON = Path(sys.executable).with_name("baton")


def wait_healthy(server: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(
                f"baton serve exited with {server.returncode}:\n{log.read_text()[-4000:]}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(
        f"baton serve was not healthy after {timeout_s:g} s:\n{log.read_text()[-4000:]}"
    )


def router_summary(url: str) -> str:
    """What the router saw during the eval, from its /metrics: answers by status and worker health
    changes (a worker marked unhealthy while it was serving is a router bug, not load)."""
    try:
        response = httpx.get(f"{url}/metrics", timeout=10)
        response.raise_for_status()
        families = list(text_string_to_metric_families(response.text))
    except (httpx.HTTPError, ValueError) as error:
        return f"router: no usable /metrics ({error!r})"
    by_status: dict[str, int] = {}
    unhealthy = 0
    for family in families:
        for sample in family.samples:
            if sample.name == "baton:router_requests_total":
                by_status[sample.labels["status"]] = int(sample.value)
            elif sample.name == "baton:router_worker_transitions_total":
                unhealthy += int(sample.value) * (sample.labels["state"] == "unhealthy")
    answers = ", ".join(f"{count} x {status}" for status, count in sorted(by_status.items()))
    return f"router: answered {answers or 'nothing'}; workers marked unhealthy: {unhealthy}"


def stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m baton.bench.accuracy.run_gsm8k", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--model", default=str(ROOT / "assets"), help="model directory (default: assets/)"
    )
    parser.add_argument(
        "--data", default=str(HELDOUT_PATH), help="GSM8K JSONL (default: the held-out file)"
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=300, help="seconds to wait for /health"
    )
    parser.add_argument(
        "--speculative-config",
        help='JSON as vLLM\'s, e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\', for baton up',
    )
    parser.add_argument("--dtype", help="the workers' --dtype (default: baton up's)")
    parser.add_argument(
        "--quantization",
        help="the workers' --quantization (fp8 on the shipped fp32 model: FP8 weights at load)",
    )
    args, eval_flags = parser.parse_known_args(argv)
    speculation = (
        ["--speculative-config", args.speculative_config] if args.speculative_config else []
    )

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    scratch = Path(tempfile.mkdtemp(prefix="baton-gsm8k-"))
    log = scratch / "serve.log"
    status = 1
    with open(log, "wb") as sink:
        server = subprocess.Popen(
            # the disaggregated stack: prefill worker + decode worker + router
            [str(BATON), "up", "--model", args.model, "--port", str(port)]
            + speculation
            + (["--dtype", args.dtype] if args.dtype else [])
            + (["--quantization", args.quantization] if args.quantization else []),
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    try:
        print(f"serving {args.model} with baton up on {url} (log: {log})", flush=True)
        wait_healthy(server, url, log, args.startup_timeout)
        command = [
            str(BATON),
            "eval",
            "gsm8k",
            "--base-url",
            url,
            "--data",
            args.data,
            *eval_flags,
        ]
        status = subprocess.call(command, cwd=ROOT)
        print(router_summary(url), flush=True)
        return status
    except RuntimeError as error:
        print(f"make gsm8k: {error}", file=sys.stderr)
        return 1
    finally:
        stop(server)
        if status == 0:
            shutil.rmtree(scratch, ignore_errors=True)
        else:  # what the stack logged is what explains a failure: keep it
            print(f"make gsm8k: the stack's log is kept at {log}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
