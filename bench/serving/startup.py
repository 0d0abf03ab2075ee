"""`baton serve`'s start as a newcomer meets it, in one run (issue 35):

    python -m baton.bench.serving.startup [--config 110m | --model DIR] [--first-model assets] [--rounds 3]
        [--llama-server BIN --llama-gguf FILE] [--output startup.json]

1. first request vs the same request again on `--first-model` (default: the shipped assets/), on
   an empty kernel cache (a fresh $BATON_CACHE_DIR each round: every C kernel is built) and on a
   warm one (that directory again): the issue's target is first <= 2x second on the empty one;
2. time to /health of `baton serve` on the benchmark model (warm kernel cache), and where the
   seconds went, from the server's and the engine's own log lines;
3. RSS of every process of `baton serve` 3 s after /health answered, at the default sizes (as a
   new user runs it) and at the context budget of llama.cpp's comparison (--parallel 32 over
   -c 16384: --max-running-requests 32 --max-total-tokens 16384), then after a load that uses
   that whole budget (32 concurrent requests of 504 tokens), 3 s after the last answer;
4. llama-server on the same model and budget when --llama-server and --llama-gguf are given
   (../shared/peers/llama_cpp_setup.sh builds it, llama_cpp_convert.py converts the model).

Every figure is the median over --rounds starts (baton and llama.cpp alternate), printed with
the machine's load average (these machines are shared); --output writes every sample as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from baton.bench.offline.peer import save_word_tokenizer
from baton.bench.serving import startup_probe as probe
from baton.bench.workloads import CONFIGS, save_model

ROOT = Path(__file__).resolve().parents[2]
QUESTION = (
    "Question: A pen costs $12. Anna buys 4 pens and pays with $60. How much change does she "
    "get?\nAnswer:"
)
FILL_NEW_TOKENS = 64
FILL_PROMPT_TOKENS = 440  # + 64 new = 504 <= 512, each of llama.cpp's 32 slots over 16k


def baton_command(model: str, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "baton.server.cli", "serve", "--model", model, "--port", str(port),
            *extra]  # fmt: skip


def llama_command(binary: str, gguf: str, port: int, parallel: int, context: int) -> list[str]:
    # ../shared/peers/llama_cpp_setup.sh's flags: both cores, its caches off
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-tb",
            "2", "--parallel", str(parallel), "-c", str(context), "--cont-batching",
            "--no-cache-prompt", "--cache-ram", "0", "-ctxcp", "0", "--no-webui"]  # fmt: skip


def ids_body(model: str, vocab: int, length: int, new: int, seed: int) -> dict:
    prompt = [3 + (seed * 7919 + i * 31) % (vocab - 3) for i in range(length)]
    return {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0,
            "ignore_eos": True}  # fmt: skip


def first_requests(model: str, rounds: int, logs: Path) -> dict[str, list[float]]:
    """First and second request on an empty kernel cache, then on the warm one it left."""
    out: dict[str, list[float]] = {}
    body = {"model": model, "prompt": QUESTION, "max_tokens": 16, "temperature": 0}
    for r in range(rounds):
        with tempfile.TemporaryDirectory(prefix="baton-cache-") as cache:
            env = dict(os.environ, BATON_CACHE_DIR=cache)
            for state in ("cold", "warm"):
                port = probe.free_port()
                server = probe.start(baton_command(model, port, []), port,
                                     logs / f"first-{state}-{r}.log", env, 1800)  # fmt: skip
                try:
                    first = probe.complete(server.url, body)
                    second = probe.complete(server.url, body)
                finally:
                    server.stop()
                for key, value in (("ready_s", server.ready_s), ("first_s", first),
                                   ("second_s", second), ("ratio", first / second)):  # fmt: skip
                    out.setdefault(f"{state} {key}", []).append(value)
    return out


def baton_round(model: str, vocab: int, extra: list[str], fill_n: int, log: Path) -> dict:
    port = probe.free_port()
    env = dict(os.environ)
    server = probe.start(baton_command(model, port, extra), port, log, env, 1800)
    try:
        cpu = server.cpu_s(("server", "engine"))
        probe.time.sleep(probe.SETTLE_S)
        sample = {"ready_s": server.ready_s, "ready_cpu_s": cpu,
                  "rss": server.rss(("server", "engine"))}  # fmt: skip
        small = ids_body(model, vocab, 32, 16, seed=1)
        sample["first_s"] = probe.complete(server.url, small)
        sample["second_s"] = probe.complete(server.url, small)
        if fill_n:
            bodies = [ids_body(model, vocab, FILL_PROMPT_TOKENS, FILL_NEW_TOKENS, seed=2 + k)
                      for k in range(fill_n)]  # fmt: skip
            sample["fill_s"] = probe.fill(server.url, bodies)
            probe.time.sleep(probe.SETTLE_S)  # the burst is over: what a server holds idle
            sample["rss_full"] = server.rss(("server", "engine"))
    finally:
        server.stop()
    sample["timeline"] = probe.baton_timeline(server)
    return sample


def llama_round(binary: str, gguf: str, vocab: int, parallel: int, context: int, log: Path) -> dict:
    port = probe.free_port()
    command = llama_command(binary, gguf, port, parallel, context)
    server = probe.start(command, port, log, dict(os.environ), 600)
    try:
        probe.time.sleep(probe.SETTLE_S)
        sample = {"ready_s": server.ready_s, "rss": server.rss(("llama-server",))}
        bodies = [ids_body("m", vocab, FILL_PROMPT_TOKENS, FILL_NEW_TOKENS, seed=2 + k)
                  for k in range(parallel)]  # fmt: skip
        sample["fill_s"] = probe.fill(server.url, bodies)
        probe.time.sleep(probe.SETTLE_S)
        sample["rss_full"] = server.rss(("llama-server",))
    finally:
        server.stop()
    return sample


def median_of(samples: list[dict], *path: str) -> float:
    values = []
    for sample in samples:
        value = sample
        for key in path:
            value = value[key]
        values.append(value)
    return statistics.median(values)


def total(rss: dict[str, float]) -> float:
    return sum(rss.values())


def report(results: dict) -> None:
    print(f"load average {results['load_before']} -> {results['load_after']} "
          f"({os.cpu_count()} CPUs); medians over {results['rounds']} rounds")  # fmt: skip
    first = results.get("first_requests")
    if first:
        med = {key: statistics.median(values) for key, values in first.items()}
        for state in ("cold", "warm"):
            print(f"{results['first_model']} {state} kernel cache: /health {med[f'{state} ready_s']:.2f} s, "
                  f"first request {med[f'{state} first_s']:.3f} s, second {med[f'{state} second_s']:.3f} s, "
                  f"first/second {med[f'{state} ratio']:.2f}x (target <= 2)")  # fmt: skip
    for name in ("default", "budget"):
        samples = results[f"baton {name}"]
        rss = {key: median_of(samples, "rss", key) for key in samples[0]["rss"]}
        cpu = {key: median_of(samples, "ready_cpu_s", key) for key in samples[0]["ready_cpu_s"]}
        line = (f"baton {name} ({' '.join(results['flags'][name]) or 'no flags'}): /health "
                f"{median_of(samples, 'ready_s'):.2f} s (CPU seconds until then: "
                f"{' + '.join(f'{k} {v:.2f}' for k, v in cpu.items())}), RSS after load "
                f"{' + '.join(f'{k} {v:.0f}' for k, v in rss.items())} = {total(rss):.0f} MB")  # fmt: skip
        if "rss_full" in samples[0]:
            full = statistics.median(total(s["rss_full"]) for s in samples)
            line += f", after using the whole budget {full:.0f} MB"
        print(line)
        timeline = samples[len(samples) // 2]["timeline"]
        print("  where the seconds went (middle round): " + "; ".join(
            f"{k} {v:.2f}" for k, v in timeline.items()))  # fmt: skip
    llama = results.get("llama")
    if llama:
        baton = results["baton budget"]
        ready = median_of(llama, "ready_s")
        rss = statistics.median(total(s["rss"]) for s in llama)
        full = statistics.median(total(s["rss_full"]) for s in llama)
        baton_rss = statistics.median(total(s["rss"]) for s in baton)
        baton_full = statistics.median(total(s["rss_full"]) for s in baton)
        print(f"llama-server (same budget): /health {ready:.2f} s, RSS after load {rss:.0f} MB, "
              f"after using the whole budget {full:.0f} MB")  # fmt: skip
        print(f"baton / llama.cpp: time to /health {median_of(baton, 'ready_s') / ready:.2f}x, "
              f"RSS after load {baton_rss / rss:.2f}x, after using the budget "
              f"{baton_full / full:.2f}x (target <= 1.5)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="benchmark model directory (default: --config saved)")
    parser.add_argument("--config", default="110m", choices=sorted(CONFIGS))
    parser.add_argument("--first-model", default=str(ROOT / "assets"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parallel", type=int, default=32, help="the budget's requests")
    parser.add_argument("--context", type=int, default=16384, help="the budget's tokens")
    parser.add_argument("--no-cold", action="store_true", help="skip section 1 (C builds)")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary")
    parser.add_argument("--llama-gguf", help="the benchmark model converted to GGUF")
    parser.add_argument("--output", help="write every sample as JSON here")
    args = parser.parse_args(argv)
    if bool(args.llama_server) != bool(args.llama_gguf):
        parser.error("--llama-server and --llama-gguf go together")
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as scratch:
        logs = Path(scratch)
        model = args.model
        if model is None:
            model = str(logs / args.config)
            save_model(args.config, model)
            save_word_tokenizer(model, CONFIGS[args.config]["vocab_size"])
        vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
        flags = {"default": [], "budget": ["--max-running-requests", str(args.parallel),
                                           "--max-total-tokens", str(args.context)]}  # fmt: skip
        results: dict = {"load_before": os.getloadavg(), "rounds": args.rounds, "flags": flags,
                         "first_model": args.first_model, "baton default": [],
                         "baton budget": []}  # fmt: skip
        if not args.no_cold:
            results["first_requests"] = first_requests(args.first_model, args.rounds, logs)
        for r in range(args.rounds):
            for name in ("default", "budget"):
                fill_n = args.parallel if name == "budget" else 0
                log = logs / f"baton-{name}-{r}.log"
                results[f"baton {name}"].append(baton_round(model, vocab, flags[name], fill_n, log))
            if args.llama_server:
                log = logs / f"llama-{r}.log"
                sample = llama_round(args.llama_server, args.llama_gguf, vocab, args.parallel,
                                     args.context, log)  # fmt: skip
                results.setdefault("llama", []).append(sample)
        results["load_after"] = os.getloadavg()
    report(results)
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
