"""Sequential requests (concurrency 1) and rate 1 against baton / vllm with env variants."""

import asyncio
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, "/work/main")
from bench.peer import save_word_tokenizer
from bench.serve import BenchConfig, BenchPrompt, run_benchmark
from bench.serve_side_by_side import server_commands, start, stop
from bench.workloads import save_model
from server.up import free_port

model = "/tmp/m110"
if not Path(model, "config.json").exists():
    save_model("110m", model)
    save_word_tokenizer(model, 32000)
rng = random.Random(0)
prompts = [
    BenchPrompt(prompt=[rng.randrange(3, 32000) for _ in range(128)], prompt_len=128, output_len=64)
    for _ in range(24)
]


def run(port, conc, rate):
    cfg = BenchConfig(
        base_url=f"http://127.0.0.1:{port}",
        endpoint="/v1/completions",
        model=model,
        prompts=prompts,
        request_rate=rate,
        burstiness=1.0,
        max_concurrency=conc,
        ignore_eos=True,
        num_warmups=2,
        slos_ms={},
        percentiles=(50, 90, 99),
        api_key=None,
        seed=0,
        progress=False,
    )
    s = asyncio.run(run_benchmark(cfg))
    s.pop("requests")
    return s


variants = sys.argv[1:]
for v in variants:
    kind, _, envs = v.partition(":")
    env = dict(os.environ)
    for kv in filter(None, envs.split(",")):
        k, _, val = kv.partition("=")
        env[k] = val
    port = free_port()
    p = start(
        server_commands(kind, model, "bfloat16", port, "/tmp/vcpu"),
        port,
        Path(f"/tmp/seq_{kind}.log"),
        600,
        env=env,
    )
    try:
        for conc, rate in ((1, float("inf")), (None, 1.0)):
            s = run(port, conc, rate)
            print(
                f"{v:40s} conc={conc} rate={rate}: TTFT mean {s['mean_ttft_ms']:.1f} p50 {s['median_ttft_ms']:.1f} p99 {s['p99_ttft_ms']:.1f} ITL {s['mean_itl_ms']:.1f} TPOT {s['mean_tpot_ms']:.1f} tok/s {s['output_throughput']:.1f}",
                flush=True,
            )
    finally:
        stop(p)
