"""Routing policies side by side on a multi-turn workload: TTFT and prefix-cache hits.

Starts `--prefill` prefill and `--decode` decode workers (`baton serve --disaggregation-mode`),
then, on those same workers, one `baton router` per policy in turn, each running the multi-turn
workload (bench/serving/multi_turn.py) on a seed of its own: the conversations differ, so no policy
reuses another's cached prefixes, and their lengths are the same, so the cache geometry is.
First comes "one pair" (a router over the first prefill and decode worker only): everything a
conversation computed is on the worker its next turn goes to, the hits a cache-aware router
should match. Hits are the workers' own counters (prefix tokens served from their caches,
prefill and decode side); TTFT is the client's.

    python -m baton.bench.serving.router_policies --conversations 8 --turns 4 --output result.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from baton.bench.accuracy.run_gsm8k import wait_healthy
from baton.bench.serving.multi_turn import MultiTurnWorkload, run_multi_turn
from baton.bench.serving.serve_side_by_side import start, stop
from baton.server.up import free_port

ROOT = Path(__file__).resolve().parents[2]
BATON = Path(sys.executable).with_name("baton")


def cache_counters(url: str) -> tuple[float, float]:
    """(prefix tokens looked up, prefix tokens served from the cache) of one worker."""
    values = {"baton:prefix_cache_queries_total": 0.0, "baton:prefix_cache_hits_total": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
    return values["baton:prefix_cache_queries_total"], values["baton:prefix_cache_hits_total"]


def worker_command(model: str, port: int, role: str, track_interval: int) -> list[str]:
    return [str(BATON), "serve", "--model", model, "--port", str(port),
            "--disaggregation-mode", role, "--mamba-track-interval", str(track_interval),
            "--max-mamba-slots", "1024", "--cpu-threads", "1",
            "--log-level", "warning"]  # fmt: skip


def run_policy(
    name: str,
    policy: str,
    prefill: list[str],
    decode: list[str],
    model: str,
    workload: MultiTurnWorkload,
    concurrency: int,
    logs: Path,
) -> dict:
    port = free_port()
    command = [str(BATON), "router", "--port", str(port), "--prefill", ",".join(prefill),
               "--decode", ",".join(decode), "--policy", policy, "--tokenizer", model]  # fmt: skip
    router = start(command, port, logs / f"router-{name}.log", 120)
    try:
        before = {url: cache_counters(url) for url in prefill + decode}
        results = asyncio.run(
            run_multi_turn(f"http://127.0.0.1:{port}", workload, concurrency=concurrency)
        )
        after = {url: cache_counters(url) for url in prefill + decode}
    finally:
        stop(router)

    def side(urls: list[str]) -> dict:
        queried = sum(after[u][0] - before[u][0] for u in urls)
        hits = sum(after[u][1] - before[u][1] for u in urls)
        return {"queried_tokens": queried, "hit_tokens": hits, "hit_rate": hits / max(queried, 1)}

    ttft = [r.ttft_s for r in results]
    later = [r.ttft_s for r in results if r.turn > 0]
    return {
        "name": name,
        "policy": policy,
        "workers": f"{len(prefill)}P x {len(decode)}D",
        "seed": workload.seed,
        "requests": len(results),
        "ttft_mean_ms": 1000 * statistics.fmean(ttft),
        "ttft_p50_ms": 1000 * statistics.median(ttft),
        "ttft_p90_ms": 1000 * statistics.quantiles(ttft, n=10)[-1],
        "ttft_later_turns_mean_ms": 1000 * statistics.fmean(later) if later else 0.0,
        "prefill": side(prefill),
        "decode": side(decode),
        "total": side(prefill + decode),
    }


def print_table(rows: list[dict]) -> None:
    print(f"{'run':<22} {'TTFT mean':>10} {'p50':>8} {'p90':>8} {'later turns':>12} "
          f"{'hit rate P':>11} {'hit rate D':>11} {'hit tokens':>11}")  # fmt: skip
    for row in rows:
        print(
            f"{row['name']:<22} {row['ttft_mean_ms']:>8.1f}ms {row['ttft_p50_ms']:>6.1f}ms "
            f"{row['ttft_p90_ms']:>6.1f}ms {row['ttft_later_turns_mean_ms']:>10.1f}ms "
            f"{row['prefill']['hit_rate']:>11.3f} {row['decode']['hit_rate']:>11.3f} "
            f"{row['total']['hit_tokens']:>11.0f}"
        )
    by_policy = {row["policy"]: row for row in rows if row["name"] != "one pair"}
    base = next((row for row in rows if row["name"] == "one pair"), None)
    if "round_robin" in by_policy and "cache_aware" in by_policy:
        rr, ca = by_policy["round_robin"], by_policy["cache_aware"]
        print(
            f"cache_aware / round_robin: TTFT mean {ca['ttft_mean_ms'] / rr['ttft_mean_ms']:.2f}x, "
            f"hit tokens {ca['total']['hit_tokens'] / max(rr['total']['hit_tokens'], 1):.2f}x"
        )
    if base is not None and "cache_aware" in by_policy:
        share = by_policy["cache_aware"]["total"]["hit_tokens"] / max(
            base["total"]["hit_tokens"], 1
        )
        print(f"cache_aware hit tokens / one pair's: {share:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m baton.bench.serving.router_policies", description=__doc__
    )
    parser.add_argument("--model", default=str(ROOT / "assets"))
    parser.add_argument("--prefill", type=int, default=2, help="prefill workers")
    parser.add_argument("--decode", type=int, default=2, help="decode workers")
    parser.add_argument("--policies", default="round_robin,cache_aware")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=64)
    parser.add_argument("--first-len", type=int, default=160)
    parser.add_argument("--turn-len", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--track-interval", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    vocab_size = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
    logs = Path(tempfile.mkdtemp(prefix="baton-router-policies-"))
    processes, urls = [], {"prefill": [], "decode": []}
    try:
        starting = []  # all at once: each loads its model while the others do
        for role, count in (("prefill", args.prefill), ("decode", args.decode)):
            for index in range(count):
                port = free_port()
                command = worker_command(args.model, port, role, args.track_interval)
                log = logs / f"{role}-{index}.log"
                with open(log, "wb") as out:
                    process = subprocess.Popen(
                        command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )  # fmt: skip
                processes.append(process)
                urls[role].append(f"http://127.0.0.1:{port}")
                starting.append((process, urls[role][-1], log))
        for process, url, log in starting:
            wait_healthy(process, url, log, 300)
        rows = []
        runs = [("one pair", "round_robin", urls["prefill"][:1], urls["decode"][:1])]
        runs += [(p, p, urls["prefill"], urls["decode"]) for p in args.policies.split(",")]
        for index, (name, policy, prefill, decode) in enumerate(runs):
            workload = MultiTurnWorkload(
                conversations=args.conversations,
                turns=args.turns,
                system_len=args.system_len,
                first_len=args.first_len,
                turn_len=args.turn_len,
                output_len=args.output_len,
                seed=args.seed + index,
                vocab_size=vocab_size,
            )
            rows.append(
                run_policy(
                    name, policy, prefill, decode, args.model, workload, args.concurrency, logs
                )
            )
        print_table(rows)
        if args.output:
            Path(args.output).write_text(json.dumps(rows, indent=2))
    finally:
        for process in processes:
            stop(process)
    return 0


if __name__ == "__main__":
    sys.exit(main())
