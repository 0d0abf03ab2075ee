import asyncio
import os
import random
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, "/work/main")
from bench.serve import BenchConfig, BenchPrompt, run_benchmark
from bench.serve_side_by_side import server_commands, start, stop
from server.up import free_port

model = sys.argv[1] if len(sys.argv) > 1 else "/tmp/m19"
rng = random.Random(0)
prompts = [
    BenchPrompt(prompt=[rng.randrange(3, 32000) for _ in range(128)], prompt_len=128, output_len=64)
    for _ in range(32)
]
port = free_port()
cmd = [
    c
    for c in server_commands("baton", model, "bfloat16", port, None)
    if c not in ("--request-metrics", "--no-prefix-cache")
]
cmd = [sys.executable, "/tmp/gcwrap.py", *cmd[3:]]
env = dict(os.environ, PYTHONPATH="/work/main")
p = start(cmd, port, Path("/tmp/gcserve.log"), 600, env=env)
os.kill(p.pid, signal.SIGUSR1)
time.sleep(0.3)
try:
    cfg = BenchConfig(
        base_url=f"http://127.0.0.1:{port}",
        endpoint="/v1/completions",
        model=model,
        prompts=prompts,
        request_rate=float("inf"),
        burstiness=1.0,
        max_concurrency=None,
        ignore_eos=True,
        num_warmups=2,
        slos_ms={},
        percentiles=(50, 90, 99),
        api_key=None,
        seed=0,
        progress=False,
    )
    for _ in range(int(os.environ.get("ROUNDS", "4"))):
        s = asyncio.run(run_benchmark(cfg))
        print(
            "tok/s",
            round(s["output_throughput"]),
            "ttft mean",
            round(s["mean_ttft_ms"]),
            "p99",
            round(s["p99_ttft_ms"]),
            "itl p99",
            round(s["p99_itl_ms"]),
        )
    os.kill(p.pid, signal.SIGUSR1)
    time.sleep(0.5)
    print(open("/tmp/gc_server.txt").read())
finally:
    stop(p)
