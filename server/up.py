"""`baton up`: a prefill worker, a decode worker and a router on 127.0.0.1, in one command.

Each part is a child process (`baton serve --disaggregation-mode …`, `baton router`); the command
waits until the router reports a healthy pair, prints where to send requests, and stays in the
foreground. Ctrl-C or SIGTERM stops all three (exit 0). It watches every process of the stack —
the three children and each worker's engine process (a grandchild) — and when one dies it stops
the rest and exits 1, naming the part that died: restarting is the job of whatever supervises
`baton up` (systemd, a container runtime), as for `baton serve`.

Without a secret (`--disagg-secret-file`, `--disagg-secret` among the worker flags, or
$BATON_DISAGG_SECRET), it makes a random one and hands it to both workers in their environment,
so worker-to-worker messages are authenticated by default. The API key reaches all three in
their environment too: no secret is ever on a child's command line, which `ps` shows.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from baton.engine.config import DTYPE_NAMES, QUANTIZATION_NAMES
from baton.engine.runtime.cpu_threads import cores_per_engine
from baton.engine.spec_decode.config import SpeculativeConfig
from baton.server.lora_args import add_lora_arguments, lora_flags
from baton.server.parsers.reasoning import REASONING_PARSERS
from baton.server.parsers.tools import TOOL_CALL_PARSERS
from baton.server.router.cli import DEFAULT_MAX_CONCURRENT_REQUESTS
from baton.server.secret_flags import (
    API_KEY_ENV,
    DISAGG_SECRET_ENV,
    SecretError,
    add_api_key_flags,
    add_disagg_secret_file_flag,
    secret,
)
from baton.server.spec_args import add_speculative_arguments, speculative_dict, speculative_flag
from baton.server.tier_args import TIER_FIELDS, add_tier_arguments, worker_flags
from baton.server.tier_args import check as tier_check

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
    parser.add_argument(
        "--tokenizer", help="Hugging Face tokenizer directory (default: the --model directory)"
    )
    add_api_key_flags(parser, "the router and both workers (/v1/*, /tokenize, /detokenize…)")
    add_disagg_secret_file_flag(parser)
    parser.add_argument(
        "--tensor-parallel-size",
        "--tp",
        dest="tp",
        type=int,
        default=1,
        help="tensor-parallel ranks of each worker's engine (default: 1)",
    )
    # Prefill is compute-bound and decode bound by memory bandwidth: sizing the two sides apart
    # is what disaggregation across TP sizes is for.
    parser.add_argument(
        "--prefill-tp", type=int, help="tensor-parallel ranks of the prefill worker (default: --tp)"
    )
    parser.add_argument(
        "--decode-tp", type=int, help="tensor-parallel ranks of the decode worker (default: --tp)"
    )
    parser.add_argument(
        "--disaggregation-transfer-backend",
        choices=["zmq", "nixl"],
        default="zmq",
        help="how the KV pages and state move from the prefill worker to the decode worker: zmq"
        " frames, or nixl reads (UCX; UCX_TLS picks the transports) (default: zmq)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPE_NAMES,
        help="weights and activations dtype; auto: the checkpoint's own (its config.json)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--quantization",
        "-q",
        choices=QUANTIZATION_NAMES,
        help="as `baton serve`'s, both workers (their weights must match for the handover)",
    )
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
    # The chat flags of `baton serve`, given to both workers (the router has no model: each
    # worker renders and parses what it serves).
    parser.add_argument(
        "--tool-call-parser", choices=TOOL_CALL_PARSERS, help="as `baton serve`'s, both workers"
    )
    parser.add_argument(
        "--enable-auto-tool-choice", action="store_true", help="as `baton serve`'s, both workers"
    )
    parser.add_argument(
        "--reasoning-parser", choices=REASONING_PARSERS, help="as `baton serve`'s, both workers"
    )
    parser.add_argument("--chat-template", help="a chat template file for both workers")
    add_speculative_arguments(parser)  # both workers: the prefill one builds the MTP state
    add_lora_arguments(parser)  # both workers, the same adapters under the same names
    add_tier_arguments(parser)  # both workers (one storage directory may serve both)
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
    try:
        envs, ns.worker_args = _secret_environments(ns, os.environ)
    except SecretError as error:
        print(f"baton up: {error}", file=sys.stderr)
        return 2
    sizes = {"prefill": ns.prefill_tp or ns.tp, "decode": ns.decode_tp or ns.tp}
    for flag, size in (
        ("--tp", ns.tp),
        ("--prefill-tp", ns.prefill_tp),
        ("--decode-tp", ns.decode_tp),
    ):
        if size is not None and size < 1:
            print(f"baton up: {flag} must be >= 1, got {size}", file=sys.stderr)
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
    if ns.quantization:
        common += ["--quantization", ns.quantization]
    common += ["--disaggregation-transfer-backend", ns.disaggregation_transfer_backend]
    if ns.served_model_name:
        common += ["--served-model-name", ns.served_model_name]
    if ns.tokenizer:
        common += ["--tokenizer", ns.tokenizer]
    threads = {"prefill": [], "decode": []}
    if ns.device == "cpu" and not any(a.split("=")[0] == "--cpu-threads" for a in ns.worker_args):
        # Every rank of both engines gets an equal share of the cores (engine/runtime/cpu_threads.py):
        # a worker's engine is given its ranks' shares and divides them among its ranks.
        share = cores_per_engine(sizes["prefill"] + sizes["decode"])
        threads = {role: ["--cpu-threads", str(share * size)] for role, size in sizes.items()}
    for flag, value in (
        ("--tool-call-parser", ns.tool_call_parser),
        ("--reasoning-parser", ns.reasoning_parser),
        ("--chat-template", _template_flag(ns.chat_template)),
    ):
        if value:
            common += [flag, value]
    if ns.enable_auto_tool_choice:
        common.append("--enable-auto-tool-choice")
    common += lora_flags(ns)
    try:
        speculative = speculative_dict(
            ns.speculative_config,
            ns.speculative_algorithm,
            ns.speculative_num_steps,
            ns.speculative_eagle_topk,
            ns.speculative_num_draft_tokens,
        )
        if speculative is not None:
            SpeculativeConfig.check_flags(speculative)
        common += speculative_flag(speculative)
        tier_values = {name: getattr(ns, name) for name in TIER_FIELDS}
        tier_check(tier_values, prefix_caching=True, tensor_parallel_size=max(sizes.values()))
        common += worker_flags(tier_values)
    except ValueError as error:
        print(f"baton up: {error}", file=sys.stderr)
        return 2
    baton = [sys.executable, "-m", "baton.server.cli"]
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
            "--tensor-parallel-size",
            str(sizes["prefill"]),
            *threads["prefill"],
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
            "--tensor-parallel-size",
            str(sizes["decode"]),
            *threads["decode"],
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
    # Each part in a process group of its own: a Ctrl-C reaches this process only, which then
    # stops the router before the workers (a router that outlives its workers reports them
    # unhealthy on the way out, which reads like a failure).
    children = {
        name: subprocess.Popen(
            cmd, env=envs["router" if name == "router" else "worker"], start_new_session=True
        )
        for name, cmd in commands.items()
    }
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
    url = f"http://127.0.0.1:{ns.port}"
    try:
        if not _wait_healthy(url, children, ns.startup_timeout, lambda: stopping):
            return 1
        name = ns.served_model_name or ns.model
        print(
            f"\nbaton is up: prefill :{prefill_port} (TP={sizes['prefill']}) -> decode :{decode_port}"
            f" (TP={sizes['decode']}) (transfer :{disagg_port}), router {url}\n"
            f"  curl {url}/v1/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{name}", "prompt": "Question: A pen costs $12. Anna buys 4 pens and pays with $60. How much change does she get?\\nAnswer:", "max_tokens": 48, "temperature": 0, "stop": ["Question"]}}\'\n'
            f"  OpenAI clients: base_url={url}/v1   (Ctrl-C stops everything)",
            flush=True,
        )
        engines = {}
        while not stopping:
            engines.update(_engine_pids(children, engines))
            dead = _dead_parts(children, engines)
            if dead:
                print(f"baton up: the {dead[0]} died; stopping the stack", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    finally:
        _stop_all(children)


def _template_flag(value: str | None) -> str | None:
    """A template file as an absolute path (the workers may run elsewhere), else as given."""
    return str(Path(value).resolve()) if value and Path(value).is_file() else value


def _secret_environments(ns, environ) -> tuple[dict[str, dict[str, str]], list[str]]:
    """The environments of the router and of the workers, and the worker flags without any
    secret: the API key reaches all three, the worker secret (a random one when none is given)
    both workers, in the environment only (server/secret_flags.py)."""
    worker_args, flagged = [], None
    args = iter(ns.worker_args)
    for arg in args:  # a --disagg-secret among the worker flags moves to the environment
        if arg == "--disagg-secret":
            flagged = next(args, "")
        elif arg.startswith("--disagg-secret="):
            flagged = arg.split("=", 1)[1]
        else:
            worker_args.append(arg)
    api_key = secret(ns.api_key, ns.api_key_file, "--api-key", environ, API_KEY_ENV)
    worker_secret = secret(
        flagged, ns.disagg_secret_file, "--disagg-secret", environ, DISAGG_SECRET_ENV
    )
    router = dict(environ)
    if api_key:
        router[API_KEY_ENV] = api_key
    worker = dict(router, **{DISAGG_SECRET_ENV: worker_secret or secrets.token_hex(32)})
    return {"router": router, "worker": worker}, worker_args


def _engine_pids(children, known: dict[str, int]) -> dict[str, int]:
    """The engine process of each worker not yet known: the worker server's only child. Linux
    (/proc); elsewhere only the children themselves are watched."""
    found = {}
    for name in ("prefill", "decode"):
        if name in known or children[name].poll() is not None:
            continue
        pids = []
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{children[name].pid}/task").iterdir():
                pids += [int(pid) for pid in (task / "children").read_text().split()]
        if len(pids) == 1:
            found[name] = pids[0]
    return found


def _dead_parts(children, engines: dict[str, int]) -> list[str]:
    """What has died, named for a person: a worker that exited because its engine died
    (ENGINE_DIED_EXIT_CODE) names the engine; a killed worker takes its engine with it, and
    names itself."""
    from baton.server.launch import ENGINE_DIED_EXIT_CODE

    dead = []
    for name, process in children.items():
        engine = engines.get(name)
        if process.poll() is None:
            if engine is not None and not _alive(engine):
                dead.append(f"{name} engine (pid {engine})")
        elif process.returncode == ENGINE_DIED_EXIT_CODE:
            dead.append(f"{name} engine (pid {engine}; its worker exited)")
        else:
            kind = "process" if name == "router" else "worker"
            dead.append(f"{name} {kind} (pid {process.pid}, exit code {process.returncode})")
    return dead


def _alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (dead, not yet reaped by its worker) counts as dead."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


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
    """The router first (no request reaches a stopping worker, and it does not see them go),
    then the workers, each given what is left of 20 s before it is killed."""
    deadline = time.time() + 20
    router = [p for name, p in children.items() if name == "router"]
    workers = [p for name, p in children.items() if name != "router"]
    for group in (router, workers):
        for process in group:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in group:
            try:
                process.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
